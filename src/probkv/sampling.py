"""Which entries a KV head keeps: sampling and the number of samples (SPEC S3, S9).

Two samplers, both driven by a proposal ``pi`` ``[..., t]`` (one row per KV head):

- with replacement (S3, the paper): draw ``m`` samples from ``pi``; entry ``i`` is kept iff it
  was drawn (``c_i > 0``). ``m`` is chosen by binary search so that the expected number of
  distinct entries ``E[J(m)] = sum_i 1 - (1 - pi_i)^m`` hits the target (Algorithm 2 of the
  paper's Appendix F), per head or globally (one ``m`` for all heads of all layers).
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
from collections.abc import Callable, Sequence

import torch

from probkv._checks import check_choice, check_distribution, check_ratio

MAX_SAMPLES = 10**12
"""Upper end of the binary search for ``m`` (S3; Algorithm 2's ``alpha``)."""

MAX_EXACT_COUNT = 2**53
"""Largest ``m`` whose counts float64 (the binomial sampler's type) represents exactly."""

ROW_SUM_TOL = 1e-3
"""A proposal row may sum to ``1 +/- ROW_SUM_TOL`` (float32 rounding); it is renormalised."""

_SEARCH_STEPS = 64  # > log2(MAX_SAMPLES + 1) = 40: every binary search ends well before this
_PROBE_STEPS = 24  # Newton probes per row before the binary search (typically under 10 used)

Probabilities = torch.Tensor | Sequence[torch.Tensor]
Count = int | torch.Tensor


# --------------------------------------------------------------------------- input helpers


def _probabilities(pi: torch.Tensor, name: str = "pi") -> torch.Tensor:
    """Validated float64 copy of a batch of distributions ``[..., t]``, rows renormalised."""
    check_distribution(pi, name)
    p = pi.to(torch.float64)
    total = p.sum(-1, keepdim=True)
    bad = (total - 1.0).abs() > ROW_SUM_TOL
    if bad.any():
        worst = total[bad].flatten()[0].item()
        raise ValueError(
            f"{name} rows must sum to 1 (within {ROW_SUM_TOL:g}); a row sums to {worst:.6g}. "
            "Pass probabilities (e.g. probkv.proposals), not scores"
        )
    return p / total


def _integer_per_row(
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


def _always_kept(a: Count | None, p: torch.Tensor, name: str = "always_kept") -> torch.Tensor:
    """Per-row count of always-kept entries (int64 ``p.shape[:-1]``); ``pi`` must be zero there."""
    if a is None:
        return torch.zeros(p.shape[:-1], dtype=torch.int64, device=p.device)
    out = _integer_per_row(a, p.shape[:-1], name, device=p.device)
    zeros = (p == 0).sum(-1)
    if (out > zeros).any():
        row = (out > zeros).nonzero()[0].tolist()
        raise ValueError(
            f"{name}={int(out[tuple(row)])} in row {row} but pi has only {int(zeros[tuple(row)])} "
            "zero entries there; pi must be zero at the always-kept positions (module docstring)"
        )
    return out


def _as_list(pi: Probabilities, name: str) -> list[torch.Tensor]:
    if isinstance(pi, torch.Tensor):
        return [pi]
    if isinstance(pi, (list, tuple)) and len(pi) > 0:
        return list(pi)
    raise ValueError(f"{name} must be a tensor or a non-empty list of tensors, got {pi!r}")


def _per_tensor(a: Count | Sequence[Count] | None, n: int, name: str) -> list[Count | None]:
    """``always_kept`` for a list of tensors: None, one value for all, or one per tensor."""
    if a is None or isinstance(a, (numbers.Integral, torch.Tensor)):
        return [a] * n
    if isinstance(a, (list, tuple)) and len(a) == n:
        return list(a)
    raise ValueError(f"{name} must be None, an integer, a tensor, or a list of {n} of those")


# --------------------------------------------------------------- expected distinct (S3)


def _log1m(p: torch.Tensor) -> torch.Tensor:
    """``log(1 - p)`` (``-inf`` where ``p = 1``)."""
    return torch.log1p(-p)


def _expected_distinct(log1m_p: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``sum_i 1 - exp(m log(1 - p_i))`` from precomputed ``log(1 - p)``; ``m`` int64 per row."""
    mf = m.to(torch.float64).unsqueeze(-1)
    x = torch.where(mf > 0, mf * log1m_p, 0.0)  # m = 0 with p = 1 would give 0 * -inf = nan
    return (-torch.expm1(x)).sum(-1)


def expected_distinct(pi: torch.Tensor, m: Count) -> torch.Tensor:
    """Expected number of distinct entries after ``m`` draws with replacement (S3).

    ``E[J(m)] = sum_i 1 - (1 - pi_i)^m``, computed as ``-expm1(m * log1p(-pi_i))`` in float64,
    which stays accurate for ``m`` up to ``10^12`` with ``pi_i`` down to ``1e-13`` and for
    ``pi_i = 1``. Non-decreasing in ``m``; ``E[J(0)] = 0``.

    Args:
        pi: ``[..., t]`` probabilities (rows sum to 1).
        m: non-negative int, or integer tensor broadcastable to ``pi.shape[:-1]``.

    Returns:
        float64 ``pi.shape[:-1]``.
    """
    p = _probabilities(pi)
    m_rows = _integer_per_row(m, p.shape[:-1], "m", device=p.device)
    return _expected_distinct(_log1m(p), m_rows)


def inclusion_probabilities_with_replacement(pi: torch.Tensor, m: Count) -> torch.Tensor:
    """``P(entry i drawn at least once in m draws) = 1 - (1 - pi_i)^m`` (S9), float64 ``[..., t]``.

    Computed as ``-expm1(m * log1p(-pi_i))``; ``m`` as in ``expected_distinct``.
    """
    p = _probabilities(pi)
    m_rows = _integer_per_row(m, p.shape[:-1], "m", device=p.device)
    mf = m_rows.to(torch.float64).unsqueeze(-1)
    return -torch.expm1(torch.where(mf > 0, mf * _log1m(p), 0.0))


# ------------------------------------------------------------ number of samples (S3)


def _distinct_and_slope(
    log1m_p: torch.Tensor, m: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``E[J(m)]`` per row and its derivative in ``m`` (S3), from one ``[R, t]`` float64 buffer.

    ``log1m_p``: ``log(1 - p)`` clamped to a finite minimum (``_search_log1m``), so that ``m = 0``
    gives ``0``, not ``0 * -inf``; ``m``: int64 per row. The value is
    ``-sum_i expm1(m log(1 - p_i))``, the same numbers as ``expected_distinct``; the slope
    ``dE/dm = -sum_i (1 - p_i)^m log(1 - p_i)`` (0 for ``p_i = 1`` once ``m >= 1``) only guides
    the search.
    """
    x = m.to(torch.float64).unsqueeze(-1) * log1m_p
    torch.expm1(x, out=x)  # (1 - p)^m - 1
    value = -x.sum(-1)
    x += 1.0  # (1 - p)^m
    return value, -torch.linalg.vecdot(x, log1m_p)


def _search_log1m(p: torch.Tensor) -> torch.Tensor:
    """``log(1 - p)`` as ``[R, t]``, with ``-inf`` (at ``p = 1``) clamped to the float64 minimum."""
    return _log1m(p).reshape(-1, p.shape[-1]).clamp(min=torch.finfo(torch.float64).min)


Objective = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``objective(m, rows) -> (value, slope)``: float64 at the int64 ``m`` of the rows ``rows``."""


def _bisection_point(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """A point of ``[low, high]`` (int64) splitting it in two: the geometric midpoint of
    ``[low + 1, high + 1]`` while that spans more than a factor 2 (``m`` ranges over 12
    decades), the arithmetic one after."""
    lo, hi = low.to(torch.float64), high.to(torch.float64)
    geometric = torch.exp(0.5 * (torch.log1p(lo) + torch.log1p(hi))) - 1.0
    mid = torch.where(hi + 1.0 > 2.0 * (lo + 1.0), geometric, 0.5 * (lo + hi)).floor()
    return mid.clamp(lo, hi).to(torch.int64)


def _as_count(x: torch.Tensor, fallback: float) -> torch.Tensor:
    """float64 -> int64 in ``[-1, MAX_SAMPLES + 1]`` (nan -> ``fallback``, +-inf -> the ends)."""
    x = x.nan_to_num(nan=fallback, posinf=MAX_SAMPLES + 1.0, neginf=-1.0)
    return x.clamp(-1.0, MAX_SAMPLES + 1.0).to(torch.int64)


def _probe_window(
    objective: Objective,
    target: torch.Tensor,
    tol: torch.Tensor,
    low: torch.Tensor,
    ceiling: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Evaluated points just below and just above each row's window (S3), by Newton steps.

    The window is the set of ``m`` with ``|objective(m) - target| <= tol``, an interval of the
    non-decreasing objective, concave in ``m`` (``E[J(m)]`` is a sum of ``1 - (1 - p)^m``): its
    tangent at any point lies above it. Per row: Newton steps towards ``target`` until one lands
    in the window (from below they never pass the root; from above they land below it;
    a step that fails to halve the distance to the target is replaced by a bisection of the
    current bracket); then one probe where the tangent at that hit reaches ``target - 1.5 tol``
    (below the window, by concavity) and up to three where it reaches ``target + 1.5 tol`` (above
    the window once past the curvature). ``_PROBE_STEPS`` evaluations at most. Rows whose
    ``ceiling`` (an upper bound of the objective) is at most ``target + tol`` are not probed: no
    ``m`` is above their window, which reaches ``MAX_SAMPLES`` if it exists, so the binary
    search's first midpoint is the one to evaluate (the case ``r = 0``).

    Returns ``(below, above)`` int64 per row: ``objective(below) < target - tol`` and
    ``objective(above) > target + tol`` (``below = low - 1`` and ``above = MAX_SAMPLES + 1``
    when nothing closer was found: ``low`` is a known lower end, no smaller ``m`` is valid).
    """
    n = target.shape[0]
    below = (low - 1).clamp(-1, MAX_SAMPLES)
    above = torch.full((n,), MAX_SAMPLES + 1, dtype=torch.int64)
    candidate = low.clamp(0, MAX_SAMPLES)
    # 0 seek a hit, 1 probe below, 2 above, 3 done
    stage = torch.where(ceiling <= target + tol, 3, 0)
    hit_m = torch.full((n,), -1, dtype=torch.int64)
    hit_v = torch.zeros(n, dtype=torch.float64)
    hit_s = torch.zeros(n, dtype=torch.float64)
    residual = torch.full((n,), math.inf, dtype=torch.float64)
    bisected = torch.zeros(n, dtype=torch.bool)
    tries_above = torch.zeros(n, dtype=torch.int64)
    for _ in range(_PROBE_STEPS):
        rows = (stage < 3).nonzero().squeeze(-1)
        if rows.numel() == 0:
            break
        m, st = candidate[rows], stage[rows]
        value, slope = objective(m, rows)
        tgt, tl = target[rows], tol[rows]
        is_below, is_above = value < tgt - tl, value > tgt + tl
        hit = ~is_below & ~is_above
        lo = torch.where(is_below, torch.maximum(below[rows], m), below[rows])
        hi = torch.where(is_above, torch.minimum(above[rows], m), above[rows])
        hm = torch.where(hit, m, hit_m[rows])
        hv = torch.where(hit, value, hit_v[rows])
        hs = torch.where(hit, slope, hit_s[rows])
        below[rows], above[rows], hit_m[rows], hit_v[rows], hit_s[rows] = lo, hi, hm, hv, hs

        # stage 0: Newton towards the target, or a bisection after a slow step
        dist = (value - tgt).abs()
        bisect = (~bisected[rows] & (dist > 0.5 * residual[rows])) | ~(slope > 0)
        residual[rows], bisected[rows] = dist, bisect
        newton = _as_count((m.to(torch.float64) + (tgt - value) / slope).round(), -1.0)
        inner_lo, inner_hi = lo + 1, hi - 1
        seek = torch.where(bisect, _bisection_point(inner_lo, inner_hi.clamp(min=inner_lo)), newton)
        seek = torch.minimum(torch.maximum(seek, inner_lo), inner_hi)
        # stages 1 and 2: where the tangent at the last hit reaches target -/+ 1.5 tol
        hmf = hm.to(torch.float64)
        probe_lo = _as_count(torch.floor(hmf + (tgt - 1.5 * tl - hv) / hs), -1.0)
        probe_hi = _as_count(torch.ceil(hmf + (tgt + 1.5 * tl - hv) / hs), MAX_SAMPLES + 1.0)
        probe_hi = probe_hi.clamp(max=MAX_SAMPLES)
        need_lo = probe_lo > lo
        tries = tries_above[rows] + (st == 2).to(torch.int64)
        tries_above[rows] = tries
        need_hi = (probe_hi < hi) & (hm < MAX_SAMPLES) & (tries < 3)

        has_hit = hm >= 0
        go_lo = has_hit & (st == 0) & need_lo
        go_hi = has_hit & ~go_lo & need_hi
        new_stage = torch.where(go_lo, 1, torch.where(go_hi, 2, 3))
        new_stage = torch.where(~has_hit & (inner_lo <= inner_hi), 0, new_stage)
        stage[rows] = new_stage
        candidate[rows] = torch.where(go_lo, probe_lo, torch.where(go_hi, probe_hi, seek))
    return below, above


def _search(
    objective: Objective,
    target: torch.Tensor,
    tol: torch.Tensor,
    low: torch.Tensor,
    ceiling: torch.Tensor,
) -> torch.Tensor:
    """Algorithm 2 of the paper (S3), run for every row at once: the integer ``m`` in
    ``[0, MAX_SAMPLES]`` with ``|objective(m) - target| <= tol`` that its binary search returns.

    ``objective`` is non-decreasing (``Objective``: only rows still searching are evaluated);
    ``low`` (int64 per row) is a known lower end: no ``m < low`` is valid; ``ceiling`` (float64
    per row) a known upper bound of the objective.

    The binary search over ``[0, MAX_SAMPLES]`` is replayed step by step, but a midpoint is only
    evaluated when its side is unknown: ``_probe_window`` first finds, by a few Newton steps,
    evaluated points just below and just above the window, and by monotonicity every midpoint
    at or below the first (at or above the second) is below (above) the window. So the search
    returns exactly the ``m`` of the plain binary search (the first midpoint inside the window;
    e.g. ``MAX_SAMPLES // 2`` when the window reaches ``MAX_SAMPLES``, as for ``r = 0``), with
    about 10 evaluations per row instead of about 40. When no valid ``m`` exists (target out of
    reach), the search ends with ``low = high + 1`` and the closer of ``low - 1`` and ``low``
    (clipped to the range) is returned: ``0`` if even ``m = 0`` overshoots, ``MAX_SAMPLES`` if
    even ``MAX_SAMPLES`` falls short.
    """
    n = target.shape[0]
    known_below, known_above = _probe_window(objective, target, tol, low, ceiling)
    low = torch.zeros(n, dtype=torch.int64)
    high = torch.full((n,), MAX_SAMPLES, dtype=torch.int64)
    found = torch.zeros(n, dtype=torch.bool)
    result = torch.zeros(n, dtype=torch.int64)
    for _ in range(_SEARCH_STEPS):
        active = ~found & (low <= high)
        if not active.any():
            break
        mid = (low + high) // 2
        below = active & (mid <= known_below)
        above = active & (mid >= known_above)
        hit = torch.zeros(n, dtype=torch.bool)
        rows = (active & ~below & ~above).nonzero().squeeze(-1)
        if rows.numel() > 0:
            value, _ = objective(mid[rows], rows)
            tgt = target[rows]
            h = (value - tgt).abs() <= tol[rows]
            hit[rows] = h
            below[rows] = ~h & (value < tgt)
            above[rows] = ~h & ~(value < tgt)
        result = torch.where(hit, mid, result)
        found |= hit
        low = torch.where(below, mid + 1, low)
        high = torch.where(above, mid - 1, high)
    if not found.all():
        rest = (~found).nonzero().squeeze(-1)
        lo = (low[rest] - 1).clamp(0, MAX_SAMPLES)
        hi = low[rest].clamp(0, MAX_SAMPLES)
        tgt = target[rest]
        closer_lo = (objective(lo, rest)[0] - tgt).abs() <= (objective(hi, rest)[0] - tgt).abs()
        result[rest] = torch.where(closer_lo, lo, hi)
    return result


def samples_for_ratio(
    pi: Probabilities,
    ratio: float,
    scope: str = "head",
    *,
    always_kept: Count | Sequence[Count] | None = None,
) -> torch.Tensor | int:
    """Number of samples ``m`` whose expected kept fraction is ``1 - ratio`` (S3, Algorithm 2).

    ``scope="head"``: ``pi`` is a tensor ``[..., t]``; every row ``h`` (a KV head) gets its own
    ``m_h`` with ``|a_h + E[J_h(m_h)] - (1 - r) t| <= 0.5``, where ``a_h`` is ``always_kept`` (0 by
    default), i.e. the sampled part targets ``j*_h = (1 - r) t - a_h`` distinct entries. Such an
    ``m`` exists because ``E[J(m + 1)] - E[J(m)] = sum_i pi_i (1 - pi_i)^m <= 1`` (consecutive
    values never jump over a window of width 1). All rows are searched at once, and the result
    is exactly Algorithm 2's binary search over ``[0, 10^12]``, computed with about 10 ``O(t)``
    evaluations per row instead of about 40 (Newton probes, ``_search``).

    ``scope="global"`` (Appendix F.1): one ``m`` for every row of every tensor (``pi`` may be a
    list of ``[H_l, t_l]`` tensors, one per layer, with different ``t_l``). With ``t_h`` the
    length of head ``h`` and ``H`` the number of heads in all, the kept fraction
    ``f(m) = (1/H) sum_h (a_h + E[J_h(m)]) / t_h`` is non-decreasing and
    ``f(m + 1) - f(m) <= (1/H) sum_h 1 / t_h``, so by the same argument the returned ``m``
    satisfies ``|f(m) - (1 - r)| <= (1/2) (1/H) sum_h 1 / t_h``. With equal lengths this is
    ``0.5 / t``: the mean expected kept count is within 0.5 of ``(1 - r) t``, as per head.

    Out-of-reach targets (clamped, documented): if the always-kept entries alone exceed the
    target (``a_h > (1 - r) t_h``, or on average for "global"), ``j*`` is clamped to 0 and
    ``m = 0``: nothing is sampled and the head keeps its ``a_h`` entries, more than the budget.
    If the proposal puts so little mass on some entries that even ``MAX_SAMPLES`` draws fall
    short of the target by more than the tolerance (possible only for masses below about
    ``1e-12`` or exactly 0; see the paper's remark after Algorithm 2), ``m = MAX_SAMPLES``, the
    closest reachable value, and the kept fraction falls short of ``1 - r``. Check with
    ``expected_distinct`` when it matters.

    Args:
        pi: ``[..., t]`` proposal (zeros at always-kept positions), or for "global" a list of
            such tensors.
        ratio: compression ratio ``r`` in ``[0, 1)`` (fraction evicted).
        scope: ``"head"`` or ``"global"``.
        always_kept: per-row count of entries kept outside sampling: an int, an integer tensor
            broadcastable to ``pi.shape[:-1]``, or (global) a list with one per tensor.

    Returns:
        "head": int64 tensor ``pi.shape[:-1]``; "global": a Python int.
    """
    r = check_ratio(ratio)
    check_choice(scope, ("head", "global"), "scope")
    if scope == "head":
        if not isinstance(pi, torch.Tensor):
            raise ValueError(
                f"pi must be one tensor [..., t] for scope='head' (lists are for scope='global'), "
                f"got {type(pi).__name__}"
            )
        p = _probabilities(pi)
        a = _always_kept(always_kept, p, "always_kept")
        t = p.shape[-1]
        target = ((1.0 - r) * t - a.to(torch.float64)).clamp(min=0.0).flatten().cpu()
        log1m_p = _search_log1m(p)
        positive = (p > 0).sum(-1).to(torch.float64)
        del p

        def distinct(m: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if rows.numel() < log1m_p.shape[0]:  # only the rows still searching
                rows = rows.to(log1m_p.device)
                return _distinct_and_slope(log1m_p[rows], m.to(rows.device))
            return _distinct_and_slope(log1m_p, m.to(log1m_p.device))

        # E[J(m)] <= min(m, n) with n the entries of positive mass: no m below j* - 0.5 can be
        # valid, and E never exceeds n
        low = (target - 0.5).ceil().to(torch.int64) - 1
        m = _search(
            lambda m, rows: tuple(x.cpu() for x in distinct(m, rows)),
            target,
            torch.full_like(target, 0.5),
            low,
            positive.flatten().cpu(),
        )
        return m.reshape(a.shape).to(a.device)

    tensors = _as_list(pi, "pi")
    kept_per_tensor = _per_tensor(always_kept, len(tensors), "always_kept")
    terms, lengths, forced, positive = [], [], [], []
    for i, (x, a) in enumerate(zip(tensors, kept_per_tensor, strict=True)):
        p = _probabilities(x, f"pi[{i}]")
        t = p.shape[-1]
        terms.append(_search_log1m(p))
        lengths.append(torch.full((terms[-1].shape[0],), float(t), dtype=torch.float64))
        forced.append(_always_kept(a, p, f"always_kept[{i}]").reshape(-1).to(torch.float64).cpu())
        positive.append((p > 0).sum(-1).reshape(-1).to(torch.float64).cpu())
        del p
    inv_t = 1.0 / torch.cat(lengths)
    base = torch.cat(forced) * inv_t  # a_h / t_h

    def kept_fraction(m: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """f(m) above and its slope, for one m ([1])."""
        pairs = [_distinct_and_slope(x, m.to(x.device)) for x in terms]
        e = torch.cat([v.cpu() for v, _ in pairs])
        slope = torch.cat([s.cpu() for _, s in pairs])
        return (base + e * inv_t).mean().reshape(1), (slope * inv_t).mean().reshape(1)

    target = torch.tensor([1.0 - r], dtype=torch.float64)
    tol = 0.5 * inv_t.mean().reshape(1)
    # f(m) <= mean_h (a_h + min(m, n_h)) / t_h (E[J_h(m)] <= min(m, n_h), n_h the entries of
    # positive mass): no smaller m can be valid, and f never exceeds the ceiling
    low = ((target - tol - base.mean()) / inv_t.mean()).ceil().to(torch.int64) - 1
    ceiling = (base + torch.cat(positive) * inv_t).mean().reshape(1)
    return int(_search(kept_fraction, target, tol, low, ceiling)[0])


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
    p = _probabilities(pi)
    batch, t = p.shape[:-1], p.shape[-1]
    m_rows = _integer_per_row(m, batch, "m", upper=MAX_EXACT_COUNT, device=p.device)
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


def _pps_scale(p: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``lam = num / den`` per row with ``sum_i min(1, lam p_i) = k`` (S9 iterative capping).

    ``p`` ``[R, n]`` float64 non-negative, ``k`` ``[R]`` float64 ``>= 0``. Sorting each row in
    decreasing order, capping the ``c`` largest entries leaves ``lam_c = (k - c) / S_c`` with
    ``S_c`` the mass of the others; the solution is the smallest ``c`` with ``lam_c p_(c+1) <= 1``
    (iterative capping stops exactly there). ``lam`` is returned as a fraction so that a tiny
    ``S_c`` (subnormal masses) cannot overflow it; ``den = 0`` when a row has fewer than ``k``
    positive entries (all of them get ``P = 1``), ``num = 0`` when ``k = 0``.
    """
    s = p.sort(-1, descending=True).values
    rest = s.flip(-1).cumsum(-1).flip(-1)  # rest[:, c] = S_c, mass outside the c largest
    c = torch.arange(s.shape[-1], dtype=torch.float64, device=p.device)
    kk = k.unsqueeze(-1)
    ok = ((kk - c) * s <= rest) & (c < kk)
    first = ok.to(torch.int8).argmax(-1)  # k = 0: no c qualifies, num = 0 below
    num = torch.where(k > 0, k - first.to(torch.float64), 0.0)
    den = rest.gather(-1, first.unsqueeze(-1)).squeeze(-1)
    return num, den


def _capped(p: torch.Tensor, num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``min(1, (num / den) p)``, computed as ``num * (p / den)``; ``P = 0`` where ``p = 0``."""
    num, den = num.unsqueeze(-1), den.unsqueeze(-1)
    return torch.where((p > 0) & (num > 0), (num * (p / den)).clamp(max=1.0), 0.0)


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
    p = _probabilities(pi)
    batch, t = p.shape[:-1], p.shape[-1]
    k_rows = _integer_per_row(k, batch, "k", device=p.device)
    if (k_rows > t).any():
        raise ValueError(f"k must be <= t = {t} (entries per row), got {int(k_rows.max())}")
    a = _always_kept(always_kept, p)
    sampled = (k_rows - a).clamp(min=0).to(torch.float64).reshape(-1)
    rows = p.reshape(-1, t)
    return _capped(rows, *_pps_scale(rows, sampled)).reshape(p.shape)


def pps_inclusion_probabilities_global(
    pis: Probabilities,
    ratio: float,
    always_kept: Count | Sequence[Count] | None = None,
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
    Note the budget here is a sum of counts (memory), whereas ``samples_for_ratio``'s global
    scope targets the mean over heads of kept fractions (Appendix F.1); with equal lengths the two
    coincide.

    Args:
        pis: ``[..., t]`` proposal or a list of such tensors (one per layer, lengths may differ).
        ratio: compression ratio ``r`` in ``[0, 1)``.
        always_kept: as in ``samples_for_ratio`` (int, tensor, or one per tensor).

    Returns:
        float64 tensors shaped like ``pis`` (a tensor for a tensor, a list for a list).
    """
    r = check_ratio(ratio)
    tensors = _as_list(pis, "pis")
    kept_per_tensor = _per_tensor(always_kept, len(tensors), "always_kept")
    probs, budget, forced = [], 0.0, 0
    for i, (x, a) in enumerate(zip(tensors, kept_per_tensor, strict=True)):
        p = _probabilities(x, f"pis[{i}]")
        probs.append(p)
        budget += (1.0 - r) * p.shape[-1] * math.prod(p.shape[:-1])
        forced += int(_always_kept(a, p, f"always_kept[{i}]").sum())
    sampled = max(budget - forced, 0.0)
    flat = torch.cat([p.reshape(1, -1).to(probs[0].device) for p in probs], -1)
    num, den = _pps_scale(flat, torch.tensor([sampled], dtype=torch.float64, device=flat.device))
    out = []
    for p in probs:  # the one (num, den) broadcast over every row of every tensor
        ones = [1] * (p.ndim - 1)
        out.append(_capped(p, num.to(p.device).reshape(ones), den.to(p.device).reshape(ones)))
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
    exactly ``round(sum P)`` when the sum is an integer (sums within ``1e-9`` relative of an
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
    take_all = P == 1.0
    cum = torch.where(take_all, 0.0, P).cumsum(-1)
    total = cum[..., -1:]
    whole = total.round()
    snap = (total - whole).abs() <= 1e-9 * whole.clamp(min=1.0)
    cum = torch.where(snap, torch.minimum(cum, whole), cum)
    cum[..., -1:] = torch.where(snap, whole, total)
    u = torch.rand((*P.shape[:-1], 1), generator=generator, dtype=torch.float64, device=P.device)
    points = torch.ceil(cum - u)  # points u + j (j >= 0) below C_i
    before = torch.cat([torch.zeros_like(points[..., :1]), points[..., :-1]], -1)
    return take_all | (points > before)
