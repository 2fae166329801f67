"""vLLM's FlexAttention backend with probkv's eviction: run on vLLM's CPU platform here.

``ProbKVFlexBackend`` is vLLM's ``FLEX_ATTENTION`` backend (chosen with vLLM's own switch,
``attention_backend="FLEX_ATTENTION"``; ``probkv.vllm.plugin`` keeps that choice on the CPU
platform, which otherwise forces ``CPU_ATTN``) with the same three changes as probkv's CPU
backend (``probkv.vllm.backend``), from the same worker state (``probkv.vllm.worker``):

- its metadata builder hands the step's metadata to ``WorkerEviction.compact_metadata`` first,
  so vLLM's FlexAttention metadata (block mask, physical-to-logical map, query offsets) is built
  over each evicted request's kept blocks (S12);
- in an engine whose method is a ``prob:`` one, the log-weights live beside the cache, per
  physical slot (``probkv.vllm.flex.SlotLogWeights``: no spare columns, no wider heads), and
  the metadata's score_mod adds them per query row: rows computed again after a preemption
  read none, exactly like the CPU path's spare columns;
- after vLLM's kernel the implementation hands the prefill chunks of requests being observed
  to the worker's state (``attend``), reading the cache in its token-major layout.

The cache write is torch's (``internals.write_flex_cache``): vLLM's calls a CUDA op that its
CPU build lacks. Full CUDA graphs are refused (a graph would replay the tables of its capture
step). Imported only by vLLM code (it imports vLLM).
"""

from __future__ import annotations

from vllm.v1.attention.backend import AttentionType

from probkv.vllm import internals, worker
from probkv.vllm.flex import SlotLogWeights
from probkv.vllm.paged import layer_index

_FlexBackend, _FlexBuilder, _FlexImpl = internals.flex_attention_classes()
TOKEN_LAYOUT = ("token", "token")  # probkv.vllm.paged.read_cache's layout of both halves


class ProbKVFlexMetadataBuilder(_FlexBuilder):
    """vLLM's FlexAttention metadata over the compacted metadata, with probkv's score_mod in
    a ``prob:`` engine (module docstring)."""

    _cudagraph_support = internals.no_full_cuda_graphs()

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._rows = vllm_config.scheduler_config.max_num_batched_tokens
        self._weights: SlotLogWeights | None = None

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        state = worker.active()
        if state is not None:
            common_attn_metadata = state.compact_metadata(common_attn_metadata, self.layer_names)
        out = super().build(common_prefix_len, common_attn_metadata, fast_build)
        internals.widen_flex_block_mask(out)  # torch's CPU lowering needs every cache block
        if state is None:
            return out
        # On the CPU a top-k engine gets the slot score_mod too (every weight 0): the path the
        # prob: engines compile (docs/vllm.md: torch's CPU flex code failing to build)
        if not state.engine.weighted and self.device.type != "cpu":
            return out
        if self._weights is None:
            self._weights = SlotLogWeights(
                out.total_cache_tokens, self._rows, self.block_size, self.device
            )
        notes = state.notes_for(layer_index(self.layer_names[0]))
        self._weights.update(common_attn_metadata.slot_mapping, notes.writes, notes.unweighted_rows)
        internals.set_flex_score_mod(out, self._weights.score_mod)
        return out


class ProbKVFlexAttentionImpl(_FlexImpl):
    """vLLM's FlexAttention with torch's cache write, then probkv's observation of prefill
    chunks (module docstring)."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.attn_type == AttentionType.ENCODER_ONLY:
            return
        internals.write_flex_cache(key, value, kv_cache, slot_mapping, self.head_size)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw):
        out = super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw
        )
        state = worker.active()
        if attn_metadata is None or state is None or self.attn_type != AttentionType.DECODER:
            return out
        layer_idx = layer_index(layer.layer_name)
        if not state.notes_for(layer_idx).work:
            return out
        state.attend(
            layer=layer_idx,
            query=query,
            caches=internals.flex_cache_halves(kv_cache, self.head_size),
            layout=TOKEN_LAYOUT,
            output=output,
            scale=self.scale,
        )
        return out


class ProbKVFlexBackend(_FlexBackend):
    """``FLEX_ATTENTION`` with probkv's builder and implementation."""

    @staticmethod
    def get_builder_cls() -> type[ProbKVFlexMetadataBuilder]:
        return ProbKVFlexMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[ProbKVFlexAttentionImpl]:
        return ProbKVFlexAttentionImpl


def register_flex_backend() -> None:
    """vLLM's ``FLEX_ATTENTION`` becomes probkv's subclass in this process (idempotent)."""
    worker.register_attention_backend(internals.FLEX)
