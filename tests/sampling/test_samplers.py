"""Tests of probkv.sampling and probkv.sampling.sample_size (S3 sampling and number of samples,
S9 pps).

Statistical tests use fixed seeds and tolerances of ``Z`` standard errors computed from the
known variance (stated at each test). ``Z = 5``: a two-sided false alarm probability of
5.7e-7 per comparison, so even the few hundred comparisons of this file together fail by
chance with probability below 1e-4.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from probkv import sampling
from probkv.sampling import (
    pps_inclusion_probabilities,
    pps_inclusion_probabilities_global,
    sample_counts,
    sample_size,
    systematic_sample,
)
from probkv.sampling.sample_size import (
    MAX_SAMPLES,
    expected_distinct,
    inclusion_probabilities_with_replacement,
    samples_for_ratio,
    samples_for_ratio_global,
)

torch.set_num_threads(1)
Z = 5.0
SETTINGS = settings(max_examples=40, deadline=None)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_proposal(kind: str, t: int, seed: int) -> torch.Tensor:
    """A float64 proposal of length ``t``: random, very peaked, or one-hot-like (S3 tests)."""
    rng = np.random.default_rng(seed)
    if kind == "softmax":
        x = torch.softmax(torch.tensor(rng.normal(size=t) * 2.0), -1)
    elif kind.startswith("dirichlet"):  # concentration 1, 0.01, 0.001: ever more peaked
        x = torch.tensor(rng.dirichlet(np.full(t, float(kind.split(":")[1]))))
    else:  # one-hot-like: 1 - (t - 1) eps on one entry, eps elsewhere
        eps = float(kind.split(":")[1])
        x = torch.full((t,), eps, dtype=torch.float64)
        x[rng.integers(t)] = 1.0 - (t - 1) * eps
    return x / x.sum()


KINDS = [
    "softmax",
    "dirichlet:1",
    "dirichlet:0.01",
    "dirichlet:0.001",
    "onehot:1e-6",
    "onehot:1e-10",
]


# ------------------------------------------------------------------ expected_distinct


def _mp_inclusion(p: float, m: int) -> float:
    """1 - (1 - p)^m with 60 significant digits (independent of the float64 formula)."""
    with mpmath.workdps(60):
        return float(1 - (1 - mpmath.mpf(p)) ** m)


@pytest.mark.parametrize("m", [0, 1, 7, 10**6, 10**9, 10**12])
def test_expected_distinct_matches_high_precision(m):
    """S3: -expm1(m log1p(-pi)) is accurate for pi from 1e-13 to 1 and m up to 1e12."""
    rows = torch.tensor(
        [[1e-13, 1e-9, 1e-6, 0.3, 1.0 - 0.3 - 1e-6 - 1e-9 - 1e-13], [1.0, 0.0, 0.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    p = rows / rows.sum(-1, keepdim=True)  # what the functions use (rows renormalised)
    got = inclusion_probabilities_with_replacement(rows, m)
    ref = torch.tensor(
        [[_mp_inclusion(x, m) for x in row] for row in p.tolist()], dtype=torch.float64
    )
    assert torch.allclose(got, ref, rtol=1e-12, atol=0.0)
    assert torch.allclose(expected_distinct(rows, m), ref.sum(-1), rtol=1e-12, atol=0.0)


def test_expected_distinct_edge_values():
    """E[J(0)] = 0; an entry with pi = 1 is drawn by one sample; m broadcasts per row."""
    pi = torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=torch.float64)
    assert expected_distinct(pi, 0).tolist() == [0.0, 0.0]
    assert expected_distinct(pi, torch.tensor([3, 1])).tolist() == [1.0, 1.0]
    assert expected_distinct(pi, torch.tensor([[2], [3]]).squeeze(-1)).tolist() == [1.0, 1.75]


@SETTINGS
@given(
    kind=st.sampled_from(KINDS),
    t=st.integers(1, 200),
    seed=st.integers(0, 10**6),
    m1=st.integers(0, MAX_SAMPLES),
    m2=st.integers(0, MAX_SAMPLES),
)
def test_expected_distinct_is_monotone_and_bounded(kind, t, seed, m1, m2):
    """S3: E[J(m)] is non-decreasing in m, and E[J(m)] <= min(m, t)."""
    pi = make_proposal(kind, t, seed)
    lo, hi = sorted((m1, m2))
    e_lo, e_hi = expected_distinct(pi, lo).item(), expected_distinct(pi, hi).item()
    assert e_lo <= e_hi
    assert e_hi <= min(hi, t) + 1e-9 * t


@pytest.mark.parametrize(
    ("kind", "t", "m"), [("softmax", 20, 15), ("dirichlet:1", 200, 300), ("onehot:1e-4", 50, 2000)]
)
def test_expected_distinct_matches_monte_carlo(kind, t, m):
    """E[J(m)] (S3) = mean number of distinct entries of sample_counts over S seeds.

    Tolerance: Z standard errors of the MC mean with Var(J) <= sum_i P_i (1 - P_i), P_i the
    inclusion probabilities: the indicators "i drawn" of multinomial sampling are negatively
    associated (Dubhashi and Ranjan 1998), so their covariances are <= 0."""
    S = 4000
    pi = make_proposal(kind, t, seed=1)
    counts = sample_counts(pi.expand(S, t), m, gen(2))
    distinct = (counts > 0).sum(-1).double()
    P = inclusion_probabilities_with_replacement(pi, m)
    se = math.sqrt((P * (1 - P)).sum().item() / S)
    assert abs(distinct.mean().item() - expected_distinct(pi, m).item()) <= Z * se


# --------------------------------------------------------------- samples_for_ratio, head


def _check_head_contract(pi: torch.Tensor, ratio: float, m: torch.Tensor, always_kept=0):
    """The documented contract of scope="head": within 0.5 of the target whenever some m in
    [0, MAX_SAMPLES] is (E is monotone with steps <= 1, so that is iff E[J(MAX)] reaches
    j* - 0.5); otherwise the clamp to the closest reachable value."""
    t = pi.shape[-1]
    a = torch.as_tensor(always_kept, dtype=torch.float64).expand(pi.shape[:-1])
    target = ((1 - ratio) * t - a).clamp(min=0)
    e = expected_distinct(pi, m)
    reachable = expected_distinct(pi, MAX_SAMPLES) >= target - 0.5
    assert ((e - target).abs() <= 0.5)[reachable].all()
    assert (m[~reachable] == MAX_SAMPLES).all()
    return reachable


@SETTINGS
@given(
    kind=st.sampled_from(KINDS),
    t=st.integers(1, 300),
    seed=st.integers(0, 10**6),
    ratio=st.floats(0.0, 0.99),
)
def test_samples_for_ratio_head_meets_half_tolerance(kind, t, seed, ratio):
    """S3 / Algorithm 2: |E[J(m)] - (1 - r) t| <= 0.5 per head (random, very peaked and
    one-hot-like proposals, r from 0 to 0.99), all rows searched at once."""
    pi = torch.stack([make_proposal(kind, t, seed + h) for h in range(3)])
    m = samples_for_ratio(pi, ratio)
    assert m.dtype == torch.int64 and m.shape == (3,)
    reachable = _check_head_contract(pi, ratio, m)
    event(f"{int(reachable.sum())} of 3 heads reachable")


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.5, 0.9, 0.99])
def test_samples_for_ratio_one_hot_like_needs_huge_m(ratio):
    """A proposal with 1 - 99 eps on one entry (eps = 1e-10) needs ~1e9-1e11 draws, still
    inside the search range, and the +/-0.5 guarantee holds. Here E[J(m)] = 1 + 99 (1 - (1 -
    eps)^m), so E >= j* - 0.5 needs m >= -log(1 - (j* - 1.5) / 99) / eps (up to a relative
    m eps^2 < 1e-8 from (1 - eps)^m ~ exp(-m eps))."""
    eps, t = 1e-10, 100
    pi = make_proposal(f"onehot:{eps}", t, seed=0)
    m = samples_for_ratio(pi.unsqueeze(0), ratio)
    assert _check_head_contract(pi.unsqueeze(0), ratio, m).all()
    j_star = (1 - ratio) * t
    if j_star >= 1.5:
        assert m.item() >= (1 - 1e-6) * -math.log(1 - (j_star - 1.5) / (t - 1)) / eps


def test_samples_for_ratio_unreachable_target_clamps_to_max():
    """Entries with mass 1e-20 are out of reach of 1e12 draws: r = 0 cannot be met and the
    search returns MAX_SAMPLES, the closest reachable value (documented clamp)."""
    pi = torch.tensor([[0.5, 0.5 - 2e-20, 1e-20, 1e-20]], dtype=torch.float64)
    m = samples_for_ratio(pi, 0.0)
    assert m.item() == MAX_SAMPLES
    assert not _check_head_contract(pi, 0.0, m).any()


def test_samples_for_ratio_always_kept_counts_toward_the_head():
    """S3 with a take-all stratum: a_h always-kept entries (zeros in pi) count toward the kept
    fraction, so |a_h + E[J_h(m_h)] - (1 - r) t| <= 0.5; a_h > (1 - r) t clamps to m = 0."""
    t = 64
    pi = torch.stack([make_proposal("softmax", t, s) for s in range(3)])
    a = torch.tensor([0, 8, 40])
    for h in range(3):
        pi[h, t - a[h] :] = 0.0  # the window: last a_h entries, outside sampling
    pi = pi / pi.sum(-1, keepdim=True)
    m = samples_for_ratio(pi, 0.5, always_kept=a)
    e = expected_distinct(pi, m)
    assert ((a + e - 0.5 * t).abs() <= 0.5)[:2].all()
    assert m[2].item() == 0  # 40 always kept > 32 = (1 - r) t: nothing sampled (clamp)
    with pytest.raises(ValueError, match="always_kept"):
        samples_for_ratio(pi, 0.5, always_kept=torch.tensor([1, 8, 40]))  # row 0 has no zeros


# ------------------------------------------------------------- samples_for_ratio, global


def _global_fraction(pis, m, always_kept=None):
    """f(m) = mean over all heads of (a_h + E[J_h(m)]) / t_h, from expected_distinct."""
    fractions = []
    for i, pi in enumerate(pis):
        a = 0 if always_kept is None else always_kept[i]
        a = torch.as_tensor(a, dtype=torch.float64).expand(pi.shape[:-1])
        fractions.append((a + expected_distinct(pi, m)) / pi.shape[-1])
    return torch.cat([f.flatten() for f in fractions]).mean().item()


@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 150), min_size=1, max_size=4),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 10**6),
    ratio=st.floats(0.0, 0.99),
)
def test_samples_for_ratio_global_guarantee(lengths, kind, seed, ratio):
    """S3 global (Appendix F.1): one m for all heads of all layers, with layers of different
    lengths, and |f(m) - (1 - r)| <= (1/2) mean_h(1/t_h) (the docstring's guarantee) whenever
    reachable; otherwise m = MAX_SAMPLES."""
    pis = [
        torch.stack([make_proposal(kind, t, seed + 7 * layer + h) for h in range(2)])
        for layer, t in enumerate(lengths)
    ]
    m = samples_for_ratio_global(pis, ratio)
    assert isinstance(m, int) and 0 <= m <= MAX_SAMPLES
    tol = 0.5 * float(np.mean([1.0 / t for t in lengths]))
    reachable = _global_fraction(pis, MAX_SAMPLES) >= (1 - ratio) - tol
    event(f"reachable: {reachable}")
    if reachable:
        assert abs(_global_fraction(pis, m) - (1 - ratio)) <= tol
    else:
        assert m == MAX_SAMPLES


def test_samples_for_ratio_global_equal_lengths_and_always_kept():
    """With equal lengths the global tolerance is 0.5 / t: the mean expected kept count is within
    0.5 of (1 - r) t. Always-kept counts enter each head's fraction; a single head reduces to the
    head scope's guarantee."""
    t = 80
    pis = [
        torch.stack([make_proposal("softmax", t, 10 * layer + h) for h in range(3)])
        for layer in range(2)
    ]
    a = [torch.tensor([0, 4, 16]), 8]
    for layer, per_head in enumerate([[0, 4, 16], [8, 8, 8]]):
        for h, k in enumerate(per_head):
            pis[layer][h, :k] = 0.0  # always-kept positions carry no proposal mass
        pis[layer] = pis[layer] / pis[layer].sum(-1, keepdim=True)
    m = samples_for_ratio_global(pis, 0.6, always_kept=a)
    assert abs(_global_fraction(pis, m, a) - 0.4) <= 0.5 / t
    single = samples_for_ratio_global([pis[0][:1]], 0.6)
    assert abs(expected_distinct(pis[0][:1], single).item() - 0.4 * t) <= 0.5


def test_samples_for_ratio_global_shares_budget_across_heads():
    """Appendix F.1: a peaked head keeps fewer entries than a flat one under one shared m."""
    flat = torch.full((1, 100), 0.01, dtype=torch.float64)
    peaked = make_proposal("dirichlet:0.01", 100, seed=3).unsqueeze(0)
    m = samples_for_ratio_global([flat, peaked], 0.5)
    kept_flat, kept_peaked = expected_distinct(flat, m).item(), expected_distinct(peaked, m).item()
    assert kept_flat > 50 > kept_peaked


# ----------------------------------------------------------------------- sample_counts


def test_sample_counts_row_sums_shapes_and_zero_mass():
    """Counts are non-negative, sum to m per row (also m = 1e12 and m = 0), zero-mass entries
    are never drawn, and a [2, 3, t] batch keeps its shape."""
    pi = make_proposal("softmax", 37, seed=0)
    pi[5] = 0.0
    pi = pi / pi.sum()
    batch = pi.expand(2, 3, 37)
    m = torch.tensor([[0, 1, 10**12], [5, 123456, 2**40]])
    counts = sample_counts(batch, m, gen(0))
    assert counts.shape == (2, 3, 37) and counts.dtype == torch.int64
    assert torch.equal(counts.sum(-1), m)
    assert (counts >= 0).all() and (counts[..., 5] == 0).all()
    one_entry = sample_counts(torch.ones(1, 1), 9, gen(0))
    assert one_entry.tolist() == [[9]]


def test_sample_counts_reproducible():
    """S3: the same seed gives the same counts; another seed other counts."""
    pi = make_proposal("dirichlet:1", 100, seed=0).expand(4, 100)
    a = sample_counts(pi, 50, gen(123))
    b = sample_counts(pi, 50, gen(123))
    c = sample_counts(pi, 50, gen(124))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("m", [50, 10**12])
def test_sample_counts_marginals_are_binomial(m):
    """c_i ~ Binomial(m, pi_i). Over S independent rows: the mean is within Z standard errors
    sqrt(m p q / S) of m p; the sample variance s^2 within Z standard errors of m p q, with
    Var(s^2) = (mu4 - sigma^4 (S - 3) / (S - 1)) / S and the binomial's mu4 = npq (1 + 3 (n - 2) pq)."""
    S = 4000
    pi = torch.tensor([1e-11, 1e-3, 0.05, 0.2, 0.3, 0.45 - 1e-3 - 1e-11], dtype=torch.float64)
    pi = pi / pi.sum()
    counts = sample_counts(pi.expand(S, 6), m, gen(7)).double()
    for i in range(6):
        p = pi[i].item()
        var = m * p * (1 - p)
        if var < 1e-6:  # (a mean of 1e-9: almost always 0, nothing to test statistically)
            assert counts[:, i].max() <= 1
            continue
        mean_hat, var_hat = counts[:, i].mean().item(), counts[:, i].var().item()
        assert abs(mean_hat - m * p) <= Z * math.sqrt(var / S)
        mu4 = var * (1 + 3 * (m - 2) * p * (1 - p))
        se_var = math.sqrt((mu4 - var**2 * (S - 3) / (S - 1)) / S)
        assert abs(var_hat - var) <= Z * se_var


def _chi2_sf(x: float, df: int) -> float:
    """P(chi2_df > x) (regularised upper incomplete gamma)."""
    return float(mpmath.gammainc(df / 2, x / 2, mpmath.inf, regularized=True))


def test_sample_counts_joint_law_is_multinomial():
    """The tree of binomial splits is exactly multinomial: Pearson's chi-square test of the
    frequencies of all 56 outcomes of m = 5 draws over t = 4 entries against the exact pmf
    (bins with expected count < 5 pooled), at significance 1e-4."""
    S, m = 40000, 5
    pi = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    counts = sample_counts(pi.expand(S, 4), m, gen(11))
    outcomes = {}
    for row in map(tuple, counts.tolist()):
        outcomes[row] = outcomes.get(row, 0) + 1
    expected, observed = [], []
    for c1 in range(m + 1):
        for c2 in range(m + 1 - c1):
            for c3 in range(m + 1 - c1 - c2):
                c = (c1, c2, c3, m - c1 - c2 - c3)
                pmf = math.factorial(m) * math.prod(
                    p**k / math.factorial(k) for p, k in zip(pi.tolist(), c, strict=True)
                )
                expected.append(S * pmf)
                observed.append(outcomes.pop(c, 0))
    assert not outcomes  # no impossible outcome was drawn
    e, o = np.array(expected), np.array(observed)
    small = e < 5
    e = np.append(e[~small], e[small].sum())
    o = np.append(o[~small], o[small].sum())
    chi2 = float(((o - e) ** 2 / e).sum())
    assert _chi2_sf(chi2, len(e) - 1) > 1e-4


# ------------------------------------------------------------------------------ pps (S9)


def _pps_reference(p: list[float], k: float) -> list[float]:
    """Iterative capping written literally (S9): scale, cap at 1, rescale the rest, repeat."""
    capped = [False] * len(p)
    while True:
        free = sum(x for x, c in zip(p, capped, strict=True) if not c)
        lam = (k - sum(capped)) / free if free > 0 else math.inf
        new = [c or (x > 0 and lam * x >= 1) for x, c in zip(p, capped, strict=True)]
        if new == capped:
            return [
                1.0 if c else (lam * x if x > 0 else 0.0) for x, c in zip(p, capped, strict=True)
            ]
        capped = new


@SETTINGS
@given(
    kind=st.sampled_from(KINDS), t=st.integers(1, 120), seed=st.integers(0, 10**6), data=st.data()
)
def test_pps_inclusion_matches_iterative_capping(kind, t, seed, data):
    """S9: P_i = min(1, lam pi_i), sum P = k, 0 <= P <= 1, order-preserving; the vectorised closed
    form equals the literal iterative capping."""
    pi = torch.stack([make_proposal(kind, t, seed + h) for h in range(2)])
    k = torch.tensor([data.draw(st.integers(0, t)), data.draw(st.integers(0, t))])
    P = pps_inclusion_probabilities(pi, k)
    p_used = pi / pi.sum(-1, keepdim=True)
    for h in range(2):
        positive = int((p_used[h] > 0).sum())
        ref = torch.tensor(_pps_reference(p_used[h].tolist(), float(k[h])), dtype=torch.float64)
        assert torch.allclose(P[h], ref, rtol=1e-10, atol=1e-12)
        assert abs(P[h].sum().item() - min(int(k[h]), positive)) <= 1e-9 * t
    assert ((P >= 0) & (P <= 1)).all()
    order = p_used.argsort(-1)
    assert (P.gather(-1, order).diff(dim=-1) >= -1e-12).all()


def test_pps_always_kept_and_clamps():
    """k is the head's whole budget: the sampled part sums to k - a; a > k gives P = 0; a row
    with fewer positive entries than the budget puts P = 1 on all of them."""
    pi = torch.tensor([[0.0, 0.0, 0.5, 0.3, 0.2], [0.0, 0.0, 0.0, 0.9, 0.1]], dtype=torch.float64)
    P = pps_inclusion_probabilities(pi, torch.tensor([3, 1]), always_kept=torch.tensor([2, 3]))
    assert P[0].sum().item() == pytest.approx(1.0, abs=1e-12) and P[0, :2].eq(0).all()
    assert P[1].eq(0).all()
    P = pps_inclusion_probabilities(pi, 4)
    assert P[1].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]


