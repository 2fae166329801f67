"""KVEviction is NP-complete: an exact solver for tiny instances and the Partition reduction (S8).

KVEviction (paper Section 3, Problem 1): given one query ``q`` ``[d]``, keys ``K`` ``[n, d]``,
values ``V`` ``[n, d_v]`` and a kept count ``k = floor(n * r)`` (``r`` the *kept* fraction here),
is there a kept set ``I``, ``|I| = k``, with ``|softmax(q.K_I) V_I - softmax(q.K) V| <= eps``?
The paper's attention omits the ``1/sqrt(d)`` factor (``scale=1.0`` here; pass ``d ** -0.5`` for
the model's convention). The solvers below return the *optimal* ``I`` and its error, a ground
truth for small tests of how far a policy is from optimal.

- ``solve_kv_eviction_brute_force``: every subset of size ``k``, written plainly.
- ``solve_kv_eviction_meet_in_the_middle``: exact for one-dimensional values (the reduction's
  ``d_v = 1``), ``O(2^(n/2))`` per step instead of ``C(n, k)``: solves ``n = 32`` in well under a
  second where brute force would enumerate 6e8 subsets.
- ``partition_instance`` / ``decide_partition``: the paper's reduction from Partition
  (Appendix B); ``partition_brute_force`` decides Partition directly, for tests.

The error of a vector output is a norm of the difference: ``ord=inf`` (default) is the paper's
componentwise ``<= eps`` with one ``eps`` for all components; ``ord=1`` and ``ord=2`` are offered.
For ``d_v = 1`` every choice is the absolute value.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "EvictionSolution",
    "KVEvictionInstance",
    "decide_partition",
    "kept_count",
    "partition_brute_force",
    "partition_instance",
    "solve_kv_eviction_brute_force",
    "solve_kv_eviction_meet_in_the_middle",
]

MAX_BRUTE_FORCE_SUBSETS = 5_000_000  # C(n, k) above this is refused (seconds of work at most)
MAX_MEET_IN_THE_MIDDLE_N = 32  # 2^16 subsets per half
MAX_PARTITION_VALUE = 2**31  # keeps float64 round-off far below the decision gap (see below)


@dataclass(frozen=True)
class KVEvictionInstance:
    """One KVEviction instance (S8): a query ``[d]``, keys ``[n, d]``, values ``[n, d_v]``
    (float64) and the kept count ``|I|``."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kept: int


@dataclass(frozen=True)
class EvictionSolution:
    """An optimal kept set: sorted indices ``I`` (``|I| = kept``) and its attention error
    ``||softmax(q.K_I) V_I - softmax(q.K) V||`` (the norm chosen by ``ord``)."""

    kept_indices: tuple[int, ...]
    error: float


