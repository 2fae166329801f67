"""Reading vLLM's paged CPU KV cache: which layout its writer uses, and entries by position.

vLLM's CPU cache holds, per block and KV head, ``block`` keys then ``block`` values. The keys are
stored dimension-major (``[d, block]``) for some instruction sets and token-major for others;
``cache_layout`` finds out by writing a known pattern with vLLM's own writer
(``cpu_attn_reshape_and_cache``), once per instruction set, block and head size and dtype.
"""

from __future__ import annotations

import functools
import re

import torch

from probkv.vllm import internals

LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """The decoder layer's index in a vLLM attention layer's name (``model.layers.3.self_attn.attn``)."""
    match = LAYER_INDEX.search(layer_name)
    if match is None:
        raise RuntimeError(f"probkv: cannot read a layer index from {layer_name!r}")
    return int(match.group(1))


@functools.cache
def cache_layout(isa: str, block_size: int, head_size: int, dtype: torch.dtype) -> tuple[str, str]:
    """``(keys, values)``, each ``"token"`` (``[block, d]`` per block and head) or ``"dim"``
    (``[d, block]``), as vLLM's cache writer lays them out for ``isa``; any other layout is
    refused by name."""
    cache = torch.zeros(1, 1, 2 * block_size, head_size, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    pattern = torch.arange(block_size * head_size, dtype=torch.float32)
    pattern = (pattern % 251).to(dtype).reshape(block_size, 1, head_size)
    slots = torch.arange(block_size, dtype=torch.int64)
    internals.cpu_cache_writer()(
        pattern, -pattern, key_cache, value_cache, slots, isa,
        k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
    )  # fmt: skip
    found = []
    for stored, expected in ((key_cache, pattern), (value_cache, -pattern)):
        token = stored[0, 0]  # [block, d]
        dim = stored[0, 0].reshape(head_size, block_size).T
        if torch.equal(token, expected[:, 0]):
            found.append("token")
        elif torch.equal(dim, expected[:, 0]):
            found.append("dim")
        else:
            raise RuntimeError(
                f"vLLM's CPU cache layout for isa={isa!r} (block {block_size}, head size "
                f"{head_size}, {dtype}) is neither token- nor dimension-major; probkv cannot "
                "read it"
            )
    return found[0], found[1]


def read_cache(
    cache: torch.Tensor, layout: str, block_ids: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Entries ``[n, Hkv, d]`` of ``cache [num_blocks, Hkv, block, d]`` (one half of vLLM's
    KV cache) at physical blocks ``block_ids`` and offsets ``offsets`` (``[n]`` each)."""
    if layout == "token":
        return cache[block_ids, :, offsets, :]
    num_blocks, h, block, d = cache.shape
    view = cache.as_strided(
        (num_blocks, h, d, block),
        (cache.stride(0), cache.stride(1), block, 1),
        cache.storage_offset(),
    )  # the block's d * block values read as [d, block]
    return view[block_ids, :, :, offsets]
