"""Reconstruction rows and the scores made of them (S10.1; probkv.scores.reconstruction).

The kernel is compared with a dense, one-row-at-a-time reference in float64 (GQA, causal
masking among the reconstruction tokens, any chunk size); the scores with their formulas.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probkv.policies import LayerObservation, parse_method
from probkv.scores import FORCED_LOG_SCORE, compute_scores
from probkv.scores.proposals import FLOOR
from probkv.scores.reconstruction import (
    ReconstructionStats,
    h2o_reconstruction,
    kvzip,
    min_reconstruction,
    reconstruction_attention,
    reconstruction_chunks,
)

F64 = torch.float64


def make_chunk(t, n, hkv, g, d=8, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q = 1.5 * torch.randn(hkv * g, n, d, generator=gen, dtype=dtype)
    k = torch.randn(hkv, t + n, d, generator=gen, dtype=dtype)
    v = torch.randn(hkv, t + n, d, generator=gen, dtype=dtype)
    return q, k, v


def dense_reference(q, k, v, t, scale):
    """Row j of query head h: softmax over keys 0..t+j of its KV head (S10.1), one at a time."""
    hq, n, _ = q.shape
    g = hq // k.shape[0]
    probs = torch.zeros(hq, n, t + n, dtype=F64)
    out = torch.zeros(hq, n, v.shape[-1], dtype=F64)
    for h in range(hq):
        for j in range(n):
            logits = scale * k[h // g, : t + j + 1].double() @ q[h, j].double()
            p = torch.softmax(logits, 0)
            probs[h, j, : t + j + 1] = p
            out[h, j] = p @ v[h // g, : t + j + 1].double()
    context = probs[..., :t]
    max_per_kv = context.amax(1).view(k.shape[0], g, t).amax(1)
    return out, max_per_kv, context.sum(1)


@pytest.mark.parametrize(("hkv", "g"), [(1, 1), (2, 2), (2, 3)])
@pytest.mark.parametrize("chunk", [1, 3, None, 100])
def test_attention_and_statistics_equal_the_dense_reference(hkv, g, chunk):
    t, n = 13, 9
    q, k, v = make_chunk(t, n, hkv, g, seed=hkv * 10 + g)
    out, mx, sums, _ = reconstruction_attention(
        q, k, v, context_length=t, scale=0.4, chunk_size=chunk
    )
    ref_out, ref_max, ref_sums = dense_reference(q, k, v, t, 0.4)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(mx, ref_max, rtol=0, atol=1e-12)
    torch.testing.assert_close(sums, ref_sums, rtol=0, atol=1e-12)
    assert out.dtype == mx.dtype == sums.dtype == F64


def test_float32_output_is_sdpa_with_the_offset_causal_mask():
    """What the model computes in the pass: causal attention of the chunk after the cache."""
    t, n, hkv, g = 40, 17, 2, 2
    q, k, v = make_chunk(t, n, hkv, g, d=16, seed=3, dtype=torch.float32)
    out, mx, _, _ = reconstruction_attention(q, k, v, context_length=t, scale=0.25)
    mask = torch.arange(t + n)[None, :] <= (t + torch.arange(n))[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, scale=0.25, enable_gqa=True
    )[0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert out.dtype == torch.float32 and mx.dtype == torch.float32


@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(1, 12),
    n=st.integers(1, 10),
    g=st.integers(1, 3),
    seed=st.integers(0, 10_000),
)
def test_statistics_are_probabilities(t, n, g, seed):
    """Per query head the context columns of a row sum to at most 1 (the rest is on the
    reconstruction tokens); the max over rows is at least the mean and at most 1."""
    q, k, v = make_chunk(t, n, 2, g, seed=seed)
    _, mx, sums, _ = reconstruction_attention(q, k, v, context_length=t, scale=0.5, chunk_size=4)
    assert (sums.sum(-1) <= n + 1e-9).all() and (sums >= 0).all()
    assert (mx <= 1 + 1e-12).all()
    mean_per_kv = (sums / n).view(2, g, t).amax(1)
    assert (mx >= mean_per_kv - 1e-12).all()


def test_statistics_accumulate_over_chunks():
    t = 11
    stats = ReconstructionStats.empty(2, 4, t)
    parts = [make_chunk(t, n, 2, 2, seed=n) for n in (5, 3)]
    results = [reconstruction_attention(*p, context_length=t, scale=0.3) for p in parts]
    for (q, _, _), (_, mx, sums, _) in zip(parts, results):
        stats.add(mx, sums, q.shape[1])
    assert stats.rows == 8
    torch.testing.assert_close(
        stats.max_attention, torch.maximum(results[0][1], results[1][1]).float()
    )
    torch.testing.assert_close(stats.mean_attention(), (results[0][2] + results[1][2]) / 8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"context_length": 0}, "context_length must be >= 1"),
        ({"context_length": 5}, "key must hold the 5 cached entries then the 3"),
        ({"context_length": 4, "scale": 0.0}, "scale must be a positive finite number"),
        ({"context_length": 4, "chunk_size": 0}, "chunk_size must be >= 1"),
    ],
)
def test_bad_input_is_refused(kwargs, message):
    q, k, v = make_chunk(4, 3, 1, 2)
    kwargs = {"scale": 0.5, **kwargs}
    with pytest.raises(ValueError, match=message):
        reconstruction_attention(q, k, v, **kwargs)


# ------------------------------------------------------------------------------ chunks


def test_one_chunk_is_instruction_suffix_context():
    chunks = reconstruction_chunks(
        [10, 11, 12, 13], first=[1, 2], later=[3], suffix=[4], context_start=1
    )
    assert [(c.start, c.end, c.input_ids) for c in chunks] == [(1, 4, (1, 2, 4, 11, 12, 13))]


def test_later_chunks_quote_the_end_of_the_previous_chunk():
    ids = list(range(100, 125))  # 25 tokens, the first 2 are the template's opening
    chunks = reconstruction_chunks(
        ids, first=[1], later=[2, 2], suffix=[9], context_start=2, chunk_tokens=10, overlap=3
    )
    assert [(c.start, c.end) for c in chunks] == [(2, 12), (12, 22), (22, 25)]
    assert chunks[0].input_ids == (1, 9, *range(102, 112))
    assert chunks[1].input_ids == (2, 2, 109, 110, 111, 9, *range(112, 122))
    assert chunks[2].input_ids == (2, 2, 119, 120, 121, 9, 122, 123, 124)
    # an overlap longer than a chunk quotes the whole previous chunk
    short = reconstruction_chunks(ids[:6], first=[], later=[], suffix=[], chunk_tokens=2)
    assert short[1].input_ids == (100, 101, 102, 103)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"context_start": 3}, r"context_start must be < 3"),
        ({"chunk_tokens": 0}, "chunk_tokens must be >= 1"),
        ({"context_start": -1}, "context_start must be >= 0"),
    ],
)
def test_bad_chunking_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        reconstruction_chunks([1, 2, 3], first=[], later=[], suffix=[], **kwargs)
    with pytest.raises(ValueError, match="context_ids is empty"):
        reconstruction_chunks([], first=[], later=[], suffix=[])


# ------------------------------------------------------------------------------ scores


def observed_stats(t=12, hkv=2, g=2, *, context_start=0, chunk_tokens=2000, seed=0):
    q, k, v = make_chunk(t, 7, hkv, g, seed=seed)
    _, mx, sums, _ = reconstruction_attention(q, k, v, context_length=t, scale=0.5)
    stats = ReconstructionStats.empty(
        hkv, hkv * g, t, context_start=context_start, chunk_tokens=chunk_tokens
    )
    stats.add(mx, sums, 7)
    return stats, v[:, :t]


@pytest.mark.parametrize(("sinks", "start", "forced"), [(0, 0, 0), (4, 0, 4), (2, 5, 5)])
def test_kvzip_is_the_log_of_the_group_max(sinks, start, forced):
    """S10.1: log max_{u, q in G(h)} p_u^q(i); the first max(sinks, context_start) entries
    are forced with FORCED_LOG_SCORE."""
    stats, _ = observed_stats(context_start=start)
    scores = kvzip(stats, sinks=sinks)
    expected = torch.log(stats.max_attention.double().clamp_min(FLOOR / (12 - forced)))
    torch.testing.assert_close(scores.log_scores[:, forced:].double(), expected[:, forced:])
    assert (scores.log_scores[:, :forced] == FORCED_LOG_SCORE).all()
    if forced:
        assert scores.forced[:, :forced].all() and not scores.forced[:, forced:].any()
    else:
        assert scores.forced is None


def test_mean_scores_are_normalised_group_mixtures():
    """h2o-rec: pi ∝ mean_u p_u(i), min-rec: pi ∝ mean_u p_u(i) ||v_i||, each query head
    normalised over the free entries and mixed within its group (S2), forced prefix apart."""
    stats, value = observed_stats(context_start=3)
    mean = stats.mean_attention()[:, 4:]  # sinks = 4 > context_start = 3
    norms = torch.linalg.vector_norm(value[:, 4:], dim=-1).repeat_interleave(2, 0)
    for scores, weights in [
        (h2o_reconstruction(stats), mean),
        (min_reconstruction(stats, value), mean * norms),
    ]:
        per_head = weights / weights.sum(-1, keepdim=True)
        mixture = per_head.view(2, 2, -1).mean(1)
        torch.testing.assert_close(
            scores.log_scores[:, 4:].exp().double(), mixture, rtol=1e-5, atol=0
        )
        assert scores.forced[:, :4].all() and int(scores.forced.sum()) == 8


def test_compute_scores_dispatches_and_checks_the_statistics():
    stats, value = observed_stats(chunk_tokens=100)
    key = torch.zeros(2, 12, 8)
    got = compute_scores(
        "min-rec", None, key, value, scale=1.0, reconstruction=stats, chunk_tokens=100
    )
    torch.testing.assert_close(
        got.log_scores, min_reconstruction(stats, value, chunk_tokens=100).log_scores
    )
    with pytest.raises(ValueError, match="required by, and only by"):
        compute_scores("kvzip", None, key, value, scale=1.0)
    with pytest.raises(ValueError, match="required by, and only by"):
        compute_scores("h2o", torch.zeros(4, 12, 8), key, value, scale=1.0, reconstruction=stats)
    with pytest.raises(ValueError, match="computed with chunk_tokens=100"):
        compute_scores("kvzip", None, key, value, scale=1.0, reconstruction=stats)
    with pytest.raises(ValueError, match="value is required for the 'min-rec'"):
        compute_scores(
            "min-rec", None, key, None, scale=1.0, reconstruction=stats, chunk_tokens=100
        )
    with pytest.raises(ValueError, match="must be the ReconstructionStats"):
        kvzip("not stats")


@pytest.mark.parametrize("name", ["kvzip", "h2o-rec", "min-rec"])
def test_reconstruction_scores_make_proposals_with_full_support(name):
    """prob:<score> samples from softmax(log_score / proposal_tau): full support on the free
    entries (S2 floor), zero on the forced prefix (take-all)."""
    stats, value = observed_stats(t=30, context_start=6)
    scores = compute_scores(
        name, None, torch.zeros(2, 30, 8), value, scale=1.0, reconstruction=stats
    )
    obs = LayerObservation(0, 0, scores.log_scores, scores.forced, torch.full((2, 30), 1 / 30))
    policy = parse_method(f"prob:{name}", ratio=0.5)
    pi = policy.proposal(policy._with_forced(obs)).double()
    torch.testing.assert_close(pi.sum(-1), torch.ones(2, dtype=F64), rtol=0, atol=1e-6)
    assert (pi[:, :6] == 0).all() and (pi[:, 6:] >= 0.99 * FLOOR / 24).all()
    if name == "kvzip":  # tau = 1: the normalised maxima
        mx = stats.max_attention[:, 6:].double()
        torch.testing.assert_close(pi[:, 6:], mx / mx.sum(-1, keepdim=True), rtol=1e-5, atol=0)
    assert math.isclose(float(pi.sum()), 2.0, rel_tol=1e-6)


@pytest.mark.parametrize(("hkv", "g"), [(1, 1), (2, 3)])
@pytest.mark.parametrize("chunk", [1, 4, None])
def test_kvzip_plus_weights_equal_the_dense_reference(hkv, g, chunk):
    """S11 KVzip+: ``max_{j, q in G(h)} r_j c^q_i p_j^q(i)`` over row chunks equals a plain
    loop over the dense probabilities; the unweighted statistics do not change."""
    t, n = 11, 7
    q, k, v = make_chunk(t, n, hkv, g, seed=3 * hkv + g)
    gen = torch.Generator().manual_seed(1)
    rows = torch.rand(n, generator=gen, dtype=F64) + 0.1
    cols = torch.rand(hkv * g, t, generator=gen, dtype=F64) + 0.1
    _, ref_max, ref_sums = dense_reference(q, k, v, t, 0.4)
    _, probs = _dense_probabilities(q, k, t, 0.4)
    want = torch.zeros(hkv, t, dtype=F64)
    for h in range(hkv * g):
        for j in range(n):
            want[h // g] = torch.maximum(want[h // g], rows[j] * cols[h] * probs[h, j])
    _, mx, sums, plus = reconstruction_attention(
        q,
        k,
        v,
        context_length=t,
        scale=0.4,
        chunk_size=chunk,
        row_weights=rows,
        column_weights=cols,
    )
    torch.testing.assert_close(plus, want)
    torch.testing.assert_close(mx, ref_max)
    torch.testing.assert_close(sums, ref_sums)
    with pytest.raises(ValueError, match="together or not at all"):
        reconstruction_attention(q, k, v, context_length=t, scale=0.4, row_weights=rows)
    with pytest.raises(ValueError, match="row_weights must be"):
        reconstruction_attention(
            q, k, v, context_length=t, scale=0.4, row_weights=rows[:-1], column_weights=cols
        )


def _dense_probabilities(q, k, t, scale):
    """``[Hq, n, t]`` the context columns of each row's softmax (as ``dense_reference``)."""
    hq, n, _ = q.shape
    g = hq // k.shape[0]
    probs = torch.zeros(hq, n, t, dtype=F64)
    for h in range(hq):
        for j in range(n):
            p = torch.softmax(scale * k[h // g, : t + j + 1].double() @ q[h, j].double(), 0)
            probs[h, j] = p[:t]
    return None, probs


def test_kvzip_plus_reads_the_weighted_max_and_is_refused_without_it():
    stats = ReconstructionStats.empty(2, 4, 9, context_start=2)
    gen = torch.Generator().manual_seed(0)
    mx = torch.rand(2, 9, generator=gen)
    weighted = torch.rand(2, 9, generator=gen) * 0.01
    stats.add(mx, torch.rand(4, 9, generator=gen), 3)
    with pytest.raises(ValueError, match="weighted by"):
        compute_scores(
            "kvzip-plus", None, torch.zeros(2, 9, 4), None, scale=1.0, reconstruction=stats
        )
    stats.add(mx * 0.5, torch.rand(4, 9, generator=gen), 3, weighted)
    got = compute_scores(
        "kvzip-plus", None, torch.zeros(2, 9, 4), None, scale=1.0, reconstruction=stats
    )
    f = 4  # max(sinks, context_start)
    torch.testing.assert_close(got.log_scores[:, f:], torch.log(weighted[:, f:]))
    assert got.forced[:, :f].all() and not got.forced[:, f:].any()
    assert (got.log_scores[:, :f] == FORCED_LOG_SCORE).all()
