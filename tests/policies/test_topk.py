"""Deterministic top-k policies against slow references written from the papers (S5, S6).

Every top-k method (StreamingLLM, H2O, SnapKV, TOVA, K-norm, PyramidKV, Ada-SnapKV,
Ada-PyramidKV and the top-k of the S2 proposals) must keep exactly the entries a plainly
written reference keeps. Observations are built by the integration's own prefill path
(``probkv.scores.observation.observe_layer``, which calls ``probkv.scores.compute_scores``) from
random GQA tensors; the references below recompute each score from a dense causal softmax with
explicit loops, from the method's paper definition, and select with explicit sorting.

Rounding: the policies rank float32 log-scores (docs/architecture.md). The references compute
in float64 and round the log-score to float32 before ranking, so both rank the same numbers;
equal scores (max-pooling creates exact ties) go to the later position, the rule
``probkv.budgets`` documents.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probkv.budgets import pyramid_budgets
from probkv.policies import LayerObservation, TopKPolicy, method_name, parse_method
from probkv.policies.base import fit_forced
from probkv.policies.threshold import threshold_ratio
from probkv.scores import snapkv
from probkv.scores.observation import observe_layer
from probkv.scores.proposals import FLOOR

torch.set_num_threads(1)

F64 = torch.float64
SCALE = 0.35


# ------------------------------------------------------------------------------ inputs


def random_layer(t: int, hkv: int, g: int, seed: int, d: int = 8):
    """Random post-RoPE-like GQA tensors: query [hkv*g, t, d], key/value [hkv, t, d] (float64,
    so the kernels compute in float64 and only the float32 log-scores round)."""
    gen = torch.Generator().manual_seed(seed)
    q = 1.5 * torch.randn(hkv * g, t, d, generator=gen, dtype=F64)
    k = torch.randn(hkv, t, d, generator=gen, dtype=F64)
    # keys of varied norms, so K-norm has something to rank
    k = k * (0.5 + torch.rand(hkv, t, 1, generator=gen, dtype=F64))
    v = torch.randn(hkv, t, d, generator=gen, dtype=F64)
    return q, k, v


def observe(policy, q, k, v, *, layer_idx: int = 0, rank: int = 0) -> LayerObservation:
    """The observation the integration builds at prefill (``observe_layer``)."""
    _, observation = observe_layer(
        q,
        k,
        v,
        scale=SCALE,
        score=policy.score,
        score_params=policy.score_params,
        layer_idx=layer_idx,
        rank=rank,
    )
    return observation


def observe_layers(policy, num_layers, t, hkv, g, seed):
    tensors = [random_layer(t, hkv, g, seed * 101 + i) for i in range(num_layers)]
    obs = [observe(policy, *x, layer_idx=i, rank=i) for i, x in enumerate(tensors)]
    return tensors, obs


def kept_sets(selection) -> list[set[int]]:
    return [set(selection.head(h)[0].tolist()) for h in range(selection.num_heads)]


# ------------------------------------------------------------------ slow references (S5)


def dense_probabilities(q, k):
    """[Hq, t, t]: row j of query head h is softmax over keys 0..j of its KV head (S1)."""
    hq, t, _ = q.shape
    g = hq // k.shape[0]
    p = torch.zeros(hq, t, t, dtype=F64)
    for h in range(hq):
        logits = SCALE * q[h].double() @ k[h // g].double().T
        for j in range(t):
            p[h, j, : j + 1] = torch.softmax(logits[j, : j + 1], dim=0)
    return p


def uniform_budget(t, r):
    """S1: keep floor((1 - r) t + 1/2) entries, at least 1."""
    return min(t, max(1, math.floor((1 - r) * t + 0.5)))


def as_f32(x: float) -> float:
    return float(torch.tensor(x, dtype=F64).to(torch.float32))


def rank_desc(keys: list[float]) -> list[int]:
    """Positions by decreasing key; equal keys: later position first."""
    return sorted(range(len(keys)), key=lambda i: (-keys[i], -i))


def keep_top(keys: list[float], budget: int, forced: set[int]) -> set[int]:
    """Forced entries, then the highest keys among the others, ``budget`` in all."""
    free = [i for i in rank_desc(keys) if i not in forced]
    return set(forced) | set(free[: budget - len(forced)])


def forced_fit(forced: list[int], budget: int) -> set[int]:
    """Forced entries count against the budget; above it, the most recent ones stay forced."""
    return set(sorted(forced)[-budget:]) if budget else set()


def pool(x: list[float], kernel: int, how: str) -> list[float]:
    """Centred 1-D pooling, stride 1: max over in-range neighbours, or their sum / kernel."""
    n, r = len(x), kernel // 2
    out = []
    for i in range(n):
        near = x[max(0, i - r) : min(n, i + r + 1)]
        out.append(max(near) if how == "max" else sum(near) / kernel)
    return out


def reference_scores(name: str, params: dict, q, k, v) -> tuple[list[list[float]], list[int]]:
    """Float64 log-scores per KV head (before float32 rounding) and the forced positions."""
    hkv, t = k.shape[:2]
    g = q.shape[0] // hkv
    p = dense_probabilities(q, k)
    norm = lambda x: [xi / sum(x) for xi in x]  # noqa: E731

    def mixture(per_query_head):  # S2: normalise each query head, average the group, floor
        out = []
        for kv in range(hkv):
            rows = [norm(per_query_head[kv * g + j]) for j in range(g)]
            mixed = [sum(r[i] for r in rows) / g for i in range(len(rows[0]))]
            floored = [max(x, FLOOR / len(mixed)) for x in mixed]
            out.append([math.log(x / sum(floored)) for x in floored])
        return out

    if name == "h2o":  # H2O: accumulated attention of every causal row
        sums = [[float(p[h, :, i].sum()) for i in range(t)] for h in range(hkv * g)]
        return mixture(sums), []
    harmonic_h = sum(1 / m for m in range(1, t + 1))
    prior = [1 / ((t - j) * harmonic_h) for j in range(t)]  # h_j for 0-based row j (S2)
    if name in ("h2o-h", "min-h"):
        sums = [
            [sum(prior[j] * float(p[h, j, i]) for j in range(t)) for i in range(t)]
            for h in range(hkv * g)
        ]
        if name == "min-h":
            sums = [
                [s * float(v[h // g, i].norm()) for i, s in enumerate(row)]
                for h, row in enumerate(sums)
            ]
        return mixture(sums), []
    if name == "min":
        last = [
            [float(p[h, -1, i] * v[h // g, i].norm()) for i in range(t)] for h in range(hkv * g)
        ]
        return mixture(last), []
    if name == "tova":  # TOVA: last query's attention averaged over all heads of the layer
        mean = [float(p[:, -1, i].mean()) for i in range(t)]
        floored = [max(x, FLOOR / t) for x in mean]
        return [[math.log(x / sum(floored)) for x in floored]] * hkv, []
    if name == "knorm":  # K-norm: lowest key norms kept
        return [[-float(k[kv, i].norm()) for i in range(t)] for kv in range(hkv)], []
    if name == "streaming_llm":  # sinks first, then recency
        s = min(params["sinks"], t)
        return [[math.log(2.0)] * s + [math.log((i + 1) / (t - s)) for i in range(t - s)]] * hkv, []
    if name == "snapkv":
        w = min(params["window"], t)
        prefix = t - w
        logs = [[math.log(2.0)] * t for _ in range(hkv)]
        if prefix:
            observed = [
                [float(p[h, prefix:, i].mean()) for i in range(prefix)] for h in range(hkv * g)
            ]
            pooled = [pool(row, params["kernel"], params["pooling"]) for row in observed]
            if params["gqa"] == "mixture":
                mixed = mixture(pooled)
            else:  # raw mean of the group (kvpress, Ada-KV)
                mixed = [
                    [
                        math.log(
                            max(sum(pooled[kv * g + j][i] for j in range(g)) / g, FLOOR / prefix)
                        )
                        for i in range(prefix)
                    ]
                    for kv in range(hkv)
                ]
            for kv in range(hkv):
                logs[kv][:prefix] = mixed[kv]
        return logs, list(range(prefix, t))
    raise AssertionError(name)


def reference_pyramid(num_layers, mean, window, t, beta):
    """PyramidKV (S5) on the budget beyond the window: linear from hi (bottom) to lo (top),
    mean exactly ``mean``; integers by largest remainder (ties: lower layer); clamped to
    [1, t] (only needed in corner cases this file does not reach, checked below)."""
    base = mean - window
    if num_layers == 1:
        return [mean]
    lo = Fraction(base) / Fraction(beta)
    hi = 2 * base - lo
    if hi > t - window:
        hi = Fraction(t - window)
        lo = 2 * base - hi
    real = [hi - layer * (hi - lo) / (num_layers - 1) for layer in range(num_layers)]
    ints = [math.floor(x) for x in real]
    left = num_layers * base - sum(ints)
    for layer in sorted(range(num_layers), key=lambda i: (-(real[i] - ints[i]), i))[:left]:
        ints[layer] += 1
    out = [window + x for x in ints]
    assert all(1 <= b <= t for b in out)
    return out


def reference_ada(keys, forced, layer_budget, alpha):
    """Ada-KV (Algorithm 1 with the safeguard, S6): the top-R non-forced scores of all heads
    (R = layer budget minus forced entries; ties: lower head, then later position) give
    B_h*; B_h = (1 - alpha) B_h* + alpha R / H, rounded by largest remainder (ties: lower
    head); then each head keeps its forced entries and its own top B_h."""
    num_heads = len(keys)
    remaining = layer_budget - sum(len(f) for f in forced)
    pool_ = [
        (-keys[h][i], h, -i)
        for h in range(num_heads)
        for i in range(len(keys[h]))
        if i not in forced[h]
    ]
    b_star = [0] * num_heads
    for _, h, _ in sorted(pool_)[:remaining]:
        b_star[h] += 1
    share = Fraction(remaining, num_heads)
    a = Fraction(alpha)
    mixed = [(1 - a) * b + a * share for b in b_star]
    ints = [math.floor(x) for x in mixed]
    for h in sorted(range(num_heads), key=lambda i: (-(mixed[i] - ints[i]), i))[
        : remaining - sum(ints)
    ]:
        ints[h] += 1
    return [len(forced[h]) + ints[h] for h in range(num_heads)]


def reference_pool(row: list[float], kernel: int, forced: list[int]) -> list[float]:
    """S10 pool: each non-forced entry takes the largest score of the non-forced entries within
    kernel // 2 of it; forced entries keep theirs."""
    half, skip = kernel // 2, set(forced)
    return [
        x
        if i in skip
        else max(
            row[j] for j in range(i - half, i + half + 1) if 0 <= j < len(row) and j not in skip
        )
        for i, x in enumerate(row)
    ]


