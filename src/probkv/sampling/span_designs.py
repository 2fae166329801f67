"""Span-preserving sampling designs for fixed-size pps eviction (S10.2-S10.4).

S9's pps keeps entry ``i`` with probability ``P_i = min(1, lam pi_i)`` by systematic sampling in
position order, which thins contiguous spans: neighbours with ``P ~ 1/k`` are kept about one in
``k`` (S10.4). The designs here change what is sampled and in which order, and keep both the
budget and the Horvitz-Thompson weights ``1 / P`` (so S4's correction stays unbiased):

- a deterministic core (S10.2): ``core_size`` and ``top_entries`` pick the entries of largest
  proposal, kept with probability 1 (weight 1); the caller zeroes them in the proposal and
  samples the rest of the budget;
- blocks (S10.3): ``block_design`` (``block_design_global`` for one scale over all heads) makes
  runs of ``block`` consecutive entries the sampling units, with ``P_k = min(1, lam M_k)`` for a
  block of mass ``M_k``; every entry of a kept block gets ``1 / P_k``. ``block = 1`` is S9's pps;
  ``units="spans"`` cuts the units where the proposal does instead (``spans``): a run of
  above-average entries (a number's digits) is one unit of at most ``block`` entries;
- the visiting order of systematic sampling (S10.4): ``visit_order`` (position, or a seeded
  random permutation) and ``sample_design``, which draws a design's kept entries with
  ``sampling.systematic_sample_ordered``.

The capping that finds ``lam`` and the systematic draw are ``probkv.sampling``'s (one
implementation of pps: ``sampling.capped_scale`` takes units of any size);

Conventions (as ``probkv.sampling``): rows ``[R, t]``, one per KV head; float64 arithmetic;
entries with ``pi = 0`` are outside the design (always-kept or core entries, kept by the caller
with weight 1); randomness only through an explicit ``torch.Generator``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from probkv import sampling
from probkv._checks import check_choice, check_ratio

ORDERS = ("position", "random")
"""Visiting orders of systematic sampling (S10.4)."""

UNITS = ("blocks", "spans")
"""Sampling units of the pps designs (S10.3): ``"blocks"``, runs of ``block`` consecutive
entries; ``"spans"``, runs of above-average proposal of at most ``block`` entries (``spans``)."""


@dataclass(frozen=True)
class UnitDesign:
    """A fixed-size pps design over sampling units (entries or blocks) of each row (S10.3).

    ``units``: int64 ``[R, t]``, the unit of each entry (units are numbered in position order),
    ``-1`` for entries outside the design. ``inclusion``: float64 ``[R, K]``, ``P_k`` of each
    unit. ``sizes``: int64 ``[R, K]``, entries per unit. Units past a row's last are padding
    (size 0, ``P = 0``). ``kind``: how the units were cut (``UNITS``); it decides how a random
    visiting order treats units of unequal size (``visit_order``).
    """

    units: torch.Tensor
    inclusion: torch.Tensor
    sizes: torch.Tensor
    kind: str = "blocks"

    @property
    def entry_inclusion(self) -> torch.Tensor:
        """float64 ``[R, t]``: ``P`` of each entry (its unit's), 0 outside the design."""
        P = self.inclusion.gather(-1, self.units.clamp(min=0))
        return torch.where(self.units >= 0, P, 0.0)

    @property
    def expected_size(self) -> torch.Tensor:
        """float64 ``[R]``: expected number of entries kept, ``sum_k |B_k| P_k``."""
        return (self.sizes.to(torch.float64) * self.inclusion).sum(-1)


# ------------------------------------------------------------------------------ checks


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.shape[-1] == 0:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a tensor [rows, t] with t >= 1, got {got}")
    return x


def _mass(
    pi: torch.Tensor,
    outside: torch.Tensor | None,
    name: str,
    *,
    row_mass: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 rows ``[R, t]`` of a proposal, each divided by its sum (zero rows stay zero) and
    multiplied by its ``row_mass`` (float64 ``[R]``, validated by the caller), then zero where
    ``outside`` (bool ``[R, t]``, e.g. the core) is set. The arithmetic is ``sampling``'s, so
    that ``block = 1`` reproduces its pps bit for bit; zeroing after it keeps the rows' common
    scale, which the global scope's one ``lam`` compares across heads."""
    _rows(pi, name)
    if not torch.is_floating_point(pi) or not torch.isfinite(pi).all() or (pi < 0).any():
        raise ValueError(f"{name} must be finite and >= 0 (a proposal), got dtype {pi.dtype}")
    p = pi.to(torch.float64)
    total = p.sum(-1, keepdim=True)
    p = p / torch.where(total > 0, total, 1.0)
    if row_mass is not None:
        p = p * row_mass.to(p.device).unsqueeze(-1)
    if outside is None:
        return p
    if not isinstance(outside, torch.Tensor) or outside.dtype != torch.bool:
        raise ValueError(f"outside must be a bool tensor of shape {tuple(pi.shape)}")
    if outside.shape != pi.shape:
        raise ValueError(f"outside {tuple(outside.shape)} must match {name} {tuple(pi.shape)}")
    return p.masked_fill(outside, 0.0)


def check_block(block: int, name: str = "block") -> int:
    """Block size: an integer ``>= 1`` (1 = the entries themselves)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(
            f"{name} must be an integer >= 1 (entries per sampling block; 1 = entries), "
            f"got {block!r}"
        )
    return block


def _per_row(n: float | torch.Tensor, rows: int, name: str, device) -> torch.Tensor:
    """A non-negative number per row (float64 ``[R]``) from a number or a ``[R]`` tensor."""
    if isinstance(n, bool) or not isinstance(n, (numbers.Real, torch.Tensor)):
        raise ValueError(f"{name} must be a number or a tensor [rows], got {n!r}")
    out = torch.as_tensor(n, dtype=torch.float64, device=device).broadcast_to((rows,))
    if not torch.isfinite(out).all() or (out < 0).any():
        raise ValueError(f"{name} must be finite and >= 0, got {out.tolist()}")
    return out


# ------------------------------------------------------------------------ core (S10.2)


def core_size(core: float, budget: int | torch.Tensor) -> int | torch.Tensor:
    """``floor(core * b)`` exactly, with ``core`` read as the decimal it prints as.

    ``core`` in ``[0, 1]``; ``budget``: a non-negative int or integer tensor (per head), or a
    float (scope "global": the real-valued budget of all heads). ``core = 0.29`` with
    ``b = 100`` is 29 (the float ``0.29 * 100`` is ``28.999...``). Returns an int (int64
    tensor for a tensor).
    """
    if isinstance(core, bool) or not isinstance(core, numbers.Real) or not 0 <= core <= 1:
        raise ValueError(f"core must be a number in [0, 1], got {core!r}")
    fraction = Fraction(str(float(core)))
    if isinstance(budget, torch.Tensor):
        if budget.dtype.is_floating_point or (budget < 0).any():
            raise ValueError(f"budget must be a non-negative integer tensor, got {budget}")
        sizes = [math.floor(fraction * int(b)) for b in budget.reshape(-1).tolist()]
        return torch.tensor(sizes, dtype=torch.int64, device=budget.device).reshape(budget.shape)
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not budget >= 0:
        raise ValueError(f"budget must be a number >= 0, got {budget!r}")
    return math.floor(fraction * Fraction(budget))


def top_entries(
    keys: torch.Tensor, count: int | torch.Tensor, eligible: torch.Tensor
) -> torch.Tensor:
    """The deterministic core (S10.2): per row, the ``count`` eligible entries of largest key.

    Ties go to the later position, as ``budgets.topk_per_head`` (so a core of every sampled
    entry, ranked by the log-scores, is exactly the top-k method's kept set).

    Args:
        keys: ``[R, t]`` ranking keys, no NaN (log-scores, or the proposal itself).
        count: entries per row: int or int64 ``[R]``, at most the row's eligible entries.
        eligible: bool ``[R, t]``, the entries that may enter the core.

    Returns:
        bool ``[R, t]``.
    """
    _rows(keys, "keys")
    if torch.isnan(keys).any():
        raise ValueError("keys must not contain NaN")
    if not isinstance(eligible, torch.Tensor) or eligible.dtype != torch.bool:
        raise ValueError("eligible must be a bool tensor [rows, t]")
    if eligible.shape != keys.shape:
        raise ValueError(f"eligible {tuple(eligible.shape)} must match keys {tuple(keys.shape)}")
    rows, t = keys.shape
    if isinstance(count, bool) or not isinstance(count, (numbers.Integral, torch.Tensor)):
        raise ValueError(f"count must be an integer or an int64 tensor [rows], got {count!r}")
    c = torch.as_tensor(count, dtype=torch.int64, device=keys.device).broadcast_to((rows,))
    available = eligible.sum(-1)
    if (c < 0).any() or (c > available).any():
        raise ValueError(
            f"count must be in [0, eligible entries] per row; got {c.tolist()} with "
            f"{available.tolist()} eligible"
        )
    if not c.any():
        return torch.zeros_like(eligible)
    # eligible first, then larger keys, then later positions (stable sorts on the flipped row)
    by_key = torch.sort(keys.flip(-1), dim=-1, descending=True, stable=True).indices
    ok = eligible.flip(-1).gather(-1, by_key).to(torch.int8)
    order = by_key.gather(-1, torch.sort(ok, dim=-1, descending=True, stable=True).indices)
    take = torch.arange(t, device=keys.device).unsqueeze(0) < c.unsqueeze(-1)
    return torch.zeros_like(eligible).scatter(-1, (t - 1) - order, take)


def top_entries_global(
    keys: Sequence[torch.Tensor], count: int, eligible: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """``top_entries`` over all rows of all tensors at once (S10.2, scope "global"): the ``count``
    eligible entries of largest key among every head of every layer; ties go to the later entry
    of the concatenation (later position, then later head, then later tensor)."""
    if len(keys) != len(eligible) or len(keys) == 0:
        raise ValueError("keys and eligible must be non-empty lists of the same length")
    flat_keys = torch.cat([_rows(k, "keys").reshape(-1) for k in keys]).unsqueeze(0)
    flat_ok = torch.cat([e.reshape(-1) for e in eligible]).unsqueeze(0)
    chosen = top_entries(flat_keys, count, flat_ok)[0]
    return [
        part.reshape(k.shape)
        for part, k in zip(chosen.split([k.numel() for k in keys]), keys, strict=True)
    ]


# ---------------------------------------------------------------------- blocks (S10.3)


def blocks(eligible: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partition each row's eligible entries into runs of ``block`` consecutive ones (S10.3).

    Entry ``i`` joins unit ``rank_i // block``, ``rank_i`` its rank among the row's eligible
    entries in position order: a unit is ``block`` consecutive positions whenever the
    ineligible entries sit at the ends of the row (SnapKV's window, a recent window); only a
    row's last unit may be shorter.

    Returns ``(units, sizes)``: int64 ``[R, t]`` (``-1`` for ineligible entries) and int64
    ``[R, K]`` with ``K = max(1, ceil(max eligible / block))`` (padding units have size 0).
    """
    _rows(eligible, "eligible")
    block = check_block(block)
    rank = eligible.to(torch.int64).cumsum(-1) - 1
    units = torch.where(eligible, torch.div(rank, block, rounding_mode="floor"), -1)
    num_units = max(1, -(-int(eligible.sum(-1).max()) // block))
    sizes = torch.zeros(eligible.shape[0], num_units, dtype=torch.int64, device=eligible.device)
    sizes.scatter_add_(-1, units.clamp(min=0), eligible.to(torch.int64))
    return units, sizes


def spans(p: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partition each row's eligible entries (``p > 0``) into spans (S10.3, ``units="spans"``).

    An entry is *high* when its ``p`` is at least the mean of ``p`` over the row's eligible
    entries. Consecutive high entries (consecutive among the eligible ones, as in ``blocks``)
    form one unit, cut every ``block`` entries; every other entry is a unit of its own. The
    units depend on the proposal only, never on the draw, so ``1 / P_k`` stays unbiased; a
    span's mass is the sum of its entries', so a run of entries each too light to be kept
    surely (a number's digits) is kept or dropped whole, with the probability of the run.
    ``block = 1``: every entry is a unit (S9's pps).

    Returns ``(units, sizes)`` as ``blocks`` does (``K`` = the largest number of units of a row).
    """
    _rows(p, "p")
    block = check_block(block)
    eligible = p > 0
    rows, t = p.shape
    count = eligible.sum(-1, keepdim=True)
    mean = torch.where(eligible, p, 0.0).sum(-1, keepdim=True) / count.clamp(min=1)
    high = eligible & (p >= mean)
    rank = eligible.to(torch.int64).cumsum(-1) - 1
    position = torch.arange(t, device=p.device).expand(rows, t)
    # the previous eligible entry of each entry (-1: none), and whether it is high
    last = torch.where(eligible, position, -1).cummax(-1).values
    prev = torch.cat([last.new_full((rows, 1), -1), last[:, :-1]], -1)
    high_prev = (prev >= 0) & high.gather(-1, prev.clamp(min=0))
    starts = high & ~high_prev
    run_start = torch.where(starts, rank, -1).cummax(-1).values
    new_unit = eligible & (~high | starts | ((rank - run_start) % block == 0))
    units = torch.where(eligible, new_unit.to(torch.int64).cumsum(-1) - 1, -1)
    num_units = max(1, int(new_unit.sum(-1).max()))
    sizes = torch.zeros(rows, num_units, dtype=torch.int64, device=p.device)
    sizes.scatter_add_(-1, units.clamp(min=0), eligible.to(torch.int64))
    return units, sizes


def check_units(units: str) -> str:
    """``"blocks"`` or ``"spans"`` (``UNITS``)."""
    return check_choice(units, UNITS, "units")


def _units(
    p: torch.Tensor, block: int, kind: str = "blocks"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(units, sizes, masses)`` of the blocks (or spans) of the entries with ``p > 0``."""
    check_units(kind)
    units, sizes = blocks(p > 0, block) if kind == "blocks" else spans(p, block)
    masses = torch.zeros(sizes.shape, dtype=torch.float64, device=p.device)
    masses.scatter_add_(-1, units.clamp(min=0), torch.where(units >= 0, p, 0.0))
    return units, sizes, masses


def block_design(
    pi: torch.Tensor,
    n: float | torch.Tensor,
    block: int = 1,
    *,
    outside: torch.Tensor | None = None,
    units: str = "blocks",
) -> UnitDesign:
    """Block pps per row (S10.3): units of ``block`` consecutive entries with ``pi > 0`` not
    ``outside``, ``P_k = min(1, lam M_k)`` with ``sum_k |B_k| P_k = n`` (expected entries kept).

    ``block = 1`` is S9's pps over the entries (``sampling.pps_inclusion_probabilities`` with
    budget ``n`` plus the always-kept entries, bit for bit). With ``outside`` (S10.2's core)
    this is pps of the proposal restricted to the other entries (per row, renormalising would
    change nothing: ``lam`` absorbs the scale). If ``n`` reaches a row's eligible entries, all
    its units get ``P = 1``.

    Args:
        pi: ``[R, t]`` non-negative proposal (need not be normalised), zero at always-kept
            entries.
        n: expected entries to keep per row: a number or a tensor ``[R]``, ``>= 0``.
        block: entries per unit, ``>= 1``.
        outside: optional bool ``[R, t]``: more entries left out of the design (the core).
        units: ``"blocks"`` (runs of ``block`` entries) or ``"spans"`` (``spans``: runs of
            above-average proposal, at most ``block`` entries, after ``outside`` is removed).
    """
    p = _mass(pi, outside, "pi")
    unit_of, sizes, masses = _units(p, block, units)
    num, den = sampling.capped_scale(masses, sizes, _per_row(n, p.shape[0], "n", p.device))
    return UnitDesign(unit_of, sampling.capped(masses, num, den), sizes, units)


def global_budget(
    pis: Sequence[torch.Tensor], ratio: float, always_kept: Sequence[torch.Tensor]
) -> float:
    """Expected entries to sample over all heads (scope "global", S9):
    ``max(0, sum_h (1 - r) t_h - sum_h a_h)``, computed as ``sampling``'s global pps does."""
    r = check_ratio(ratio)
    budget, forced = 0.0, 0
    for p, a in zip(pis, always_kept, strict=True):
        budget += (1.0 - r) * p.shape[-1] * math.prod(p.shape[:-1])
        forced += int(torch.as_tensor(a).sum())
    return max(budget - forced, 0.0)


def block_design_global(
    pis: Sequence[torch.Tensor],
    n: float,
    block: int = 1,
    *,
    outside: Sequence[torch.Tensor] | None = None,
    row_mass: Sequence[torch.Tensor] | None = None,
    units: str = "blocks",
) -> list[UnitDesign]:
    """``block_design`` with one ``lam`` for every row of every tensor (scope "global", S9):
    ``sum`` over all heads of ``sum_k |B_k| P_k`` is ``n``. With ``block = 1`` this is
    ``sampling.pps_inclusion_probabilities_global`` bit for bit (``n`` from ``global_budget``,
    the same ``row_mass``). Each row is normalised, then multiplied by its ``row_mass`` (the
    head's weight against the others, 1 if None), before ``outside`` (one mask per tensor)
    zeroes entries, so ``lam`` compares the heads as weighed: ``P = min(1, lam m_h pi)`` on the
    remaining entries. A head's own expected size is then real, and its kept count random
    (``sample_design``). ``units`` as in ``block_design`` (spans are cut per row, on
    its own mean)."""
    if not isinstance(pis, (list, tuple)) or len(pis) == 0:
        raise ValueError("pis must be a non-empty list of tensors [rows, t]")
    masks = [None] * len(pis) if outside is None else list(outside)
    if len(masks) != len(pis):
        raise ValueError(f"outside must hold one mask per tensor ({len(pis)}), got {len(masks)}")
    weights = sampling.row_masses(row_mass, pis)
    parts = [
        _units(_mass(p, o, f"pis[{i}]", row_mass=w), block, units)
        for i, (p, o, w) in enumerate(zip(pis, masks, weights))
    ]
    flat_mass = torch.cat([m.reshape(1, -1) for _, _, m in parts], -1)
    flat_sizes = torch.cat([s.reshape(1, -1) for _, s, _ in parts], -1)
    n_all = _per_row(n, 1, "n", flat_mass.device)
    num, den = sampling.capped_scale(flat_mass, flat_sizes, n_all)
    return [UnitDesign(u, sampling.capped(m, num, den), s, units) for u, s, m in parts]


# ------------------------------------------------------------- visiting order (S10.4)


def visit_order(
    sizes: torch.Tensor, order: str, generator: torch.Generator, units: str = "blocks"
) -> torch.Tensor:
    """The order in which systematic sampling visits each row's units (S10.4), int64 ``[R, K]``.

    ``"position"``: unit order, i.e. position order (no random draw). ``"random"``: a uniform
    random permutation of the row's full-size units (one ``torch.rand`` of ``[R, K]``), then
    the row's shorter last unit, then padding. Keeping the short unit last bounds the kept
    count: it differs from its expectation by less than the block size (``sample_design``).
    With ``units="spans"`` (units of any size up to ``block``) every non-empty unit is
    shuffled, then padding: no bound of that kind holds for unequal units anyway.
    """
    check_choice(order, ORDERS, "order")
    check_units(units)
    rows, k = sizes.shape
    if order == "position":
        return torch.arange(k, device=sizes.device).expand(rows, k)
    keys = torch.rand((rows, k), generator=generator, dtype=torch.float64, device=sizes.device)
    full = sizes > 0 if units == "spans" else sizes == sizes.max(-1, keepdim=True).values
    keys = torch.where(full, keys, torch.where(sizes > 0, 2.0, 3.0))
    return keys.argsort(dim=-1, stable=True)


def sample_design(design: UnitDesign, order: str, generator: torch.Generator) -> torch.Tensor:
    """The kept entries of a design (S10.3, S10.4): bool ``[R, t]``.

    Draws the visiting order (``visit_order``; nothing for ``"position"``), then one offset per
    row (``torch.rand`` of ``[R, 1]`` float64, the draw ``sampling.systematic_sample`` makes),
    then keeps every entry of every unit ``systematic_sample_ordered`` keeps. Entry ``i``
    is kept with probability exactly ``P_i`` (its unit's), so ``1 / P_i`` weights are unbiased.
    With units of one entry and ``"position"`` this is ``sampling.systematic_sample`` for the
    same generator state.

    Kept count: exactly ``sum P`` entries when units are entries and ``sum P`` is an integer.
    With blocks of ``b`` entries (only the row's last unit may be shorter, and it is visited
    last), the count differs from its expectation ``sum_k |B_k| P_k`` by less than ``b``: the
    full units visited first give ``floor`` or ``ceil`` of their total ``L`` (entries off by
    ``b (N - L)``, ``|N - L| < 1``), and the short unit, of size ``s < b``, is hit exactly when
    that count and the offset leave room for it, which keeps ``|b (N - L) + s (I - P)| < b``.
    Spans (units of 1 to ``b`` entries): the count is random, ``sum_k |B_k| P_k`` in
    expectation; each entry is still kept with probability exactly ``P_i``.
    """
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    visit = visit_order(design.sizes, order, generator, design.kind)
    rows = design.inclusion.shape[0]
    offset = torch.rand(
        (rows, 1), generator=generator, dtype=torch.float64, device=design.inclusion.device
    )
    kept_units = sampling.systematic_sample_ordered(design.inclusion, visit, offset[:, 0])
    return kept_units.gather(-1, design.units.clamp(min=0)) & (design.units >= 0)
