"""vLLM's CPU attention backend with probkv's compaction and observation.

``ProbKVCPUBackend`` is vLLM's ``CPU_ATTN`` backend with two changes. Its metadata builder
hands the step's attention metadata to the worker's eviction state first
(``probkv.vllm.worker.WorkerEviction.compact_metadata``): an evicted request's block table lists
only its kept blocks and its length is the kept length, so vLLM's own kernel reads the shorter
sequence (S12), at no extra cost per layer. In an engine whose method is a ``prob:`` one the cache is wider
than the heads: its implementation pads keys, values and queries and stores the log-weights of
kept positions in spare key columns, so that the same kernel call adds them to the logits
(``probkv.vllm.weights``). After vLLM's kernel it hands the prefill chunks of requests being
observed to the worker's state (``attend``).

The cache is read through the layout vLLM's own writer produces (``probkv.vllm.paged``).
"""

from __future__ import annotations

from vllm.v1.attention.backend import AttentionType

from probkv.vllm import (
    internals,
    worker,  # the worker module holds the process's eviction state
)
from probkv.vllm.paged import cache_layout, layer_index
from probkv.vllm.weights import (
    padded_entries,
    padded_queries,
    spare_key_columns,
    write_spare_columns,
)

CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadataBuilder = (
    internals.cpu_attention_classes()
)


class ProbKVCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder over the compacted metadata (module docstring)."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        state = worker.active()
        if state is not None:
            common_attn_metadata = state.compact_metadata(common_attn_metadata, self.layer_names)
        return super().build(common_prefix_len, common_attn_metadata, fast_build)


class ProbKVCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention over spare key columns where the engine has them, then probkv's
    observation of prefill chunks (module docstring)."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        width = kv_cache.shape[-1] // 2
        if width != self.head_size:  # spare columns: log w = 0 until a selection writes it
            key, value = padded_entries(key, width), padded_entries(value, width)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw):
        if attn_metadata is None or self.attn_type != AttentionType.DECODER:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw
            )
        state = worker.active()
        layer_idx = layer_index(layer.layer_name)
        notes = worker.NO_NOTES if state is None else state.notes_for(layer_idx)
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        width = kv_cache.shape[-1] // 2
        halves = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
        layout = cache_layout(layer.isa, block_size, width, kv_cache.dtype)
        if width == self.head_size:
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw)
        else:
            self._weighted_forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   notes, halves[0], layout[0], width, *args, **kw)  # fmt: skip
        if not notes.work:
            return output
        state.attend(
            layer=layer_idx,
            query=query,
            caches=halves,
            layout=layout,
            output=output.view(output.shape[0], self.num_heads, -1),
            scale=self.scale,
        )
        return output

    def _weighted_forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                          notes, key_cache, layout, width, *args, **kw):  # fmt: skip
        """vLLM's kernel over keys ``width`` wide: this step's log-weights stored first, every
        query row widened with 1 in the spare columns (0 in ``notes.unweighted_rows``), the
        output's first ``d`` columns kept (``probkv.vllm.weights``)."""
        if notes.writes is not None:
            blocks, offsets, log_weights = notes.writes
            columns = spare_key_columns(log_weights, self.scale, key_cache.dtype)
            write_spare_columns(key_cache, layout, blocks, offsets, self.head_size, columns)
        n = attn_metadata.num_actual_tokens
        wide = padded_queries(query[:n], width, notes.unweighted_rows)
        out = wide.new_empty(wide.shape)
        super().forward(layer, wide, key, value, kv_cache, attn_metadata, out, *args, **kw)
        output[:n].view(n, self.num_heads, self.head_size).copy_(out[..., : self.head_size])


class ProbKVCPUBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with probkv's builder and implementation (registered by
    ``probkv.vllm.plugin``)."""

    @staticmethod
    def get_impl_cls() -> type[ProbKVCPUAttentionImpl]:
        return ProbKVCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[ProbKVCPUMetadataBuilder]:
        return ProbKVCPUMetadataBuilder