def kept_count(n: int, kept_fraction: float) -> int:
    """``|I| = floor(n * r)`` with ``r`` the kept fraction in (0, 1] (S8; Problem 1 of the paper)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if (
        isinstance(kept_fraction, bool)
        or not isinstance(kept_fraction, (int, float))
        or not 0.0 < kept_fraction <= 1.0
    ):
        raise ValueError(
            f"kept_fraction must be in (0, 1] (fraction of entries kept), got {kept_fraction!r}"
        )
    return math.floor(n * kept_fraction)


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def _check_instance(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kept: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    for name, x, ndim in (("query", query, 1), ("key", key, 2), ("value", value, 2)):
        if not isinstance(x, torch.Tensor) or x.ndim != ndim:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            want = "[d]" if ndim == 1 else ("[n, d]" if name == "key" else "[n, d_v]")
            raise ValueError(f"{name} must be a tensor {want}, got {shape}")
        if not torch.isfinite(x.to(torch.float64)).all():
            raise ValueError(f"{name} must be finite")
    n = key.shape[0]
    if n == 0:
        raise ValueError("key has no entries (n = 0); KVEviction needs n >= 1")
    if key.shape[1] != query.shape[0]:
        raise ValueError(f"query has d = {query.shape[0]} but key has d = {key.shape[1]}")
    if value.shape[0] != n:
        raise ValueError(f"value has {value.shape[0]} rows but key has n = {n}")
    if isinstance(kept, bool) or not isinstance(kept, int) or not 1 <= kept <= n:
        raise ValueError(f"kept must be an integer in [1, n = {n}], got {kept!r}")
    f64 = torch.float64
    return query.to(f64).cpu(), key.to(f64).cpu(), value.to(f64).cpu(), kept


def _check_ord(ord: float) -> float:
    if ord not in (1, 2, math.inf):
        raise ValueError(f"ord must be 1, 2 or math.inf (norm of the output error), got {ord!r}")
    return float(ord)


# --------------------------------------------------------------------------------------------
# Exact solvers
# --------------------------------------------------------------------------------------------


def solve_kv_eviction_brute_force(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kept: int,
    *,
    scale: float = 1.0,
    ord: float = math.inf,
) -> EvictionSolution:
    """The optimal kept set by enumerating all ``C(n, kept)`` subsets (the reference solver, S8).

    For each subset ``I`` (in ``itertools.combinations`` order) the evicted output
    ``softmax(scale * K_I q) V_I`` is computed literally and compared with the full output; the
    first subset with the smallest error wins. Refuses ``C(n, kept) > 5e6``.
    """
    q, k, v, kept = _check_instance(query, key, value, kept)
    ord = _check_ord(ord)
    n = k.shape[0]
    if math.comb(n, kept) > MAX_BRUTE_FORCE_SUBSETS:
        raise ValueError(
            f"C(n, kept) = C({n}, {kept}) = {math.comb(n, kept)} subsets exceeds the brute-force "
            f"limit {MAX_BRUTE_FORCE_SUBSETS}; use solve_kv_eviction_meet_in_the_middle (d_v = 1)"
        )
    logits = scale * (k @ q)  # [n]
    full = torch.softmax(logits, 0) @ v  # [d_v]
    best_error, best_subset = math.inf, None
    combos = itertools.combinations(range(n), kept)
    while chunk := list(itertools.islice(combos, 65536)):
        idx = torch.tensor(chunk, dtype=torch.int64)  # [C, kept]
        weights = torch.softmax(logits[idx], dim=-1)  # [C, kept]
        out = torch.einsum("ck,ckd->cd", weights, v[idx])  # [C, d_v]
        err = torch.linalg.vector_norm(out - full, ord=ord, dim=-1)
        i = int(torch.argmin(err))  # first minimum
        if float(err[i]) < best_error:
            best_error, best_subset = float(err[i]), chunk[i]
    return EvictionSolution(tuple(best_subset), best_error)


def _evicted_error(logits: torch.Tensor, value: torch.Tensor, full: torch.Tensor, subset) -> float:
    idx = torch.tensor(sorted(subset), dtype=torch.int64)
    out = torch.softmax(logits[idx], 0) @ value[idx]
    return float(torch.linalg.vector_norm(out - full, ord=math.inf))


def _half_sums(w: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All ``2^m`` subsets of one half: (sizes, sums of ``w``, sums of ``a``), subset = bit mask."""
    m = w.numel()
    masks = torch.arange(2**m, dtype=torch.int64)
    bits = ((masks.unsqueeze(-1) >> torch.arange(m)) & 1).to(torch.float64)  # [2^m, m]
    return bits.sum(-1).to(torch.int64), bits @ w, bits @ a