def reference_select(policy: TopKPolicy, layers, num_layers: int) -> list[list[set[int]]]:
    """What each KV head of each layer keeps, by the paper definitions above."""
    out = []
    for rank, (q, k, v) in enumerate(layers):
        hkv, t = k.shape[:2]
        logs, window = reference_scores(policy.score, policy.score_params, q, k, v)
        keys = [[as_f32(x) for x in row] for row in logs]
        budget = uniform_budget(t, policy.ratio)
        if policy.layer_budgets == "pyramid":
            budget = reference_pyramid(
                num_layers, budget, min(len(window), budget), t, policy.beta
            )[rank]
        recent = min(budget, math.floor(policy.recent * budget + 0.5))
        forced_all = sorted(set(window) | set(range(t - recent, t)))
        forced = forced_fit(forced_all, budget)
        keys = [reference_pool(row, policy.pool, forced) for row in keys]
        if policy.head_budgets == "ada":
            heads = reference_ada(keys, [forced] * hkv, budget * hkv, policy.alpha)
        else:
            heads = [budget] * hkv
        out.append([keep_top(keys[kv], heads[kv], forced) for kv in range(hkv)])
    return out


# ---------------------------------------------------------------------------- the tests

METHODS = [
    "streaming_llm",
    "streaming_llm/sinks=2",
    "h2o",
    "h2o/recent=0.5",
    "snapkv",
    "snapkv/window=8",
    "snapkv/window=8/pooling=avg/kernel=5",
    "snapkv/window=8/gqa=mixture",
    "snapkv/window=6/kernel=1/recent=0.25",
    "tova",
    "knorm",
    "pyramidkv/window=8",
    "pyramidkv/window=8/beta=2",
    "ada_snapkv/window=8",
    "ada_snapkv/window=8/alpha=0",
    "ada_snapkv/window=8/alpha=1",
    "ada_pyramidkv/window=8",
    "topk:h2o-h",
    "topk:min",
    "topk:min-h",
    "h2o/pool=5",
    "knorm/pool=3/recent=0.25",
    "snapkv/window=8/pool=3",
    "ada_snapkv/window=8/pool=5",
]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("t", "ratio", "hkv", "g"), [(45, 0.5, 2, 3), (70, 0.8, 3, 2)])
def test_topk_keeps_exactly_what_the_reference_keeps(method, t, ratio, hkv, g):
    """S5/S6: each method's kept entries, windows and sinks included, per head and layer."""
    policy = parse_method(method, ratio=ratio)
    num_layers = 3
    layers, obs = observe_layers(policy, num_layers, t, hkv, g, seed=t + len(method))
    got = [kept_sets(s) for s in policy.select(obs, num_layers=num_layers)]
    assert got == reference_select(policy, layers, num_layers)