def test_pps_global_one_scale_for_all_heads():
    """S9 global: one lam across all heads of all layers (P / pi is the same on every entry with
    0 < P < 1), total sum_h (1 - r) t_h minus always-kept, and equal to the literal iterative
    capping on the concatenation of all heads."""
    pis = [
        torch.stack([make_proposal("dirichlet:1", t, 3 * t + h) for h in range(3)])
        for t in (20, 45)
    ]
    P = pps_inclusion_probabilities_global(pis, 0.7)
    total = sum(x.sum().item() for x in P)
    assert total == pytest.approx(0.3 * (3 * 20 + 3 * 45), abs=1e-9)
    free = torch.cat([(x / pi)[(x > 0) & (x < 1)] for x, pi in zip(P, pis, strict=True)])
    assert torch.allclose(free, free[0].expand_as(free), rtol=1e-10)
    concat = torch.cat([pi.flatten() for pi in pis]).tolist()
    ref = _pps_reference(concat, 0.3 * 195)
    assert torch.allclose(
        torch.cat([x.flatten() for x in P]), torch.tensor(ref, dtype=torch.float64), rtol=1e-10
    )
    single = pps_inclusion_probabilities_global(pis[0], 0.7, always_kept=0)
    assert isinstance(single, torch.Tensor) and single.sum().item() == pytest.approx(
        0.3 * 60, abs=1e-9
    )
    pis[1][:, :5] = 0.0
    pis[1] = pis[1] / pis[1].sum(-1, keepdim=True)
    P = pps_inclusion_probabilities_global(pis, 0.7, always_kept=[0, 5])
    assert sum(x.sum().item() for x in P) == pytest.approx(0.3 * 195 - 15, abs=1e-9)


