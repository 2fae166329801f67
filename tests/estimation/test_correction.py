"""Tests of probkv.estimation (S4 decode-time correction, S9 weight schemes).

Statistical tests use fixed seeds. z-tests use the sample standard error over S independent
replicates (S >= 4000, so the mean is normal to a good approximation) and reject at |z| > 4.5:
two-sided 6.8e-6 per comparison, below 1e-4 for the file's few dozen comparisons together.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from probkv.estimation import (
    compose_log_weights,
    corrected_attention,
    corrected_attention_reference,
    counts_log_weights,
    inclusion_log_weights,
    kish_effective_sample_size,
    pps_log_weights,
    ragged_corrected_attention,
)
from probkv.sampling import pps_inclusion_probabilities, sample_counts, systematic_sample
from probkv.sampling.sample_size import samples_for_ratio

torch.set_num_threads(1)
Z_CRIT = 4.5


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed), dtype=torch.float64) * scale


def plain_attention(query, key, value, scale, mask=None):
    """Independent reference: torch's SDPA with GQA by repeat_interleave (transformers' order)."""
    g = query.shape[0] // key.shape[0]
    k, v = key.repeat_interleave(g, 0), value.repeat_interleave(g, 0)
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale)


# ------------------------------------------------------------------------- log-weights


def test_counts_log_weights_match_eq10():
    """S4 Eq. 10: log w_i = (log c_i - log m - log pi_i) / tau on kept entries, 0 elsewhere,
    float32; tau = inf gives zeros (no correction)."""
    pi = torch.softmax(randn(3, 20, seed=0, scale=2.0), -1).float()
    m = torch.tensor([5, 40, 1000])
    counts = sample_counts(pi, m, gen(1))
    kept = counts > 0
    p64 = pi.double() / pi.double().sum(-1, keepdim=True)
    expected = torch.zeros(3, 20, dtype=torch.float64)
    for h, i in kept.nonzero().tolist():
        expected[h, i] = math.log(counts[h, i] / (int(m[h]) * p64[h, i].item()))
    for tau in (1.0, 2.0, 0.3):
        got = counts_log_weights(pi, kept, counts, tau=tau)
        assert got.dtype == torch.float32
        assert torch.allclose(got.double(), expected / tau, rtol=1e-6, atol=1e-6)
        assert (got[~kept] == 0).all()
    same = counts_log_weights(pi, kept=kept, counts=counts, num_samples=m)
    assert torch.equal(same, counts_log_weights(pi, kept, counts))
    none = counts_log_weights(pi, kept, counts, tau=math.inf)
    assert torch.equal(none, torch.zeros(3, 20))


def _mp_neg_log_inclusion(p: float, m: int) -> float:
    with mpmath.workdps(60):
        return float(-mpmath.log(1 - (1 - mpmath.mpf(p)) ** m))


def test_inclusion_log_weights_in_log_space():
    """S9 Horvitz-Thompson: -log(1 - (1 - pi)^m), accurate where the naive formula is not
    (tiny pi m) and exactly 0 where the inclusion probability rounds to 1."""
    pi = torch.tensor([[1e-13, 1e-7, 0.2, 0.8 - 1e-7 - 1e-13]], dtype=torch.float64)
    for m in (1, 10, 10**6, 10**12):
        kept = torch.ones(1, 4, dtype=torch.bool)
        got = inclusion_log_weights(pi, kept, m)
        ref = [_mp_neg_log_inclusion(x, m) for x in (pi / pi.sum()).flatten().tolist()]
        assert torch.allclose(
            got.double(), torch.tensor([ref], dtype=torch.float64), rtol=1e-6, atol=0
        )
    got = inclusion_log_weights(pi, torch.ones(1, 4, dtype=torch.bool), 10**12)
    assert got[0, 2].item() == 0.0 and got[0, 3].item() == 0.0  # (0.8)^1e12 underflows: P = 1


def test_pps_log_weights():
    """S9 pps: -log P_i / tau, and exactly 0 for the take-all stratum (P_i = 1)."""
    pi = torch.softmax(randn(2, 30, seed=2, scale=3.0), -1)
    P = pps_inclusion_probabilities(pi, 10)
    kept = systematic_sample(P, gen(3))
    got = pps_log_weights(pi, kept, P, tau=2.0)
    assert torch.allclose(
        got.double(), torch.where(kept, -P.log() / 2.0, 0.0), rtol=1e-6, atol=1e-7
    )
    assert (P == 1).any() and (got[P == 1] == 0).all()


# ------------------------------------------------------------------- corrected attention


def test_fast_corrected_attention_equals_algorithm_1():
    """S4: logits + log-weights in one softmax (GQA, g = 3) equals the paper's Algorithm 1
    written literally with two normalisers, per query head, in float64."""
    h_kv, g, k, u, d, d_v = 2, 3, 9, 4, 8, 5
    q = randn(h_kv * g, 1, d, seed=0)
    key, value = randn(h_kv, k + u, d, seed=1), randn(h_kv, k + u, d_v, seed=2)
    lw = torch.cat([randn(h_kv, k, seed=3), torch.zeros(h_kv, u, dtype=torch.float64)], -1)
    fast = corrected_attention(q, key, value, lw, scale=d**-0.5)
    assert fast.shape == (h_kv * g, 1, d_v) and fast.dtype == torch.float64
    for h in range(h_kv * g):
        kv = h // g
        ref = corrected_attention_reference(
            q[h, 0],
            key[kv, :k],
            value[kv, :k],
            lw[kv, :k],
            key[kv, k:],
            value[kv, k:],
            scale=d**-0.5,
        )
        assert torch.allclose(fast[h, 0], ref, rtol=1e-12, atol=1e-13)
    no_new = corrected_attention_reference(
        q[0, 0], key[0], value[0], lw[0], key[0, :0], value[0, :0], scale=d**-0.5
    )
    assert torch.allclose(
        corrected_attention(q[:1], key[:1], value[:1], lw[:1], scale=d**-0.5)[0, 0],
        no_new,
        rtol=1e-12,
    )


def test_zero_log_weights_is_plain_attention_and_causal_offset():
    """With log-weights 0 the fast form is plain attention (SDPA reference), also with several
    query rows under a causal offset; -inf log-weights drop entries exactly like removing them."""
    h_kv, g, n, qn, d = 2, 2, 12, 3, 4
    q, key, value = (
        randn(h_kv * g, qn, d, seed=4),
        randn(h_kv, n, d, seed=5),
        randn(h_kv, n, d, seed=6),
    )
    zero = torch.zeros(h_kv, n, dtype=torch.float64)
    assert torch.allclose(
        corrected_attention(q, key, value, zero, scale=0.5),
        plain_attention(q, key, value, 0.5),
        rtol=1e-12,
    )
    mask = torch.arange(n)[None, :] <= (n - qn) + torch.arange(qn)[:, None]
    got = corrected_attention(q, key, value, zero, scale=0.5, causal_offset=n - qn)
    assert torch.allclose(got, plain_attention(q, key, value, 0.5, mask), rtol=1e-12)
    drop = torch.tensor([1, 4, 7])
    keep = torch.tensor([i for i in range(n) if i not in drop.tolist()])
    lw = zero.clone()
    lw[:, drop] = -math.inf
    got = corrected_attention(q, key, value, lw, scale=0.5)
    assert torch.allclose(got, plain_attention(q, key[:, keep], value[:, keep], 0.5), rtol=1e-12)


def test_low_precision_inputs_compute_in_float32():
    q, key, value = randn(4, 1, 8, seed=7), randn(2, 10, 8, seed=8), randn(2, 10, 8, seed=9)
    lw = randn(2, 10, seed=10).float()
    out = corrected_attention(q.bfloat16(), key.bfloat16(), value.bfloat16(), lw, scale=8**-0.5)
    ref = corrected_attention(
        q.bfloat16().double(),
        key.bfloat16().double(),
        value.bfloat16().double(),
        lw.double(),
        scale=8**-0.5,
    )
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.double(), ref, rtol=2**-7, atol=2**-7)  # bf16 output rounding


def _prefill(t=40, d=8, d_v=4, seed=0):
    """One head at eviction time: a query, keys, values, the target p and a proposal."""
    q, key, value = randn(d, seed=seed), randn(t, d, seed=seed + 1), randn(t, d_v, seed=seed + 2)
    logits = (key @ q) * d**-0.5
    p = torch.softmax(logits, -1)
    pi = 0.6 * p + 0.4 / t  # a reasonable proposal: full support, close to the target
    return q, key, value, logits, p, pi


def test_ragged_corrected_attention_is_algorithm_1_per_head():
    """The ragged reference (Ada-KV's flattened prefix, a head may keep nothing): every query
    row equals the paper's Algorithm 1 written literally over its head's kept entries and the
    new entries it sees (causal among the newest q, excluded slots dropped), in float64; the
    same with float32 inputs to float32 precision."""
    lengths, g, q_len, t, d, d_v = [4, 0, 7], 2, 3, 5, 8, 5
    s, n = len(lengths), sum(lengths)
    query = randn(s, g, q_len, d, seed=30)
    keys, values, lw = randn(n, d, seed=31), randn(n, d_v, seed=32), randn(n, seed=33).float()
    new_k, new_v = randn(s, t, d, seed=34), randn(s, t, d_v, seed=35)
    excluded = torch.zeros(s, t, dtype=torch.bool)
    excluded[2, 1] = True
    got = ragged_corrected_attention(
        query, keys, values, lw, lengths, new_k, new_v, scale=0.5, new_excluded=excluded
    )
    assert got.shape == (s, g, q_len, d_v) and got.dtype == torch.float64
    offsets = [0, 4, 4, 11]
    for h in range(s):
        a, b = offsets[h], offsets[h + 1]
        for j in range(q_len):
            seen = [i for i in range(t - q_len + j + 1) if not excluded[h, i]]
            for k in range(g):
                ref = corrected_attention_reference(
                    query[h, k, j], keys[a:b], values[a:b], lw[a:b].double(),
                    new_k[h, seen], new_v[h, seen], scale=0.5,
                )  # fmt: skip
                assert torch.allclose(got[h, k, j], ref, rtol=1e-12, atol=1e-13)
    unweighted = ragged_corrected_attention(
        query, keys, values, None, lengths, new_k, new_v, scale=0.5
    )
    zeros = ragged_corrected_attention(
        query, keys, values, torch.zeros(n), lengths, new_k, new_v, scale=0.5
    )
    assert torch.equal(unweighted, zeros)
    single = ragged_corrected_attention(
        query.float(), keys.float(), values.float(), lw, lengths, new_k.float(), new_v.float(),
        scale=0.5, new_excluded=excluded,
    )  # fmt: skip
    assert single.dtype == torch.float32
    torch.testing.assert_close(single, got.float(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="len\\(lengths\\)"):
        ragged_corrected_attention(query, keys, values, lw, [4, 7], new_k, new_v, scale=0.5)
    with pytest.raises(ValueError, match="T >= q"):
        ragged_corrected_attention(query, keys, values, lw, lengths, new_k[:, :2], new_v, scale=0.5)


def test_tau_inf_is_plain_attention_over_kept_set():
    """S4: tau = inf means no correction: the output is plain attention over the kept prefix
    entries and the entries created after eviction."""
    q, key, value, _, _, pi = _prefill()
    counts = sample_counts(pi, 30, gen(1))
    kept = counts > 0
    lw = counts_log_weights(pi, kept, counts, tau=math.inf)
    new_k, new_v = randn(3, 8, seed=20), randn(3, 4, seed=21)
    keys = torch.cat([key[kept], new_k]).unsqueeze(0)
    values = torch.cat([value[kept], new_v]).unsqueeze(0)
    lws = torch.cat([lw[kept].double(), torch.zeros(3, dtype=torch.float64)]).unsqueeze(0)
    got = corrected_attention(q.view(1, 1, -1), keys, values, lws, scale=8**-0.5)
    assert torch.allclose(got, plain_attention(q.view(1, 1, -1), keys, values, 8**-0.5), rtol=1e-12)
    assert not torch.allclose(
        got, plain_attention(q.view(1, 1, -1), key[None], value[None], 8**-0.5)
    )


def test_nothing_evicted_gives_full_attention():
    """S1/S9: with r = 0 every entry is kept. "inclusion" and "pps" weights are then exactly 1
    (P_i = 1: here m pi_i > 745, so (1 - pi_i)^m underflows to 0; pps with k = t caps every entry),
    so the corrected output is bitwise plain full attention. "counts" weights c_i / (m pi_i) are
    not exactly 1: c_i is Binomial(m, pi_i), so w_i - 1 has standard deviation
    sqrt((1 - pi_i) / (m pi_i)); what holds instead is |o - o_full| <= 2 d / (1 - d) max|v| with
    d = max_i |w_i - 1| (o is a ratio of sums with weights in [1 - d, 1 + d]), and d is within
    6 standard deviations of that law (union bound over 40 entries: failure < 1e-7)."""
    q, key, value, _, _, pi = _prefill()
    t = pi.shape[-1]
    m = samples_for_ratio(pi, 0.0)
    counts = sample_counts(pi, m, gen(2))
    kept = counts > 0
    assert kept.all() and m.item() * pi.min().item() > 745
    Q, K, V = q.view(1, 1, -1), key[None], value[None]
    full = corrected_attention(Q, K, V, torch.zeros(1, t, dtype=torch.float64), scale=8**-0.5)
    assert torch.allclose(full, plain_attention(Q, K, V, 8**-0.5), rtol=1e-12)

    lw = inclusion_log_weights(pi, kept, m)
    assert (lw == 0).all()
    assert torch.equal(corrected_attention(Q, K, V, lw[None].double(), scale=8**-0.5), full)

    P = pps_inclusion_probabilities(pi, t)
    kept_pps = systematic_sample(P, gen(3))
    lw = pps_log_weights(pi, kept_pps, P)
    assert kept_pps.all() and (lw == 0).all()
    assert torch.equal(corrected_attention(Q, K, V, lw[None].double(), scale=8**-0.5), full)

    lw = counts_log_weights(pi, kept, counts).double()
    w = lw.exp()
    dev = (w - 1).abs().max().item()
    assert dev > 0  # not exact, as explained above
    assert dev <= 6 * ((1 - pi) / (m.item() * pi)).sqrt().max().item()
    out = corrected_attention(Q, K, V, lw[None], scale=8**-0.5)
    assert (out - full).abs().max().item() <= 2 * dev / (1 - dev) * value.abs().max().item()


# ----------------------------------------------------------- unbiasedness at eviction time


def _replicates(pi: torch.Tensor, scheme: str, S: int, ratio: float, seed: int):
    """S independent evictions of one head: kept masks [S, t] and tau = 1 log-weights."""
    t = pi.shape[-1]
    rows = pi.expand(S, t)
    if scheme == "pps":
        P = pps_inclusion_probabilities(rows, round((1 - ratio) * t))
        kept = systematic_sample(P, gen(seed))
        return kept, pps_log_weights(rows, kept, P)
    m = samples_for_ratio(rows, ratio)
    counts = sample_counts(rows, m, gen(seed))
    kept = counts > 0
    if scheme == "counts":
        return kept, counts_log_weights(rows, kept, counts)
    return kept, inclusion_log_weights(rows, kept, m)


def _z_scores(samples: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """(mean - truth) / (sample sd / sqrt(S)) per component; samples [S, ...]."""
    S = samples.shape[0]
    return (samples.mean(0) - truth) / (samples.std(0) / math.sqrt(S))


def eviction_time_estimate(target, values, *, log_weights, kept):
    """Importance estimates of ``sum_i p~(i) v_i`` and ``Z = sum_i p~(i)`` at eviction time
    (S4): ``(sum_{i kept} w_i p~(i) v_i, sum_{i kept} w_i p~(i))``, not self-normalised, so both
    are unbiased when ``E[1{i kept} w_i] = 1`` for every entry (what the tests below check)."""
    w = torch.where(kept, torch.exp(log_weights.to(torch.float64)), 0.0)
    mass = w * target.to(torch.float64)
    return (mass.unsqueeze(-1) * values.to(torch.float64)).sum(-2), mass.sum(-1)


@pytest.mark.parametrize("scheme", ["counts", "inclusion", "pps"])
def test_eviction_time_estimate_is_unbiased(scheme):
    """S4/S9: for every scheme, E[1{i kept} w_i] = 1, so the importance estimates of
    sum_i p~(i) v_i and of Z = sum_i p~(i) average to the truth over S = 6000 evictions
    (|z| <= 4.5 per component). Negative control: without the weights (tau = inf) the same
    estimate is far off (|z| > 4.5), so the test can fail."""
    S = 6000
    _, _, value, logits, _, pi = _prefill(t=30)
    target = logits.exp()
    kept, lw = _replicates(pi, scheme, S, ratio=0.6, seed=11)
    total, z_hat = eviction_time_estimate(
        target.expand(S, -1), value.expand(S, -1, -1), log_weights=lw, kept=kept
    )
    truth_total, truth_z = (target[:, None] * value).sum(0), target.sum()
    assert (_z_scores(total, truth_total).abs() <= Z_CRIT).all()
    assert _z_scores(z_hat, truth_z).abs().item() <= Z_CRIT
    _, z_uncorrected = eviction_time_estimate(
        target.expand(S, -1), value.expand(S, -1, -1), log_weights=torch.zeros_like(lw), kept=kept
    )
    assert _z_scores(z_uncorrected, truth_z).abs().item() > Z_CRIT


def test_second_eviction_composed_weights_are_unbiased():
    """S4 second eviction: evict again over the kept entries with target p~ w_1 (pps from a
    proposal over the survivors); the composed weights w_1 w_2 keep the estimate of the original
    sum_i p~(i) v_i unbiased (tower property), |z| <= 4.5 per component over S = 6000."""
    S = 6000
    _, _, value, logits, p, pi = _prefill(t=30)
    target = logits.exp()
    kept1, lw1 = _replicates(pi, "counts", S, ratio=0.4, seed=12)
    second = torch.where(kept1, p * lw1.double().exp(), 0.0)  # proposal over survivors
    second = second / second.sum(-1, keepdim=True)
    k2 = (kept1.sum(-1) // 2).clamp(min=1)
    P2 = pps_inclusion_probabilities(second, k2)
    kept2 = systematic_sample(P2, gen(13))
    assert (kept2 <= kept1).all() and torch.equal(kept2.sum(-1), k2)
    lw2 = pps_log_weights(second, kept2, P2)
    lw = compose_log_weights(lw1, lw2)
    total, _ = eviction_time_estimate(
        target.expand(S, -1), value.expand(S, -1, -1), log_weights=lw, kept=kept2
    )
    assert (_z_scores(total, (target[:, None] * value).sum(0)).abs() <= Z_CRIT).all()


# ------------------------------------------------------------------------- convergence


def _self_normalised(logits, value, pi, counts):
    """Corrected outputs [S, d_v] of one query at eviction time (Algorithm 1 with no entries
    after t): target logits on the keys, evicted entries dropped with log-weight -inf."""
    S, t = counts.shape
    kept = counts > 0
    lw = counts_log_weights(pi.expand(S, t), kept, counts).double()
    lw = lw.masked_fill(~kept, -math.inf)
    ones = torch.ones(S, 1, 1, dtype=torch.float64)  # q . k_i = logit_i with d = 1, scale 1
    keys = logits.expand(S, t).unsqueeze(-1)
    return corrected_attention(ones, keys, value.expand(S, t, -1), lw, scale=1.0)[:, 0]


def test_corrected_output_mse_shrinks_like_one_over_m():
    """S4 (Appendix C; [10] Thm 2.1): the self-normalised corrected output converges to the full
    output with MSE = V1 / m + O(1/m^2), V1 = sum_i pi_i r_i^2 ||v_i - o||^2, r = p / pi (delta
    method). Over 8 values of m spanning two decades, S = 3000 seeds each, the weighted
    least-squares slope of log MSE on log m is -1 within 4 of its standard errors (point
    weights from each MSE's own standard error, delta method), and m MSE(m) at the largest m is
    within 4 standard errors of V1."""
    S, t = 3000, 16
    logits, value = randn(t, seed=30, scale=1.5), randn(t, 3, seed=31)
    p = torch.softmax(logits, -1)
    pi = 0.7 * p + 0.3 / t
    full = p @ value
    r = p / pi
    v1 = (pi * r**2 * ((value - full) ** 2).sum(-1)).sum().item()
    ms = np.unique(np.round(np.logspace(np.log10(30), np.log10(3000), 8)).astype(int))
    g = gen(32)
    log_mse, se_log = [], []
    for m in ms:
        err2 = (
            (_self_normalised(logits, value, pi, sample_counts(pi.expand(S, t), int(m), g)) - full)
            ** 2
        ).sum(-1)
        mse = err2.mean().item()
        log_mse.append(math.log(mse))
        se_log.append(err2.std().item() / math.sqrt(S) / mse)
    x, y, w = np.log(ms), np.array(log_mse), 1.0 / np.array(se_log) ** 2
    xc = x - (w * x).sum() / w.sum()
    slope = (w * xc * y).sum() / (w * xc**2).sum()
    se_slope = 1.0 / math.sqrt((w * xc**2).sum())
    assert abs(slope + 1.0) <= 4 * se_slope
    assert abs(ms[-1] * math.exp(log_mse[-1]) / v1 - 1) <= 4 * se_log[-1]


def test_bias_and_mse_are_order_one_over_m_exactly():
    """S4: exact expectations over every count vector of m draws (t = 3, multinomial pmf):
    m * bias(m) -> B1 = -sum_i pi_i r_i^2 (v_i - o) and m * MSE(m) -> V1 (first-order delta
    method of the ratio N / D), with remainders O(1/m): each doubling of m from 64 to 1024 halves
    them, within 10% (the next order changes that ratio by O(1/m))."""
    logits = torch.tensor([1.0, -0.5, 0.3], dtype=torch.float64)
    value = torch.tensor([[1.0, -1.0], [-2.0, 0.5], [0.5, 2.0]], dtype=torch.float64)
    pi = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    p = torch.softmax(logits, -1)
    full = p @ value
    r = p / pi
    b1 = -(pi[:, None] * r[:, None] ** 2 * (value - full)).sum(0)
    v1 = (pi * r**2 * ((value - full) ** 2).sum(-1)).sum().item()
    rem_bias, rem_mse = [], []
    for m in (64, 128, 256, 512, 1024):
        c1, c2 = torch.meshgrid(torch.arange(m + 1), torch.arange(m + 1), indexing="ij")
        ok = c1 + c2 <= m
        counts = torch.stack([c1[ok], c2[ok], m - c1[ok] - c2[ok]], -1)
        log_pmf = (
            math.lgamma(m + 1)
            - torch.lgamma(counts.double() + 1).sum(-1)
            + (counts * pi.log()).sum(-1)
        )
        pmf = log_pmf.exp()
        assert abs(pmf.sum().item() - 1) < 1e-10
        err = _self_normalised(logits, value, pi, counts) - full
        bias = (pmf[:, None] * err).sum(0)
        mse = (pmf * (err**2).sum(-1)).sum().item()
        rem_bias.append((m * bias - b1).norm().item())
        rem_mse.append(abs(m * mse - v1))
    for rem in (rem_bias, rem_mse):
        ratios = np.array(rem[:-1]) / np.array(rem[1:])
        assert ((ratios > 1.8) & (ratios < 2.2)).all()
    assert rem_bias[-1] < 0.01 * b1.norm().item() and rem_mse[-1] < 0.01 * v1


# -------------------------------------------------------------------- diagnostics, misc


def test_kish_effective_sample_size():
    lw = torch.tensor([[0.0, 0.0, 0.0, 5.0], [1.0, 2.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    kept = torch.tensor([[True, True, True, False], [True, True, True, True], [False] * 4])
    ess = kish_effective_sample_size(lw, kept)
    w = lw[1].double().exp()
    assert ess[0].item() == pytest.approx(3.0)
    assert ess[1].item() == pytest.approx((w.sum() ** 2 / (w**2).sum()).item(), rel=1e-12)
    assert ess[2].item() == 0.0
    one = kish_effective_sample_size(torch.tensor([[0.0, 800.0]]), torch.tensor([[True, True]]))
    assert one.item() == pytest.approx(1.0)  # one weight dominates (and no overflow)


def test_compose_log_weights_adds():
    old, new = randn(2, 5, seed=40).float(), randn(2, 5, seed=41).float()
    assert torch.allclose(compose_log_weights(old, new), old + new)
    with pytest.raises(ValueError, match="shapes differ"):
        compose_log_weights(old, new[:, :4])
    with pytest.raises(ValueError, match="NaN"):
        compose_log_weights(old, torch.full((2, 5), math.nan))


# ---------------------------------------------------------------------------- bad input


def test_log_weights_rejects_bad_combinations():
    pi = torch.full((2, 4), 0.25)
    counts = torch.tensor([[2, 0, 1, 0], [0, 0, 3, 0]])
    kept = counts > 0
    P = pps_inclusion_probabilities(pi, 2)
    # One function per scheme: combinations such as pps weights with counts, or an unknown
    # scheme name, cannot be expressed (the policy validates its ``weights`` field, S9).
    cases = [
        (counts_log_weights, dict(counts=None), "needs counts"),
        (inclusion_log_weights, dict(num_samples=None), "needs num_samples"),
        (pps_log_weights, dict(inclusion=None), "needs inclusion"),
        (counts_log_weights, dict(counts=counts, num_samples=4), r"num_samples \[4, 4\] differs"),
        (counts_log_weights, dict(counts=counts.float()), "non-negative integers"),
        (counts_log_weights, dict(counts=-counts), "non-negative integers"),
        (counts_log_weights, dict(counts=counts, tau=0.0), "tau must be > 0"),
        (counts_log_weights, dict(counts=counts, tau=-1.0), "tau must be > 0"),
        (inclusion_log_weights, dict(num_samples=-1), "num_samples must be >= 0"),
        (pps_log_weights, dict(inclusion=P * 3), r"inclusion must lie in \[0, 1\]"),
    ]
    for log_weights, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            log_weights(pi, kept, **kwargs)
    with pytest.raises(ValueError, match="kept must be exactly the entries with counts > 0"):
        counts_log_weights(pi, ~kept, counts)
    with pytest.raises(ValueError, match=r"kept must be a bool tensor of shape \(2, 4\)"):
        inclusion_log_weights(pi, kept[:, :3], 3)
    with pytest.raises(ValueError, match="proposal probability 0"):
        inclusion_log_weights(torch.tensor([[0.0, 1.0]]), torch.tensor([[True, True]]), 3)
    with pytest.raises(ValueError, match="negative"):
        inclusion_log_weights(torch.tensor([[-0.5, 1.5]]), torch.tensor([[True, True]]), 3)


def test_attention_rejects_bad_shapes():
    q, key, value = randn(4, 1, 8, seed=0), randn(2, 5, 8, seed=1), randn(2, 5, 3, seed=2)
    lw = torch.zeros(2, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"log_weights must be \[Hkv, n\] = \(2, 5\)"):
        corrected_attention(q, key, value, lw[:, :4], scale=1.0)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        corrected_attention(q[:3], key, value, lw, scale=1.0)
    with pytest.raises(ValueError, match="t = 0"):
        corrected_attention(q, key[:, :0], value[:, :0], lw[:, :0], scale=1.0)
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        corrected_attention(q, key, value, torch.full((2, 5), math.inf), scale=1.0)
    with pytest.raises(ValueError, match="causal_offset must be None or an integer >= 0, got -1"):
        corrected_attention(q, key, value, lw, scale=1.0, causal_offset=-1)
    with pytest.raises(ValueError, match="expected query"):
        corrected_attention_reference(
            q[0, 0], key[0], value[0], lw[0, :4], key[0, :0], value[0, :0], scale=1.0
        )
    with pytest.raises(ValueError, match="exceeds 700"):
        corrected_attention_reference(
            q[0, 0], key[0] * 1e3, value[0], lw[0], key[0, :0], value[0, :0], scale=1.0
        )