@pytest.mark.parametrize(
    "method", ["snapkv", "pyramidkv", "ada_snapkv", "ada_pyramidkv", "h2o/recent=0.75"]
)
@pytest.mark.parametrize(("t", "ratio"), [(20, 0.5), (40, 0.5), (40, 0.9), (33, 0.2)])
def test_short_prompts_where_the_window_exceeds_the_budget(method, t, ratio):
    """The 32-entry window counts against the budget; when it does not fit, the most recent
    ``budget`` entries are kept (fit_forced), and the kept counts still equal the budgets."""
    policy = parse_method(method, ratio=ratio)
    layers, obs = observe_layers(policy, 2, t, 2, 2, seed=t)
    selections = policy.select(obs, num_layers=2)
    assert [kept_sets(s) for s in selections] == reference_select(policy, layers, 2)
    for rank, s in enumerate(selections):
        budget = uniform_budget(t, ratio)
        if policy.layer_budgets == "pyramid":
            budget = pyramid_budgets(2, budget, window=min(32, t, budget), t=t)[rank]
        assert int(s.lengths.sum()) == 2 * budget
        if budget <= 32 and method != "h2o/recent=0.75":
            # the window does not fit: exactly the most recent entries survive
            assert kept_sets(s) == [set(range(t - budget, t))] * 2