def test_pps_global_row_mass_weighs_each_head():
    """S9 global with ``row_mass``: one lam over ``m_h pi_hi`` (the literal capping on the
    weighed concatenation); masses of 1 change nothing, bit for bit; bad masses are refused."""
    pis = [
        torch.stack([make_proposal("dirichlet:1", t, 5 * t + h) for h in range(2)])
        for t in (30, 50)
    ]
    masses = [torch.tensor([1.0, 0.05], dtype=torch.float64), torch.tensor([0.3, 2.0])]
    P = pps_inclusion_probabilities_global(pis, 0.6, row_mass=masses)
    weighed = torch.cat(
        [(pi.double() * m.double()[:, None]).flatten() for pi, m in zip(pis, masses)]
    )
    ref = _pps_reference(weighed.tolist(), 0.4 * 160)
    flat = torch.cat([x.flatten() for x in P])
    assert torch.allclose(flat, torch.tensor(ref, dtype=torch.float64), rtol=1e-8)
    ones = [torch.ones(2), torch.ones(2)]
    for a, b in zip(
        pps_inclusion_probabilities_global(pis, 0.6, row_mass=ones),
        pps_inclusion_probabilities_global(pis, 0.6),
        strict=True,
    ):
        assert torch.equal(a, b)
    for bad in ([torch.ones(3), torch.ones(2)], [torch.ones(2)], [torch.ones(2), -torch.ones(2)]):
        with pytest.raises(ValueError, match="row_mass"):
            pps_inclusion_probabilities_global(pis, 0.6, row_mass=bad)


