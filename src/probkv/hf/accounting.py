"""What a ``ProbKVCache`` holds, per sequence of a batch and in total (S3, S11 batches).

Also the token ids a cache holds (``before_generate``, ``after_generate``: per sequence, with
a padded batch's attention mask) and each sequence's prompt length (``prompt_tokens``).

A batch's evicting layers store every (sequence, KV head) segment in one ragged prefix and the
sequences' dense tails in one ``[B, Hkv, capacity, d]`` buffer; padding is never kept, so a
sequence's bytes are its own segments' entries and its share of the tail buffer (and of a
sliding-window layer's buffer), and its effective ratio counts only its own tokens. The totals
of a batch are sums (bytes) and means over sequences (ratio).
"""

from __future__ import annotations

import torch

from probkv.hf import decode_budget, guards
from probkv.hf.report import LayerReport


def batch_size(cache) -> int:
    """Sequences the cache holds (1 before its first forward)."""
    return cache.layers[cache.evicting_layers[0]].batch_size


def check_sequence(cache, sequence: int | None) -> None:
    size = batch_size(cache)
    if sequence is not None and not (isinstance(sequence, int) and 0 <= sequence < size):
        raise ValueError(f"sequence={sequence!r}: this cache holds sequences 0..{size - 1}")


def reports(cache, sequence: int | None) -> list[LayerReport]:
    """Each evicted layer's report of ``sequence`` (of the only sequence: ``None``)."""
    check_sequence(cache, sequence)
    if sequence is None and batch_size(cache) != 1:
        raise ValueError(
            f"this cache holds a batch of {batch_size(cache)} sequences: pass sequence=i for "
            "one sequence's reports (effective_ratio() and nbytes() also give the batch's totals)"
        )
    b = sequence or 0
    return [
        cache.layers[i].sequence_reports[b]
        for i in cache.evicting_layers
        if cache.layers[i].sequence_reports
    ]


def nbytes(cache, sequence: int | None) -> int:
    """Bytes held for ``sequence``, or by the whole cache (``None``)."""
    check_sequence(cache, sequence)
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "sequence_reports"):  # an EvictingLayer
            total += layer.nbytes() if sequence is None else _evicting_nbytes(layer, sequence)
        elif layer.is_initialized:
            held = layer.keys.numel() * layer.keys.element_size() * 2
            total += held if sequence is None else held // layer.keys.shape[0]
    return total


def _evicting_nbytes(layer, b: int) -> int:
    if layer.sequence_layers is not None:  # a batch held to a decode budget: its own layer
        return layer.sequence_layers[b].nbytes()
    tail = layer.tail.nbytes() // layer.batch_size
    prefix = layer.prefix
    if prefix is None:
        return tail
    kept = sum(prefix.lengths[b * layer.num_heads : (b + 1) * layer.num_heads])
    per_entry = prefix.keys.shape[1] * prefix.keys.element_size()
    per_entry += prefix.values.shape[1] * prefix.values.element_size()
    if prefix.log_weights is not None:
        per_entry += prefix.log_weights.element_size()
    return tail + kept * per_entry


def effective_ratio(cache, sequence: int | None) -> float:
    """Mean over evicting layers and heads of the fraction of a sequence's prompt entries
    evicted; of a batch (``None``), the mean over its sequences."""
    check_sequence(cache, sequence)
    if sequence is None and batch_size(cache) != 1:
        ratios = [effective_ratio(cache, b) for b in range(batch_size(cache))]
        return sum(ratios) / len(ratios)
    done = reports(cache, sequence)
    if not done:
        return 0.0
    return sum(r.effective_ratio for r in done) / len(done)


def prompt_tokens(cache) -> list[int]:
    """Each sequence's prompt tokens held, padding not counted (the whole prompt after
    eviction; before it, every token so far)."""
    layer = cache.layers[cache.evicting_layers[0]]
    held = layer.prefix_length if layer.is_evicted else layer.get_seq_length()
    return [held - pad for pad in layer.pads]


def before_generate(cache, ids: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """``ProbKVCache.before_generate``: refuse ``ids [B, n]`` that do not begin with the tokens
    the cache holds (``hf.guards``), keep the mask for ``after_generate``; returns whether the
    cache will know its ids afterwards (it knew them, or held nothing)."""
    held = cache.get_seq_length()
    guards.check_generation_ids(ids, held, cache.token_ids)
    guards.check_padding(attention_mask, cache.layers)
    decode_budget.check_budget_padding(attention_mask, cache.decode_budget)
    if attention_mask is not None and bool(attention_mask.all()):
        attention_mask = None
    cache.generate_mask = attention_mask
    return held == 0 or cache.token_ids is not None


def after_generate(cache, sequences: torch.Tensor) -> None:
    """``ProbKVCache.after_generate``: the ids held, and a padded batch's mask grown by the
    generated tokens (never padded)."""
    held = cache.get_seq_length()
    cache.token_ids = sequences[:, :held] if sequences.shape[1] >= held else None
    mask = cache.generate_mask
    if mask is not None and cache.token_ids is not None:
        grown = mask.new_ones(mask.shape[0], max(0, held - mask.shape[1]))
        mask = torch.cat([mask, grown], dim=1)[:, :held]
    cache.attention_mask = mask if cache.token_ids is not None else None
    cache.generate_mask = None
