"""Tests of probkv.scores.proposals: temperature, uniform mixing, floor, forced entries, GQA
mixture, and the proposal of every named score (S2, S6).

References are plain float64 formulas written in this file; outputs are float32, so
comparisons allow float32 rounding of probabilities (relative 2^-24 ~ 6e-8; tolerance 1e-6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probkv.scores import SCORE_NAMES, compute_scores, needs_reconstruction
from probkv.scores.proposals import (
    FLOOR,
    check_pool_kernel,
    group_mixture,
    log_mass,
    max_pool_log_scores,
    proposal_from_log_scores,
    with_floor,
)

torch.set_num_threads(1)

F64 = torch.float64


def reference_proposal(log_scores, tau, a, forced=None):
    """S2, one row at a time: softmax(ls / tau) over free entries, a * pi + (1 - a) / n,
    floor FLOOR / n, renormalise; forced entries 0."""
    ls = log_scores.double()
    out = torch.zeros_like(ls)
    for r in range(ls.shape[0]):
        free = torch.ones(ls.shape[1], dtype=torch.bool) if forced is None else ~forced[r]
        n = int(free.sum())
        if n == 0:
            continue
        z = ls[r, free] / tau if math.isfinite(tau) else torch.zeros(n, dtype=F64)
        pi = torch.exp(z - z.max())
        pi = pi / pi.sum()
        pi = a * pi + (1 - a) / n
        pi = torch.clamp(pi, min=FLOOR / n)
        out[r, free] = pi / pi.sum()
    return out


def random_log_scores(rows, t, seed, spread=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (spread * torch.randn(rows, t, generator=gen, dtype=F64)).float()


@pytest.mark.parametrize("tau", [0.25, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("a", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("t", [1, 2, 50])
def test_proposal_equals_reference(tau, a, t):
    ls = random_log_scores(3, t, seed=t)
    pi = proposal_from_log_scores(ls, tau=tau, uniform_mix=a)
    assert pi.dtype == torch.float32 and pi.shape == (3, t)
    torch.testing.assert_close(pi.double(), reference_proposal(ls, tau, a), rtol=1e-6, atol=0)


def test_proposal_with_forced_entries():
    """S6: forced entries get 0, the rest is a full-support proposal over the free ones;
    a row with every entry forced is all zeros."""
    ls = random_log_scores(3, 12, seed=1)
    forced = torch.zeros(3, 12, dtype=torch.bool)
    forced[0, -4:] = True
    forced[1, ::2] = True
    forced[2] = True
    pi = proposal_from_log_scores(ls, tau=2.0, uniform_mix=0.5, forced=forced)
    torch.testing.assert_close(
        pi.double(), reference_proposal(ls, 2.0, 0.5, forced), rtol=1e-6, atol=0
    )
    assert (pi[forced] == 0).all() and (pi[:2][~forced[:2]] > 0).all()
    torch.testing.assert_close(pi.sum(-1), torch.tensor([1.0, 1.0, 0.0]))
    # uniform_mix = 0 is uniform over the free entries only
    uni = proposal_from_log_scores(ls, uniform_mix=0.0, forced=forced)
    torch.testing.assert_close(uni[0, :8], torch.full((8,), 1 / 8))
    torch.testing.assert_close(uni[1, 1::2], torch.full((6,), 1 / 6))


def test_floor_gives_full_support_for_extreme_scores():
    """A score gap of 1e4 underflows exp; the floor keeps every entry >= FLOOR / t (S2)."""
    ls = torch.tensor([[0.0, -1e4, -1e4, 5.0]])
    pi = proposal_from_log_scores(ls)
    assert (pi > 0).all()
    bound = FLOOR / 4 / (1 + 4 * FLOOR)  # floor, then renormalised by at most 1 + t FLOOR/t
    assert pi.min() >= bound * (1 - 1e-6)
    # a tiny temperature is still finite (no overflow): the argmax takes all but the floors
    sharp = proposal_from_log_scores(ls, tau=1e-300)
    assert torch.isfinite(sharp).all() and sharp.argmax() == 3
    assert math.isclose(float(sharp[0, 3]), 1.0, rel_tol=1e-6)


def test_with_floor():
    pi = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]], dtype=F64)
    out = with_floor(pi)
    assert out.dtype == F64
    assert out[0, 2] >= FLOOR / 4 / (1 + FLOOR) and out[0, 2] == out[0, 3]
    torch.testing.assert_close(out.sum(-1), torch.ones(2, dtype=F64), rtol=1e-15, atol=0)
    # entries above the floor keep their ratios; a distribution above the floor is unchanged
    assert out[0, 0] == out[0, 1]
    torch.testing.assert_close(out[1], pi[1], rtol=1e-15, atol=0)
    # unnormalised input is normalised first
    torch.testing.assert_close(with_floor(3 * pi[1:]), pi[1:], rtol=1e-15, atol=0)
    assert with_floor(pi.float()).dtype == torch.float32


def test_group_mixture():
    """S2 GQA: pi_G = sum_h alpha_h pi_h over the query heads of each group."""
    gen = torch.Generator().manual_seed(0)
    per_head = torch.rand(6, 9, generator=gen, dtype=F64)
    normed = per_head / per_head.sum(-1, keepdim=True)
    mixed = group_mixture(per_head, 2)
    torch.testing.assert_close(mixed, torch.stack([normed[:3].mean(0), normed[3:].mean(0)]))
    alpha = torch.tensor([1.0, 0.0, 3.0, 2.0, 2.0, 0.0])
    weighted = group_mixture(per_head, 2, alpha)
    expected = torch.stack(
        [
            0.25 * normed[0] + 0.75 * normed[2],
            0.5 * normed[3] + 0.5 * normed[4],
        ]
    )
    torch.testing.assert_close(weighted, expected)
    torch.testing.assert_close(group_mixture(per_head, 2, alpha.view(2, 3)), expected)
    torch.testing.assert_close(group_mixture(per_head, 6), normed)
    assert group_mixture(per_head.float(), 3).dtype == torch.float32


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 3),
    t=st.integers(1, 200),
    tau=st.floats(0.05, 50.0),
    a=st.floats(0.0, 1.0),
    spread=st.floats(0.0, 80.0),
    forced_fraction=st.floats(0.0, 0.9),
    seed=st.integers(0, 10_000),
)
def test_property_full_support_and_normalised(rows, t, tau, a, spread, forced_fraction, seed):
    """Any scores, tau, mixing and forced set: rows sum to 1 (float32 sum of t terms: error
    <= t * 2^-24 < 2e-5), every free entry is > 0, forced entries are exactly 0."""
    ls = random_log_scores(rows, t, seed, spread)
    gen = torch.Generator().manual_seed(seed + 1)
    forced = torch.rand(rows, t, generator=gen) < forced_fraction
    forced[:, 0] = False  # at least one free entry per row
    pi = proposal_from_log_scores(ls, tau=tau, uniform_mix=a, forced=forced)
    assert torch.isfinite(pi).all()
    assert (pi[~forced] > 0).all() and (pi[forced] == 0).all()
    torch.testing.assert_close(pi.double().sum(-1), torch.ones(rows, dtype=F64), rtol=0, atol=2e-5)


@settings(max_examples=30, deadline=None)
@given(
    t=st.integers(1, 200),
    spread=st.floats(0.0, 50.0),
    forced_fraction=st.floats(0.0, 0.9),
    seed=st.integers(0, 10_000),
)
def test_property_large_tau_is_near_uniform(t, spread, forced_fraction, seed):
    """pi_i ∝ exp(ls_i / tau) over the n free entries, range(ls) = R: every ratio
    pi_i / pi_j lies within exp(+-R / tau), so |pi_i n - 1| <= exp(R / tau) - 1; tau = 1e6 R
    (+1) makes this <= 1e-6 (float32 output adds <= 1e-6 relative). Forced entries stay 0."""
    ls = random_log_scores(2, t, seed, spread)
    forced = torch.rand(2, t, generator=torch.Generator().manual_seed(seed)) < forced_fraction
    forced[:, -1] = False
    r = float(ls.max() - ls.min())
    tau = 1e6 * r + 1.0
    pi = proposal_from_log_scores(ls, tau=tau, forced=forced)
    n = (~forced).sum(-1, keepdim=True).double()
    bound = math.expm1(r / tau) + 1e-6
    assert ((pi.double() * n - 1).abs()[~forced] <= bound).all()
    assert (pi[forced] == 0).all()


@settings(max_examples=30, deadline=None)
@given(t=st.integers(1, 200), spread=st.floats(0.0, 50.0), seed=st.integers(0, 10_000))
def test_property_uniform_mix_zero_is_uniform(t, spread, seed):
    ls = random_log_scores(2, t, seed, spread)
    pi = proposal_from_log_scores(ls, tau=0.5, uniform_mix=0.0)
    torch.testing.assert_close(pi.double(), torch.full((2, t), 1 / t, dtype=F64), rtol=1e-6, atol=0)


# ------------------------------------------------------------ proposal of a named score


@dataclass(frozen=True)
class Proposal:
    pi: torch.Tensor
    forced: torch.Tensor | None


def build_proposal(name, query, key, value, *, scale, tau=1.0, uniform_mix=1.0, **params):
    """The S2 proposal of score ``name`` for one layer, composed as ``ProbabilisticPolicy``
    composes it: ``compute_scores`` then ``proposal_from_log_scores``."""
    scores = compute_scores(name, query, key, value, scale=scale, **params)
    pi = proposal_from_log_scores(
        scores.log_scores, tau=tau, uniform_mix=uniform_mix, forced=scores.forced
    )
    return Proposal(pi, scores.forced)


def make_layer(t, hkv, g, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(hkv * g, t, d, generator=gen)
    k = torch.randn(hkv, t, d, generator=gen)
    v = torch.randn(hkv, t, d, generator=gen)
    return q, k, v


# scores of the prefill's own attention (reconstruction scores: tests/scores/test_reconstruction.py)
# kvzap needs a trained scorer (S11; tests/scores/test_surrogate.py)
PREFILL_SCORES = [s for s in SCORE_NAMES if not needs_reconstruction(s) and s != "kvzap"]


@pytest.mark.parametrize("name", PREFILL_SCORES)
def test_build_proposal_is_scores_then_proposal(name):
    q, k, v = make_layer(40, 2, 3, seed=3)
    params = {"window": 8} if name == "snapkv" else {}
    prop = build_proposal(name, q, k, v, scale=0.35, tau=2.0, uniform_mix=0.8, **params)
    scores = compute_scores(name, q, k, v, scale=0.35, **params)
    assert isinstance(prop, Proposal) and prop.pi.shape == (2, 40)
    expected = reference_proposal(scores.log_scores, 2.0, 0.8, scores.forced)
    torch.testing.assert_close(prop.pi.double(), expected, rtol=1e-6, atol=0)
    if name == "snapkv":
        assert torch.equal(prop.forced, scores.forced) and int(prop.forced[0].sum()) == 8
        assert (prop.pi[:, -8:] == 0).all()
    else:
        assert prop.forced is None


def test_h2o_proposal_at_tau_one_is_normalised_column_sums():
    """S2: pi_h2o(i) ∝ sum_j p_j(i) (one query head per KV head, so no mixing)."""
    t = 30
    q, k, _ = make_layer(t, 1, 1, seed=4)
    logits = 0.3 * q[0].double() @ k[0].double().T
    logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    col = torch.softmax(logits, -1).sum(0)
    pi = build_proposal("h2o", q, k, None, scale=0.3).pi[0]
    torch.testing.assert_close(pi.double(), col / col.sum(), rtol=2e-5, atol=0)


# ----------------------------------------------------------------- pooled log-scores (S10)


def reference_max_pool(log_scores, kernel, forced=None):
    """Entry by entry: max over the non-forced j with |i - j| <= kernel // 2; forced keep theirs."""
    rows, t = log_scores.shape
    out = log_scores.clone()
    for r in range(rows):
        for i in range(t):
            if forced is not None and forced[r, i]:
                continue
            window = [
                log_scores[r, j]
                for j in range(max(0, i - kernel // 2), min(t, i + kernel // 2 + 1))
                if forced is None or not forced[r, j]
            ]
            out[r, i] = max(window)
    return out


@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(1, 30),
    kernel=st.sampled_from([1, 3, 5, 7, 31]),
    forced_fraction=st.sampled_from([0.0, 0.3, 0.9]),
    seed=st.integers(0, 10**6),
)
def test_max_pool_log_scores_equals_reference(t, kernel, forced_fraction, seed):
    """S10 pooling: every entry takes the largest log-score of its non-forced neighbours within
    kernel // 2 (clipped at the ends, itself included); forced entries keep theirs and lend
    nothing. Exact (a max), in the input dtype."""
    ls = random_log_scores(3, t, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    forced = torch.rand(3, t, generator=gen) < forced_fraction
    pooled = max_pool_log_scores(ls, kernel, forced=forced)
    assert pooled.dtype == ls.dtype and torch.isfinite(pooled).all()
    assert torch.equal(pooled, reference_max_pool(ls, kernel, forced))
    assert torch.equal(
        max_pool_log_scores(ls.double(), kernel), reference_max_pool(ls.double(), kernel)
    )
    assert (pooled >= ls).all()


def test_max_pool_is_the_log_of_snapkv_style_max_pooling():
    """exp is increasing: pooling log-scores = log of max-pooled scores (S6's pooling)."""
    ls = random_log_scores(2, 40, seed=3).double()
    pooled_scores = torch.nn.functional.max_pool1d(ls.exp()[:, None], 5, stride=1, padding=2)[:, 0]
    torch.testing.assert_close(max_pool_log_scores(ls, 5).exp(), pooled_scores, rtol=1e-15, atol=0)
    assert max_pool_log_scores(ls, 1) is ls


def test_a_needle_lends_its_score_to_its_neighbours():
    """A single high entry raises exactly its kernel // 2 neighbours on each side."""
    ls = torch.zeros(1, 11)
    ls[0, 5] = 4.0
    assert max_pool_log_scores(ls, 5)[0].tolist() == [0, 0, 0, 4, 4, 4, 4, 4, 0, 0, 0]


@pytest.mark.parametrize("bad", [0, 2, -1, 3.0, True, "3"])
def test_bad_pool_kernel_names_the_value(bad):
    with pytest.raises(ValueError, match=rf"pool must be an odd integer >= 1 .* got {bad!r}"):
        check_pool_kernel(bad)
    with pytest.raises(ValueError, match="kernel must be an odd integer >= 1"):
        max_pool_log_scores(torch.zeros(1, 3), bad)


def test_max_pool_bad_tensors():
    with pytest.raises(ValueError, match="log_scores must be a floating-point tensor"):
        max_pool_log_scores(torch.zeros(1, 3, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="non-empty last dimension"):
        max_pool_log_scores(torch.zeros(1, 0), 3)
    with pytest.raises(ValueError, match=r"forced must be a bool tensor .* \(1, 3\)"):
        max_pool_log_scores(torch.zeros(1, 3), 3, forced=torch.zeros(1, 3))


# ------------------------------------------------------------------------- bad input


def test_bad_input_raises_value_error():
    ls = random_log_scores(2, 5, seed=0)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="tau must be > 0"):
            proposal_from_log_scores(ls, tau=bad)
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match=r"uniform_mix must be in \[0, 1\]"):
            proposal_from_log_scores(ls, uniform_mix=bad)
    with pytest.raises(ValueError, match="log_scores contains NaN or infinite"):
        proposal_from_log_scores(torch.tensor([[0.0, math.inf]]))
    with pytest.raises(ValueError, match="t >= 1"):
        proposal_from_log_scores(torch.zeros(2, 0))
    with pytest.raises(
        ValueError, match=r"forced must be a bool tensor of the log_scores' shape \(2, 5\)"
    ):
        proposal_from_log_scores(ls, forced=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="forced must be a bool tensor"):
        proposal_from_log_scores(ls, forced=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="negative entries"):
        with_floor(torch.tensor([0.5, -0.1]))
    with pytest.raises(ValueError, match="zero total mass"):
        with_floor(torch.zeros(2, 3))
    with pytest.raises(
        ValueError, match=r"query heads \(5\) must be a multiple of num_kv_heads \(2\)"
    ):
        group_mixture(torch.rand(5, 3), 2)
    with pytest.raises(ValueError, match="num_kv_heads must be an integer >= 1, got 0"):
        group_mixture(torch.rand(4, 3), 0)
    with pytest.raises(ValueError, match="alpha must be finite and >= 0"):
        group_mixture(torch.rand(4, 3), 2, torch.tensor([1.0, -1.0, 1.0, 1.0]))
    q, k, v = make_layer(6, 1, 1)
    with pytest.raises(ValueError, match=r"name must be one of .* got 'h2'"):
        build_proposal("h2", q, k, v, scale=1.0)
    with pytest.raises(ValueError, match="tau must be > 0"):
        build_proposal("h2o", q, k, v, scale=1.0, tau=0)


def test_log_mass_is_the_log_of_the_free_entries_tempered_mass():
    """S9 global: log sum_i exp(s_i / tau) over the non-forced entries; tau = inf counts them."""
    s = torch.tensor([[0.0, math.log(2.0), math.log(3.0), 5.0], [1.0, 1.0, 1.0, 1.0]])
    forced = torch.tensor([[False, False, False, True], [True, True, True, True]])
    assert log_mass(s, forced=forced).tolist() == pytest.approx([math.log(6.0), -math.inf])
    assert log_mass(s[:1], tau=2.0)[0].item() == pytest.approx(
        math.log(1 + 2**0.5 + 3**0.5 + math.exp(2.5))
    )
    assert log_mass(s, tau=math.inf, forced=forced)[0].item() == pytest.approx(math.log(3.0))
    with pytest.raises(ValueError, match="tau"):
        log_mass(s, tau=0.0)