def test_systematic_sample_exact_size_and_take_all():
    """S9: exactly k entries per row when sum P = k is an integer; P = 1 always kept; P = 0 never."""
    pi = torch.stack([make_proposal(kind, 200, s) for s, kind in enumerate(KINDS)])
    k = torch.tensor([1, 10, 50, 100, 150, 199])
    P = pps_inclusion_probabilities(pi, k)
    g = gen(5)
    for _ in range(50):
        kept = systematic_sample(P, g)
        assert torch.equal(kept.sum(-1), k)
        assert kept[P == 1].all() and not kept[P == 0].any()
    assert torch.equal(systematic_sample(P, gen(9)), systematic_sample(P, gen(9)))


def test_systematic_sample_inclusion_frequencies_match_P():
    """Over S rows the frequency of keeping entry i is within Z binomial standard errors
    sqrt(P (1 - P) / S) of P_i; a non-integer total keeps floor or ceil of it, with mean sum P
    (Z standard errors of the Bernoulli(frac) rounding)."""
    S = 20000
    pi = make_proposal("softmax", 15, seed=4)
    P = pps_inclusion_probabilities(pi, 6)
    kept = systematic_sample(P.expand(S, 15), gen(6))
    freq = kept.double().mean(0)
    free = (P > 0) & (P < 1)
    assert ((freq - P).abs()[free] <= Z * (P * (1 - P) / S).sqrt()[free]).all()
    assert (freq[P == 1] == 1).all()
    Q = P * (4.4 / 6.0)  # sum 4.4: keeps 4 or 5 entries
    sizes = systematic_sample(Q.expand(S, 15), gen(8)).sum(-1).double()
    assert set(sizes.unique().tolist()) <= {4.0, 5.0}
    assert abs(sizes.mean().item() - 4.4) <= Z * math.sqrt(0.4 * 0.6 / S)


