"""How many samples a with-replacement eviction draws (S3, Algorithm 2 of Appendix F).

With ``m`` draws from a proposal ``pi`` (``probkv.sampling.sample_counts``) an entry is kept
iff it was drawn; the expected number of distinct entries is
``E[J(m)] = sum_i 1 - (1 - pi_i)^m``. ``samples_for_ratio`` finds, per KV head, the ``m`` whose
expected kept fraction is ``1 - r``; ``samples_for_ratio_global`` one ``m`` for every head of
every layer (the global scope, Appendix F.1). Both replay Algorithm 2's binary search over
``[0, MAX_SAMPLES]`` exactly, with Newton probes that skip most of its evaluations.

Conventions (float64 arithmetic, renormalised rows, ``always_kept`` counts with zeros at the
always-kept positions of ``pi``) are those of ``probkv.sampling``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from probkv._checks import check_ratio
from probkv.sampling.samplers import (
    Count,
    Probabilities,
    as_tensor_list,
    checked_always_kept,
    checked_probabilities,
    integer_per_row,
    per_tensor,
)

MAX_SAMPLES = 10**12
"""Upper end of the binary search for ``m`` (S3; Algorithm 2's ``alpha``)."""

_SEARCH_STEPS = 64  # > log2(MAX_SAMPLES + 1) = 40: every binary search ends well before this
_PROBE_STEPS = 24  # Newton probes per row before the binary search (typically under 10 used)


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
    p = checked_probabilities(pi)
    m_rows = integer_per_row(m, p.shape[:-1], "m", device=p.device)
    return _expected_distinct(_log1m(p), m_rows)


def inclusion_probabilities_with_replacement(pi: torch.Tensor, m: Count) -> torch.Tensor:
    """``P(entry i drawn at least once in m draws) = 1 - (1 - pi_i)^m`` (S9), float64 ``[..., t]``.

    Computed as ``-expm1(m * log1p(-pi_i))``; ``m`` as in ``expected_distinct``.
    """
    p = checked_probabilities(pi)
    m_rows = integer_per_row(m, p.shape[:-1], "m", device=p.device)
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
    pi: torch.Tensor, ratio: float, *, always_kept: Count | None = None
) -> torch.Tensor:
    """Number of samples ``m_h`` per KV head whose expected kept fraction is ``1 - ratio``
    (S3, Algorithm 2 per head; ``samples_for_ratio_global`` is the global scope).

    ``pi`` is a tensor ``[..., t]``; every row ``h`` (a KV head) gets its own ``m_h`` with
    ``|a_h + E[J_h(m_h)] - (1 - r) t| <= 0.5``, where ``a_h`` is ``always_kept`` (0 by default),
    i.e. the sampled part targets ``j*_h = (1 - r) t - a_h`` distinct entries. Such an ``m``
    exists because ``E[J(m + 1)] - E[J(m)] = sum_i pi_i (1 - pi_i)^m <= 1`` (consecutive values
    never jump over a window of width 1). All rows are searched at once, and the result is
    exactly Algorithm 2's binary search over ``[0, 10^12]``, computed with about 10 ``O(t)``
    evaluations per row instead of about 40 (Newton probes, ``_search``).

    Out-of-reach targets (clamped, documented): if the always-kept entries alone exceed the
    target (``a_h > (1 - r) t``), ``j*`` is clamped to 0 and ``m = 0``: nothing is sampled and
    the head keeps its ``a_h`` entries, more than the budget. If the proposal puts so little
    mass on some entries that even ``MAX_SAMPLES`` draws fall short of the target by more than
    the tolerance (possible only for masses below about ``1e-12`` or exactly 0; see the paper's
    remark after Algorithm 2), ``m = MAX_SAMPLES``, the closest reachable value, and the kept
    fraction falls short of ``1 - r``. Check with ``expected_distinct`` when it matters.

    Args:
        pi: ``[..., t]`` proposal (zeros at always-kept positions).
        ratio: compression ratio ``r`` in ``[0, 1)`` (fraction evicted).
        always_kept: per-row count of entries kept outside sampling: an int or an integer
            tensor broadcastable to ``pi.shape[:-1]``.

    Returns:
        int64 tensor ``pi.shape[:-1]``.
    """
    r = check_ratio(ratio)
    if not isinstance(pi, torch.Tensor):
        raise ValueError(
            "pi must be one tensor [..., t] (lists are for scope='global': "
            f"samples_for_ratio_global), got {type(pi).__name__}"
        )
    p = checked_probabilities(pi)
    a = checked_always_kept(always_kept, p, "always_kept")
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


def samples_for_ratio_global(
    pi: Probabilities, ratio: float, *, always_kept: Count | Sequence[Count] | None = None
) -> int:
    """One number of samples ``m`` for every KV head of every layer (S3 global scope, the
    paper's Appendix F.1): the kept fraction averaged over heads is ``1 - ratio``.

    ``pi`` may be a list of ``[H_l, t_l]`` tensors, one per layer, with different ``t_l``. With
    ``t_h`` the length of head ``h`` and ``H`` the number of heads in all, the kept fraction
    ``f(m) = (1/H) sum_h (a_h + E[J_h(m)]) / t_h`` is non-decreasing and
    ``f(m + 1) - f(m) <= (1/H) sum_h 1 / t_h``, so by the argument of ``samples_for_ratio`` the
    returned ``m`` satisfies ``|f(m) - (1 - r)| <= (1/2) (1/H) sum_h 1 / t_h``. With equal
    lengths this is ``0.5 / t``: the mean expected kept count is within 0.5 of ``(1 - r) t``,
    as per head. Out-of-reach targets are clamped as in ``samples_for_ratio`` (on average over
    the heads).

    Args:
        pi: ``[..., t]`` proposal (zeros at always-kept positions), or a list of such tensors.
        ratio: compression ratio ``r`` in ``[0, 1)`` (fraction evicted).
        always_kept: per-row count of entries kept outside sampling: an int, an integer tensor,
            or a list with one per tensor.

    Returns:
        a Python int.
    """
    r = check_ratio(ratio)
    tensors = as_tensor_list(pi, "pi")
    kept_per_tensor = per_tensor(always_kept, len(tensors), "always_kept")
    terms, lengths, forced, positive = [], [], [], []
    for i, (x, a) in enumerate(zip(tensors, kept_per_tensor, strict=True)):
        p = checked_probabilities(x, f"pi[{i}]")
        t = p.shape[-1]
        terms.append(_search_log1m(p))
        lengths.append(torch.full((terms[-1].shape[0],), float(t), dtype=torch.float64))
        forced.append(
            checked_always_kept(a, p, f"always_kept[{i}]").reshape(-1).to(torch.float64).cpu()
        )
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