def test_tova_keeps_one_set_for_all_kv_heads():
    """TOVA scores the layer's heads together: every KV head keeps the same entries."""
    policy = parse_method("tova", ratio=0.6)
    (obs,) = observe_layers(policy, 1, 50, 4, 2, seed=3)[1]
    (sel,) = policy.select([obs], num_layers=1)
    sets = kept_sets(sel)
    assert all(s == sets[0] for s in sets)


def test_streaming_llm_is_sinks_plus_recent():
    policy = parse_method("streaming_llm", ratio=0.75)
    (obs,) = observe_layers(policy, 1, 64, 2, 2, seed=4)[1]
    (sel,) = policy.select([obs], num_layers=1)
    assert kept_sets(sel) == [set(range(4)) | set(range(52, 64))] * 2


def test_h2o_recent_window_is_the_papers_equal_split():
    """h2o/recent=0.5: half the budget is the most recent entries, half heavy hitters."""
    policy = parse_method("h2o/recent=0.5", ratio=0.5)
    (obs,) = observe_layers(policy, 1, 60, 2, 2, seed=5)[1]
    (sel,) = policy.select([obs], num_layers=1)
    for kept in kept_sets(sel):
        assert len(kept) == 30 and set(range(45, 60)) <= kept


def self_attending_window(q, k, heads, window):
    """Make query ``heads`` look (almost) only at themselves: each window query is 3 times
    its own key. With d = 32 the logit on itself is ~3 * 0.35 * ||k||^2 ~ 34 against
    ~3 * 0.35 * ||k|| * N(0, 1) ~ 6 N(0, 1) on any other key: prefix mass ~1e-7."""
    t = k.shape[1]
    g = q.shape[0] // k.shape[0]
    for h in heads:
        q[h, t - window :] = 3.0 * k[h // g, t - window :]
    return q, k


def test_snapkv_gqa_mean_differs_from_mixture_only_with_groups():
    """g = 1: both GQA forms rank a head's entries the same. g = 2 with one query head of the
    group looking only at its window: the mixture gives that head's near-uniform prefix
    distribution half the weight, the raw mean almost none, so the kept sets differ."""
    mean = parse_method("snapkv/window=8", ratio=0.7)
    mixture = parse_method("snapkv/window=8/gqa=mixture", ratio=0.7)
    for g, expect_equal in ((1, True), (2, False)):
        q, k, v = random_layer(80, 1, g, seed=11, d=32)
        if g == 2:
            q, k = self_attending_window(q, k, [0], 8)
        a = kept_sets(mean.select([observe(mean, q, k, v)], num_layers=1)[0])
        b = kept_sets(mixture.select([observe(mixture, q, k, v)], num_layers=1)[0])
        assert (a == b) is expect_equal


def test_ada_moves_budget_toward_the_head_with_more_prefix_mass():
    """Ada-KV on raw window attention (S6): a KV head whose window looks only at itself has
    almost no prefix mass and gets little more than its safeguard share; the other head gets
    the rest. (Renormalising each head's prefix attention would hide this.)"""
    t, window = 64, 8
    q, k, v = random_layer(t, 2, 1, seed=0, d=32)
    q, k = self_attending_window(q, k, [0], window)
    policy = parse_method(f"ada_snapkv/window={window}", ratio=0.5)
    obs = observe(policy, q, k, v)
    (sel,) = policy.select([obs], num_layers=1)
    lengths = sel.lengths.tolist()
    share = 32 - window  # uniform non-window share per head
    assert sum(lengths) == 64
    assert lengths[0] - window <= math.ceil(0.2 * share) + 1 < lengths[1] - window


def test_ratio_zero_keeps_everything_for_every_method():
    for method in METHODS:
        policy = parse_method(method, ratio=0.0)
        (obs,) = observe_layers(policy, 1, 30, 2, 2, seed=6)[1]
        (sel,) = policy.select([obs], num_layers=1)
        assert kept_sets(sel) == [set(range(30))] * 2 and sel.log_weights is None


def test_topk_selections_carry_no_weights():
    """S4: top-k methods are the special case with no correction."""
    policy = parse_method("ada_pyramidkv", ratio=0.5)
    _, obs = observe_layers(policy, 2, 50, 2, 2, seed=7)
    assert all(s.log_weights is None for s in policy.select(obs, num_layers=2))


# ------------------------------------------------------------- budgets per layer and head

COUNT_METHODS = [
    "h2o",
    "knorm",
    "streaming_llm",
    "snapkv",
    "snapkv/window=4",
    "pyramidkv",
    "pyramidkv/window=4/beta=5",
    "ada_snapkv",
    "ada_snapkv/window=4/alpha=0.5",
    "ada_pyramidkv/window=4",
    "h2o/recent=0.3/head_budgets=ada",
    "knorm/head_budgets=ada",
    "tova/layer_budgets=pyramid",
]


@settings(max_examples=40, deadline=None)
@given(
    method=st.sampled_from(COUNT_METHODS),
    t=st.integers(1, 70),
    ratio=st.floats(0.01, 0.95),
    hkv=st.integers(1, 3),
    g=st.integers(1, 3),
    num_layers=st.integers(1, 4),
    seed=st.integers(0, 10_000),
)
def test_kept_counts_match_the_budgets_exactly(method, t, ratio, hkv, g, num_layers, seed):
    """Uniform: every head keeps uniform_budget(t, r). Pyramid: every head of layer l keeps
    the l-th PyramidKV budget (window outside the pyramid, S5). Ada: the heads of a layer
    share exactly H times the layer budget, each keeping at least its forced entries and
    its safeguard floor (S6). Forced entries (windows) are always inside the kept set when
    they fit."""
    policy = parse_method(method, ratio=ratio)
    _, obs = observe_layers(policy, num_layers, t, hkv, g, seed)
    selections = policy.select(obs, num_layers=num_layers)
    mean = uniform_budget(t, ratio)
    window = 0 if obs[0].forced is None else min(int(obs[0].forced.sum(-1).max()), mean)
    for rank, (o, s) in enumerate(zip(obs, selections)):
        budget = mean
        if policy.layer_budgets == "pyramid":
            budget = pyramid_budgets(num_layers, mean, beta=policy.beta, window=window, t=t)[rank]
        lengths = s.lengths.tolist()
        recent = min(budget, math.floor(policy.recent * budget + 0.5))
        forced = o.forced if o.forced is not None else torch.zeros(hkv, t, dtype=torch.bool)
        forced = forced.clone()
        forced[:, t - recent :] |= recent > 0
        forced = fit_forced(forced, torch.full((hkv,), budget))
        if policy.head_budgets == "ada":
            assert sum(lengths) == hkv * budget
            free_share = (hkv * budget - int(forced.sum())) / hkv
            for h, n in enumerate(lengths):
                assert int(forced[h].sum()) + math.floor(policy.alpha * free_share) <= n <= t
        else:
            assert lengths == [budget] * hkv
        for h, kept in enumerate(kept_sets(s)):
            assert set(forced[h].nonzero().flatten().tolist()) <= kept
            assert all(0 <= i < t for i in kept)


def test_pyramid_budgets_decrease_and_keep_the_mean():
    """PyramidKV: the bottom layer keeps the most, the top the least, and the layers keep
    exactly num_layers times the uniform budget in all (S5)."""
    policy = parse_method("pyramidkv/window=8", ratio=0.6)
    num_layers = 4
    _, obs = observe_layers(policy, num_layers, 90, 2, 2, seed=9)
    per_layer = [int(s.lengths[0]) for s in policy.select(obs, num_layers=num_layers)]
    assert per_layer == sorted(per_layer, reverse=True) and per_layer[0] > per_layer[-1]
    assert sum(per_layer) == num_layers * uniform_budget(90, 0.6)


def test_bad_fields_fail_at_construction_naming_the_value():
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\].*got 1.5"):
        TopKPolicy(score="snapkv", head_budgets="ada", alpha=1.5)
    with pytest.raises(ValueError, match=r"beta \(PyramidKV\) must be >= 1.*got 0.5"):
        TopKPolicy(score="snapkv", layer_budgets="pyramid", beta=0.5)
    with pytest.raises(ValueError, match=r"beta .* finite"):
        TopKPolicy(score="snapkv", layer_budgets="pyramid", beta=float("nan"))
    with pytest.raises(ValueError, match="layer_budgets must be one of 'uniform', 'pyramid'"):
        TopKPolicy(layer_budgets="steep")
    with pytest.raises(ValueError, match=r"recent must be in \[0, 1\]"):
        TopKPolicy(recent=-0.1)
    with pytest.raises(ValueError, match="score must be one of"):
        TopKPolicy(score="attention")