# The second pps implementation the library once ran (per-entry capping by sort and suffix sums,
# and a systematic draw in index order), kept here as a reference: production runs one
# implementation for entries and units alike (``sampling.capped_scale``, ``_systematic``), and
# these check it reproduces the entry case bit for bit.


def _sorted_capping_reference(p: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """S9 capping per row of ``p`` ``[R, n]`` float64 for budgets ``k`` ``[R]``: sort each row,
    cap the ``c`` largest with ``lam_c = (k - c) / S_c``, take the smallest ``c`` with
    ``lam_c p_(c+1) <= 1``; ``P = min(1, lam p)``."""
    s = p.sort(-1, descending=True).values
    rest = s.flip(-1).cumsum(-1).flip(-1)
    c = torch.arange(s.shape[-1], dtype=torch.float64)
    ok = ((k.unsqueeze(-1) - c) * s <= rest) & (c < k.unsqueeze(-1))
    first = ok.to(torch.int8).argmax(-1)
    num = torch.where(k > 0, k - first.to(torch.float64), 0.0).unsqueeze(-1)
    den = rest.gather(-1, first.unsqueeze(-1))
    return torch.where((p > 0) & (num > 0), (num * (p / den)).clamp(max=1.0), 0.0)


def _index_order_systematic_reference(P: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Systematic sampling in index order at offsets ``u`` ``[R]``, entry by entry in Python:
    keep ``i`` iff ``[C_(i-1), C_i)`` holds a point ``u + j`` (take-all entries left out, a
    total within 1e-9 of an integer snapped to it)."""
    out = torch.zeros(P.shape, dtype=torch.bool)
    for r, row in enumerate(P.tolist()):
        total = math.fsum(x for x in row if x < 1.0)
        cum, whole = 0.0, round(total)
        snap = abs(torch.tensor(total) - whole) <= 1e-9 * max(whole, 1.0)
        prev = 0.0
        sums = torch.tensor([x if x < 1.0 else 0.0 for x in row], dtype=torch.float64).cumsum(0)
        if snap:
            sums = torch.minimum(sums, torch.tensor(float(whole), dtype=torch.float64))
            sums[-1] = float(whole)
        for i, x in enumerate(row):
            if x == 1.0:
                out[r, i] = True
                continue
            cum = math.ceil(float(sums[i]) - float(u[r]))
            out[r, i] = cum > prev
            prev = cum
    return out


@SETTINGS
@given(
    kind=st.sampled_from(KINDS), t=st.integers(1, 80), seed=st.integers(0, 10**6), data=st.data()
)
def test_pps_is_the_sorted_capping_and_index_order_draw_bit_for_bit(kind, t, seed, data):
    """The one production pps (units of size 1) against the per-entry references above: the
    same inclusion probabilities bit for bit, per head and with one global scale, and the same
    kept entries for the same generator state."""
    pi = torch.stack([make_proposal(kind, t, seed + h) for h in range(3)])
    k = torch.tensor([data.draw(st.integers(0, t)) for _ in range(3)])
    P = pps_inclusion_probabilities(pi, k)
    p = pi.double() / pi.double().sum(-1, keepdim=True)
    assert torch.equal(P, _sorted_capping_reference(p, k.double()))
    flat = p.reshape(1, -1)
    budget = (1.0 - 0.6) * t * 3  # as the global pps computes it
    want = _sorted_capping_reference(flat, torch.tensor([budget], dtype=torch.float64))
    assert torch.equal(pps_inclusion_probabilities_global(pi, 0.6).reshape(1, -1), want)
    g = gen(seed)
    u = torch.rand((3, 1), generator=gen(seed), dtype=torch.float64)[:, 0]
    assert torch.equal(systematic_sample(P, g), _index_order_systematic_reference(P, u))


# ---------------------------------------------------------------------------- bad input


def _proposal() -> torch.Tensor:
    return torch.full((2, 4), 0.25, dtype=torch.float64)


@pytest.mark.parametrize("ratio", [1.0, -0.1, float("nan"), 2, "0.5"])
def test_bad_ratio(ratio):
    with pytest.raises(ValueError, match="ratio"):
        samples_for_ratio(_proposal(), ratio)
    with pytest.raises(ValueError, match="ratio"):
        pps_inclusion_probabilities_global(_proposal(), ratio)


@pytest.mark.parametrize(
    ("pi", "message"),
    [
        (torch.tensor([[0.5, -0.1, 0.6]]), "negative"),
        (torch.tensor([[0.5, float("nan"), 0.5]]), "NaN"),
        (torch.tensor([[0.0, 0.0, 0.0]]), "zero total mass"),
        (torch.zeros(2, 0), "t >= 1"),
        (torch.tensor([[0.5, 0.7, 0.3]]), "sum to 1"),
        (torch.tensor([[1, 0, 0]]), "floating-point"),
    ],
)
def test_bad_proposal(pi, message):
    calls = [
        lambda: expected_distinct(pi, 3),
        lambda: samples_for_ratio(pi, 0.5),
        lambda: samples_for_ratio_global([pi], 0.5),
        lambda: sample_counts(pi, 3, gen(0)),
        lambda: pps_inclusion_probabilities(pi, 0),
        lambda: pps_inclusion_probabilities_global([pi], 0.5),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=message):
            call()


def test_bad_counts_budgets_and_shapes():
    pi = _proposal()
    with pytest.raises(ValueError, match="m must be >= 0, got -1"):
        expected_distinct(pi, -1)
    with pytest.raises(ValueError, match="m must be >= 0"):
        sample_counts(pi, torch.tensor([3, -2]), gen(0))
    with pytest.raises(ValueError, match="integer dtype"):
        sample_counts(pi, torch.tensor([3.0, 2.0]), gen(0))
    with pytest.raises(ValueError, match="m must be a non-negative integer"):
        expected_distinct(pi, 2.5)
    with pytest.raises(ValueError, match=r"m must be <= 9007199254740992"):
        sample_counts(pi, 2**53 + 1, gen(0))
    with pytest.raises(ValueError, match=r"does not broadcast to the rows of pi \(2,\)"):
        sample_counts(pi, torch.tensor([1, 2, 3]), gen(0))
    with pytest.raises(ValueError, match=r"k must be <= t = 4 \(entries per row\), got 5"):
        pps_inclusion_probabilities(pi, 5)
    with pytest.raises(ValueError, match="k must be >= 0"):
        pps_inclusion_probabilities(pi, torch.tensor([1, -1]))
    with pytest.raises(ValueError, match="always_kept of shape"):
        samples_for_ratio(pi, 0.5, always_kept=torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="lists are for scope='global'"):
        samples_for_ratio([pi], 0.5)
    with pytest.raises(ValueError, match="list of 2"):
        samples_for_ratio_global([pi, pi], 0.5, always_kept=[0])
    with pytest.raises(ValueError, match=r"generator must be a torch\.Generator"):
        sample_counts(pi, 3, 0)
    with pytest.raises(ValueError, match=r"inclusion probabilities must lie in \[0, 1\]"):
        systematic_sample(torch.tensor([0.5, 1.5]), gen(0))
    with pytest.raises(ValueError, match="t >= 1"):
        systematic_sample(torch.zeros(3, 0), gen(0))


def test_module_constants():
    """The search range is Algorithm 2's [0, 1e12]; counts stay exact in float64."""
    assert sample_size.MAX_SAMPLES == 10**12 and sampling.MAX_EXACT_COUNT == 2**53


def _literal_binary_search(pi: torch.Tensor, target: float) -> int:
    """Algorithm 2 (Appendix F) for one row, written plainly: bisect [0, 10^12] until
    |E[J(m)] - target| <= 0.5; if no m qualifies, the closer end of the final bracket."""
    lo, hi = 0, sample_size.MAX_SAMPLES
    while lo <= hi:
        mid = (lo + hi) // 2
        value = float(expected_distinct(pi, mid))
        if abs(value - target) <= 0.5:
            return mid
        if value < target:
            lo = mid + 1
        else:
            hi = mid - 1
    a, b = max(lo - 1, 0), min(lo, sample_size.MAX_SAMPLES)
    da = abs(float(expected_distinct(pi, a)) - target)
    db = abs(float(expected_distinct(pi, b)) - target)
    return a if da <= db else b


@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(1, 300),
    ratio=st.floats(0.0, 0.99),
    concentration=st.sampled_from([0.01, 0.1, 1.0, 10.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_fast_search_returns_the_literal_binary_search_m(t, ratio, concentration, seed):
    """S3: the accelerated search replays Algorithm 2 exactly (same m, not just a valid one)."""
    gamma = np.random.default_rng(seed).gamma(concentration, size=t) + 1e-300
    pi = torch.tensor(gamma / gamma.sum(), dtype=torch.float64)
    m = int(samples_for_ratio(pi.unsqueeze(0), ratio)[0])
    assert m == _literal_binary_search(pi, (1 - ratio) * t)
