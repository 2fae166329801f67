"""The log-weights of ``prob:`` requests inside vLLM's own attention kernel: spare key columns.

vLLM's CPU kernel adds no per-position bias to the logits, but it computes
``scale * <q, k>`` over whatever head width the cache has. An engine that runs ``prob:``
methods therefore stores every key and value ``width`` wide instead of ``d``
(``padded_head_size``: the smallest head size the kernel supports with two columns to spare,
refused where that doubles the bytes, as Gemma-3's 256 -> 512 would).
A kept prompt position of a ``prob:`` request holds ``log w / scale`` in its key's first two
spare columns, split into a high part in the cache's dtype and the low remainder
(``spare_key_columns``: exact in float32, within the low part's rounding in bfloat16); every
other key, and every value, holds 0 there. A query row that reads the weights gets 1 in both
columns (``padded_queries``), so the kernel's logit becomes ``scale <q, k> + log w``: S4's
corrected attention (``probkv.vllm.request_eviction.decode_attention`` is the reference) in one call, at
the kept length, with no second pass. A prompt row computed again after a preemption gets 0
there: the prompt attends to itself unweighted.

The price is head width: 64 -> 80 for SmolLM2 (1.25x KV bytes per position, and the kernel's
16-wide variant), paid by every request of such an engine. Pure tensors; no vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SPARE = 2  # the high and the low part of log w / scale


#: The most KV bytes per position the spare columns may cost (``padded_head_size``): at twice a
#: model's bytes a ``prob:`` engine holds more than plain vLLM's even where r = 0.5 halves every
#: layer (Gemma-3, 256 -> 512: 1.25x plain's bytes per 8k request; docs/vllm.md).
MAX_WIDENING = 2.0


def next_head_size(head_size: int, supported: Sequence[int]) -> int:
    """The smallest of the kernel's ``supported`` head sizes with ``SPARE`` columns beyond
    ``head_size``; refused by name when there is none."""
    wide = [s for s in supported if s >= head_size + SPARE]
    if not wide:
        raise ValueError(
            f"prob: methods in vLLM store log-weights in {SPARE} spare key columns, but the "
            f"attention backend supports no head size above {head_size} + {SPARE} (it supports "
            f"{sorted(supported)}); use a top-k method with this model"
        )
    return min(wide)


def padded_head_size(head_size: int, supported: Sequence[int]) -> int:
    """``next_head_size``, refused by name where it costs ``MAX_WIDENING`` times the KV bytes
    per position or more (every layer of the engine widens: vLLM's KV cache groups share one
    page size, so a hybrid model's windowed layers too)."""
    width = next_head_size(head_size, supported)
    if width >= MAX_WIDENING * head_size:
        raise ValueError(
            f"prob: methods in vLLM store log-weights in {SPARE} spare key columns: at head "
            f"size {head_size} the kernel's next size is {width}, {width / head_size:.2f}x the "
            "KV bytes of every layer, more than the eviction frees (Gemma-3 at 8,192 "
            "positions, r = 0.5: 1.25x plain vLLM's bytes per request); use a top-k method "
            "(snapkv, topk:kvzap) with this model"
        )
    return width


def spare_key_columns(log_weights: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``[n, SPARE]`` in ``dtype``: ``log w / scale`` as a high part and its low remainder,
    whose sum in float32 is ``log w / scale`` to the low part's rounding (0 where ``log w`` is
    0; ``-inf`` weights are never stored: evicted positions are not read)."""
    value = log_weights.to(torch.float32) / scale
    high = value.to(dtype)
    low = (value - high.to(torch.float32)).to(dtype)
    return torch.stack([high, low], dim=-1)


def padded_entries(entries: torch.Tensor, width: int) -> torch.Tensor:
    """Keys or values ``[T, H, d]`` with ``width - d`` zero columns (log w = 0: positions
    written during decode, and every position until its request's selection)."""
    t, h, d = entries.shape
    out = entries.new_zeros(t, h, width)
    out[..., :d] = entries
    return out


def padded_queries(
    query: torch.Tensor, width: int, unweighted_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Queries ``[T, Hq, d]`` widened to ``width``: 1 in the spare columns (the row adds its
    keys' log-weights), 0 in the rows ``unweighted_rows`` (int64 indices: prompt rows computed
    again after a preemption) and in the padding beyond the spare columns."""
    t, h, d = query.shape
    out = query.new_zeros(t, h, width)
    out[..., :d] = query
    out[..., d : d + SPARE] = 1
    if unweighted_rows is not None and unweighted_rows.numel():
        out[unweighted_rows, :, d : d + SPARE] = 0
    return out


def write_spare_columns(
    cache: torch.Tensor,
    layout: str,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
    head_size: int,
    columns: torch.Tensor,
) -> None:
    """Store ``columns [n, SPARE]`` in the spare columns (``head_size ..``) of the keys at
    physical blocks ``block_ids`` and ``offsets`` (``[n]`` each) of every KV head of ``cache
    [num_blocks, Hkv, block, width]`` (the key half of vLLM's cache), in the ``layout`` vLLM's
    writer uses (``probkv.vllm.paged.cache_layout``)."""
    h = cache.shape[1]
    for j in range(columns.shape[1]):
        values = columns[:, j : j + 1].to(cache.dtype).expand(-1, h)
        if layout == "token":
            cache[block_ids, :, offsets, head_size + j] = values
        else:
            num_blocks, _, block, width = cache.shape
            view = cache.as_strided(
                (num_blocks, h, width, block),
                (cache.stride(0), cache.stride(1), block, 1),
                cache.storage_offset(),
            )  # the block's width * block values read as [width, block]
            view[block_ids, :, head_size + j, offsets] = values