def test_snapkv_gqa_mean_with_query_head_weights():
    """scores.snapkv(gqa="mean", alpha=...): the alpha-weighted raw mean of the group's pooled
    window attention (weights normalised within each group), floored at FLOOR / prefix."""
    t, w, kernel = 30, 6, 3
    q, k, _ = random_layer(t, 2, 3, seed=12)
    alpha = [0.2, 0.0, 0.8, 1.0, 2.0, 3.0]
    got = snapkv(q, k, scale=SCALE, window=w, kernel=kernel, gqa="mean", alpha=torch.tensor(alpha))
    p = dense_probabilities(q, k)
    prefix = t - w
    for kv in range(2):
        weights = alpha[3 * kv : 3 * kv + 3]
        expected = [0.0] * prefix
        for j, a in enumerate(weights):
            row = pool(
                [float(p[3 * kv + j, prefix:, i].mean()) for i in range(prefix)], kernel, "max"
            )
            expected = [e + a / sum(weights) * x for e, x in zip(expected, row)]
        ref = torch.tensor([math.log(max(x, FLOOR / prefix)) for x in expected], dtype=F64)
        torch.testing.assert_close(got.log_scores[kv, :prefix].double(), ref, rtol=0, atol=1e-5)
    assert got.forced[:, prefix:].all() and not got.forced[:, :prefix].any()


