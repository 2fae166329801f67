"""probkv.scores.observation: a prefill observed in chunks (PrefillStatistics) observes exactly what
one pass over the whole prompt (observe_layer) observes, for every score; where it cannot
(harmonic weights of an unknown final length) it refuses by name (issue 11, S2)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probkv.models.testing import tiny_scorer
from probkv.scores import SCORE_NAMES, SCORE_TABLE, column_sums_needed
from probkv.scores.observation import PrefillStatistics, observe_layer

torch.set_num_threads(1)

F64 = torch.float64
# Scores of the prefill's own rows (a reconstruction score reads a pass run after prefill).
PREFILL_SCORES = [n for n in SCORE_NAMES if SCORE_TABLE[n].source == "prefill"]


def make_layer(t, hkv=2, g=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = 1.5 * torch.randn(hkv * g, t, d, generator=gen, dtype=F64)
    k = torch.randn(hkv, t, d, generator=gen, dtype=F64)
    v = torch.randn(hkv, t, d, generator=gen, dtype=F64)
    return q, k, v


def params_of(name):
    if name == "kvzap":  # S11: a trained scorer of these layers (tests/scores/test_surrogate.py)
        return {"surrogate": tiny_scorer(2, 8, 8, layers=(0, 3))}
    return {"window": 5} if name == "snapkv" else {}


def observe_in_chunks(name, q, k, v, bounds, *, prompt_length):
    stats = PrefillStatistics(name, params_of(name), 0.3, prompt_length=prompt_length)
    outputs = []
    for a, b in itertools.pairwise(bounds):
        outputs.append(stats.add_chunk(q[:, a:b], k[:, :b], v[:, :b]))
    t = bounds[-1]
    return torch.cat(outputs, 1), stats.observe(k[:, :t], v[:, :t], layer_idx=3, rank=1)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(PREFILL_SCORES),
    t=st.integers(1, 40),
    cuts=st.lists(st.integers(1, 39), max_size=4),
)
def test_chunks_observe_what_one_pass_observes(name, t, cuts):
    """Any split of the prompt into chunks, the final length given (what compress and a
    cache with prompt_length do): same output rows, same log-scores, forced entries and last
    query attention as observe_layer on the whole prompt (float64, to 1e-12)."""
    q, k, v = make_layer(t, seed=t)
    bounds = sorted({0, t, *(c for c in cuts if c < t)})
    out, obs = observe_in_chunks(name, q, k, v, bounds, prompt_length=t)
    ref_out, ref = observe_layer(
        q, k, v, scale=0.3, score=name, score_params=params_of(name), layer_idx=3, rank=1
    )
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(obs.log_scores, ref.log_scores, rtol=0, atol=1e-6)
    torch.testing.assert_close(obs.last_query_attention, ref.last_query_attention)
    assert (obs.forced is None) == (ref.forced is None)
    if ref.forced is not None:
        assert torch.equal(obs.forced, ref.forced)
    assert (obs.layer_idx, obs.rank) == (3, 1)


@pytest.mark.parametrize("name", [n for n in PREFILL_SCORES if column_sums_needed(n) != "harmonic"])
def test_unknown_length_accumulates_exactly_but_for_harmonic_scores(name):
    """Without the final length, every score but h2o-h and min-h still accumulates exactly."""
    t = 23
    q, k, v = make_layer(t, seed=1)
    _, obs = observe_in_chunks(name, q, k, v, [0, 9, 10, 23], prompt_length=None)
    _, ref = observe_layer(q, k, v, scale=0.3, score=name, score_params=params_of(name))
    torch.testing.assert_close(obs.log_scores, ref.log_scores, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", [n for n in PREFILL_SCORES if column_sums_needed(n) == "harmonic"])
def test_harmonic_scores_refuse_a_second_chunk_of_unknown_length(name):
    q, k, v = make_layer(12, seed=2)
    stats = PrefillStatistics(name, {}, 0.3)
    stats.add_chunk(q[:, :6], k[:, :6], v[:, :6])  # a whole prompt of 6 tokens, maybe
    with pytest.raises(ValueError, match=rf"score '{name}'.*prompt_length=N.*prefill_chunk_size"):
        stats.add_chunk(q[:, 6:], k, v)
    # One chunk is a whole prompt: exactly what one pass observes.
    _, ref = observe_layer(q[:, :6], k[:, :6], v[:, :6], scale=0.3, score=name)
    torch.testing.assert_close(stats.observe(k[:, :6], v[:, :6]).log_scores, ref.log_scores)


def test_chunks_must_continue_and_fit_the_prompt():
    q, k, v = make_layer(10)
    stats = PrefillStatistics("h2o", {}, 0.3, prompt_length=8)
    stats.add_chunk(q[:, :4], k[:, :4], v[:, :4])
    with pytest.raises(ValueError, match="must continue the 4 rows seen, got 2 rows at positions"):
        stats.add_chunk(q[:, 5:7], k[:, :7], v[:, :7])
    with pytest.raises(ValueError, match="the prompt has 10 tokens, beyond prompt_length=8"):
        stats.add_chunk(q[:, 4:], k, v)
