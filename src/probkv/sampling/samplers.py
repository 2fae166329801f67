"""Which entries a KV head keeps: the samplers (S3, S9).

Two samplers, both driven by a proposal ``pi`` ``[..., t]`` (one row per KV head):

- with replacement (S3, the paper): draw ``m`` samples from ``pi``; entry ``i`` is kept iff it
  was drawn (``c_i > 0``). ``m`` is chosen so that the expected number of distinct entries
  ``E[J(m)] = sum_i 1 - (1 - pi_i)^m`` hits the target, per head or globally (one ``m`` for all
  heads of all layers): ``probkv.sampling.sample_size`` (Algorithm 2 of the paper's Appendix F).
- pps (S9): fixed-size sampling without replacement with inclusion probabilities
  ``P_i = min(1, lam * pi_i)`` summing to the budget, drawn by systematic sampling.

Conventions shared by every function here:

- All arithmetic is float64. Each row of ``pi`` is renormalised in float64 before use (this only
  removes float32 rounding of the row sum; rows whose sum is off by more than ``ROW_SUM_TOL``
  are rejected as a likely mistake, e.g. scores passed instead of probabilities).
- Entries kept outside sampling (SnapKV's observation window, a take-all stratum) are passed
  as ``always_kept``: a per-row count ``a_h``. The proposal is then given over the full row
  of ``t_h = pi.shape[-1]`` entries with **zeros at the always-kept positions** (it is the
  proposal over the other entries); ``t_h`` counts every entry of the head, and the
  always-kept entries count toward the head's kept fraction. A zero entry is never sampled.
- Randomness only through an explicit ``torch.Generator``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from probkv._checks import check_distribution, check_ratio

MAX_EXACT_COUNT = 2**53
"""Largest ``m`` whose counts float64 (the binomial sampler's type) represents exactly."""

ROW_SUM_TOL = 1e-3
"""A proposal row may sum to ``1 +/- ROW_SUM_TOL`` (float32 rounding); it is renormalised."""

SNAP = 1e-9
"""A total inclusion within ``SNAP`` (relative) of an integer is that integer (float rounding):
systematic sampling then keeps exactly that many."""

Probabilities = torch.Tensor | Sequence[torch.Tensor]
Count = int | torch.Tensor


# --------------------------------------------------------------------------- input helpers


def checked_probabilities(pi: torch.Tensor, name: str = "pi") -> torch.Tensor:
    """Validated float64 copy of a batch of distributions ``[..., t]``, rows renormalised."""
    check_distribution(pi, name)
    p = pi.to(torch.float64)
    total = p.sum(-1, keepdim=True)
    bad = (total - 1.0).abs() > ROW_SUM_TOL
    if bad.any():
        worst = total[bad].flatten()[0].item()
        raise ValueError(
            f"{name} rows must sum to 1 (within {ROW_SUM_TOL:g}); a row sums to {worst:.6g}. "
            "Pass probabilities (e.g. probkv.scores.proposals), not scores"
        )
    return p / total


def integer_per_row(
    value: Count, batch_shape: torch.Size, name: str, *, upper: int | None = None, device=None
) -> torch.Tensor:
    """A non-negative integer, or an integer tensor broadcastable to ``batch_shape``, as int64."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise ValueError(f"{name} must be a non-negative integer or integer tensor, got {value!r}")
    if isinstance(value, numbers.Integral):
        out = torch.tensor(int(value), dtype=torch.int64, device=device)
    elif isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex:
            raise ValueError(f"{name} must have an integer dtype, got {value.dtype}")
        out = value.to(device=device, dtype=torch.int64)
    else:
        raise ValueError(
            f"{name} must be a non-negative integer or integer tensor, got {type(value).__name__}"
        )
    if (out < 0).any():
        raise ValueError(f"{name} must be >= 0, got {int(out.min())}")
    if upper is not None and (out > upper).any():
        raise ValueError(f"{name} must be <= {upper}, got {int(out.max())}")
    try:
        return out.broadcast_to(batch_shape)
    except RuntimeError:
        raise ValueError(
            f"{name} of shape {tuple(out.shape)} does not broadcast to the rows of pi "
            f"{tuple(batch_shape)}"
        ) from None


def checked_always_kept(
    a: Count | None, p: torch.Tensor, name: str = "always_kept"
) -> torch.Tensor:
    """Per-row count of always-kept entries (int64 ``p.shape[:-1]``); ``pi`` must be zero there."""
    if a is None:
        return torch.zeros(p.shape[:-1], dtype=torch.int64, device=p.device)
    out = integer_per_row(a, p.shape[:-1], name, device=p.device)
    zeros = (p == 0).sum(-1)
    if (out > zeros).any():
        row = (out > zeros).nonzero()[0].tolist()
        raise ValueError(
            f"{name}={int(out[tuple(row)])} in row {row} but pi has only {int(zeros[tuple(row)])} "
            "zero entries there; pi must be zero at the always-kept positions (module docstring)"
        )
    return out


def as_tensor_list(pi: Probabilities, name: str) -> list[torch.Tensor]:
    if isinstance(pi, torch.Tensor):
        return [pi]
    if isinstance(pi, (list, tuple)) and len(pi) > 0:
        return list(pi)
    raise ValueError(f"{name} must be a tensor or a non-empty list of tensors, got {pi!r}")


def per_tensor(a: Count | Sequence[Count] | None, n: int, name: str) -> list[Count | None]:
    """``always_kept`` for a list of tensors: None, one value for all, or one per tensor."""
    if a is None or isinstance(a, (numbers.Integral, torch.Tensor)):
        return [a] * n
    if isinstance(a, (list, tuple)) and len(a) == n:
        return list(a)
    raise ValueError(f"{name} must be None, an integer, a tensor, or a list of {n} of those")


# ------------------------------------------------------------- with replacement (S3)


def sample_counts(pi: torch.Tensor, m: Count, generator: torch.Generator) -> torch.Tensor:
    """Multinomial counts: ``m`` draws with replacement from each row of ``pi`` (S3).

    Exact in distribution and ``O(t)`` memory per row whatever ``m`` (up to ``2^53``): the
    entries are the leaves of a binary tree; a node's count is split between its two children by
    one binomial draw with probability ``mass(left) / mass(node)`` (the multinomial's
    conditional law), one tree level at a time for all rows at once (``log2 t`` binomial calls).
    The same ``generator`` state gives the same counts. Kept set: ``counts > 0``.

    Args:
        pi: ``[..., t]`` probabilities (rows sum to 1; zero entries are never drawn).
        m: draws per row: non-negative int or integer tensor broadcastable to ``pi.shape[:-1]``.
        generator: the only source of randomness (on ``pi``'s device).

    Returns:
        int64 ``[..., t]``, each row summing to its ``m``.
    """
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    p = checked_probabilities(pi)
    batch, t = p.shape[:-1], p.shape[-1]
    m_rows = integer_per_row(m, batch, "m", upper=MAX_EXACT_COUNT, device=p.device)
    rows = p.reshape(-1, t)
    width = 1 << max(t - 1, 0).bit_length()  # leaves padded with zero mass to a power of two
    masses = [torch.nn.functional.pad(rows, (0, width - t))]
    while masses[-1].shape[-1] > 1:
        masses.append(masses[-1].unflatten(-1, (-1, 2)).sum(-1))
    counts = m_rows.reshape(-1, 1).to(torch.float64)
    for level in reversed(masses[:-1]):
        pairs = level.unflatten(-1, (-1, 2))
        node = pairs.sum(-1)
        p_left = torch.where(node > 0, pairs[..., 0] / node, 0.0).clamp(0.0, 1.0)
        left = torch.binomial(counts, p_left, generator=generator)
        left = torch.minimum(left.clamp(min=0.0), counts)  # guard: counts stay in [0, parent]
        counts = torch.stack([left, counts - left], -1).flatten(-2)
    return counts[:, :t].to(torch.int64).reshape(*batch, t)


# --------------------------------------------------------------------------- pps (S9)


def capped_scale(
    mass: torch.Tensor, sizes: torch.Tensor | None, n: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lam = num / den`` per row with ``sum_k |B_k| min(1, lam M_k) = n`` (S9, S10.3 capping).

    Iterative capping in closed form, for units of any sizes (entries: ``sizes=None``, all 1;
    blocks or spans of ``probkv.sampling.span_designs``): sorting units by decreasing mass and capping the
    ``c`` largest leaves ``lam_c = (n - W_c) / S_c`` with ``W_c`` the entries of the capped units
    and ``S_c = sum_{j >= c} |B_j| M_j``; the sum is non-decreasing and continuous in ``lam``, and
    the solution is the smallest ``c`` with ``(n - W_c) M_(c) <= S_c`` (iterative capping stops
    exactly there). ``lam`` is returned as a fraction so that a tiny ``S_c`` (subnormal masses)
    cannot overflow it; ``den = 0`` when ``n`` is at least the row's positive entries (all of
    them get ``P = 1``), ``num = 0`` when ``n = 0``.

    Args: ``mass`` float64 ``[R, K]`` non-negative, ``sizes`` int64 ``[R, K]`` or ``None``,
    ``n`` float64 ``[R]`` non-negative. Returns float64 ``(num, den)``, each ``[R]``.
    """
    pad = mass.new_zeros(mass.shape[0], 1)  # sentinel: some c always qualifies
    s, order = torch.cat([mass, pad], -1).sort(-1, descending=True)  # ties: equal values
    if sizes is None:
        z = torch.ones_like(s)
    else:
        z = torch.cat([sizes.to(torch.float64), pad], -1).gather(-1, order)
    capped = z.cumsum(-1) - z  # W_c
    rest = (z * s).flip(-1).cumsum(-1).flip(-1)  # S_c
    nn = n.unsqueeze(-1)
    ok = ((nn - capped) * s <= rest) & (capped < nn)
    first = ok.to(torch.int8).argmax(-1, keepdim=True)  # n = 0: none qualifies, num = 0
    num = torch.where(n > 0, n - capped.gather(-1, first).squeeze(-1), 0.0)
    return num, rest.gather(-1, first).squeeze(-1)


def capped(mass: torch.Tensor, num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``min(1, (num / den) M)`` per row (``num``, ``den`` ``[R]``, or ``[1]`` for one scale for
    every row), computed as ``num * (M / den)``; ``P = 0`` where ``M = 0``."""
    num, den = num.unsqueeze(-1), den.unsqueeze(-1)
    return torch.where((mass > 0) & (num > 0), (num * (mass / den)).clamp(max=1.0), 0.0)


def pps_inclusion_probabilities(
    pi: torch.Tensor, k: Count, always_kept: Count | None = None
) -> torch.Tensor:
    """Inclusion probabilities of fixed-size pps sampling per row (S9).

    ``P_i = min(1, lam * pi_i)`` with ``lam`` per row such that ``sum_i P_i = k - a`` (``a`` =
    ``always_kept``; ``k`` is the head's whole budget, always-kept entries included). Entries
    with ``P_i = 1`` form the take-all stratum. Computed by the closed form of iterative capping
    (sort, suffix sums), vectorised over rows; the sum is exact up to float64 rounding.

    Clamps (documented): ``a > k`` gives ``P = 0`` (nothing sampled; the head keeps its ``a``
    entries, over budget). A row with fewer than ``k - a`` positive entries gets ``P = 1`` on
    all of them (its sum is their number, below ``k - a``).

    Args:
        pi: ``[..., t]`` proposal, zero at always-kept positions.
        k: budget per row, ``0 <= k <= t``: int or integer tensor broadcastable to ``pi.shape[:-1]``.
        always_kept: per-row count of entries kept outside sampling (default 0).

    Returns:
        float64 ``[..., t]`` in ``[0, 1]``.
    """
    p = checked_probabilities(pi)
    batch, t = p.shape[:-1], p.shape[-1]
    k_rows = integer_per_row(k, batch, "k", device=p.device)
    if (k_rows > t).any():
        raise ValueError(f"k must be <= t = {t} (entries per row), got {int(k_rows.max())}")
    a = checked_always_kept(always_kept, p)
    sampled = (k_rows - a).clamp(min=0).to(torch.float64).reshape(-1)
    rows = p.reshape(-1, t)
    return capped(rows, *capped_scale(rows, None, sampled)).reshape(p.shape)


def row_masses(
    row_mass: torch.Tensor | Sequence[torch.Tensor] | None, tensors: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """Validated float64 ``row_mass``: one tensor per proposal tensor, shaped like its rows
    (``pi.shape[:-1]``), finite and ``>= 0``; ``None`` (every row weighs 1) passes through."""
    if row_mass is None:
        return [None] * len(tensors)
    masses = [row_mass] if isinstance(row_mass, torch.Tensor) else row_mass
    if not isinstance(masses, (list, tuple)) or len(masses) != len(tensors):
        raise ValueError(f"row_mass must hold one tensor per proposal tensor ({len(tensors)})")
    out = []
    for i, (m, p) in enumerate(zip(masses, tensors)):
        if not isinstance(m, torch.Tensor) or tuple(m.shape) != tuple(p.shape[:-1]):
            raise ValueError(
                f"row_mass[{i}] must be a tensor of shape {tuple(p.shape[:-1])} (one per row)"
            )
        m = m.to(torch.float64)
        if not torch.isfinite(m).all() or (m < 0).any():
            raise ValueError(f"row_mass[{i}] must be finite and >= 0, got {m.tolist()}")
        out.append(m)
    return out


def pps_inclusion_probabilities_global(
    pis: Probabilities,
    ratio: float,
    always_kept: Count | Sequence[Count] | None = None,
    *,
    row_mass: torch.Tensor | Sequence[torch.Tensor] | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """pps inclusion probabilities with one ``lam`` for all heads of all layers (S9 global).

    ``P_hi = min(1, lam * pi_hi)`` with a single ``lam`` such that the total expected number of
    kept entries is the global budget: ``sum_h (a_h + sum_i P_hi) = sum_h (1 - r) t_h`` (``a_h``
    always kept, ``t_h`` the head's length; the sampled total is clamped at 0 if the always-kept
    entries exceed the budget). ``lam`` solves capping on the concatenation of all rows.

    What is exact and what is only in expectation: ``P_hi`` is exactly each entry's inclusion
    probability under ``systematic_sample``, and the ``P`` of all heads sum to the global budget
    (up to float64 rounding). A head's own sum ``s_h = sum_i P_hi`` is real, generally not an
    integer: ``systematic_sample`` keeps ``floor(s_h)`` or ``ceil(s_h)`` of its entries, with
    mean ``s_h``, so per-head sizes and the total kept are random, equal to the budget in
    expectation only (the total lies between ``sum_h floor(s_h)`` and ``sum_h ceil(s_h)``).
    Note the budget here is a sum of counts (memory), whereas ``samples_for_ratio_global``
    targets the mean over heads of kept fractions (Appendix F.1); with equal lengths the two
    coincide.

    ``row_mass`` (S9 global): what each head's proposal weighs against the others. Each row is a
    distribution over its own entries; with ``row_mass`` the pooled scale applies to
    ``m_h pi_hi`` (``m_h`` the head's share of attention on its sampled entries), so heads are
    compared on the score's own scale. Without it every head weighs 1.

    Args:
        pis: ``[..., t]`` proposal or a list of such tensors (one per layer, lengths may differ).
        ratio: compression ratio ``r`` in ``[0, 1)``.
        always_kept: as in ``sample_size.samples_for_ratio_global`` (int, tensor, or one per
            tensor).
        row_mass: optional, one ``pi.shape[:-1]`` tensor per tensor, ``>= 0`` (see above).

    Returns:
        float64 tensors shaped like ``pis`` (a tensor for a tensor, a list for a list).
    """
    r = check_ratio(ratio)
    tensors = as_tensor_list(pis, "pis")
    kept_per_tensor = per_tensor(always_kept, len(tensors), "always_kept")
    masses = row_masses(row_mass, tensors)
    probs, budget, forced = [], 0.0, 0
    for i, (x, a) in enumerate(zip(tensors, kept_per_tensor, strict=True)):
        p = checked_probabilities(x, f"pis[{i}]")
        probs.append(p)
        budget += (1.0 - r) * p.shape[-1] * math.prod(p.shape[:-1])
        forced += int(checked_always_kept(a, p, f"always_kept[{i}]").sum())
    sampled = max(budget - forced, 0.0)
    weighed = [p if m is None else p * m.to(p.device).unsqueeze(-1) for p, m in zip(probs, masses)]
    flat = torch.cat([p.reshape(1, -1).to(probs[0].device) for p in weighed], -1)
    n = torch.tensor([sampled], dtype=torch.float64, device=flat.device)
    num, den = capped_scale(flat, None, n)
    # the one (num, den) broadcast over every row of every tensor
    out = [capped(p, num.to(p.device), den.to(p.device)) for p in weighed]
    return out[0] if isinstance(pis, torch.Tensor) else out


def systematic_sample(inclusion: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Systematic sampling: a bool mask drawing entry ``i`` with probability ``P_i`` (S9).

    Per row, one uniform offset ``u`` in ``[0, 1)``; entry ``i`` is kept iff the interval
    ``[C_{i-1}, C_i)`` of the cumulative sums contains a point of ``u + {0, 1, 2, ...}``. Entries
    with ``P_i = 1`` are always kept and left out of the cumulative sums (removing an interval of
    length 1 shifts the points by an integer: the same draw as keeping them in). The sums run in
    the natural (index) order; the marginal inclusion probabilities are ``P_i`` whatever the
    order, but the joint ones depend on it (e.g. neighbours with ``P_i + P_j <= 1`` are never kept
    together). A row keeps ``floor(sum P)`` or ``ceil(sum P)`` entries, with mean ``sum P``;
    exactly ``round(sum P)`` when the sum is an integer (sums within ``SNAP`` relative of an
    integer are snapped to it, absorbing float rounding).

    Args:
        inclusion: ``[..., t]`` probabilities in ``[0, 1]`` (e.g. ``pps_inclusion_probabilities``).
        generator: the only source of randomness.

    Returns:
        bool ``[..., t]``.
    """
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if not isinstance(inclusion, torch.Tensor) or inclusion.ndim == 0 or inclusion.shape[-1] == 0:
        raise ValueError("inclusion must be a tensor [..., t] with t >= 1")
    P = inclusion.to(torch.float64)
    if not torch.isfinite(P).all() or (P < 0).any() or (P > 1).any():
        raise ValueError(
            f"inclusion probabilities must lie in [0, 1], got range "
            f"[{P.min().item():.6g}, {P.max().item():.6g}]"
        )
    u = torch.rand((*P.shape[:-1], 1), generator=generator, dtype=torch.float64, device=P.device)
    return _systematic(P, u)


def _systematic(P: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The systematic draw of float64 ``P`` ``[..., K]`` in its own (visiting) order at offsets
    ``u`` ``[..., 1]`` in ``[0, 1)``: bool ``[..., K]`` (``systematic_sample``)."""
    take_all = P == 1.0
    cum = torch.where(take_all, 0.0, P).cumsum(-1)
    total = cum[..., -1:]
    whole = total.round()
    snap = (total - whole).abs() <= SNAP * whole.clamp(min=1.0)
    cum = torch.where(snap, torch.minimum(cum, whole), cum)
    cum[..., -1:] = torch.where(snap, whole, total)
    points = torch.ceil(cum - u)  # points u + j (j >= 0) below C_i
    before = torch.cat([torch.zeros_like(points[..., :1]), points[..., :-1]], -1)
    return take_all | (points > before)


def systematic_sample_ordered(
    inclusion: torch.Tensor, order: torch.Tensor, offset: torch.Tensor
) -> torch.Tensor:
    """Systematic sampling visiting units in ``order``, for a given offset (S9, S10.4).

    Per row, units are laid end to end in the order ``order[r, 0], order[r, 1], ...`` as
    intervals of lengths ``P_k``; unit ``k`` is kept iff its interval ``[C_(k-1), C_k)``
    contains a point of ``offset + {0, 1, 2, ...}``. Units with ``P = 1`` are always kept and
    left out of the sums (an interval of length 1 holds exactly one point), as are zeros
    (never kept). For an offset uniform on ``[0, 1)``, unit ``k`` is kept with probability
    exactly ``P_k`` whatever the order; the order decides which units are kept together. A row
    keeps ``floor(sum P)`` or ``ceil(sum P)`` units (``round`` when the sum is within ``SNAP``
    of an integer). With ``order`` the identity this is ``systematic_sample`` at that offset.

    Args:
        inclusion: float ``[R, K]`` in ``[0, 1]``.
        order: int64 ``[R, K]``, a permutation of ``0..K-1`` per row
            (``probkv.sampling.span_designs.visit_order``).
        offset: float ``[R]`` in ``[0, 1)``.

    Returns:
        bool ``[R, K]``, indexed like ``inclusion``.
    """
    if not isinstance(inclusion, torch.Tensor) or inclusion.ndim != 2 or inclusion.shape[-1] == 0:
        raise ValueError("inclusion must be a tensor [rows, t] with t >= 1")
    P = inclusion.to(torch.float64)
    if not torch.isfinite(P).all() or (P < 0).any() or (P > 1).any():
        raise ValueError("inclusion probabilities must lie in [0, 1]")
    if not isinstance(order, torch.Tensor) or order.shape != P.shape:
        raise ValueError(f"order must be an int64 tensor of shape {tuple(P.shape)}")
    if order.dtype != torch.int64 or (order < 0).any() or (order >= P.shape[-1]).any():
        raise ValueError("order must hold a permutation of 0..K-1 in every row")
    seen = torch.zeros_like(order).scatter_add_(-1, order, torch.ones_like(order))
    if not (seen == 1).all():
        raise ValueError("order must hold a permutation of 0..K-1 in every row")
    u = torch.as_tensor(offset, dtype=torch.float64, device=P.device)
    if u.shape != P.shape[:1] or not ((u >= 0) & (u < 1)).all():
        raise ValueError(f"offset must be a tensor [{P.shape[0]}] in [0, 1)")
    hit = _systematic(P.gather(-1, order), u.unsqueeze(-1))
    return torch.zeros_like(hit).scatter(-1, order, hit)
