"""vLLM's CPU attention backend with probkv's reading of each evicting request.

``ProbKVCPUBackend`` is vLLM's ``CPU_ATTN`` backend whose implementation, after vLLM's own
kernel has run, hands each layer's queries and paged cache to the worker's eviction state
(``probkv.vllm.worker``): prefill chunks of an evicting request are observed, and the rows of a
request already evicted are recomputed over its kept positions with their log-weights
(``probkv.vllm.requests.decode_attention``). Requests that do not evict keep vLLM's output.

The cache is read through the layout vLLM's own writer produces (``probkv.vllm.paged``).
"""

from __future__ import annotations

from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from probkv.vllm import worker  # the worker module holds the process's eviction state
from probkv.vllm.paged import LAYER_INDEX, cache_layout


class ProbKVCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, then probkv's observation or corrected decode (module doc)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw):
        output = super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw
        )
        if attn_metadata is None or self.attn_type != AttentionType.DECODER:
            return output
        state = worker.active()
        if state is None:
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
            metadata=attn_metadata,
            output=output.view(output.shape[0], self.num_heads, -1),
            scale=self.scale,
        )
        return output


class ProbKVCPUBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with ``ProbKVCPUAttentionImpl`` (registered by ``probkv.vllm.plugin``)."""

    @staticmethod
    def get_impl_cls() -> type[ProbKVCPUAttentionImpl]:
        return ProbKVCPUAttentionImpl
