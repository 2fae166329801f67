"""Online decode statistics (probkv.decode_statistics, S2, S10.5) against slow references."""

from __future__ import annotations

import math

import pytest
import torch

from probkv.decode_statistics import (
    DecodeStatistics,
    decode_probabilities,
    harmonic_kernel,
)


def test_harmonic_kernel_is_one_over_distance():
    """The exponential sum stays within 0.1 % of 1/x over 1..10^4 decode steps."""
    x = torch.arange(1, 10_001)
    ratio = harmonic_kernel(x) * x
    assert float((ratio - 1).abs().max()) < 1e-3


def test_decode_probabilities_match_a_per_head_softmax():
    """Batched, padded and causal: each head's rows equal a plain softmax over its entries."""
    gen = torch.Generator().manual_seed(0)
    hkv, g, q, d = 3, 2, 3, 8
    lengths = [7, 5, 9]
    keys = torch.randn(hkv, 9, d, generator=gen)
    logw = torch.randn(hkv, 9, generator=gen)
    query = torch.randn(hkv * g, q, d, generator=gen)
    probs = decode_probabilities(query, keys, logw, lengths, 0.3)
    for h, n in enumerate(lengths):
        for r in range(q):
            visible = n - q + r + 1
            logits = query[h * g : (h + 1) * g, r] @ keys[h, :visible].T * 0.3 + logw[h, :visible]
            expected = torch.softmax(logits, -1)
            torch.testing.assert_close(probs[h, :, r, :visible], expected)
            assert not probs[h, :, r, visible:].any()


@pytest.mark.parametrize("score", ["h2o", "h2o-h"])
def test_online_column_sums_equal_the_weighted_sum_of_rows(score):
    """Steps one at a time (and one forward of 2 rows), eviction of some entries in between:
    the accumulated sums equal sum_j w(T - j + 1) p_j(i) computed from every row kept aside,
    with w = 1 (h2o) or the harmonic kernel (h2o-h), plus the prompt's rows."""
    gen = torch.Generator().manual_seed(1)
    hkv, g, t = 2, 2, 6
    prompt = torch.softmax(torch.randn(hkv, t, generator=gen), -1)
    kept = [torch.tensor([0, 2, 3, 5]), torch.tensor([1, 2, 4, 5])]
    stats = DecodeStatistics.from_prompt(
        score,
        {},
        prompt_log_scores=prompt.log(),
        last_query_attention=prompt,
        kept=kept,
    )
    rows = []  # (step, [Hq, n] probabilities over the entries held then)
    held = 4
    steps = [1, 1, 2, 1]
    for step, q in enumerate(steps):
        held += q
        probs = torch.softmax(torch.randn(hkv, g, q, held, generator=gen), -1)
        stats.observe(probs, torch.randn(hkv * g, q, 4, generator=gen))
        for r in range(q):
            rows.append((step, r, q, probs[:, :, r].reshape(hkv * g, held)))
    total_rows = sum(steps)
    weight = (lambda x: torch.ones_like(x)) if score == "h2o" else harmonic_kernel
    expected = torch.zeros(hkv * g, held, dtype=torch.float64)
    for j, (_, _, _, p) in enumerate(rows, start=1):
        distance = torch.tensor([float(total_rows - j + 1)])
        expected[:, : p.shape[1]] += weight(distance).double() * p.double()
    # the prompt's rows: its proposal times their total weight
    distances = torch.arange(total_rows + 1, total_rows + t + 1, dtype=torch.float64)
    mass = float(t) if score == "h2o" else float(weight(distances).sum())
    for h, idx in enumerate(kept):
        expected[h * g : (h + 1) * g, :4] += mass * prompt[h, idx].double()
    got = stats.column_sums([0, 1], held)
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-6)
    # a stage keeps some entries: their sums follow them
    stats.keep([torch.tensor([0, 3, 8]), torch.tensor([1, 2])])
    assert stats.lengths == [3, 2]
    got = stats.column_sums([0], 3)
    torch.testing.assert_close(got, expected[:g, [0, 3, 8]].float(), rtol=1e-5, atol=1e-6)
    assert math.isclose(float(stats.column_sums([1], 3)[:, 2].abs().max()), 0.0)


@pytest.mark.parametrize("score", ["h2o", "h2o-h"])
def test_pending_rows_flush_whenever_full(monkeypatch, score):
    """Rows wait in a small buffer (3 rows here) before they enter the sums: flushes when it
    is full, a forward longer than the buffer, growing widths and a stage in between leave the
    sums equal to sum_j w(T - j + 1) p_j(i), computed from every row kept aside."""
    import probkv.decode_statistics as module

    monkeypatch.setattr(module, "PENDING_ROWS", 3)
    gen = torch.Generator().manual_seed(2)
    hkv, g, t = 2, 3, 5
    prompt = torch.softmax(torch.randn(hkv, t, generator=gen), -1)
    stats = DecodeStatistics.from_prompt(
        score,
        {},
        prompt_log_scores=prompt.log(),
        last_query_attention=prompt,
        kept=[torch.arange(t), torch.arange(t)],
    )
    weight = (lambda x: torch.ones_like(x)) if score == "h2o" else harmonic_kernel
    rows, held = [], t
    for q in [1, 2, 1, 4, 1, 1, 1, 2, 1]:
        held += q
        probs = torch.softmax(torch.randn(hkv, g, q, held, generator=gen), -1)
        stats.observe(probs, torch.randn(hkv * g, q, 4, generator=gen))
        rows.extend(probs[:, :, r].reshape(hkv * g, held) for r in range(q))

    def expected_at(total: int) -> torch.Tensor:
        """The sums ``total`` rows after the prompt, over the rows kept aside (and the prompt)."""
        sums = torch.zeros(hkv * g, held, dtype=torch.float64)
        for j, p in enumerate(rows, start=1):
            sums[:, : p.shape[1]] += weight(torch.tensor([float(total - j + 1)])).double() * p
        distances = torch.arange(total + 1, total + t + 1, dtype=torch.float64)
        mass = float(t) if score == "h2o" else float(weight(distances).sum())
        sums[:, :t] += mass * prompt.double().repeat_interleave(g, 0)
        return sums

    got = stats.column_sums([0, 1], held)
    torch.testing.assert_close(got, expected_at(len(rows)).float(), rtol=1e-5, atol=1e-6)
    kept = [[1, 4, 12], [0, 18]]
    stats.keep([torch.tensor(k) for k in kept])
    probs = torch.softmax(torch.randn(hkv, g, 1, 4, generator=gen), -1)
    probs[1, :, :, 3] = 0.0  # head 1 holds 3 entries: the 4th is padding
    stats.observe(probs, torch.randn(hkv * g, 1, 4, generator=gen))
    before = expected_at(len(rows) + 1)
    expected = torch.zeros(hkv * g, 4, dtype=torch.float64)
    for h, cols in enumerate(kept):
        expected[h * g : (h + 1) * g, : len(cols)] = before[h * g : (h + 1) * g, cols]
    expected += weight(torch.tensor([1.0])).double() * probs.reshape(hkv * g, 4).double()
    got = stats.column_sums([0, 1], 4)
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-6)
