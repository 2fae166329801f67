"""vLLM's FlexAttention backend with probkv's log-weights: the GPU path, untested on a GPU.

``ProbKVFlexBackend`` is vLLM's ``FLEX_ATTENTION`` backend whose metadata builder, after vLLM's
own ``build``, fills fixed-size tables (``probkv.vllm.flex.KeptTables``: one row per batch slot,
one unit per block of the longest model length) from the kept prefixes of the step's requests
and sets the metadata's ``score_mod`` (``probkv.vllm.flex.packed_score_mod``): the kernel then
adds each kept block's log-weight and gives evicted prompt positions ``-inf``, inside vLLM's one
attention call. Freed blocks are vLLM's null block, which vLLM's own mask already skips. The
metadata keeps true positions (no compaction on this path). Full CUDA graphs are refused (a
graph would replay the tables of its capture step); piecewise graphs and eager mode keep
attention outside graphs.

Nothing registers this backend yet: ``probkv.vllm.plugin`` refuses every platform but vLLM's
CPU one, and a GPU worker that observes prompts from FlexAttention's cache is not written
(docs/vllm.md, "A GPU path (untested)"). ``register_flex_backend`` is the switch a GPU worker
would call. Imported only by vLLM code (it imports vLLM).
"""

from __future__ import annotations

from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from probkv.vllm import internals
from probkv.vllm.flex import KeptTables, batch_tables, packed_score_mod

_FlexBackend, _FlexBuilder = internals.flex_attention_classes()


def attach_log_weights(metadata, kept, block_size: int, tables: KeptTables | None = None):
    """Give a step's ``FlexAttentionMetadata`` probkv's score_mod for ``kept`` (per batch row, a
    ``KeptPrefix`` or None); the metadata unchanged when no row has evicted. Returns the
    tables used (``tables`` when given, written in place), or None."""
    filled = batch_tables(kept, block=block_size, out=tables, device=metadata.block_table.device)
    if filled is not None:
        internals.set_flex_score_mod(metadata, lambda doc_ids: packed_score_mod(filled, doc_ids))
    return filled


def kept_of_batch(num_reqs: int) -> list:
    """The kept prefix of each of the step's first ``num_reqs`` batch rows, from this process's
    eviction state (``probkv.vllm.worker``); all None when the engine does not evict."""
    from probkv.vllm import worker

    state = worker.active()
    if state is None or state.runner is None:
        return [None] * num_reqs
    req_ids = internals.batch_request_ids(state.runner)[:num_reqs]
    return [getattr(state.requests.get(r), "kept", None) for r in req_ids]


class ProbKVFlexMetadataBuilder(_FlexBuilder):
    """vLLM's FlexAttention metadata, then probkv's score_mod (module docstring)."""

    _cudagraph_support = internals.no_full_cuda_graphs()

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        rows = vllm_config.scheduler_config.max_num_seqs
        width = -(-vllm_config.model_config.max_model_len // self.block_size)
        self._tables = KeptTables.empty(rows, width, self.block_size, device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        out = super().build(common_prefix_len, common_attn_metadata, fast_build)
        kept = kept_of_batch(common_attn_metadata.num_reqs)
        attach_log_weights(out, kept, self.block_size, self._tables)
        return out


class ProbKVFlexBackend(_FlexBackend):
    """``FLEX_ATTENTION`` with ``ProbKVFlexMetadataBuilder``."""

    @staticmethod
    def get_builder_cls() -> type[ProbKVFlexMetadataBuilder]:
        return ProbKVFlexMetadataBuilder


def register_flex_backend() -> None:
    """vLLM's ``FLEX_ATTENTION`` becomes probkv's subclass in this process (idempotent)."""
    register_backend(
        AttentionBackendEnum.FLEX_ATTENTION, "probkv.vllm.flex_backend.ProbKVFlexBackend"
    )
