"""Tests of probkv.scores: classic scores as log-scores (S2, S5, S6).

Each score is compared with a dense reference built from the full ``t x t`` causal softmax,
written plainly (loops) in this file. Inputs are float64, which the kernels compute in
float64, so the only rounding left is the float32 of the returned log-scores: for
log-probabilities ``|log p| <= 40`` that is ``<= 40 * 2^-24 < 3e-6`` (tolerance 1e-5).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probkv._checks import check_positive_int
from probkv.models.testing import tiny_scorer
from probkv.scores import (
    FORCED_LOG_SCORE,
    SCORE_NAMES,
    SCORE_TABLE,
    Param,
    Scores,
    ScoreSpec,
    column_sums_needed,
    compute_scores,
    default_params,
    h2o,
    knorm,
    last_query_rows,
    needs_reconstruction,
    on_attention_scale,
    score_param_names,
    snapkv,
    streaming_llm,
    tensor_param_names,
    validate_params,
)
from probkv.scores.column_sums import (
    causal_attention_with_column_sums,
    harmonic_row_weights,
    uniform_row_weights,
)
from probkv.scores.proposals import FLOOR

torch.set_num_threads(1)

F64 = torch.float64
LOG_ATOL = 1e-5


def make_layer(t, hkv, g, d=8, dv=6, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q = 1.5 * torch.randn(hkv * g, t, d, generator=gen, dtype=F64)
    k = torch.randn(hkv, t, d, generator=gen, dtype=F64)
    v = torch.randn(hkv, t, dv, generator=gen, dtype=F64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# ------------------------------------------------------------- plain dense references


def dense_probabilities(q, k, scale):
    """[Hq, t, t]: row j is softmax over keys 0..j (S1)."""
    hq, t, _ = q.shape
    g = hq // k.shape[0]
    p = torch.zeros(hq, t, t, dtype=F64)
    for h in range(hq):
        logits = scale * q[h].double() @ k[h // g].double().T
        for j in range(t):
            p[h, j, : j + 1] = torch.softmax(logits[j, : j + 1], dim=0)
    return p


def normalise(x):
    return x / x.sum(-1, keepdim=True)


def floored(p):
    """S2 floor: at least FLOOR / n, then renormalised."""
    return normalise(torch.clamp(normalise(p), min=FLOOR / p.shape[-1]))


def group_average(per_head, hkv, alpha=None):
    """S2 GQA: mixture of the normalised per-query-head distributions of each group."""
    g = per_head.shape[0] // hkv
    out = torch.zeros(hkv, per_head.shape[1], dtype=F64)
    for kv in range(hkv):
        for j in range(g):
            a = 1.0 / g if alpha is None else alpha[kv * g + j] / sum(alpha[kv * g : kv * g + g])
            out[kv] += a * normalise(per_head[kv * g + j])
    return out


def reference_log(per_head, hkv, alpha=None):
    return torch.log(floored(group_average(per_head, hkv, alpha)))


def harmonic(t):
    h_t = sum(1.0 / i for i in range(1, t + 1))
    return torch.tensor([1.0 / ((t - j + 1) * h_t) for j in range(1, t + 1)], dtype=F64)


def value_norms(v, g):
    return torch.stack([v[h // g].norm(dim=-1) for h in range(v.shape[0] * g)]).double()


def pool_reference(x, kernel, how):
    """Centred 1-D pooling with kernel // 2 padding: max over the in-range neighbours, or
    the sum over them divided by the kernel (zero padding counted, like avg_pool1d)."""
    n = x.shape[-1]
    r = kernel // 2
    out = torch.empty_like(x)
    for i in range(n):
        lo, hi = max(0, i - r), min(n, i + r + 1)
        out[..., i] = x[..., lo:hi].amax(-1) if how == "max" else x[..., lo:hi].sum(-1) / kernel
    return out


def reference_scores(name, q, k, v, scale, **params):
    """Dense, loop-based log-scores [Hkv, t] (and the forced mask) for each S2/S5 score."""
    hkv, t = k.shape[:2]
    g = q.shape[0] // hkv
    p = dense_probabilities(q, k, scale)
    alpha = params.get("alpha")
    if name == "h2o":
        return reference_log(p.sum(1), hkv, alpha), None
    if name == "h2o-h":
        return reference_log(torch.einsum("j,hji->hi", harmonic(t), p), hkv, alpha), None
    if name == "min":
        return reference_log(p[:, -1] * value_norms(v, g), hkv, alpha), None
    if name == "min-h":
        sums = torch.einsum("j,hji->hi", harmonic(t), p)
        return reference_log(sums * value_norms(v, g), hkv, alpha), None
    if name == "tova":
        mean = normalise(p[:, -1]).mean(0)
        return torch.log(floored(mean)).expand(hkv, t), None
    if name == "knorm":
        return -k.double().norm(dim=-1), None
    if name == "snapkv":
        window, kernel = params.get("window", 32), params.get("kernel", 7)
        w = min(window, t)
        prefix = t - w
        forced = torch.zeros(hkv, t, dtype=torch.bool)
        forced[:, prefix:] = True
        log_scores = torch.full((hkv, t), FORCED_LOG_SCORE, dtype=F64)
        if prefix:
            observed = p[:, prefix:, :prefix].mean(1)
            pooled = pool_reference(observed, kernel, params.get("pooling", "max"))
            log_scores[:, :prefix] = reference_log(pooled, hkv, alpha)
        return log_scores, forced
    raise AssertionError(name)


ATTENTION_SCORES = ["h2o", "h2o-h", "min", "min-h", "tova", "knorm", "snapkv"]
SHAPES = [(1, 1, 1), (2, 1, 2), (9, 2, 3), (40, 3, 2), (150, 1, 3)]


@pytest.mark.parametrize("name", ATTENTION_SCORES)
@pytest.mark.parametrize("t,hkv,g", SHAPES)
def test_scores_equal_dense_reference(name, t, hkv, g):
    q, k, v = make_layer(t, hkv, g, seed=t * 7 + hkv * 3 + g)
    params = {"window": 4, "kernel": 3} if name == "snapkv" else {}
    scores = compute_scores(name, q, k, v, scale=8**-0.5, **params)
    ref, ref_forced = reference_scores(name, q, k, v, 8**-0.5, **params)
    assert scores.log_scores.dtype == torch.float32 and scores.log_scores.shape == (hkv, t)
    assert torch.isfinite(scores.log_scores).all()
    torch.testing.assert_close(scores.log_scores.double(), ref, rtol=0, atol=LOG_ATOL)
    if ref_forced is None:
        assert scores.forced is None
    else:
        assert torch.equal(scores.forced, ref_forced)


@pytest.mark.parametrize("name", ["h2o", "h2o-h", "min-h"])
@pytest.mark.parametrize("chunk", [1, 7, "t", "t+3"])
def test_column_sum_scores_any_chunk(name, chunk):
    """S2: h2o, h2o-h and min-h are computed in row chunks; any chunk size gives the same."""
    t, hkv, g = 37, 3, 2
    q, k, v = make_layer(t, hkv, g, seed=4)
    chunk_size = {"t": t, "t+3": t + 3}.get(chunk, chunk)
    scores = compute_scores(name, q, k, v, scale=0.3, chunk_size=chunk_size)
    ref, _ = reference_scores(name, q, k, v, 0.3)
    torch.testing.assert_close(scores.log_scores.double(), ref, rtol=0, atol=LOG_ATOL)


@pytest.mark.parametrize("name", ["h2o", "h2o-h", "min-h"])
def test_given_column_sums_are_used(name):
    """The integration layer passes the column sums of its own attention pass."""
    t, hkv, g = 30, 2, 2
    q, k, v = make_layer(t, hkv, g, seed=8, dtype=torch.float32)
    weighting = column_sums_needed(name)
    w = torch.ones(1, t) if weighting == "uniform" else harmonic_row_weights(t)[None]
    _, sums = causal_attention_with_column_sums(q, k, v, scale=0.3, row_weights=w)
    given = compute_scores(name, q, k, v, scale=0.3, column_sums=sums[0])
    computed = compute_scores(name, q, k, v, scale=0.3)
    torch.testing.assert_close(given.log_scores, computed.log_scores, rtol=0, atol=0)
    # and they really are used: different sums, different scores
    other = compute_scores(name, q, k, v, scale=0.3, column_sums=sums[0].flip(-1))
    assert not torch.allclose(other.log_scores, computed.log_scores)


def test_column_sums_needed():
    assert column_sums_needed("h2o") == "uniform"
    assert column_sums_needed("h2o-h") == "harmonic"
    assert column_sums_needed("min-h") == "harmonic"
    for name in ("min", "snapkv", "tova", "knorm", "streaming_llm", "uniform"):
        assert column_sums_needed(name) is None
    assert tuple(SCORE_TABLE) == SCORE_NAMES  # the names are the table's rows, in order
    assert {
        "h2o",
        "h2o-h",
        "min",
        "min-h",
        "snapkv",
        "tova",
        "knorm",
        "streaming_llm",
        "uniform",
    } <= set(SCORE_NAMES)


@pytest.mark.parametrize("name", ["h2o", "min", "snapkv"])
def test_gqa_alpha_weights(name):
    """S2: per-query-head weights alpha, normalised within each group."""
    t, hkv, g = 25, 2, 3
    q, k, v = make_layer(t, hkv, g, seed=12)
    alpha = [0.2, 0.0, 0.8, 1.0, 2.0, 3.0]
    params = {"window": 5, "kernel": 5} if name == "snapkv" else {}
    scores = compute_scores(name, q, k, v, scale=0.4, alpha=torch.tensor(alpha), **params)
    ref, _ = reference_scores(name, q, k, v, 0.4, alpha=alpha, **params)
    torch.testing.assert_close(scores.log_scores.double(), ref, rtol=0, atol=LOG_ATOL)
    # [Hkv, g] layout is the same weighting
    again = compute_scores(name, q, k, v, scale=0.4, alpha=torch.tensor(alpha).view(2, 3), **params)
    torch.testing.assert_close(again.log_scores, scores.log_scores, rtol=0, atol=0)


def test_float32_inputs_close_to_reference():
    """float32 kernels: probabilities with relative error ~1e-5 (see test_attention), so
    log-scores within ~1e-5 + the float32 log rounding; 1e-4 leaves a margin of 5."""
    q, k, v = make_layer(120, 3, 3, seed=13, dtype=torch.float32)
    for name in ("h2o", "h2o-h", "min", "min-h", "tova", "snapkv"):
        scores = compute_scores(name, q, k, v, scale=8**-0.5)
        ref, _ = reference_scores(name, q, k, v, 8**-0.5)
        torch.testing.assert_close(scores.log_scores.double(), ref, rtol=0, atol=1e-4)


def test_scores_stay_finite_when_attention_underflows():
    """Huge logits make most probabilities exactly 0 in float32: the floor keeps every
    log-score finite (>= log(FLOOR / t) up to renormalisation)."""
    q, k, v = make_layer(50, 2, 2, seed=1, dtype=torch.float32)
    for name in ("h2o", "h2o-h", "min", "min-h", "tova", "snapkv"):
        ls = compute_scores(name, q * 300, k, v, scale=1.0).log_scores
        assert torch.isfinite(ls).all()
        assert ls.min() >= math.log(FLOOR / 50) - 1e-3
    # all-zero values: min has no mass anywhere -> the per-head score counts as uniform
    ls = compute_scores("min", q, k, torch.zeros_like(v), scale=1.0).log_scores
    torch.testing.assert_close(ls, torch.full_like(ls, -math.log(50)))


# -------------------------------------------------------------------------- snapkv


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("kernel", [1, 3, 7, 21])
@pytest.mark.parametrize("window", [1, 6, 30])
def test_snapkv_pooling_and_window(pooling, kernel, window):
    t, hkv, g = 31, 2, 2
    q, k, v = make_layer(t, hkv, g, seed=kernel + window)
    params = {"window": window, "kernel": kernel, "pooling": pooling}
    scores = snapkv(q, k, scale=0.5, **params)
    ref, ref_forced = reference_scores("snapkv", q, k, v, 0.5, **params)
    torch.testing.assert_close(scores.log_scores.double(), ref, rtol=0, atol=LOG_ATOL)
    assert torch.equal(scores.forced, ref_forced)
    assert int(scores.forced[0].sum()) == window
    # a plain top-k ranks the forced window first
    top = scores.log_scores.topk(window, dim=-1).indices.sort(-1).values
    assert torch.equal(top, torch.arange(t - window, t).expand(hkv, -1))


def test_snapkv_window_covering_everything():
    """t <= window: every entry is the observation window, all forced."""
    q, k, _ = make_layer(10, 2, 1)
    scores = snapkv(q, k, scale=0.5, window=10)
    assert scores.forced.all()
    assert torch.equal(scores.log_scores, torch.full((2, 10), FORCED_LOG_SCORE))
    assert snapkv(q, k, scale=0.5, window=32).forced.all()


def test_snapkv_kernel_one_is_plain_window_attention():
    """kernel = 1 is no pooling: the window-averaged attention to the prefix (one head)."""
    t, w = 20, 4
    q, k, _ = make_layer(t, 1, 1, seed=5)
    scores = snapkv(q, k, scale=0.5, window=w, kernel=1)
    p = dense_probabilities(q, k, 0.5)
    expected = torch.log(floored(p[0, t - w :, : t - w].mean(0)))
    torch.testing.assert_close(
        scores.log_scores[0, : t - w].double(), expected, rtol=0, atol=LOG_ATOL
    )


# ------------------------------------------------------------- tova, knorm, streaming


def test_tova_same_for_every_kv_head():
    q, k, v = make_layer(33, 3, 2, seed=2)
    ls = compute_scores("tova", q, k, v, scale=0.5).log_scores
    assert torch.equal(ls[0], ls[1]) and torch.equal(ls[0], ls[2])


def test_knorm_is_negative_key_norm():
    q, k, v = make_layer(12, 2, 1, seed=3)
    scores = compute_scores("knorm", q, k, v, scale=1.0)
    torch.testing.assert_close(scores.log_scores, (-k.norm(dim=-1)).float())
    assert torch.equal(knorm(k).log_scores, scores.log_scores)
    # query and value are not needed
    assert torch.equal(
        compute_scores("knorm", None, k, None, scale=1.0).log_scores, scores.log_scores
    )


def test_uniform_scores():
    _, k, _ = make_layer(7, 3, 1)
    scores = compute_scores("uniform", None, k, None, scale=1.0)
    assert torch.equal(scores.log_scores, torch.zeros(3, 7)) and scores.forced is None


@settings(max_examples=60, deadline=None)
@given(t=st.integers(1, 3000), sinks=st.integers(0, 8), data=st.data())
def test_streaming_llm_topk_is_sinks_plus_recent(t, sinks, data):
    """S5: for every k >= sinks, top-k = the first `sinks` entries + the k - sinks newest."""
    s = min(sinks, t)
    k = data.draw(st.integers(s, t))
    ls = streaming_llm(t, 2, sinks=sinks).log_scores
    top = set(ls[0].topk(k).indices.tolist())
    assert top == set(range(s)) | set(range(t - (k - s), t))
    assert torch.equal(ls[0], ls[1])


@pytest.mark.parametrize("t", [1_000_000, 16_000_000])
def test_streaming_llm_strict_order_in_float32_for_long_prompts(t):
    """Recency log-scores stay strictly increasing after rounding to float32."""
    ls = streaming_llm(t, 1).log_scores[0]
    assert (ls[5:] > ls[4:-1]).all() and (ls[:4] > ls[4:].max()).all()


@pytest.mark.parametrize("t,sinks", [(1, 4), (3, 4), (4, 4), (5, 4), (100, 4), (100, 0), (57, 1)])
def test_streaming_llm_softmax_is_sink_recency_mixture(t, sinks):
    """S2: softmax of the log-scores (tau = 1) = lam * Uniform(sinks) + (1 - lam) * r with
    r(i) = 2 (i - s + 1) / (n (n + 1)) increasing and lam = 4 s / (4 s + n + 1)."""
    s = min(sinks, t)
    n = t - s
    probs = torch.softmax(streaming_llm(t, 1, sinks=sinks).log_scores[0].double(), -1)
    lam = 4 * s / (4 * s + n + 1) if n else 1.0  # t <= sinks: every entry is a sink
    expected = torch.zeros(t, dtype=F64)
    expected[:s] = lam / s if s else 0.0
    for i in range(s, t):
        expected[i] = (1 - lam) * 2 * (i - s + 1) / (n * (n + 1))
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=0)
    assert (probs[s + 1 :] > probs[s:-1]).all()


# ------------------------------------------------------------------------- bad input


def test_bad_input_raises_value_error():
    q, k, v = make_layer(10, 2, 2)
    with pytest.raises(ValueError, match=r"name must be one of .*'h2o'.*got 'h3o'"):
        compute_scores("h3o", q, k, v, scale=1.0)
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['window'\] for score 'h2o'"):
        compute_scores("h2o", q, k, v, scale=1.0, window=3)
    with pytest.raises(ValueError, match="allowed: none"):
        compute_scores("tova", q, k, v, scale=1.0, sinks=3)
    with pytest.raises(ValueError, match="column_sums were given but score 'tova'"):
        compute_scores("tova", q, k, v, scale=1.0, column_sums=torch.ones(4, 10))
    with pytest.raises(ValueError, match=r"column_sums must be \[Hq, t\] = \[4, 10\]"):
        compute_scores("h2o", q, k, v, scale=1.0, column_sums=torch.ones(2, 10))
    with pytest.raises(ValueError, match="column_sums must be finite and >= 0"):
        compute_scores("h2o-h", q, k, v, scale=1.0, column_sums=-torch.ones(4, 10))
    with pytest.raises(ValueError, match="value is required for the 'min' score"):
        compute_scores("min", q, k, None, scale=1.0)
    with pytest.raises(ValueError, match="value is required for the 'min-h' score"):
        compute_scores("min-h", q, k, None, scale=1.0)
    with pytest.raises(ValueError, match="query is required for the 'h2o' score"):
        compute_scores("h2o", None, k, v, scale=1.0)
    with pytest.raises(ValueError, match="t = 0"):
        compute_scores("h2o", q[:, :0], k[:, :0], v[:, :0], scale=1.0)
    with pytest.raises(ValueError, match="t = 0"):
        compute_scores("knorm", None, k[:, :0], None, scale=1.0)
    with pytest.raises(ValueError, match=r"multiple of KV heads"):
        compute_scores("snapkv", q[:3], k, v, scale=1.0)
    with pytest.raises(ValueError, match="query length 9 must equal key length 10"):
        compute_scores("tova", q[:, :9], k, v, scale=1.0)
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        compute_scores("snapkv", q, k, v, scale=1.0, window=0)
    with pytest.raises(ValueError, match=r"kernel must be odd .* got 4"):
        compute_scores("snapkv", q, k, v, scale=1.0, kernel=4)
    with pytest.raises(ValueError, match="kernel must be >= 1, got 0"):
        snapkv(q, k, scale=1.0, kernel=0)
    with pytest.raises(ValueError, match="pooling must be one of 'max', 'avg'; got 'mean'"):
        snapkv(q, k, scale=1.0, pooling="mean")
    with pytest.raises(ValueError, match="sinks must be >= 0, got -1"):
        streaming_llm(10, 2, sinks=-1)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        compute_scores("min", q, k, v, scale=0.0)
    with pytest.raises(ValueError, match=r"alpha must be \[Hq\] = \[4\] or \[Hkv, g\]"):
        compute_scores("h2o", q, k, v, scale=1.0, alpha=torch.ones(3))
    with pytest.raises(ValueError, match="alpha must give each GQA group positive total weight"):
        compute_scores("h2o", q, k, v, scale=1.0, alpha=torch.tensor([1.0, 1.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="log_scores must be float32"):
        Scores(torch.zeros(2, 3, dtype=F64))


def test_validate_params_and_param_names():
    assert score_param_names("snapkv") == ("window", "kernel", "pooling", "gqa", "alpha")
    assert score_param_names("min-h") == ("alpha", "chunk_size")
    assert score_param_names("streaming_llm") == ("sinks",)
    validate_params("snapkv", {"window": 8, "kernel": 5, "pooling": "avg"})
    with pytest.raises(ValueError, match="kernel must be odd"):
        validate_params("snapkv", {"kernel": 2})
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        validate_params("h2o", {"chunk_size": 0})
    with pytest.raises(
        ValueError, match=r"unknown parameter\(s\) \['chunk_size'\] for score 'min'"
    ):
        validate_params("min", {"chunk_size": 4})


# ---------------------------------------------------------------------------- the score table


def test_table_declares_scale_source_and_defaults():
    """The facts the rest of probkv reads from the table (Ada-KV's scale, S6; the policies'
    defaults; the reconstruction scores of S10.1)."""
    reconstruction = {"kvzip", "kvzip-plus", "h2o-rec", "min-rec"}
    attention = {name for name in SCORE_NAMES if on_attention_scale(name)}
    surrogates = {"kvzap"}  # S11: predicts kvzip's scale
    expected = {"h2o", "h2o-h", "min", "min-h", "snapkv", "tova", *reconstruction, *surrogates}
    assert attention == expected
    assert {name for name in SCORE_NAMES if needs_reconstruction(name)} == reconstruction
    assert default_params("kvzip") == {"sinks": 4, "chunk_tokens": 2000}
    assert default_params("snapkv") == {"window": 32, "kernel": 7, "pooling": "max", "gqa": "mean"}
    assert default_params("streaming_llm") == {"sinks": 4}
    assert default_params("h2o") == {}
    assert tensor_param_names("snapkv") == ("alpha",) and tensor_param_names("knorm") == ()


def value_norm(value: torch.Tensor) -> Scores:
    """A toy score for the tests below (docs/architecture.md's worked example): ``log ||v_i||``."""
    return Scores(torch.log(torch.linalg.vector_norm(value.double(), dim=-1)).float())


def test_adding_a_score_is_one_function_and_one_row(monkeypatch):
    """A new row is dispatched, validated and named everywhere from the table alone."""
    from probkv.policies import DEFAULT_SCORE_PARAMS, TopKPolicy, method_name, parse_method

    def vnorm(value: torch.Tensor, *, power: int = 1) -> Scores:
        return Scores(power * value_norm(value).log_scores)

    row = ScoreSpec(vnorm, ("value",), {"power": Param(2, check_positive_int)})
    monkeypatch.setitem(SCORE_TABLE, "vnorm", row)
    q, k, v = make_layer(12, 2, 2, seed=3)
    got = compute_scores("vnorm", q, k, v, scale=0.3, power=3)
    torch.testing.assert_close(got.log_scores, 3 * value_norm(v).log_scores)
    assert score_param_names("vnorm") == ("power",) and column_sums_needed("vnorm") is None
    with pytest.raises(ValueError, match="power must be >= 1, got 0"):
        compute_scores("vnorm", q, k, v, scale=0.3, power=0)
    policy = TopKPolicy(score="vnorm", ratio=0.5)
    assert policy.score_params == {"power": 2} and policy.layerwise
    assert method_name(policy) == "topk:vnorm"
    assert parse_method("prob:vnorm/power=3").score_params == {"power": 3}
    assert "vnorm" not in DEFAULT_SCORE_PARAMS  # a snapshot, taken when policies are imported


def test_a_reconstruction_score_makes_policies_evict_all_layers_at_once(monkeypatch):
    """Statistics from a pass after prefill: no layer can be evicted on its own."""
    from probkv.policies import ProbabilisticPolicy, TopKPolicy

    row = ScoreSpec(value_norm, ("value",), source="reconstruction")
    monkeypatch.setitem(SCORE_TABLE, "recon", row)
    assert needs_reconstruction("recon")
    assert not TopKPolicy(score="recon").layerwise
    assert not ProbabilisticPolicy(score="recon", scope="head").layerwise
    assert TopKPolicy(score="h2o").layerwise and ProbabilisticPolicy(scope="head").layerwise


def test_bad_rows_are_refused_when_the_table_is_built():
    with pytest.raises(ValueError, match=r"bad inputs or params \['power'\]"):
        ScoreSpec(value_norm, ("value",), {"power": Param(2)})
    with pytest.raises(ValueError, match="bad inputs or params"):
        ScoreSpec(knorm, ("keys",))
    with pytest.raises(ValueError, match="column_sums and inputs disagree"):
        ScoreSpec(h2o, ("query", "key", "scale"), column_sums="uniform")
    with pytest.raises(ValueError, match="source must be one of"):
        ScoreSpec(value_norm, ("value",), source="decode")


PREFILL_SCORES = [n for n in SCORE_NAMES if SCORE_TABLE[n].source == "prefill"]


@pytest.mark.parametrize("name", PREFILL_SCORES)
@pytest.mark.parametrize("t", [1, 5, 40])
def test_scores_read_only_their_declared_last_rows(name, t):
    """``last_rows`` is true (what a chunked prefill keeps, issue 11): with the column sums
    given, the query rows before the last ``last_query_rows`` can be anything."""
    q, k, v = make_layer(t, 2, 2, seed=t)
    params = {"window": 4} if name == "snapkv" else {}
    if name == "kvzap":  # S11: a trained scorer (tests/scores/test_surrogate.py)
        params = {"surrogate": tiny_scorer(2, 8, 6)}
    rows = last_query_rows(name, {**default_params(name), **params})
    weighting = column_sums_needed(name)
    sums = None
    if weighting is not None:
        w = uniform_row_weights(t, dtype=F64) if weighting == "uniform" else harmonic(t)
        _, sums = causal_attention_with_column_sums(q, k, v, scale=0.3, row_weights=w[None])
        sums = sums[0]
    other = torch.randn_like(q) * 7
    other[:, max(0, t - rows) :] = q[:, max(0, t - rows) :]
    got = compute_scores(name, other, k, v, scale=0.3, column_sums=sums, layer_idx=0, **params)
    ref = compute_scores(name, q, k, v, scale=0.3, column_sums=sums, layer_idx=0, **params)
    assert torch.equal(got.log_scores, ref.log_scores)
    assert rows == (4 if name == "snapkv" else 1)


@pytest.mark.parametrize("name", [n for n in SCORE_NAMES if SCORE_TABLE[n].fixed])
@pytest.mark.parametrize("start", [0, 2, 5, 17])
def test_fixed_scores_read_only_their_own_position(name, start):
    """``fixed`` is true (what a decode budget relies on, S10.5): the entries from ``start`` on,
    scored alone with ``sinks`` counted from ``start`` (``DecodeStatistics.enter``), get the
    scores and forced flags the whole sequence gives them; nothing later changes them."""
    t = 24
    _, k, v = make_layer(t, 2, 2, seed=start)
    params = {"surrogate": tiny_scorer(2, 8, 6)} if name == "kvzap" else {}
    whole = compute_scores(name, None, k, v, scale=0.3, layer_idx=0, **params)
    for end in (start + 1, t):
        part_params = dict(params)
        if "sinks" in SCORE_TABLE[name].params:
            part_params["sinks"] = max(0, default_params(name)["sinks"] - start)
        part = compute_scores(
            name, None, k[:, start:end], v[:, start:end], scale=0.3, layer_idx=0, **part_params
        )
        torch.testing.assert_close(part.log_scores, whole.log_scores[:, start:end])
        forced = torch.zeros_like(part.log_scores, dtype=torch.bool)
        whole_forced = torch.zeros_like(whole.log_scores, dtype=torch.bool)
        forced = forced if part.forced is None else part.forced
        whole_forced = whole_forced if whole.forced is None else whole.forced
        assert torch.equal(forced, whole_forced[:, start:end])


def test_a_fixed_score_reads_no_query_rows():
    ScoreSpec(knorm, ("key",), fixed=True)  # allowed: its own key only
    with pytest.raises(ValueError, match="a fixed score reads no query rows"):
        ScoreSpec(
            h2o,
            ("query", "key", "scale", "column_sums", "chunk_size"),
            column_sums="uniform",
            fixed=True,
        )
