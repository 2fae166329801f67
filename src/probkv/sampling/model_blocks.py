"""Model-wide units (S11): one kept set of positions for every layer and KV head.

A paged KV cache (vLLM's) frees memory by blocks of ``b`` consecutive positions shared by all
layers and heads of a request, so a method that must fit it keeps whole blocks, the same ones
everywhere. Positions are cut into blocks ``[0, b), [b, 2b), ...`` from the first position (the
last block may be shorter). Each block gets one score, an aggregate over every (layer, head) of
that head's proposal mass in the block (``"sum"`` of the masses, or their ``"max"``); a block
holding any always-kept entry of any head (sinks, the recent window, SnapKV's window) is kept
with ``P_b = 1``. The budget is ``k = floor(B / b + 1/2)`` blocks (``B`` the per-head budget
in positions, ``probkv.budgets.uniform_budget``), clamped to ``[1, number of blocks]`` and
raised to the number of forced blocks if they are more.

Protected blocks are kept by rule whatever their score, and count in the budget
(``protected_blocks``): the first ``sink_blocks`` blocks (attention sinks) and the blocks
holding the last ``recent_tokens`` positions, at most ``k`` of them (sinks first, then the
recent blocks nearest the end).

``top_blocks`` keeps the ``k`` forced-or-highest blocks (zero variance); ``pps_blocks`` keeps the
forced blocks, the ``floor(core (k - F))`` highest others with ``P = 1`` and draws the rest by
fixed-size pps over blocks (``P_b = min(1, lam M_b)``, ``sum P_b`` = the blocks left to draw;
systematic sampling in a random or position order): exactly ``k`` blocks. Every entry of a kept
block, in every layer and head, is weighted ``1 / P_b`` (Horvitz-Thompson, S9), so each head's
weighted totals stay design-unbiased.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from probkv import sampling
from probkv._checks import check_choice
from probkv.sampling import span_designs

AGGREGATES = ("sum", "max")
"""How a block's score combines the heads' proposal masses in it (S11)."""


def check_aggregate(aggregate: str) -> str:
    return check_choice(aggregate, AGGREGATES, "aggregate")


def num_blocks(t: int, block: int) -> int:
    """Blocks of ``block`` positions covering ``t`` positions (the last may be shorter)."""
    return -(-t // span_designs.check_block(block))


def block_budget(budget: int, t: int, block: int) -> int:
    """Kept blocks for a per-head budget of ``budget`` positions: ``floor(budget / block +
    1/2)`` (round half up), clamped to ``[1, num_blocks(t, block)]``."""
    return min(num_blocks(t, block), max(1, math.floor(budget / block + 0.5)))


def _per_block(x: torch.Tensor, block: int) -> torch.Tensor:
    """``[R, t]`` -> ``[R, K, block]`` (zero padded at the end)."""
    rows, t = x.shape
    k = num_blocks(t, block)
    pad = x.new_zeros(rows, k * block - t)
    return torch.cat([x, pad], -1).reshape(rows, k, block)


def block_masses(pis: Sequence[torch.Tensor], block: int, aggregate: str) -> torch.Tensor:
    """float64 ``[K]``: each block's score over every layer's ``[H, t]`` proposal ``pis``: the
    sum (``"sum"``) or the max (``"max"``) over (layer, head) of the head's mass in the block."""
    check_aggregate(aggregate)
    lengths = {pi.shape[-1] for pi in pis}
    if len(lengths) != 1:
        raise ValueError(f"model-wide blocks need one prefix length, got {sorted(lengths)}")
    rows = torch.cat([_per_block(pi.double().cpu(), block).sum(-1) for pi in pis])  # [L*H, K]
    return rows.sum(0) if aggregate == "sum" else rows.max(0).values


def forced_blocks(forced: Sequence[torch.Tensor | None], t: int, block: int) -> torch.Tensor:
    """bool ``[K]``: blocks holding an always-kept entry of some layer and head."""
    out = torch.zeros(num_blocks(t, block), dtype=torch.bool)
    for f in forced:
        if f is not None:
            out |= _per_block(f.cpu().to(torch.int64), block).sum(-1).sum(0) > 0
    return out


def protected_blocks(
    t: int, block: int, k: int, *, sink_blocks: int, recent_tokens: int
) -> torch.Tensor:
    """bool ``[K]``: the first ``min(sink_blocks, k)`` blocks and, within the ``k`` kept, the
    blocks holding the last ``recent_tokens`` positions, those nearest the end first."""
    n = num_blocks(t, block)
    out = torch.zeros(n, dtype=torch.bool)
    sinks = min(sink_blocks, k, n)
    out[:sinks] = True
    first_recent = (t - min(recent_tokens, t)) // block if recent_tokens > 0 else n
    recent = torch.nonzero(~out & (torch.arange(n) >= first_recent)).flatten()
    room = k - sinks
    if room > 0:
        out[recent[-room:]] = True
    return out


def _ranked(mass: torch.Tensor, eligible: torch.Tensor, count: int) -> torch.Tensor:
    """bool ``[K]``: the ``count`` eligible blocks of largest mass (ties: the later block)."""
    key = torch.where(eligible, mass, -math.inf)
    order = key.flip(0).argsort(descending=True, stable=True)  # stable on the flipped: later first
    out = torch.zeros_like(eligible)
    out[(key.numel() - 1 - order[:count])] = True
    return out & eligible


def top_blocks(mass: torch.Tensor, forced: torch.Tensor, k: int) -> torch.Tensor:
    """bool ``[K]``: the forced blocks and the highest others, ``max(k, forced)`` in all."""
    rest = max(0, k - int(forced.sum()))
    return forced | _ranked(mass, ~forced, rest)


def pps_blocks(
    mass: torch.Tensor,
    forced: torch.Tensor,
    k: int,
    *,
    core: float,
    order: str,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept blocks (bool ``[K]``) and their inclusion probabilities (float64 ``[K]``, 1 for
    forced and core blocks, 0 for blocks of zero mass): forced blocks, then the top
    ``floor(core (k - F))`` of the others, then fixed-size pps over the rest for the blocks
    left (systematic sampling visiting the blocks in ``order``, ``probkv.sampling.span_designs``)."""
    check_choice(order, span_designs.ORDERS, "order")
    sampled = max(0, k - int(forced.sum()))
    core_mask = _ranked(mass, ~forced, span_designs.core_size(core, sampled))
    rest = sampled - int(core_mask.sum())
    free = ~(forced | core_mask)
    m = torch.where(free, mass.double(), 0.0).unsqueeze(0)
    n = torch.tensor([float(min(rest, int((m > 0).sum())))], dtype=torch.float64)
    inclusion = sampling.capped(m, *sampling.capped_scale(m, None, n))  # [1, K]
    k_all = mass.numel()
    units = torch.arange(k_all, dtype=torch.int64).unsqueeze(0)
    sizes = torch.ones(1, k_all, dtype=torch.int64)  # one "entry" per block: exactly n blocks
    design = span_designs.UnitDesign(units=units, inclusion=inclusion, sizes=sizes)
    drawn = span_designs.sample_design(design, order, generator)[0]
    P = torch.where(forced | core_mask, 1.0, inclusion[0])
    return forced | core_mask | (drawn & free), P


def expand(per_block: torch.Tensor, t: int, block: int) -> torch.Tensor:
    """A ``[K]`` value per block as ``[t]`` per position."""
    return per_block.repeat_interleave(block)[:t]
