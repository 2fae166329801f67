"""vLLM's CPU attention backend with probkv's compaction and observation.

``ProbKVCPUBackend`` is vLLM's ``CPU_ATTN`` backend with two changes. Its metadata builder
hands the step's attention metadata to the worker's eviction state first
(``probkv.vllm.worker.WorkerEviction.compact_metadata``): an evicted request's block table lists
only its kept blocks and its length is the kept length, so vLLM's own kernel reads the shorter
sequence (S12), at no extra cost per layer. Its implementation, after vLLM's kernel, hands the
rows that need probkv to the same state (``attend``): prefill chunks of requests being observed,
and the rows of ``prob:`` requests, recomputed with their log-weights. Requests that do not
evict, and top-k requests once evicted, keep vLLM's output as it is.

The cache is read through the layout vLLM's own writer produces (``probkv.vllm.paged``).
"""

from __future__ import annotations

from vllm.v1.attention.backend import AttentionType

from probkv.vllm import (
    internals,
    worker,  # the worker module holds the process's eviction state
)
from probkv.vllm.paged import LAYER_INDEX, cache_layout

CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadataBuilder = (
    internals.cpu_attention_classes()
)


class ProbKVCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder over the compacted metadata (module docstring)."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        state = worker.active()
        if state is not None:
            common_attn_metadata = state.compact_metadata(common_attn_metadata)
        return super().build(common_prefix_len, common_attn_metadata, fast_build)


class ProbKVCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, then probkv's observation or corrected rows (module doc)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw):
        output = super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw
        )
        if attn_metadata is None or self.attn_type != AttentionType.DECODER:
            return output
        state = worker.active()
        if state is None or not (state.step[0] or state.step[1] is not None):
            return output
        match = LAYER_INDEX.search(layer.layer_name)
        if match is None:
            raise RuntimeError(f"probkv: cannot read a layer index from {layer.layer_name!r}")
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        halves = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
        layout = cache_layout(layer.isa, block_size, self.head_size, kv_cache.dtype)
        state.attend(
            layer=int(match.group(1)),
            query=query,
            caches=halves,
            layout=layout,
            output=output.view(output.shape[0], self.num_heads, -1),
            scale=self.scale,
        )
        return output


class ProbKVCPUBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with probkv's builder and implementation (registered by
    ``probkv.vllm.plugin``)."""

    @staticmethod
    def get_impl_cls() -> type[ProbKVCPUAttentionImpl]:
        return ProbKVCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[ProbKVCPUMetadataBuilder]:
        return ProbKVCPUMetadataBuilder
