"""Win score and average total score on hand-made tables (S7; paper Section 7)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from probkv.eval.winscore import (
    average_total_score,
    average_total_scores,
    example_ranks,
    kept_of_full,
    score_table,
    task_averages,
    win_scores,
    win_scores_per_task,
)


def test_ties_count_as_wins_for_every_tied_method():
    # Scores [1, 1, 0]: A and B each beat C and tie with each other -> a tie is a win, rank 2.
    assert example_ranks({"A": 1.0, "B": 1.0, "C": 0.0}) == {"A": 2, "B": 2, "C": 0}
    # All tied: everyone "wins" against the n - 1 others.
    assert example_ranks({"A": 0.5, "B": 0.5, "C": 0.5}) == {"A": 2, "B": 2, "C": 2}
    # No ties: 0 = worst, n - 1 = best.
    assert example_ranks({"A": 0.9, "B": 0.5, "C": 0.1}) == {"A": 2, "B": 1, "C": 0}
    # Partial tie among 4: A beats nobody (0); B and C beat A and tie each other (2); D beats all (3).
    assert example_ranks({"A": 0.2, "B": 0.7, "C": 0.7, "D": 0.9}) == {
        "A": 0,
        "B": 2,
        "C": 2,
        "D": 3,
    }


def test_single_rows_normalised_by_n_minus_one():
    assert win_scores({"t": {"e": {"A": 1.0, "B": 1.0, "C": 0.0}}}) == {
        "A": 1.0,
        "B": 1.0,
        "C": 0.0,
    }
    assert win_scores({"t": {"e": {"A": 0.3, "B": 0.3, "C": 0.3}}}) == {
        "A": 1.0,
        "B": 1.0,
        "C": 1.0,
    }
    assert win_scores({"t": {"e": {"A": 0.9, "B": 0.5, "C": 0.1}}}) == {
        "A": 1.0,
        "B": 0.5,
        "C": 0.0,
    }


def test_tasks_count_equally():
    table = {
        # One example: ranks A=2, B=1, C=0 -> A=1, B=1/2, C=0.
        "t1": {"x": {"A": 1.0, "B": 0.5, "C": 0.0}},
        # Three examples: all tied (2, 2, 2); C > B > A (0, 1, 2); A = B > C (2, 2, 0).
        # Rank sums A=4, B=5, C=4; means /3, then /2: A=2/3, B=5/6, C=2/3.
        "t2": {
            "y1": {"A": 0.0, "B": 0.0, "C": 0.0},
            "y2": {"A": 0.1, "B": 0.2, "C": 0.3},
            "y3": {"A": 1.0, "B": 1.0, "C": 0.0},
        },
    }
    per_task = win_scores_per_task(table)
    assert per_task["t1"] == pytest.approx({"A": 1.0, "B": 0.5, "C": 0.0})
    assert per_task["t2"] == pytest.approx({"A": 2 / 3, "B": 5 / 6, "C": 2 / 3})
    # Mean over the two tasks: A=(1 + 2/3)/2=5/6, B=(1/2 + 5/6)/2=2/3, C=(0 + 2/3)/2=1/3.
    # (Weighting by examples instead would give A = (2 + 4) / 4 / 2 = 3/4.)
    assert win_scores(table) == pytest.approx({"A": 5 / 6, "B": 2 / 3, "C": 1 / 3})


def test_average_total_score_weights_splits_by_their_share_of_examples():
    # Split a: mean 1/2 over 2 examples; split b: mean 3/4 over 4. Weights 2/6 and 4/6:
    # 1/2 * 2/6 + 3/4 * 4/6 = 1/6 + 1/2 = 2/3 (= the mean over all 6 examples).
    assert average_total_score({"a": [1.0, 0.0], "b": [1.0, 1.0, 1.0, 0.0]}) == pytest.approx(2 / 3)
    table = {
        "a": {"e1": {"M": 1.0, "N": 0.0}, "e2": {"M": 0.0, "N": 0.0}},
        "b": {"f1": {"M": 1.0, "N": 1.0}},
    }
    # M: (1 + 0 + 1) / 3 = 2/3; N: 1/3. Task means: a: M 1/2, N 0; b: M 1, N 1.
    assert average_total_scores(table) == pytest.approx({"M": 2 / 3, "N": 1 / 3})
    assert task_averages(table) == {"a": {"M": 0.5, "N": 0.0}, "b": {"M": 1.0, "N": 1.0}}


def test_score_table_from_rows():
    rows = [
        {"task": "t", "id": "e1", "method": "A", "score": 1.0, "ratio": 0.5},
        {"task": "t", "id": "e1", "method": "B", "score": 0.0, "ratio": 0.5},
    ]
    assert score_table(rows) == {"t": {"e1": {"A": 1.0, "B": 0.0}}}
    with pytest.raises(ValueError, match="duplicate"):
        score_table([*rows, rows[0]])
    with pytest.raises(ValueError, match="keys"):
        score_table([{"task": "t"}])


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="non-empty"):
        win_scores({})
    with pytest.raises(ValueError, match="different methods"):
        win_scores({"t": {"e1": {"A": 1.0, "B": 0.0}, "e2": {"A": 1.0}}})
    with pytest.raises(ValueError, match="at least 2 methods"):
        win_scores({"t": {"e1": {"A": 1.0}}})
    with pytest.raises(ValueError, match="finite"):
        win_scores({"t": {"e1": {"A": math.nan, "B": 0.0}}})
    with pytest.raises(ValueError, match="no examples"):
        win_scores({"t": {}})
    with pytest.raises(ValueError, match="non-empty list"):
        average_total_score({"a": []})


_scores = st.sampled_from([0.0, 0.25, 0.5, 1.0])  # few values, so ties are frequent


@settings(max_examples=50, deadline=None)
@given(
    rows=st.lists(st.lists(_scores, min_size=3, max_size=3), min_size=1, max_size=6),
    tasks=st.integers(1, 3),
)
def test_win_score_properties(rows, tasks):
    methods = ["A", "B", "C"]
    table = {f"t{i % tasks}": {} for i in range(len(rows))}
    for i, row in enumerate(rows):
        table[f"t{i % tasks}"][f"e{i}"] = dict(zip(methods, row, strict=True))
    table = {t: ex for t, ex in table.items() if ex}
    ws = win_scores(table)
    assert all(0.0 <= v <= 1.0 for v in ws.values())
    # Ranks depend only on the order of the scores: a strictly increasing map changes nothing.
    squashed = {
        t: {e: {m: s**3 + 2 for m, s in sc.items()} for e, sc in ex.items()}
        for t, ex in table.items()
    }
    assert win_scores(squashed) == pytest.approx(ws)
    # Renaming methods permutes the result.
    renamed = {
        t: {e: {m.lower(): s for m, s in sc.items()} for e, sc in ex.items()}
        for t, ex in table.items()
    }
    assert win_scores(renamed) == pytest.approx({m.lower(): v for m, v in ws.items()})
    # Per example, ranks sum to n(n-1)/2 without ties and more with ties (ties are wins).
    for examples in table.values():
        for sc in examples.values():
            total = sum(example_ranks(sc).values())
            assert total == 3 if len(set(sc.values())) == 3 else total > 3


def test_kept_of_full_by_hand():
    """min(s, f) summed over the common ids, over full's total; luck (s > f) is not kept."""
    full = {"a": 1.0, "b": 0.5, "c": 0.0, "d": 1.0}
    scores = {"a": 0.25, "b": 1.0, "c": 1.0, "e": 1.0}  # "d" not run yet, "e" not in full
    assert kept_of_full(scores, full) == {
        "examples": 3,
        "kept": pytest.approx((0.25 + 0.5 + 0.0) / 1.5),
        "below": 1,
        "above": 2,
    }
    assert kept_of_full({"c": 1.0}, full)["kept"] is None  # full answers nothing here
    with pytest.raises(ValueError, match=r"score of example 'a' must be a finite number"):
        kept_of_full({"a": math.nan}, full)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=20))
def test_kept_of_full_is_a_share_and_full_keeps_all(pairs):
    scores = {str(i): s for i, (s, _) in enumerate(pairs)}
    full = {str(i): f for i, (_, f) in enumerate(pairs)}
    out = kept_of_full(scores, full)
    if out["kept"] is not None:
        assert 0.0 <= out["kept"] <= 1.0 + 1e-12
        assert kept_of_full(full, full)["kept"] == pytest.approx(1.0)
    assert out["below"] + out["above"] <= out["examples"] == len(pairs)