def solve_kv_eviction_meet_in_the_middle(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kept: int,
    *,
    scale: float = 1.0,
) -> EvictionSolution:
    """The optimal kept set for one-dimensional values (``d_v = 1``, as in the reduction), exactly.

    With ``w_i = exp(scale * q.k_i)`` and ``a_i = w_i (v_i - o)`` (``o`` the full output), the
    error of ``I`` is ``f(I) = |A_I| / W_I`` (``A_I = sum_I a_i``, ``W_I = sum_I w_i``): a ratio of
    subset sums. Dinkelbach's iteration minimises it: with ``lam = f(I_best)``, find the ``I``
    minimising ``|A_I| - lam W_I``; if ``f(I) < lam`` it becomes ``I_best`` and we repeat, else
    ``I_best`` is optimal (any ``I'`` with ``f(I') < lam`` would make that minimum negative, hence
    ``f(I) < lam``). Each inner minimum is exact by meet in the middle: split the entries into two
    halves, enumerate each half's subsets with their sizes and sums, and for every left subset
    find the best right subset of complementary size on each side of ``A_L + A_R = 0`` (sorted
    right sums, prefix/suffix minima, binary search): ``O(2^(n/2) n)`` per step, ``n <= 32``.
    On ties the solver may return a different optimal set than brute force; the error agrees.
    """
    q, k, v, kept = _check_instance(query, key, value, kept)
    n = k.shape[0]
    if v.shape[1] != 1:
        raise ValueError(
            f"meet in the middle needs one-dimensional values (d_v = 1), got d_v = {v.shape[1]}; "
            "use solve_kv_eviction_brute_force"
        )
    if n > MAX_MEET_IN_THE_MIDDLE_N:
        raise ValueError(f"n = {n} exceeds the meet-in-the-middle limit {MAX_MEET_IN_THE_MIDDLE_N}")
    logits = scale * (k @ q)
    w = torch.exp(logits - logits.max())  # the ratio f(I) is invariant to scaling w
    full = torch.softmax(logits, 0) @ v
    a = w * (v[:, 0] - full[0])

    half = n // 2
    size_l, w_l, a_l = _half_sums(w[:half], a[:half])
    size_r, w_r, a_r = _half_sums(w[half:], a[half:])
    groups = []  # per left size s: left subsets of size s, right subsets of size kept - s (sorted)
    for s in range(max(0, kept - (n - half)), min(kept, half) + 1):
        left = (size_l == s).nonzero().flatten()
        right = (size_r == kept - s).nonzero().flatten()
        right = right[torch.argsort(a_r[right], stable=True)]
        groups.append((left, right))

    def subset(mask_l: int, mask_r: int) -> list[int]:
        return [i for i in range(half) if mask_l >> i & 1] + [
            half + j for j in range(n - half) if mask_r >> j & 1
        ]

    def best_pair(lam: float) -> tuple[int, int]:
        """argmin over |I| = kept of |A_I| - lam W_I, as (left mask, right mask)."""
        best, arg = math.inf, (0, 0)
        for left, right in groups:
            al, wl, ar, wr = a_l[left], w_l[left], a_r[right], w_r[right]
            # A_L + A_R >= 0: minimise (a_R - lam w_R) over right sums >= -A_L (suffix minima).
            up = ar - lam * wr
            suf_val, suf_idx = torch.cummin(up.flip(0), 0)
            suf_val, suf_idx = suf_val.flip(0), (len(up) - 1 - suf_idx).flip(0)
            p = torch.searchsorted(ar, -al, side="left")
            ok = p < len(ar)
            pc = p.clamp(max=len(ar) - 1)
            val1 = torch.where(ok, al - lam * wl + suf_val[pc], math.inf)
            # A_L + A_R <= 0: minimise (-a_R - lam w_R) over right sums <= -A_L (prefix minima).
            down = -ar - lam * wr
            pre_val, pre_idx = torch.cummin(down, 0)
            p2 = torch.searchsorted(ar, -al, side="right") - 1
            ok2 = p2 >= 0
            p2c = p2.clamp(min=0)
            val2 = torch.where(ok2, -al - lam * wl + pre_val[p2c], math.inf)
            for val, idx in ((val1, suf_idx[pc]), (val2, pre_idx[p2c])):
                i = int(torch.argmin(val))
                if float(val[i]) < best:
                    best, arg = float(val[i]), (int(left[i]), int(right[idx[i]]))
        return arg

    def ratio(members: list[int]) -> float:
        return _evicted_error(logits, v, full, members)

    best_set = list(range(kept))
    best_err = ratio(best_set)
    for _ in range(200):  # Dinkelbach converges superlinearly; a handful of steps in practice
        if best_err == 0.0:
            break
        candidate = subset(*best_pair(best_err))
        err = ratio(candidate)
        if not err < best_err * (1 - 1e-12):
            break
        best_set, best_err = candidate, err
    return EvictionSolution(tuple(sorted(best_set)), best_err)


