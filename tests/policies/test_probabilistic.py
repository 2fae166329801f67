"""Probabilistic eviction policies: proposals from every score, sampling, weights (S2-S4, S9).

Every score is also a proposal (``prob:<score>``, Appendix D of the paper): checked here for
full support on the entries that are not forced, for the take-all stratum of forced entries
(SnapKV's window, H2O's recent window), and against plain references of what each proposal
is. The selections' log-weights are checked against the estimator formulas, and the
statistical claims (expected kept count, unbiased corrected totals) with fixed seeds and
tolerances derived from the known variances. Observations come from the integration's own
prefill path (``probkv.scores.observation.observe_layer``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from probkv import estimation, sampling, scores
from probkv.policies import (
    LayerObservation,
    ProbabilisticPolicy,
    method_name,
    method_options,
    parse_method,
    prob_options,
)
from probkv.policies.base import check_fraction
from probkv.policies.probabilistic import SEEDS
from probkv.sampling import sample_size, span_designs
from probkv.scores import FORCED_LOG_SCORE, SCORE_NAMES, needs_reconstruction
from probkv.scores.observation import observe_layer
from probkv.scores.proposals import FLOOR, max_pool_log_scores, proposal_from_log_scores

torch.set_num_threads(1)

F64 = torch.float64
SCALE = 0.35


def random_layer(t: int, hkv: int, g: int, seed: int, d: int = 8):
    gen = torch.Generator().manual_seed(seed)
    q = 1.5 * torch.randn(hkv * g, t, d, generator=gen, dtype=F64)
    k = torch.randn(hkv, t, d, generator=gen, dtype=F64)
    k = k * (0.5 + torch.rand(hkv, t, 1, generator=gen, dtype=F64))
    v = torch.randn(hkv, t, d, generator=gen, dtype=F64)
    return q, k, v


def observe(policy, q, k, v, layer_idx: int = 0):
    _, observation = observe_layer(
        q,
        k,
        v,
        scale=SCALE,
        score=policy.score,
        score_params=policy.score_params,
        layer_idx=layer_idx,
        rank=layer_idx,
    )
    return observation


def dense_probabilities(q, k):
    """[Hq, t, t] causal softmax rows (S1), one row at a time."""
    hq, t, _ = q.shape
    g = hq // k.shape[0]
    p = torch.zeros(hq, t, t, dtype=F64)
    for h in range(hq):
        logits = SCALE * q[h] @ k[h // g].T
        for j in range(t):
            p[h, j, : j + 1] = torch.softmax(logits[j, : j + 1], dim=0)
    return p


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def budget(t: int, r: float) -> int:
    return min(t, max(1, math.floor((1 - r) * t + 0.5)))


# ---------------------------------------------------------------- proposals (S2, App. D)


# scores of the prefill's own attention (reconstruction scores: tests/scores/test_reconstruction.py)
# kvzap needs a trained scorer (S11; tests/scores/test_surrogate.py)
PREFILL_SCORES = [s for s in SCORE_NAMES if not needs_reconstruction(s) and s != "kvzap"]


@pytest.mark.parametrize("name", [*PREFILL_SCORES, "snapkv/window=8", "h2o/recent=0.4"])
def test_every_score_gives_a_proposal_with_full_support(name):
    """pi >= 0, rows sum to 1, every non-forced entry has at least the S2 floor FLOOR / n
    (n = non-forced entries of the head), forced entries have exactly 0 (take-all)."""
    policy = parse_method(f"prob:{name}", ratio=0.6)
    q, k, v = random_layer(50, 2, 3, seed=1)
    obs = policy._with_forced(observe(policy, q, k, v))
    pi = policy.proposal(obs).double()
    forced = obs.forced if obs.forced is not None else torch.zeros_like(pi, dtype=torch.bool)
    assert torch.isfinite(pi).all() and (pi >= 0).all()
    torch.testing.assert_close(pi.sum(-1), torch.ones(2, dtype=F64), rtol=0, atol=1e-6)
    assert (pi[forced] == 0).all()
    n = (~forced).sum(-1, keepdim=True).double()
    assert ((pi >= 0.99 * FLOOR / n) | forced).all()
    if name.startswith("snapkv"):  # the window (32 fits no 20-entry budget: its last 20)
        window = min(8 if "=8" in name else 32, budget(50, 0.6))
        assert forced[:, -window:].all() and int(forced.sum()) == 2 * window
    if name.startswith("h2o/recent"):
        assert int(forced.sum(-1)[0]) == round(0.4 * budget(50, 0.6))


def test_prob_h2o_is_the_normalised_accumulated_attention():
    """App. D Eq. 17: pi_H2O(i) ∝ sum_j p_j(i), per KV head the mean over its query heads."""
    q, k, v = random_layer(40, 2, 2, seed=2)
    policy = parse_method("prob:h2o", ratio=0.5)
    pi = policy.proposal(observe(policy, q, k, v)).double()
    sums = dense_probabilities(q, k).sum(1).view(2, 2, 40).mean(1)
    torch.testing.assert_close(pi, sums / sums.sum(-1, keepdim=True), rtol=1e-5, atol=0)


def test_prob_tova_is_the_layer_mean_of_the_last_query():
    """App. D Eq. 19-20: the last query's attention averaged over all query heads of the
    layer, the same proposal for every KV head (``uniform_mix=1``); by default (pps) the
    defensive mixture 0.5 * that + 0.5 / t (S2, ``ScoreSpec.prob_uniform_mix``)."""
    q, k, v = random_layer(40, 3, 2, seed=3)
    mean = dense_probabilities(q, k)[:, -1].mean(0).expand(3, -1)
    policy = parse_method("prob:tova/uniform_mix=1", ratio=0.5)
    pi = policy.proposal(observe(policy, q, k, v)).double()
    torch.testing.assert_close(pi, mean, rtol=1e-5, atol=0)
    policy = parse_method("prob:tova", ratio=0.5)
    assert policy.uniform_mix == 0.5
    pi = policy.proposal(observe(policy, q, k, v)).double()
    torch.testing.assert_close(pi, 0.5 * mean + 0.5 / 40, rtol=1e-5, atol=0)
    assert parse_method("prob:tova/sampler=with_replacement", 0.5).uniform_mix == 1.0


def test_prob_streaming_llm_tempers_its_weights_by_default():
    """``streaming_llm``'s pps weights are tempered (tau = 2, ``ScoreSpec.prob_tau``): its
    log-weights are half those of ``tau=1`` for the same kept set; other scores keep tau = 1."""
    q, k, v = random_layer(40, 2, 2, seed=4)
    default = parse_method("prob:streaming_llm", ratio=0.5)
    plain = parse_method("prob:streaming_llm/tau=1", ratio=0.5)
    assert default.tau == 2.0 and parse_method("prob:h2o", 0.5).tau == 1.0
    assert parse_method("prob:streaming_llm/sampler=with_replacement", 0.5).tau == 1.0
    (a,) = default.select([observe(default, q, k, v)], num_layers=1)
    (b,) = plain.select([observe(plain, q, k, v)], num_layers=1)
    assert torch.equal(a.indices, b.indices) and b.log_weights.abs().max() > 0
    torch.testing.assert_close(a.log_weights, b.log_weights / 2)


def test_prob_knorm_is_the_softmax_of_minus_key_norms():
    """App. D Eq. 18 with keys (S2): pi ∝ exp(-||k_i||), lower key norm = more mass."""
    q, k, v = random_layer(40, 2, 2, seed=4)
    policy = parse_method("prob:knorm", ratio=0.5)
    pi = policy.proposal(observe(policy, q, k, v)).double()
    torch.testing.assert_close(pi, torch.softmax(-k.norm(dim=-1), -1), rtol=1e-5, atol=0)


@pytest.mark.parametrize("sinks", [4, 1])
def test_prob_streaming_llm_has_its_modes_on_the_sinks_and_the_newest(sinks):
    """S2: a mixture of the sinks (mass lam = 4s / (4s + n + 1), uniform over them) and the
    increasing recency r(i) = 2 (i - s + 1) / (n (n + 1)): each sink twice the newest entry."""
    t = 30
    policy = parse_method(f"prob:streaming_llm/sinks={sinks}", ratio=0.5)
    pi = policy.proposal(observe(policy, *random_layer(t, 1, 2, seed=5)))[0].double()
    n = t - sinks
    lam = 4 * sinks / (4 * sinks + n + 1)
    recency = torch.tensor([2 * (i + 1) / (n * (n + 1)) for i in range(n)], dtype=F64)
    expected = torch.cat([torch.full((sinks,), lam / sinks, dtype=F64), (1 - lam) * recency])
    torch.testing.assert_close(pi, expected, rtol=1e-5, atol=0)
    assert (pi[sinks + 1 :] > pi[sinks:-1]).all()  # strictly increasing after the sinks
    torch.testing.assert_close(pi[0], 2 * pi[-1], rtol=1e-5, atol=0)


@pytest.mark.parametrize("gqa", ["mean", "mixture"])
def test_prob_snapkv_is_the_pooled_window_attention_with_the_window_taken_all(gqa):
    """Probabilistic SnapKV (S2, S6): the window is a take-all stratum (probability 0, kept
    with weight 1); the prefix proposal is the max-pooled window attention of the group,
    raw mean (default, as SnapKV's reference implementations) or mixture, normalised."""
    t, w, kernel = 45, 8, 7
    q, k, v = random_layer(t, 2, 3, seed=6)
    policy = parse_method(f"prob:snapkv/window={w}/gqa={gqa}", ratio=0.5)
    pi = policy.proposal(observe(policy, q, k, v)).double()
    prefix = t - w
    observed = dense_probabilities(q, k)[:, prefix:, :prefix].mean(1)  # [Hq, prefix]
    pooled = F.max_pool1d(observed[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    if gqa == "mixture":
        pooled = pooled / pooled.sum(-1, keepdim=True)
    group = pooled.view(2, 3, prefix).mean(1)
    torch.testing.assert_close(
        pi[:, :prefix], group / group.sum(-1, keepdim=True), rtol=1e-5, atol=0
    )
    assert (pi[:, prefix:] == 0).all()


def test_proposal_temperature_and_uniform_mixing():
    """S2 adjustments: pi_tau ∝ pi^(1/tau), then a * pi_tau + (1 - a) / t."""
    q, k, v = random_layer(40, 2, 2, seed=7)
    base = parse_method("prob:h2o", ratio=0.5)
    obs = observe(base, q, k, v)
    pi = base.proposal(obs).double()
    adjusted = parse_method("prob:h2o/proposal_tau=2/uniform_mix=0.7", ratio=0.5).proposal(obs)
    tempered = pi.sqrt() / pi.sqrt().sum(-1, keepdim=True)
    torch.testing.assert_close(adjusted.double(), 0.7 * tempered + 0.3 / 40, rtol=1e-5, atol=0)


# --------------------------------------------------------------- selections and weights (S4)


def one_layer(method, *, t=48, hkv=2, g=2, seed=8, ratio=0.5):
    policy = parse_method(method, ratio=ratio)
    obs = observe(policy, *random_layer(t, hkv, g, seed=seed))
    return policy, obs


@pytest.mark.parametrize(
    "method",
    ["prob:snapkv/window=8", "prob:snapkv/window=8/sampler=pps", "prob:h2o/recent=0.5"],
)
def test_forced_entries_are_kept_with_weight_one(method):
    """The take-all stratum (S6, S9): window and recent entries always kept, log-weight 0."""
    policy, obs = one_layer(method)
    forced = policy._with_forced(obs).forced
    for seed in range(5):
        (sel,) = dataclasses.replace(policy, seed=seed).select([obs], num_layers=1)
        for h in range(2):
            idx, logw = sel.head(h)
            window = forced[h].nonzero().flatten()
            assert set(window.tolist()) <= set(idx.tolist())
            assert (logw[torch.isin(idx, window)] == 0).all()


def test_inclusion_weights_are_one_over_the_inclusion_probability():
    """S9 Horvitz-Thompson: log w_i = -log(1 - (1 - pi_i)^m) / tau, m per head (S3)."""
    for tau in (1.0, 2.0):
        policy, obs = one_layer(f"prob:min-h/sampler=with_replacement/weights=inclusion/tau={tau}")
        pi = policy.proposal(obs).double()
        m = sample_size.samples_for_ratio(pi, 0.5)
        (sel,) = policy.select([obs], num_layers=1)
        for h in range(2):
            idx, logw = sel.head(h)
            p = pi[h, idx]
            expected = -torch.log(-torch.expm1(m[h] * torch.log1p(-p))) / tau
            torch.testing.assert_close(logw.double(), expected, rtol=1e-5, atol=1e-6)


def test_count_weights_recover_integer_counts_summing_to_m():
    """S4 Eq. 10: w_i = c_i / (m pi_i), so w_i m pi_i are the draw counts: integers >= 1
    that add up to the number of samples m of the head."""
    policy, obs = one_layer("prob:h2o/sampler=with_replacement/weights=counts")
    pi = policy.proposal(obs).double()
    m = sample_size.samples_for_ratio(pi, 0.5)
    (sel,) = policy.select([obs], num_layers=1)
    for h in range(2):
        idx, logw = sel.head(h)
        counts = torch.exp(logw.double()) * m[h] * pi[h, idx]
        torch.testing.assert_close(counts, counts.round(), rtol=1e-4, atol=0)
        assert (counts.round() >= 1).all() and int(counts.round().sum()) == int(m[h])


def test_pps_keeps_exactly_the_budget_with_weights_one_over_p():
    """S9 pps: exactly the head budget (forced entries included), log w_i = -log P_i."""
    policy, obs = one_layer(
        "prob:snapkv/window=8/sampler=pps/block=1/order=position", t=60, ratio=0.7
    )
    obs = policy._with_forced(obs)
    pi = policy.proposal(obs).double()
    b = budget(60, 0.7)
    inclusion = sampling.pps_inclusion_probabilities(pi, b - 8)
    for seed in range(5):
        (sel,) = dataclasses.replace(policy, seed=seed).select([obs], num_layers=1)
        assert sel.lengths.tolist() == [b, b]
        for h in range(2):
            idx, logw = sel.head(h)
            free = idx < 52
            expected = -torch.log(inclusion[h, idx[free]])
            torch.testing.assert_close(logw[free].double(), expected, rtol=1e-5, atol=1e-6)


def test_temperature_scales_the_weights_of_the_same_sample():
    """S4: log w / tau; the kept set does not depend on tau (same seed)."""
    _, obs = one_layer("prob:min-h")
    one = parse_method("prob:min-h/seed=3", ratio=0.5).select([obs], num_layers=1)[0]
    two = parse_method("prob:min-h/seed=3/tau=2", ratio=0.5).select([obs], num_layers=1)[0]
    assert torch.equal(one.indices, two.indices)
    torch.testing.assert_close(two.log_weights, one.log_weights / 2, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("option", ["correct=false", "tau=inf"])
def test_no_correction_gives_no_weights(option):
    policy, obs = one_layer(f"prob:h2o/{option}")
    assert policy.select([obs], num_layers=1)[0].log_weights is None


def test_same_seed_same_kept_set_different_seed_differs():
    policy, obs = one_layer("prob:min-h")
    a = policy.select([obs], num_layers=1)[0]
    b = policy.select([obs], num_layers=1)[0]
    c = dataclasses.replace(policy, seed=1).select([obs], num_layers=1)[0]
    assert torch.equal(a.indices, b.indices) and torch.equal(a.lengths, b.lengths)
    assert not (torch.equal(a.indices, c.indices) and torch.equal(a.lengths, c.lengths))


@pytest.mark.parametrize("sampler", ["with_replacement", "pps"])
@pytest.mark.parametrize(("t", "ratio"), [(1, 0.5), (3, 0.1), (20, 0.5), (40, 0.5)])
def test_short_prompts_keep_the_most_recent_budget(sampler, t, ratio):
    """SnapKV's 32-entry window does not fit: the most recent ``budget`` entries are the
    take-all stratum and nothing is sampled, so the budget is exact even with replacement."""
    policy = parse_method(f"prob:snapkv/sampler={sampler}", ratio=ratio)
    obs = [observe(policy, *random_layer(t, 2, 2, seed=9 + i), layer_idx=i) for i in range(2)]
    b = budget(t, ratio)
    for sel in policy.select(obs, num_layers=2):
        assert sel.lengths.tolist() == [b, b]
        assert sel.indices.tolist() == list(range(t - b, t)) * 2
        assert (sel.log_weights == 0).all()


# ------------------------------------------------------------------- statistical claims


def test_expected_kept_count_is_the_budget():
    """S3: m is chosen so that E[J(m)] = sum_i 1 - (1 - pi_i)^m is within 0.5 of (1 - r) t.
    The kept indicators of multinomial sampling are negatively associated, so
    Var[J] <= sum_i P_i (1 - P_i); the mean over N seeds is within 4 standard errors."""
    policy, obs = one_layer("prob:h2o/sampler=with_replacement", t=60, hkv=1, ratio=0.5)
    pi = policy.proposal(obs).double()
    m = sample_size.samples_for_ratio(pi, 0.5)
    expected = float(sample_size.expected_distinct(pi, m)[0])
    assert abs(expected - 30) <= 0.5
    inclusion = sample_size.inclusion_probabilities_with_replacement(pi, m)
    var_bound = float((inclusion * (1 - inclusion)).sum())
    n = 300
    kept = [
        int(dataclasses.replace(policy, seed=s).select([obs], num_layers=1)[0].lengths[0])
        for s in range(n)
    ]
    assert abs(sum(kept) / n - expected) <= 4 * math.sqrt(var_bound / n)


def corrected_totals(policy, obs, f, seeds):
    """sum over kept entries of w_i f_i, one value per seed (first KV head)."""
    out = []
    for s in seeds:
        (sel,) = dataclasses.replace(policy, seed=s).select([obs], num_layers=1)
        idx, logw = sel.head(0)
        out.append(float((torch.exp(logw.double()) * f[idx]).sum()))
    return torch.tensor(out, dtype=F64)


def test_inclusion_weighted_total_is_unbiased():
    """S9: with w_i = 1 / P_i the corrected total sum_{i kept} w_i f_i is unbiased for
    sum_i f_i (Horvitz-Thompson). For f >= 0 and negatively associated inclusions its
    variance is at most sum_i f_i^2 (1 - P_i) / P_i; 4 standard errors over N seeds."""
    policy, obs = one_layer("prob:h2o/sampler=with_replacement/uniform_mix=0.5", t=40, hkv=1)
    pi = policy.proposal(obs).double()[0]
    m = sample_size.samples_for_ratio(pi, 0.5)
    inclusion = sample_size.inclusion_probabilities_with_replacement(pi, m)
    f = torch.linspace(0.1, 2.0, 40, dtype=F64) ** 2
    n = 400
    totals = corrected_totals(policy, obs, f, range(n))
    var_bound = float((f**2 * (1 - inclusion) / inclusion).sum())
    assert abs(float(totals.mean()) - float(f.sum())) <= 4 * math.sqrt(var_bound / n)


def test_count_weighted_total_is_unbiased():
    """S4 Hansen-Hurwitz: sum_i c_i f_i / (m pi_i) is unbiased for sum_i f_i with the exact
    variance (1/m) (sum_i f_i^2 / pi_i - (sum_i f_i)^2); 4 standard errors over N seeds."""
    policy, obs = one_layer(
        "prob:h2o/sampler=with_replacement/uniform_mix=0.5/weights=counts", t=40, hkv=1
    )
    pi = policy.proposal(obs).double()[0]
    m = int(sample_size.samples_for_ratio(pi, 0.5))
    f = torch.linspace(0.1, 2.0, 40, dtype=F64) ** 2
    n = 400
    totals = corrected_totals(policy, obs, f, range(n))
    var = float((f**2 / pi).sum() - f.sum() ** 2) / m
    assert abs(float(totals.mean()) - float(f.sum())) <= 4 * math.sqrt(var / n)


def test_global_scope_shares_one_m_and_hits_the_mean_fraction():
    """S3 global: one m for all heads of all layers, so heads keep different fractions, and
    the mean kept fraction is 1 - r in expectation (within the search tolerance 0.5 / t).
    Every head draws its own samples independently, so the variance of the mean fraction is
    sum_h Var[J_h] / (H t)^2 <= sum_h sum_i P_hi (1 - P_hi) / (H t)^2; 4 standard errors."""
    policy = parse_method("prob:h2o/sampler=with_replacement/scope=global", ratio=0.6)
    assert not policy.layerwise
    t, n = 50, 200
    obs = [observe(policy, *random_layer(t, 2, 2, seed=20 + i), layer_idx=i) for i in range(2)]
    pis = [policy.proposal(o).double() for o in obs]
    m = sample_size.samples_for_ratio_global(pis, 0.6)
    inclusion = torch.cat([sample_size.inclusion_probabilities_with_replacement(p, m) for p in pis])
    expected = float(inclusion.sum(-1).mean()) / t
    assert abs(expected - 0.4) <= 0.5 / t
    fractions = []
    for s in range(n):
        sels = dataclasses.replace(policy, seed=s).select(obs, num_layers=2)
        fractions.append(float(torch.cat([x.lengths for x in sels]).double().mean()) / t)
    var_bound = float((inclusion * (1 - inclusion)).sum()) / (4 * t) ** 2
    assert abs(sum(fractions) / n - expected) <= 4 * math.sqrt(var_bound / n)


# ------------------------------------------------------------------------------ bad input


def test_bad_fields_fail_at_construction_naming_the_value():
    with pytest.raises(
        ValueError, match="scope must be one of 'head', 'global', 'model'; got 'layer'"
    ):
        ProbabilisticPolicy(scope="layer")
    with pytest.raises(ValueError, match="sampler must be one of 'with_replacement', 'pps'"):
        ProbabilisticPolicy(sampler="poisson")
    with pytest.raises(ValueError, match="weights must be one of 'counts', 'inclusion'"):
        ProbabilisticPolicy(sampler="with_replacement", weights="pps")
    with pytest.raises(ValueError, match=r"tau must be > 0.*got 0"):
        ProbabilisticPolicy(tau=0)
    with pytest.raises(ValueError, match=r"uniform_mix must be in \(0, 1\]"):
        ProbabilisticPolicy(uniform_mix=0.0)
    with pytest.raises(ValueError, match="correct must be True or False, got 'yes'"):
        ProbabilisticPolicy(correct="yes")
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, .*got 1\.5"):
        ProbabilisticPolicy(seed=1.5)
    with pytest.raises(ValueError, match=r"ratio must be in \[0, 1\)"):
        ProbabilisticPolicy(ratio=1.0)
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['window'\] for score 'h2o'"):
        ProbabilisticPolicy(score="h2o", score_params={"window": 8})


# --------------------------------------------------------- span-preserving designs (S10)


def synthetic(log_scores, window: int = 0, layer_idx: int = 0) -> LayerObservation:
    """An observation from given log-scores; the last ``window`` entries forced (a SnapKV-like
    window with ``FORCED_LOG_SCORE``)."""
    ls = log_scores.float().clone()
    forced = None
    if window > 0:
        forced = torch.zeros(ls.shape, dtype=torch.bool)
        forced[:, -window:] = True
        ls[forced] = FORCED_LOG_SCORE
    return LayerObservation(layer_idx, layer_idx, ls, forced, torch.zeros_like(ls))


def reference_core(scores: torch.Tensor, forced: torch.Tensor | None, count: int) -> set[int]:
    """S10.2 for one head: the ``count`` non-forced entries of largest score (the proposal is
    increasing in it), ties to the later position, as top-k methods break them (S5)."""
    free = [i for i in range(scores.numel()) if forced is None or not forced[i]]
    return set(sorted(free, key=lambda i: (-float(scores[i]), -i))[:count])


def floor_fraction(f: float, b: int) -> int:
    return math.floor(Fraction(str(f)) * b)


@dataclasses.dataclass(frozen=True)
class SpanPathPolicy(ProbabilisticPolicy):
    """The policy forced through the S10 design path even with S9's options."""

    @property
    def _span_design(self) -> bool:
        return True


@pytest.mark.parametrize("scope", ["head", "global"])
@pytest.mark.parametrize("method", ["prob:snapkv/window=8", "prob:h2o/recent=0.3", "prob:knorm"])
def test_design_path_with_s9_options_is_todays_sampler(scope, method):
    """core=0, block=1, order=position is S9's pps exactly: through the S10 design path the
    same kept sets and the same log-weights (bit for bit) for the same seed."""
    policy = parse_method(f"{method}/scope={scope}", ratio=0.6)
    obs = [observe(policy, *random_layer(45, 2, 2, seed=30 + i), layer_idx=i) for i in range(2)]
    span = SpanPathPolicy(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)})
    layers = [obs] if scope == "global" else [[o] for o in obs]
    for seed in range(4):
        for group in layers:
            old = dataclasses.replace(policy, seed=seed).select(group, num_layers=2)
            new = dataclasses.replace(span, seed=seed).select(group, num_layers=2)
            for a, b in zip(old, new, strict=True):
                assert torch.equal(a.indices, b.indices) and torch.equal(a.lengths, b.lengths)
                assert torch.equal(a.log_weights, b.log_weights)


@pytest.mark.parametrize("ratio", [0.3, 0.7, 0.95])
@pytest.mark.parametrize(
    "options",
    ["snapkv/window=8", "h2o", "h2o/recent=0.3", "knorm", "snapkv/window=8/pool=5", "min-h/pool=3"],
)
def test_core_one_is_the_topk_method_of_the_score(ratio, options):
    """S10.2: core=1 keeps the top-k of the proposal: the same kept set as topk:<score> with
    the same options (forced entries alike), every weight 1."""
    prob = parse_method(f"prob:{options}/core=1", ratio=ratio)
    topk = parse_method(f"topk:{options}", ratio=ratio)
    q, k, v = random_layer(50, 2, 2, seed=40)
    obs = observe(prob, q, k, v)
    for seed in range(3):
        (ours,) = dataclasses.replace(prob, seed=seed).select([obs], num_layers=1)
        (theirs,) = topk.select([obs], num_layers=1)
        assert torch.equal(ours.indices, theirs.indices)
        assert torch.equal(ours.lengths, theirs.lengths)
        assert (ours.log_weights == 0).all()


def assert_core_then_pps(head, core: set[int], pi: torch.Tensor, *, forced: int, sampled: int):
    """One head's selection ``(idx, logw)`` against S10.2 with its last ``forced`` entries
    forced: the core and the forced entries kept with log-weight 0, ``forced + sampled`` entries
    in all, every other kept entry ``-log P_i`` with ``P`` the pps of ``pi`` restricted to the
    entries outside the core, for the rest of the budget."""
    idx, logw = head
    t = pi.numel()
    rest = pi.clone()
    rest[list(core)] = 0.0
    P = sampling.pps_inclusion_probabilities(
        rest / rest.sum(), forced + sampled, forced + len(core)
    )
    assert core <= set(idx.tolist()) and len(idx) == forced + sampled
    for i, w in zip(idx.tolist(), logw.double().tolist()):
        if i in core or i >= t - forced:
            assert w == 0.0
        else:
            assert w == pytest.approx(-math.log(float(P[i])), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("pool", [1, 5])
def test_core_is_weight_one_and_the_rest_pps_of_the_restricted_proposal(pool):
    """S10.2 per head: the floor(f b) entries of largest (pooled) score are kept with log-weight
    0; every other kept entry has -log P_i with P the pps of the proposal restricted to the
    remaining entries (renormalised) for the remaining budget b - |C|."""
    policy = parse_method(
        f"prob:snapkv/window=8/core=0.5/pool={pool}/block=1/order=position", ratio=0.7
    )
    q, k, v = random_layer(60, 2, 2, seed=41)
    obs = policy._with_forced(observe(policy, q, k, v))
    pi = policy.proposal(obs).double()
    scores = policy.pooled_scores(obs)
    b = budget(60, 0.7) - 8
    for seed in range(4):
        (sel,) = dataclasses.replace(policy, seed=seed).select([obs], num_layers=1)
        for h in range(2):
            core = reference_core(scores[h], obs.forced[h], floor_fraction(0.5, b))
            assert_core_then_pps(sel.head(h), core, pi[h], forced=8, sampled=b)


def test_global_core_is_the_top_of_all_heads_then_one_scale():
    """S10.2 with scope=global: the core is the floor(f S) entries of largest score over all
    heads of all layers (S = sum_h (1 - r) t_h - forced; h2o is on the attention scale, so the
    raw log-scores are compared), weight 1; the rest is pps with one lam over the remaining
    entries of every head weighed by the head's attention mass (S9): P = min(1, lam m_h pi),
    m_h = sum_i exp(s_hi), sum P = S - |C|."""
    policy = parse_method("prob:h2o/scope=global/core=0.5/block=1/order=position", ratio=0.75)
    obs = [
        synthetic(torch.randn(2, 30 + 10 * i, generator=gen(i)) * 2, layer_idx=i) for i in range(2)
    ]
    pis = [policy.proposal(o).double() for o in obs]
    masses = [torch.logsumexp(o.log_scores.double(), -1).exp() for o in obs]
    total = 0.25 * (2 * 30 + 2 * 40)
    keys = torch.cat([o.log_scores.double().flatten() for o in obs])
    order = sorted(range(keys.numel()), key=lambda i: (-float(keys[i]), -i))
    core = set(order[: floor_fraction(0.5, total)])
    rest = torch.cat([(p * m.unsqueeze(-1)).flatten() for p, m in zip(pis, masses)])
    rest[list(core)] = 0.0
    P = reference_capping(rest, total - len(core))
    sels = policy.select(obs, num_layers=2)
    offsets = [0, 60]
    kept_total = 0
    for sel, offset, t in zip(sels, offsets, [30, 40]):
        for h in range(2):
            idx, logw = sel.head(h)
            flat_idx = [offset + h * t + i for i in idx.tolist()]
            kept_total += len(flat_idx)
            head = set(range(offset + h * t, offset + (h + 1) * t))
            assert core & head <= set(flat_idx)
            expected = len(core & head) + float(sum(P[i] for i in head))
            assert math.floor(expected - 1e-9) <= len(flat_idx) <= math.ceil(expected + 1e-9)
            for i, w in zip(flat_idx, logw.double().tolist()):
                target = 0.0 if i in core else -math.log(float(P[i]))
                assert w == pytest.approx(target, rel=1e-5, abs=1e-6)
    assert abs(kept_total - total) < 4  # each of the 4 heads within 1 of its expectation


@pytest.mark.parametrize("score", ["h2o", "knorm"])
@pytest.mark.parametrize("window", [0, 4])
def test_global_core_one_is_the_global_top_k(score, window):
    """S9, S10.1: prob:<score>/scope=global/core=1 keeps exactly the kept sets of the global
    top-k (Ada-KV's allocation over all heads and layers without safeguard, alpha = 0, which
    is KVzip's rule), weight 1, when (1 - r) t is an integer: both rank raw scores on the
    attention scale and per-head distributions otherwise."""
    obs = [
        synthetic(2 * torch.randn(3, 40, generator=gen(10 + i)), window=window, layer_idx=i)
        for i in range(3)
    ]
    prob = parse_method(f"prob:{score}/scope=global/core=1", ratio=0.75)
    topk = parse_method(f"topk:{score}/layer_budgets=global/head_budgets=ada/alpha=0", 0.75)
    for a, b in zip(prob.select(obs, num_layers=3), topk.select(obs, num_layers=3), strict=True):
        assert torch.equal(a.indices, b.indices) and torch.equal(a.lengths, b.lengths)
        assert a.log_weights is None or torch.all(a.log_weights == 0)


def test_global_scope_weighs_heads_only_on_the_attention_scale():
    """S9 global: a head whose scores are all 10x smaller on the attention scale (h2o) keeps
    ~10x fewer entries (its mass m_h is 10x smaller); for knorm (not attention) each head's
    proposal is a distribution and both heads keep the same expected number."""
    base = torch.randn(1, 50, generator=gen(3))
    log_scores = torch.cat([base, base - math.log(10.0)])
    for score, head_weights in (("h2o", (1.0, 0.1)), ("knorm", (1.0, 1.0))):
        policy = parse_method(f"prob:{score}/scope=global/block=1/order=position", ratio=0.9)
        obs = synthetic(log_scores)
        pi = policy.proposal(obs).double()
        weighed = torch.cat([pi[h] * w for h, w in enumerate(head_weights)])
        P = reference_capping(weighed, 10.0)
        expected = [float(P[:50].sum()), float(P[50:].sum())]
        kept = policy.select([obs], num_layers=1)[0]
        for h in range(2):
            n = len(kept.head(h)[0])
            assert math.floor(expected[h] - 1e-9) <= n <= math.ceil(expected[h] + 1e-9)
    assert expected[0] == pytest.approx(expected[1])  # knorm: the heads weigh the same


def reference_capping(p: torch.Tensor, n: float) -> torch.Tensor:
    """S9 iterative capping, literally: P = min(1, lam p) with sum P = n."""
    capped = torch.zeros_like(p, dtype=torch.bool)
    while True:
        lam = (n - capped.sum()) / p[~capped].sum()
        new = ~capped & (lam * p >= 1)
        if not new.any():
            return torch.where(capped, 1.0, lam * p)
        capped |= new


@settings(max_examples=60, deadline=None)
@given(
    t=st.integers(1, 50),
    heads=st.integers(1, 3),
    spread=st.sampled_from([0.3, 2.0, 8.0]),
    ratio=st.floats(0.0, 0.9999, exclude_min=True),
    core=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
    block=st.integers(1, 9),
    order=st.sampled_from(["position", "random"]),
    window=st.integers(0, 10),
    recent=st.sampled_from([0.0, 0.25]),
    pool=st.sampled_from([1, 3]),
    seed=st.integers(0, 10**6),
)
def test_span_designs_property(
    t, heads, spread, ratio, core, block, order, window, recent, pool, seed
):
    """For any proposal, ratio, core, block, order: each head keeps its budget exactly with
    entry units (block=1) and within block - 1 of it with blocks; forced entries are kept;
    log-weights are finite and >= 0 (weights 1 / P >= 1) and exactly 0 on forced and core
    entries; the same seed gives the same selection."""
    policy = ProbabilisticPolicy(
        score="h2o",
        ratio=ratio,
        core=core,
        block=block,
        order=order,
        recent=recent,
        pool=pool,
        seed=seed % 1000,
    )
    obs = synthetic(spread * torch.randn(heads, t, generator=gen(seed)), min(window, t))
    (sel,) = policy.select([obs], num_layers=1)
    (again,) = policy.select([obs], num_layers=1)
    assert torch.equal(sel.indices, again.indices) and torch.equal(
        sel.log_weights, again.log_weights
    )
    fitted = policy._with_forced(obs)
    scores = policy.pooled_scores(fitted)
    b = budget(t, ratio)
    for h in range(heads):
        idx, logw = sel.head(h)
        forced = fitted.forced[h] if fitted.forced is not None else torch.zeros(t, dtype=torch.bool)
        assert abs(len(idx) - b) <= block - 1
        assert set(forced.nonzero().flatten().tolist()) <= set(idx.tolist())
        assert torch.isfinite(logw).all() and (logw >= 0).all()
        sampled = b - int(forced.sum())
        core_set = reference_core(scores[h], forced, floor_fraction(core, sampled))
        take_all = core_set | set(forced.nonzero().flatten().tolist())
        assert all(w == 0 for i, w in zip(idx.tolist(), logw.tolist()) if i in take_all)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    heads=st.integers(1, 3),
    ratio=st.floats(0.0, 0.9999, exclude_min=True),
    core=st.sampled_from([0.0, 0.5, 1.0]),
    block=st.integers(1, 6),
    order=st.sampled_from(["position", "random"]),
    window=st.integers(0, 6),
    seed=st.integers(0, 10**6),
)
def test_span_designs_global_property(lengths, heads, ratio, core, block, order, window, seed):
    """scope=global: forced entries and the global core (the floor(f S) entries of largest
    raw score over all heads, h2o being on the attention scale, S the sampled budget) are kept with log-weight 0; log-weights
    are finite and >= 0; every head keeps within block of its expected count, so the total over
    the sampled heads is within (heads) x block of their global budget (a head whose entries
    are all forced is left out of the sampling); the same seed gives the same selections."""
    policy = ProbabilisticPolicy(
        score="h2o", scope="global", ratio=ratio, core=core, block=block, order=order, seed=seed
    )
    obs = [
        synthetic(2 * torch.randn(heads, t, generator=gen(seed + i)), min(window, t), i)
        for i, t in enumerate(lengths)
    ]
    sels = policy.select(obs, num_layers=len(obs))
    again = policy.select(obs, num_layers=len(obs))
    assert all(torch.equal(a.indices, b.indices) for a, b in zip(sels, again))
    fitted = [policy._with_forced(o) for o in obs]
    pis = [policy.proposal(o).double() for o in fitted]
    live = [p.sum(-1) > 0 for p in pis]
    forced_total = sum(
        int(o.forced[lv].sum()) for o, lv in zip(fitted, live) if o.forced is not None
    )
    target = sum((1 - ratio) * t * int(lv.sum()) for t, lv in zip(lengths, live))
    flat = torch.cat([p.flatten() for p in pis])
    keys = torch.cat([o.log_scores.double().flatten() for o in fitted])  # h2o: attention scale
    count = floor_fraction(core, max(target - forced_total, 0.0))
    ranked = sorted(
        (i for i in range(flat.numel()) if flat[i] > 0), key=lambda i: (-float(keys[i]), -i)
    )
    core_flat = set(ranked[:count])
    kept_total, offset = 0, 0
    for sel, o, t in zip(sels, fitted, lengths):
        for h in range(heads):
            idx, logw = sel.head(h)
            forced = set() if o.forced is None else set(o.forced[h].nonzero().flatten().tolist())
            assert forced <= set(idx.tolist())
            assert torch.isfinite(logw).all() and (logw >= 0).all()
            take_all = forced | {
                i - offset - h * t for i in core_flat if 0 <= i - offset - h * t < t
            }
            assert take_all <= set(idx.tolist())
            assert all(w == 0 for i, w in zip(idx.tolist(), logw.tolist()) if i in take_all)
            if len(forced) < t:  # all forced: left out of the sampling and of the target
                kept_total += len(idx)
        offset += heads * t
    live_heads = sum(int(lv.sum()) for lv in live)
    assert abs(kept_total - target) < live_heads * block + 1e-9


@pytest.mark.parametrize(
    "options",
    [
        "core=0.25/block=3/order=random",
        "block=4",
        "order=random",
        "units=spans/block=4",
        "core=0.5/units=spans/block=3",
        "scope=global/core=0.5/units=spans/block=4",
        "units=spans/block=6",
        "scope=global/core=0.5/units=spans/block=8",
    ],
)
def test_span_designs_corrected_total_is_unbiased(options):
    """S10: the policy's weights keep the Horvitz-Thompson total unbiased:
    sum_{i kept} w_i f_i over N seeds has mean sum_i f_i within 5 of its own standard errors
    (sample standard deviation / sqrt N)."""
    policy, obs = one_layer(f"prob:h2o/uniform_mix=0.5/{options}", t=40, hkv=1)
    f = torch.linspace(0.1, 2.0, 40, dtype=F64) ** 2
    n = 400
    totals = corrected_totals(policy, obs, f, range(n))
    se = float(totals.std()) / math.sqrt(n)
    assert abs(float(totals.mean()) - float(f.sum())) <= 5 * se


def test_pool_max_pools_the_scores_before_the_proposal():
    """S10 pool: the proposal is S2's proposal of the max-pooled log-scores (forced excluded)."""
    policy = parse_method("prob:h2o/recent=0.2/pool=5/proposal_tau=2", ratio=0.5)
    obs = policy._with_forced(observe(policy, *random_layer(40, 2, 2, seed=42)))
    pooled = max_pool_log_scores(obs.log_scores, 5, forced=obs.forced)
    expected = proposal_from_log_scores(pooled, tau=2.0, forced=obs.forced)
    assert torch.equal(policy.proposal(obs), expected)
    with_replacement = parse_method("prob:h2o/pool=5/sampler=with_replacement", ratio=0.5)
    assert with_replacement.select([obs], num_layers=1)[0].lengths.sum() > 0


def test_span_options_fail_naming_the_value():
    with pytest.raises(ValueError, match=r"core must be in \[0, 1\] .*got 1.2"):
        ProbabilisticPolicy(core=1.2)
    with pytest.raises(ValueError, match=r"block must be an integer >= 1 .*got 0"):
        ProbabilisticPolicy(block=0)
    with pytest.raises(ValueError, match="order must be one of 'position', 'random'; got 'lifo'"):
        ProbabilisticPolicy(order="lifo")
    with pytest.raises(ValueError, match=r"pool must be an odd integer >= 1 .*got 2"):
        ProbabilisticPolicy(pool=2)
    with pytest.raises(ValueError, match="designs of sampler='pps'"):
        ProbabilisticPolicy(sampler="with_replacement", block=2)
    with pytest.raises(ValueError, match="units must be one of 'blocks', 'spans'; got 'words'"):
        ProbabilisticPolicy(units="words")
    with pytest.raises(ValueError, match="designs of sampler='pps'"):
        ProbabilisticPolicy(sampler="with_replacement", units="spans")


@pytest.mark.parametrize("scope", ["head", "global"])
def test_spans_of_one_entry_are_the_entries(scope):
    """units=spans with block=1 draws exactly what units=blocks with block=1 draws (every
    entry is its own unit either way): same kept sets and log-weights for the same seed."""
    obs = [synthetic(2 * torch.randn(3, 50, generator=gen(7 + i)), 4, i) for i in range(2)]
    for seed in range(5):
        a = ProbabilisticPolicy(
            score="h2o", ratio=0.7, scope=scope, block=1, units="spans", seed=seed
        ).select(obs, num_layers=2)
        b = ProbabilisticPolicy(
            score="h2o", ratio=0.7, scope=scope, block=1, units="blocks", seed=seed
        ).select(obs, num_layers=2)
        for x, y in zip(a, b):
            assert torch.equal(x.indices, y.indices) and torch.equal(x.log_weights, y.log_weights)


def test_spans_keep_a_heavy_run_whole():
    """units=spans: a run of entries each too light to be kept surely (P < 1 alone) but heavy
    together is one unit: over seeds it is kept or dropped whole, never thinned as single
    entries or fixed blocks of the same size thin it."""
    t = 64
    log_scores = torch.zeros(1, t)
    log_scores[0, 20:27] = 0.7  # a 7-token "number", each entry ~ 2x the others
    obs = synthetic(log_scores, 0)
    whole = {"spans": 0, "entries": 0}
    for seed in range(200):
        for name, options in (("spans", dict(units="spans", block=8)), ("entries", {})):
            policy = ProbabilisticPolicy(score="h2o", ratio=0.95, core=0.0, seed=seed, **options)
            (sel,) = policy.select([obs], num_layers=1)
            kept = set(sel.head(0)[0].tolist()) & set(range(20, 27))
            assert name == "entries" or len(kept) in (0, 7)
            whole[name] += len(kept) == 7
    # the run's P as one unit (S10.3 capping of the policy's own proposal), within Z = 5
    # binomial standard errors; alone, each entry has P < 0.1, so all 7 are (almost) never kept
    pi = policy.proposal(obs).double()
    design = span_designs.block_design(pi, budget(t, 0.95), 8, units="spans")
    p_run = float(design.entry_inclusion[0, 20])
    assert (
        0.05 < p_run < 0.95
        and float(span_designs.block_design(pi, budget(t, 0.95)).inclusion.max()) < 0.1
    )
    assert whole["entries"] == 0
    assert abs(whole["spans"] / 200 - p_run) <= 5 * math.sqrt(p_run * (1 - p_run) / 200)


# ------------------------------------------------------------- calibrated weights (S9)


def test_calibrate_names_and_refusals():
    """``calibrate`` (S9): its canonical name, inf as the default, and refusals by name."""
    policy = parse_method("prob:kvzip/calibrate=0.01", ratio=0.5)
    assert policy.calibrates and method_name(policy) == "prob:kvzip/calibrate=0.01"
    assert parse_method("prob:kvzip/calibrate=inf", 0.5) == parse_method("prob:kvzip", 0.5)
    assert not parse_method("prob:kvzip", 0.5).calibrates
    assert not parse_method("prob:kvzip/calibrate=0.01", 0.0).calibrates  # r = 0: exact
    for bad in (0, -1.0, float("nan"), "much"):
        with pytest.raises(ValueError, match=r"calibrate must be a number > 0"):
            ProbabilisticPolicy(score="kvzip", calibrate=bad)
    with pytest.raises(
        ValueError, match=r"calibrate=0.01 with score='h2o': .*kvzip, kvzip-plus, h2o-rec"
    ):
        ProbabilisticPolicy(score="h2o", calibrate=0.01)
    for options in ({"correct": False}, {"tau": math.inf}):
        with pytest.raises(ValueError, match=r"calibrate=0.01 calibrates the correction"):
            ProbabilisticPolicy(score="kvzip", calibrate=0.01, **options)


def test_calibrated_selections_need_tensors_and_reference_queries():
    from probkv.policies import select_layers

    policy = parse_method("prob:kvzip/calibrate=0.01", ratio=0.5)
    bare = synthetic(torch.randn(2, 30, generator=gen(3)))
    with pytest.raises(ValueError, match=r"select_layers needs tensors, one \(key, value\)"):
        select_layers(policy, [bare], num_layers=1)
    key = torch.randn(2, 30, 4, generator=gen(4))
    with pytest.raises(ValueError, match="layer 0's observation has no reference queries"):
        select_layers(policy, [bare], num_layers=1, tensors=[(key, key)])
    with_rows = dataclasses.replace(bare, reference_queries=torch.randn(4, 5, 4), scale=0.5)
    with pytest.raises(ValueError, match="needs the 30 observed entries before eviction"):
        select_layers(policy, [with_rows], num_layers=1, tensors=[(key[:, :20], key[:, :20])])
    out = select_layers(policy, [with_rows], num_layers=1, tensors=[(key, key)])[0]
    plain = parse_method("prob:kvzip", ratio=0.5).select([with_rows], num_layers=1)[0]
    assert torch.equal(out.indices, plain.indices) and torch.equal(out.lengths, plain.lengths)
    assert not torch.equal(out.log_weights, plain.log_weights)


# ----------------------------------------------- the parts and their one place of defaults


@dataclasses.dataclass(frozen=True)
class Poisson(prob_options.Design):
    """Poisson pps (docs/architecture.md's worked example): entry i kept independently with
    P_i = min(1, lam pi_i), sum P_i = share * (the head's budget after forced entries)."""

    NAME: ClassVar[str] = "poisson"
    OPTIONS: ClassVar[tuple[str, ...]] = ("share",)
    WHY_NOT: ClassVar[Mapping[str, str]] = {"weights": "poisson weighs by 1 / P_i"}
    share: float

    def __post_init__(self) -> None:
        check_fraction(self.share, "share", what="share of the sampled budget")

    def draw(self, stratum, weighting, generator):
        out = []
        for pi, forced, b in zip(stratum.pis, stratum.forced, stratum.budgets):
            n = self.share * (b - forced).clamp(min=0).double()
            P = sampling.capped(pi, *sampling.capped_scale(pi, None, n))
            kept = torch.rand(pi.shape, generator=generator, dtype=pi.dtype) < P
            logw = None
            if weighting.correct:
                logw = estimation.pps_log_weights(pi, kept, P, tau=weighting.tau)
            out.append((kept, logw))
        return out


def test_adding_a_design_is_one_class_in_one_module(monkeypatch):
    """A temporary sampler added as docs/architecture.md says (one class, one DESIGNS entry,
    its option's default in DEFAULTS, all in probkv.policies.prob_options) is a method name
    with its option, round-trips, refuses the other samplers' options and is refused by them,
    and draws with unbiased Horvitz-Thompson weights (5 standard errors over 400 seeds)."""
    monkeypatch.setitem(prob_options.DESIGNS, "poisson", Poisson)
    monkeypatch.setitem(prob_options.DEFAULTS, "share", {"*": 1.0, "kvzip": 0.5})
    policy = parse_method("prob:h2o/sampler=poisson/share=0.8", ratio=0.6)
    assert policy.design == Poisson(share=0.8) and policy.share == 0.8
    assert "share" in method_options("prob:h2o")
    assert method_name(policy) == "prob:h2o/sampler=poisson/share=0.8"
    assert parse_method(method_name(policy), ratio=0.6) == policy
    assert method_name(parse_method("prob:kvzip/sampler=poisson/share=0.5")) == (
        "prob:kvzip/sampler=poisson"
    )
    assert ProbabilisticPolicy(score="h2o", ratio=0.6, sampler="poisson", share=0.8) == policy
    with pytest.raises(ValueError, match=r"share=0\.5 does nothing with sampler='pps'"):
        parse_method("prob:h2o/share=0.5")
    with pytest.raises(ValueError, match=r"core=0\.5 does nothing with sampler='poisson'"):
        parse_method("prob:h2o/sampler=poisson/core=0.5")
    with pytest.raises(ValueError, match="weights='counts' does nothing with sampler='poisson'"):
        parse_method("prob:h2o/sampler=poisson/weights=counts")
    with pytest.raises(ValueError, match=r"share must be in \[0, 1\]"):
        parse_method("prob:h2o/sampler=poisson/share=2")
    policy, obs = one_layer("prob:h2o/sampler=poisson/uniform_mix=0.5", t=40, hkv=1)
    f = torch.linspace(0.1, 2.0, 40, dtype=F64) ** 2
    totals = corrected_totals(policy, obs, f, range(400))
    assert abs(float(totals.mean()) - float(f.sum())) <= 5 * float(totals.std()) / 20
    assert "poisson" not in prob_options.DESIGNS or prob_options.DESIGNS["poisson"] is Poisson


def test_parts_refuse_options_that_change_nothing():
    """One spelling per behaviour: pps has no weights option (always 1 / P), tau=inf is
    correct=false, a finite tau with correct=false is refused, and so are the pps designs with
    the with-replacement sampler; each refusal names the option and why."""
    with pytest.raises(ValueError, match=r"weights='counts' does nothing with sampler='pps': "):
        parse_method("prob:h2o/weights=counts")
    with pytest.raises(ValueError, match="pps always weighs a kept entry by 1 / P_i"):
        ProbabilisticPolicy(score="h2o", weights="inclusion")
    assert parse_method("prob:h2o/tau=inf") == parse_method("prob:h2o/correct=false")
    assert parse_method("prob:h2o/correct=false/tau=inf") == parse_method("prob:h2o/correct=false")
    assert method_name(parse_method("prob:h2o/tau=inf")) == "prob:h2o/correct=false"
    uncorrected = parse_method("prob:streaming_llm/correct=false")  # its pps tau 2 is not set
    assert "tau" not in uncorrected.option_values() and not uncorrected.corrected
    with pytest.raises(ValueError, match="tau=2 with correct=false: tau tempers the"):
        parse_method("prob:h2o/correct=false/tau=2")
    with pytest.raises(ValueError, match="tau=1 with correct=false"):
        parse_method("prob:h2o/tau=1/correct=false")
    with pytest.raises(ValueError, match="core=0 does nothing with sampler='with_replacement'"):
        parse_method("prob:h2o/sampler=with_replacement/core=0")
    changed = dataclasses.replace(uncorrected, correct=True)  # tau back to its default
    assert changed == parse_method("prob:streaming_llm") and changed.tau == 2.0
    switched = dataclasses.replace(parse_method("prob:kvzip"), sampler="with_replacement")
    assert switched == parse_method("prob:kvzip/sampler=with_replacement")


def test_proposal_tau_zero_speaks_of_the_proposal():
    with pytest.raises(ValueError, match=r"proposal_tau must be > 0 \(the proposal's temp"):
        parse_method("prob:h2o/proposal_tau=0")
    with pytest.raises(ValueError) as refused:
        parse_method("prob:h2o/proposal_tau=0")
    assert "correction" not in str(refused.value)


@pytest.mark.parametrize("digits", [23, 5000])
def test_seeds_outside_torch_range_are_refused_at_parse_time(digits):
    """torch generators take 64-bit seeds (and each layer's is seed * 100003 + its index): a
    larger seed is refused when the name is parsed, naming the range; even 5,000 digits."""
    lo, hi = SEEDS
    with pytest.raises(ValueError, match=rf"seed must be an integer in \[{lo}, {hi}\]"):
        parse_method(f"prob:snapkv/seed={'9' * digits}")
    policy = parse_method(f"prob:snapkv/seed={hi}", ratio=0.5)
    obs = [synthetic(torch.randn(2, 20, generator=gen(1)), 0, layer) for layer in range(3)]
    policy.select(obs, num_layers=3)  # the largest seed draws
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, "):
        parse_method("prob:snapkv/seed=-1")


def test_defaults_live_in_one_table_and_docs_list_them():
    """Every default of a prob: option is in prob_options.DEFAULTS (the options of the parts
    and designs, scope, seed and sampler: nothing else, nothing missing), docs/methods.md's
    defaults table is exactly that table, and a global default scope needs the attention
    scale."""
    options = set(ProbabilisticPolicy.option_names())
    assert set(prob_options.DEFAULTS) == options
    rows = defaults_rows()
    text = (Path(__file__).parents[2] / "docs" / "methods.md").read_text()
    table = text.split("<!-- prob-defaults -->")[1]
    listed = [line for line in table.strip().splitlines() if line.startswith("| `")]
    assert listed == rows
    assert all(
        scores.on_attention_scale(s)
        for s, scope in prob_options.DEFAULTS["scope"].items()
        if s != "*" and scope == "global"
    )


def defaults_rows() -> list[str]:
    """docs/methods.md's rows of the defaults table, from ``DEFAULTS``: option, default, and
    the exceptions by score or by sampler, in the table's order."""

    def shown(value) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, float) and (math.isinf(value) or value.is_integer()):
            return "inf" if math.isinf(value) else str(int(value))
        return str(value)

    rows = []
    for option, table in prob_options.DEFAULTS.items():
        others = {}
        for key, value in table.items():
            if key == "*":
                continue
            where = f"`{key[1]}` with `{key[0]}`" if isinstance(key, tuple) else f"`{key}`"
            others.setdefault(shown(value), []).append(where)
        exceptions = "; ".join(f"`{v}` for {', '.join(w)}" for v, w in others.items())
        rows.append(f"| `{option}` | `{shown(table['*'])}` | {exceptions or 'none'} |")
    return rows


def test_each_part_checks_itself():
    """The parts cannot be built in a state that means nothing: bad values are refused by name
    and the one redundant spelling (tau = inf) becomes the canonical one (correct=False)."""
    with pytest.raises(ValueError, match=r"core must be in \[0, 1\]"):
        prob_options.Pps(core=2.0, block=8, order="random", units="blocks")
    with pytest.raises(ValueError, match="weights must be one of 'counts', 'inclusion'"):
        prob_options.WithReplacement(weights="pps")
    with pytest.raises(ValueError, match="tau=2 with correct=false"):
        prob_options.Weighting(correct=False, tau=2, calibrate=math.inf)
    with pytest.raises(ValueError, match=r"calibrate=0\.1 calibrates the correction's weights"):
        prob_options.Weighting(correct=False, tau=math.inf, calibrate=0.1)
    assert prob_options.Weighting(True, math.inf, math.inf) == prob_options.Weighting(
        False, math.inf, math.inf
    )
    with pytest.raises(ValueError, match=r"uniform_mix must be in \(0, 1\]"):
        prob_options.Proposal(proposal_tau=1.0, uniform_mix=0.0, pool=1, recent=0.0)
    policy = ProbabilisticPolicy(
        score="h2o",
        design=prob_options.WithReplacement("counts"),
        weighting=prob_options.Weighting(True, 2.0, math.inf),
    )
    assert policy == parse_method("prob:h2o/sampler=with_replacement/weights=counts/tau=2")