def test_snapkv_gqa_mean_stays_finite_when_attention_underflows():
    """Window queries 1e3 times their own keys: prefix attention underflows to 0 in float32,
    the floor keeps the log-scores finite (S2) and the window is still forced."""
    q, k, _ = random_layer(40, 1, 2, seed=13)
    q, k = q.float(), k.float()
    q[:, -8:] = 1e3 * k[0, -8:]
    got = snapkv(q, k, scale=SCALE, window=8, gqa="mean")
    assert torch.isfinite(got.log_scores).all()
    assert (got.log_scores[:, :32] >= math.log(FLOOR / 32) - 1e-4).all()


# ------------------------------------------------ global budget (KVzip's global top-k, S10.1)


def random_observations(num_layers, hkv, t, seed, forced_prefix=0):
    """Observations with random log-scores (some exact ties) and a forced prefix."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num_layers):
        scores = torch.randint(0, 6, (hkv, t), generator=gen).float() - 3.0
        scores += (
            0.1 * torch.randn(hkv, t, generator=gen) * (torch.rand(hkv, t, generator=gen) < 0.5)
        )
        forced = None
        if forced_prefix:
            forced = torch.zeros(hkv, t, dtype=torch.bool)
            forced[:, :forced_prefix] = True
        out.append(LayerObservation(i, i, scores, forced, torch.full((hkv, t), 1.0 / t)))
    return out


def global_topk_reference(observations, budget_per_head):
    """One competition over every (layer, head, position): forced entries first, then the
    highest log-scores; ties to the lower layer, the lower head, the later position."""
    entries, kept = [], {}
    total = 0
    for obs in observations:
        for h in range(obs.num_heads):
            total += budget_per_head
            for i in range(obs.length):
                forced = obs.forced is not None and bool(obs.forced[h, i])
                entries.append((obs.layer_idx, h, i, forced, float(obs.log_scores[h, i])))
    entries.sort(key=lambda e: (not e[3], -e[4], e[0], e[1], -e[2]))
    for layer, h, i, _, _ in entries[:total]:
        kept.setdefault((layer, h), set()).add(i)
    return kept


@settings(max_examples=40, deadline=None)
@given(
    num_layers=st.integers(1, 4),
    hkv=st.integers(1, 3),
    t=st.integers(1, 20),
    ratio=st.sampled_from([0.1, 0.5, 0.75, 0.9]),
    forced_prefix=st.integers(0, 3),
    seed=st.integers(0, 10_000),
)
def test_kvzip_global_topk_is_one_competition_over_all_heads_and_layers(
    num_layers, hkv, t, ratio, forced_prefix, seed
):
    """layer_budgets=global, head_budgets=ada, alpha=0 (the ``kvzip`` method, as KVzip's
    reference evicts): the kept entries are the global top-(L H k) of the log-scores, forced
    entries first, exactly; the total is exact, heads and layers keep different numbers."""
    forced_prefix = min(forced_prefix, uniform_budget(t, ratio))
    policy = TopKPolicy(
        score="kvzip", ratio=ratio, layer_budgets="global", head_budgets="ada", alpha=0.0
    )
    assert policy == parse_method("kvzip", ratio=ratio) and not policy.layerwise
    observations = random_observations(num_layers, hkv, t, seed, forced_prefix)
    selections = policy.select(observations, num_layers=num_layers)
    expected = global_topk_reference(observations, uniform_budget(t, ratio))
    for obs, sel in zip(observations, selections):
        for h, got in enumerate(kept_sets(sel)):
            assert got == expected.get((obs.layer_idx, h), set())
    assert sum(int(s.lengths.sum()) for s in selections) == num_layers * hkv * uniform_budget(
        t, ratio
    )


def test_global_budgets_with_the_safeguard_and_with_uniform_heads():
    """With alpha > 0 every head of every layer keeps at least floor(alpha k); with uniform
    head budgets the pooled budget is split evenly (every head keeps k, as uniform layers)."""
    observations = random_observations(3, 2, 40, seed=5)
    k = uniform_budget(40, 0.75)
    ada = TopKPolicy(score="kvzip", ratio=0.75, layer_budgets="global", head_budgets="ada")
    selections = ada.select(observations, num_layers=3)
    lengths = torch.cat([s.lengths for s in selections])
    assert int(lengths.sum()) == 6 * k and int(lengths.min()) >= math.floor(0.2 * k)
    assert len(set(lengths.tolist())) > 1
    even = TopKPolicy(score="kvzip", ratio=0.75, layer_budgets="global")
    uniform = TopKPolicy(score="kvzip", ratio=0.75)
    for a, b in zip(
        even.select(observations, num_layers=3), uniform.select(observations, num_layers=3)
    ):
        assert kept_sets(a) == kept_sets(b)
    assert not even.layerwise and not uniform.layerwise  # kvzip needs the reconstruction pass
    assert TopKPolicy(score="snapkv", layer_budgets="global").layerwise is False
    assert TopKPolicy(score="snapkv").layerwise is True


def test_global_budget_needs_one_prefix_length():
    a, b = random_observations(1, 2, 10, seed=1)[0], random_observations(1, 2, 12, seed=2)[0]
    policy = parse_method("kvzip", ratio=0.5)
    with pytest.raises(ValueError, match="same prefix, got lengths"):
        policy.select([a, b], num_layers=2)


def distinct_observations(num_layers, hkv, t, seed, forced_prefix=0):
    """Observations with distinct log-scores (no ties), a forced prefix."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num_layers):
        scores = -8.0 * torch.rand(hkv, t, generator=gen)
        forced = torch.zeros(hkv, t, dtype=torch.bool)
        forced[:, :forced_prefix] = True
        out.append(LayerObservation(i, i, scores, forced, torch.full((hkv, t), 1.0 / t)))
    return out