# --------------------------------------------------------------------------------------------
# The reduction from Partition (paper Appendix B)
# --------------------------------------------------------------------------------------------


def _check_partition_values(values: Sequence[int]) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"values must be a sequence of integers, got {type(values).__name__}")
    out = []
    for i, x in enumerate(values):
        if isinstance(x, bool):
            raise ValueError(f"values[{i}] must be an integer, got {x!r}")
        try:
            out.append(operator.index(x))
        except TypeError:
            raise ValueError(f"values[{i}] must be an integer, got {x!r}") from None
    return out


def partition_brute_force(values: Sequence[int]) -> bool:
    """Partition as the paper states it (Problem 2): is there ``I`` with ``|I| = floor(n / 2)``
    and ``sum_I v = sum_(not I) v``? Decided by trying every subset of that size.

    Note the size constraint: this is the equal-cardinality variant of Partition (also
    NP-complete). ``[1, 1, 1, 3]`` splits into equal sums (``{3}`` vs ``{1, 1, 1}``) but not into
    halves of two, so the answer here is no.
    """
    v = _check_partition_values(values)
    total = sum(v)
    return any(2 * sum(c) == total for c in itertools.combinations(v, len(v) // 2))


def partition_instance(values: Sequence[int]) -> KVEvictionInstance:
    """The KVEviction instance of a Partition instance (paper Appendix B, S8).

    ``d = 1``, ``K = Q = 1``, values = the integers, kept fraction ``r = 1/2`` (so ``|I| = n/2``)
    and ``eps = 0``. All logits are equal, so both softmaxes are uniform and the error of ``I``
    is ``|mean(V_I) - mean(V)| = |2 sum_I v - sum v| / n``: zero exactly when ``I`` and its
    complement have equal sums. The reduction needs ``n`` even (the paper's "without loss of
    generality"); an odd-length instance gets one ``0`` appended, which keeps the answer: a
    size-``(n-1)/2`` solution ``I`` gives the size-``(n+1)/2`` solution "complement of ``I``",
    and conversely removing the ``0`` from whichever side holds it recovers one. Values must be
    integers with ``|v| <= 2^31``.
    """
    v = _check_partition_values(values)
    if not v:
        raise ValueError("values is empty; the reduction needs n >= 1 integers")
    big = [x for x in v if abs(x) > MAX_PARTITION_VALUE]
    if big:
        raise ValueError(f"values must satisfy |v| <= 2^31, got {big[0]}")
    if len(v) % 2:
        v = [*v, 0]
    n = len(v)
    return KVEvictionInstance(
        query=torch.ones(1, dtype=torch.float64),
        key=torch.ones(n, 1, dtype=torch.float64),
        value=torch.tensor(v, dtype=torch.float64).unsqueeze(-1),
        kept=kept_count(n, 0.5),
    )


def decide_partition(
    values: Sequence[int],
    *,
    method: Literal["brute_force", "meet_in_the_middle"] = "meet_in_the_middle",
) -> bool:
    """Decide Partition (equal-cardinality, as in ``partition_brute_force``) by solving its
    KVEviction instance exactly and asking whether the optimal error is ``eps = 0``.

    Floating point cannot test ``== 0`` on ``|2 sum_I v - sum v| / n`` computed through
    softmaxes, but it need not: for integers a non-zero error is at least ``1 / n``, while the
    float64 round-off of the computed error is below ``n * 2^31 * 2^-50 < 1e-4``, far below
    ``1 / (2 n)`` for any ``n`` the solvers accept. So "optimal error < 1 / (2 n)" decides
    ``eps = 0`` exactly.
    """
    inst = partition_instance(values)
    if method == "brute_force":
        solution = solve_kv_eviction_brute_force(inst.query, inst.key, inst.value, inst.kept)
    elif method == "meet_in_the_middle":
        solution = solve_kv_eviction_meet_in_the_middle(inst.query, inst.key, inst.value, inst.kept)
    else:
        raise ValueError(f"method must be 'brute_force' or 'meet_in_the_middle', got {method!r}")
    return solution.error < 1.0 / (2 * inst.key.shape[0])
