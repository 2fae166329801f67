"""Online decode statistics (probkv.scores.decode_statistics, S2, S10.5) against slow references."""

from __future__ import annotations

import math

import pytest
import torch

from probkv._checks import check_positive_int
from probkv.models.testing import tiny_scorer
from probkv.scores import (
    SCORE_NAMES,
    SCORE_TABLE,
    Param,
    Scores,
    ScoreSpec,
    compute_scores,
    needs_reconstruction,
    score_spec,
)
from probkv.scores.decode_statistics import (
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
    import probkv.scores.decode_statistics as module

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


@pytest.mark.parametrize(
    "name",
    # kvzap reads the values through a scorer trained for a model (none for random tensors)
    [
        n
        for n in SCORE_NAMES
        if "value" in score_spec(n).inputs and not needs_reconstruction(n) and n != "kvzap"
    ],
)
def test_value_norm_declarations_match_the_functions(name):
    """A row declares ``value_norm`` exactly when scaling one entry's value by c adds log c
    to that entry's log-score against the others' (up to a per-head normalisation): what
    from_prompt divides out."""
    gen = torch.Generator().manual_seed(2)
    hkv, g, t, d = 2, 1, 10, 8  # one query head per group: no mixing of normalised heads
    query = torch.randn(hkv * g, t, d, generator=gen, dtype=torch.float64).float()
    key = torch.randn(hkv, t, d, generator=gen)
    value = torch.randn(hkv, t, d, generator=gen)
    scaled = value.clone()
    scaled[:, 3] *= 4.0
    base = compute_scores(name, query, key, value, scale=0.3).log_scores
    moved = compute_scores(name, query, key, scaled, scale=0.3).log_scores
    diff = (moved - base).double()
    diff = diff - diff[:, :1]  # log-scores may be normalised per head: compare differences
    expected = torch.zeros_like(diff)
    if score_spec(name).value_norm:
        expected[:, 3] = math.log(4.0)
    torch.testing.assert_close(diff, expected, rtol=0, atol=1e-5)


def test_from_prompt_divides_value_norms_out_of_a_value_norm_score():
    """min-h's prompt scores are column sums times ||v_i||: its decode column sums start from
    the column sums alone (normalised like the prompt's proposal), h2o-h's from its scores."""
    gen = torch.Generator().manual_seed(3)
    hkv, t = 2, 6
    sums = torch.rand(hkv, t, generator=gen, dtype=torch.float64) + 0.1
    values = torch.randn(hkv, t, 4, generator=gen)
    norms = values.double().norm(dim=-1)
    kept = [torch.arange(t), torch.arange(t)]
    started = {}
    for name, scores_ in (("min-h", sums * norms), ("h2o-h", sums)):
        pi = scores_ / scores_.sum(-1, keepdim=True)
        started[name] = DecodeStatistics.from_prompt(
            name,
            {},
            prompt_log_scores=pi.log().float(),
            last_query_attention=pi.float(),
            kept=kept,
            values=values,
        ).sums
    torch.testing.assert_close(started["min-h"], started["h2o-h"], rtol=1e-6, atol=1e-12)
    with pytest.raises(ValueError, match="value norms"):
        DecodeStatistics.from_prompt(
            "min-h",
            {},
            prompt_log_scores=sums.log().float(),
            last_query_attention=sums.float(),
            kept=kept,
        )


def test_observation_clamps_the_rows_parameter_the_row_declares(monkeypatch):
    """The parameter named by a row's ``last_rows`` (not a name known in advance) shrinks to
    the decode rows seen when a stage observes after fewer rows than it asks for."""
    seen = []

    def last_n(query, key, *, rows: int = 5):
        seen.append(rows)
        return Scores(torch.zeros(key.shape[0], key.shape[1]))

    row = ScoreSpec(
        last_n, ("query", "key"), {"rows": Param(5, check_positive_int)}, last_rows="rows"
    )
    monkeypatch.setitem(SCORE_TABLE, "last-n", row)
    t = 4
    stats = DecodeStatistics.from_prompt(
        "last-n",
        {"rows": 5},
        prompt_log_scores=torch.full((1, t), 1 / t).log(),
        last_query_attention=torch.full((1, t), 1 / t),
        kept=[torch.arange(t)],
    )
    for _ in range(2):  # two decode rows
        n = stats.width + 1
        stats.observe(torch.full((1, 1, 1, n), 1 / n), torch.randn(1, 1, 8))
    keys = torch.randn(1, stats.width, 8)
    stats.observation([0], keys, keys, scale=0.3, layer_idx=0, rank=0)
    assert seen == [2]


def test_a_fixed_score_keeps_each_entrys_score_from_when_it_entered():
    """S10.5, S11: kvzap (a ``fixed`` row) under stages: the prompt's kept entries keep their
    prefill scores, the tail's are scored once at ``enter`` from every head's entries, and after
    ``keep`` each head's observation is the whole sequence's scores of the entries it holds
    (the 4 sinks forced); ragged heads are read one at a time."""
    gen = torch.Generator().manual_seed(1)
    hkv, d, t, m = 2, 8, 10, 5
    scorer = tiny_scorer(hkv, d)
    params = {"surrogate": scorer, "sinks": 4}
    key = torch.randn(hkv, t + m, d, generator=gen)
    value = torch.randn(hkv, t + m, d, generator=gen)
    whole = compute_scores("kvzap", None, key, value, scale=1.0, layer_idx=0, **params)
    prompt = compute_scores(
        "kvzap", None, key[:, :t], value[:, :t], scale=1.0, layer_idx=0, **params
    )
    kept = [torch.tensor([0, 1, 2, 3, 6, 8]), torch.tensor([0, 1, 2, 3, 5, 7, 9])]
    stats = DecodeStatistics.from_prompt(
        "kvzap",
        params,
        prompt_log_scores=prompt.log_scores,
        last_query_attention=torch.rand(hkv, t, generator=gen),
        kept=kept,
        prompt_forced=prompt.forced,
    )
    query = torch.randn(hkv * 3, 1, d, generator=gen)
    for _ in range(m):
        stats.observe(torch.rand(hkv, 3, 1, max(stats.lengths) + 1, generator=gen), query)
    stats.enter(key[:, t:], value[:, t:], first_position=t, layer_idx=0)
    for h, idx in enumerate(kept):
        held = torch.cat([idx, torch.arange(t, t + m)])
        n = len(held)
        obs = stats.observation(
            [h], key[h : h + 1, :n], value[h : h + 1, :n], scale=1.0, layer_idx=0, rank=0
        )
        torch.testing.assert_close(obs.log_scores[0], whole.log_scores[h, held])
        assert torch.equal(obs.forced[0], held < 4)
    stats.keep([torch.tensor([0, 4, 7]), torch.tensor([1, 6, 11])])
    obs = stats.observation([0, 1], key[:, :3], value[:, :3], scale=1.0, layer_idx=0, rank=0)
    expected = torch.stack([whole.log_scores[0, [0, 6, t + 1]], whole.log_scores[1, [1, 9, t + 4]]])
    torch.testing.assert_close(obs.log_scores, expected)
    assert obs.forced.tolist() == [[True, False, False], [True, False, False]]
    with pytest.raises(ValueError, match="pass its entries' scores"):
        DecodeStatistics("kvzap", params, torch.zeros(0, hkv, 3), torch.zeros(hkv, 3), [3, 3], 3)