@settings(max_examples=40, deadline=None)
@given(
    num_layers=st.integers(1, 3),
    hkv=st.integers(1, 3),
    t=st.integers(2, 20),
    kept_per_head=st.integers(1, 20),
    forced_prefix=st.integers(0, 2),
    seed=st.integers(0, 10_000),
)
def test_a_threshold_keeps_exactly_the_entries_above_it_with_kvzaps_global_topk(
    num_layers, hkv, t, kept_per_head, forced_prefix, seed
):
    """S11 threshold mode, ``kvzap/threshold=x`` (one top-k over every head and layer): a
    threshold between the (L H k)-th and the next score of the non-forced entries keeps exactly
    the forced entries and those above it (k a whole number per head, so no rounding); the
    ratio is that prompt's, ``1 - kept / entries``."""
    kept_per_head = min(kept_per_head, t)
    forced_prefix = min(forced_prefix, kept_per_head)
    observations = distinct_observations(num_layers, hkv, t, seed, forced_prefix)
    free = torch.cat([o.log_scores[~o.forced] for o in observations]).sort(descending=True).values
    above = num_layers * hkv * (kept_per_head - forced_prefix)
    if above == 0:
        threshold = 1.0  # above every log-score
    elif above >= free.numel():
        threshold = float(free[-1]) - 1.0
    else:
        threshold = float((free[above - 1] + free[above]) / 2)
    policy = parse_method(f"kvzap/threshold={threshold!r}", ratio=0.0)
    assert not policy.layerwise and policy.threshold == threshold
    assert parse_method(method_name(policy), ratio=0.0) == policy
    expected_ratio = 1.0 - kept_per_head / t
    assert threshold_ratio(observations, threshold) == pytest.approx(min(expected_ratio, 1 - 1 / t))
    for obs, sel in zip(observations, policy.select(observations, num_layers=num_layers)):
        for h, got in enumerate(kept_sets(sel)):
            want = {i for i in range(t) if obs.forced[h, i] or obs.log_scores[h, i] > threshold}
            assert got == want


