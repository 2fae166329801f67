"""FlexAttention mods for evicted requests (S4, S11, S12): pure torch, no vLLM import.

torch's ``flex_attention`` calls ``score_mod(score, b, h, q_idx, kv_idx)`` on every logit and
``mask_mod(b, h, q_idx, kv_idx)`` to hide entries. For requests whose prompts were evicted, the
logit of the key at sequence index ``kv`` of request ``r`` gets

- ``log w`` where ``kv`` is a kept prompt position (0 for top-k, ``-log P_b`` for a kept block
  of a ``prob:`` selection, S11),
- ``-inf`` where ``kv`` is an evicted prompt position (no mass, whatever its key),
- 0 after the prompt (entries created after eviction, S4),

which is ``probkv.estimation.corrected_attention`` over the kept entries. ``kept_tables`` builds
the dense tables the mods index, ``[R, W]`` float32 over units of ``block`` positions, in one
vectorised step from the requests' kept sets (``KeptTables.empty`` and ``out=`` keep fixed
shapes). Requests that evict nothing get a row with prompt
length 0 (every position weight 0). Indices are clamped, so the mods may be evaluated at any
``(b, kv_idx)`` (vLLM evaluates them at invalid positions and discards the result).

``score_mod`` / ``mask_mod`` take a padded batch, one request per row (batch index ``b``);
causality is the caller's. vLLM's packed form is ``SlotLogWeights`` (below): per physical
cache slot, over vLLM's compacted metadata, so it needs no prompt tables (an earlier form over
true positions, indexed by logical position and prompt length, lost a decode budget's earlier
plans and weighed rows recomputed after a preemption; it was removed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

NEG_INF = -math.inf


@dataclass(frozen=True)
class KeptTables:
    """Per request ``r`` and unit ``u`` (positions ``[u block, (u + 1) block)``) of its prompt:
    ``log_weights[r, u]`` = the unit's log-weight if kept, ``-inf`` if evicted (float32
    ``[R, W]``); ``prompt_lengths[r]`` = where weights end (int64 ``[R]``, 0: nothing evicted).
    Rows and units past those a batch uses are never read (``-inf``, length 0)."""

    log_weights: torch.Tensor
    prompt_lengths: torch.Tensor
    block: int

    @classmethod
    def empty(
        cls, rows: int, width: int, block: int = 1, device: torch.device | str | None = None
    ) -> KeptTables:
        """Fixed-size tables to be filled by ``kept_tables(..., out=)`` step after step (a
        compiled ``flex_attention`` then sees the same shapes and does not recompile)."""
        if rows < 1 or width < 1 or block < 1:
            raise ValueError(f"rows, width and block must be >= 1, got {rows}, {width}, {block}")
        return cls(
            torch.full((rows, width), NEG_INF, dtype=torch.float32, device=device),
            torch.zeros(rows, dtype=torch.int64, device=device),
            block,
        )


def kept_tables(
    positions: Sequence[torch.Tensor],
    log_weights: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int] | torch.Tensor,
    *,
    block: int = 1,
    out: KeptTables | None = None,
    device: torch.device | str | None = None,
) -> KeptTables:
    """The tables of ``R`` requests from their kept sets, in one scatter.

    Args:
        positions: per request, int ``[n_r]`` its kept prompt positions (distinct, in
            ``[0, t_r)``), indices in the sequence the attention kernel reads.
        log_weights: per request, float ``[n_r]`` their log-weights (zeros for top-k).
        prompt_lengths: ``t_r`` per request; 0 for a request that evicts nothing.
        block: positions per unit. With ``block > 1`` every unit must be kept whole (each of
            its prompt positions, the last partial unit's included) with one log-weight: a
            vLLM block of a model-wide selection (S11).
        out: tables to write into (``KeptTables.empty``): at least ``R`` rows and
            ``ceil(max t_r / block)`` units, the same ``block``.
        device: where new tables go (``out``'s device otherwise).

    Returns:
        ``KeptTables`` (``out`` when given). Built on the CPU, then copied once.
    """
    rows = len(positions)
    if rows == 0 or len(log_weights) != rows:
        raise ValueError(
            f"positions and log_weights need one tensor per request (>= 1), got "
            f"{len(positions)} and {len(log_weights)}"
        )
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be an integer >= 1, got {block!r}")
    lengths = torch.as_tensor(prompt_lengths, dtype=torch.int64).cpu().flatten()
    if lengths.numel() != rows or (lengths < 0).any():
        raise ValueError(f"prompt_lengths must be {rows} integers >= 0, got {lengths.tolist()}")
    counts = torch.tensor([p.numel() for p in positions], dtype=torch.int64)
    if any(w.shape != p.shape for p, w in zip(positions, log_weights)):
        raise ValueError("each request's log_weights must have its positions' shape [n_r]")
    pos = torch.cat([p.reshape(-1).cpu().to(torch.int64) for p in positions])
    logw = torch.cat([w.reshape(-1).cpu().to(torch.float32) for w in log_weights])
    request = torch.repeat_interleave(torch.arange(rows), counts)
    if not torch.isfinite(logw).all():
        raise ValueError("log_weights must be finite (an evicted position is left out)")
    outside = (pos < 0) | (pos >= lengths[request])
    if outside.any():
        r = int(request[outside][0])
        raise ValueError(
            f"request {r} keeps position {int(pos[outside][0])}, outside its prompt "
            f"[0, {int(lengths[r])})"
        )
    key = request * (int(lengths.max()) + 1) + pos
    if torch.unique(key).numel() != key.numel():
        raise ValueError("a request keeps a position twice: positions must be distinct")
    width = max(1, -(-int(lengths.max()) // block))
    unit = pos // block
    # every unit kept whole and once: count its kept positions against its size in the prompt
    size = torch.clamp(lengths[request] - unit * block, max=block)
    flat = request * width + unit
    seen = torch.zeros(rows * width, dtype=torch.int64).index_add_(0, flat, torch.ones_like(pos))
    low = torch.full((rows * width,), math.inf).scatter_reduce(0, flat, logw, "amin")
    high = torch.full((rows * width,), NEG_INF).scatter_reduce(0, flat, logw, "amax")
    bad = (seen[flat] != size) | (low[flat] != high[flat])
    if bad.any():
        r, u = int(request[bad][0]), int(unit[bad][0])
        what = "position" if block == 1 else f"block of {block} positions"
        raise ValueError(
            f"request {r}'s {what} {u} is not kept whole with one log-weight "
            f"({int(seen[flat][bad][0])} of {int(size[bad][0])} kept)"
        )
    table = torch.full((rows, width), NEG_INF, dtype=torch.float32)
    table[request, unit] = logw
    if out is None:
        return KeptTables(table.to(device), lengths.to(device), block)
    if out.block != block or out.log_weights.shape[0] < rows or out.log_weights.shape[1] < width:
        raise ValueError(
            f"out holds {tuple(out.log_weights.shape)} units of {out.block}; this batch needs "
            f"({rows}, {width}) units of {block}"
        )
    out.log_weights.fill_(NEG_INF)
    out.log_weights[:rows, :width].copy_(table, non_blocking=True)
    out.prompt_lengths.zero_()
    out.prompt_lengths[:rows].copy_(lengths, non_blocking=True)
    return out


def _bias(
    table: torch.Tensor, lengths: torch.Tensor, block: int, request: torch.Tensor, kv: torch.Tensor
) -> torch.Tensor:
    """``log w`` (kept), ``-inf`` (evicted) or 0 (after the prompt) at ``(request, kv)``."""
    r = request.clamp(0, table.shape[0] - 1)
    u = torch.div(kv, block, rounding_mode="floor").clamp(0, table.shape[1] - 1)
    return torch.where(kv < lengths[r], table[r, u], 0.0)


def score_mod(tables: KeptTables):
    """``score_mod`` for a batch whose row ``b`` is request ``b``: ``score + log w``,
    ``-inf`` on evicted prompt positions, unchanged after the prompt. It hides evicted
    positions by itself; ``mask_mod`` adds the block sparsity."""
    table, lengths, block = tables.log_weights, tables.prompt_lengths, tables.block

    def log_weight_score_mod(score, b, h, q_idx, kv_idx):
        return score + _bias(table, lengths, block, b, kv_idx)

    return log_weight_score_mod


def mask_mod(tables: KeptTables):
    """``mask_mod`` (row ``b`` is request ``b``): True except on evicted prompt positions.
    Combine with the causal mask (``torch.nn.attention.flex_attention.and_masks``)."""
    table, lengths, block = tables.log_weights, tables.prompt_lengths, tables.block

    def kept_mask_mod(b, h, q_idx, kv_idx):
        return _bias(table, lengths, block, b, kv_idx) > NEG_INF

    return kept_mask_mod


class SlotLogWeights:
    """The log-weights of ``prob:`` requests beside FlexAttention's paged cache: ``log w`` per
    physical cache slot (0 unless a selection wrote it; a slot written again by the step's
    keys is reset to 0) and, per packed query row of the step, whether it reads them (1, or 0
    for prompt rows computed again after a preemption). The same state as the CPU backend's
    spare key columns (``probkv.vllm.weights``), outside the cache. ``score_mod`` is one
    function for the engine's life over these fixed-size tensors, updated in place each step
    (``update``), so a compiled ``flex_attention`` is not recompiled per step."""

    def __init__(self, slots: int, rows: int, block: int, device=None) -> None:
        if slots < 1 or rows < 1 or block < 1:
            raise ValueError(f"slots, rows and block must be >= 1, got {slots}, {rows}, {block}")
        self.block = block
        self.slot = torch.zeros(slots, dtype=torch.float32, device=device)
        self.row = torch.ones(rows, dtype=torch.float32, device=device)
        slot, row, last_slot, last_row = self.slot, self.row, slots - 1, rows - 1

        def slot_log_weight_score_mod(score, b, h, q_idx, kv_idx):
            w = row[q_idx.clamp(0, last_row)] * slot[kv_idx.clamp(0, last_slot)]
            return score + w.to(score.dtype)

        self.score_mod = slot_log_weight_score_mod

    def update(self, new_slots: torch.Tensor, writes=None, unweighted_rows=None) -> None:
        """One step: the slots its keys are written to reset (``new_slots``, negative:
        padding), then ``writes = (blocks, offsets, log_weights)`` stored, then the query rows
        in ``unweighted_rows`` (None: none) set to read no weight."""
        new = new_slots[new_slots >= 0].to(device=self.slot.device, dtype=torch.int64)
        self.slot[new] = 0.0
        if writes is not None:
            blocks, offsets, log_weights = writes
            where = (blocks.to(torch.int64) * self.block + offsets.to(torch.int64)).to(
                self.slot.device
            )
            self.slot[where] = log_weights.to(device=self.slot.device, dtype=torch.float32)
        self.row.fill_(1.0)
        if unweighted_rows is not None:
            self.row[unweighted_rows.to(self.row.device)] = 0.0