def test_a_threshold_adapts_the_ratio_per_prompt_and_ratio_is_the_least_compression():
    """Two prompts, one threshold, two effective ratios; a given ``ratio`` above the
    threshold's compresses more (the cap); uniform budgets take the threshold's ratio."""
    easy = distinct_observations(2, 2, 40, seed=1)
    hard = [
        dataclasses.replace(o, log_scores=o.log_scores - 2.0)
        for o in distinct_observations(2, 2, 40, seed=1)
    ]
    policy = TopKPolicy(
        score="kvzap",
        ratio=0.0,
        layer_budgets="global",
        head_budgets="ada",
        alpha=0.0,
        threshold=-3.0,
    )
    counts = []
    for obs in (easy, hard):
        kept = sum(int(s.lengths.sum()) for s in policy.select(obs, num_layers=2))
        counts.append(kept)
        assert kept == sum(int((o.log_scores > -3.0).sum()) for o in obs)
    assert counts[0] > counts[1]  # the ratio adapts to the prompt's scores
    capped = dataclasses.replace(policy, ratio=0.9)
    assert sum(int(s.lengths.sum()) for s in capped.select(easy, num_layers=2)) == 4 * 4
    r = threshold_ratio(easy, -3.0)
    uniform = TopKPolicy(score="kvzap", ratio=0.0, threshold=-3.0)
    at_r = TopKPolicy(score="kvzap", ratio=r)
    for a, b in zip(uniform.select(easy, num_layers=2), at_r.select(easy, num_layers=2)):
        assert kept_sets(a) == kept_sets(b)
