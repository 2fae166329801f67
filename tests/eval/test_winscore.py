"""Win score and average total score on hand-made tables (S7; paper Section 7)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from probkv.eval.winscore import (
    average_total_score,
    average_total_scores,
    example_ranks,
    head_to_head,
    kept_of_full,
    score_table,
    sign_test_p,
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


def _sign_test_by_enumeration(wins: int, losses: int) -> float:
    """Slow reference: walk all 2^n equally likely sign sequences and count those at least as
    far from n / 2 as the one observed."""
    n = wins + losses
    far = abs(wins - n / 2)
    hits = sum(1 for bits in itertools.product((0, 1), repeat=n) if abs(sum(bits) - n / 2) >= far)
    return hits / 2**n


@pytest.mark.parametrize("n", range(13))
def test_sign_test_equals_the_enumeration_of_every_sign_sequence(n):
    for wins in range(n + 1):
        p = sign_test_p(wins, n - wins)
        assert p == pytest.approx(_sign_test_by_enumeration(wins, n - wins), abs=1e-15)


def test_sign_test_known_values_and_limits():
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(5, 5) == 1.0
    assert sign_test_p(10, 0) == 2 / 2**10
    assert sign_test_p(0, 1) == 1.0  # one sign says nothing
    # large n: no float overflow, and a lopsided count is tiny
    assert 0.0 < sign_test_p(400, 600) < 1e-9
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="wins must be an integer >= 0"):
            sign_test_p(bad, 3)


@given(st.integers(0, 200), st.integers(0, 200))
@settings(max_examples=200, deadline=None)
def test_sign_test_is_symmetric_and_grows_towards_a_tie(wins, losses):
    p = sign_test_p(wins, losses)
    assert 0.0 < p <= 1.0
    assert p == sign_test_p(losses, wins)
    if wins > losses:  # one more win moved to a loss brings the count nearer a tie
        assert sign_test_p(wins - 1, losses + 1) >= p


def test_head_to_head_by_hand():
    table = {
        "t1": {"a": {"A": 1.0, "B": 0.0, "C": 1.0}, "b": {"A": 0.5, "B": 0.5, "C": 0.0}},
        "t2": {"c": {"A": 0.0, "B": 1.0, "C": 0.0}, "d": {"A": 1.0, "B": 0.0, "C": 0.0},
               "e": {"A": 1.0, "B": 0.0, "C": 1.0}},
    }  # fmt: skip
    h = head_to_head(table, "A", "B")
    assert {k: h[k] for k in ("examples", "won", "lost", "tied")} == {
        "examples": 5, "won": 3, "lost": 1, "tied": 1,
    }  # fmt: skip
    assert h["p"] == pytest.approx(10 / 16)  # P(X <= 1) * 2 for n = 4
    # ranked alone (C ignored): t1 A 2/2, B 1/2; t2 A 2/3, B 1/3 -> means over tasks
    assert h["win_score"] == pytest.approx((1 + 2 / 3) / 2)
    assert h["reference_win_score"] == pytest.approx((0.5 + 1 / 3) / 2)
    with pytest.raises(ValueError, match="two different methods"):
        head_to_head(table, "A", "A")
    with pytest.raises(ValueError, match=r"\['D'\] not in the score table"):
        head_to_head(table, "A", "D")


_pair_tables = st.dictionaries(
    st.sampled_from(["t1", "t2", "t3"]),
    st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0]), st.sampled_from([0.0, 0.5, 1.0])),
             min_size=1, max_size=6),
    min_size=1,
)  # fmt: skip


@given(_pair_tables)
@settings(max_examples=100, deadline=None)
def test_pair_win_score_difference_is_the_task_weighted_won_lost_margin(rows):
    """Ranked alone, A's win score minus B's is the mean over tasks of (won - lost) / examples:
    so A's win score >= B's exactly when that margin is >= 0."""
    table = {
        t: {f"{t}{i}": {"A": a, "B": b} for i, (a, b) in enumerate(r)} for t, r in rows.items()
    }
    h = head_to_head(table, "A", "B")
    margin = sum(
        (sum(a > b for a, b in r) - sum(a < b for a, b in r)) / len(r) for r in rows.values()
    ) / len(rows)
    assert h["win_score"] - h["reference_win_score"] == pytest.approx(margin, abs=1e-12)
    assert h["won"] + h["lost"] + h["tied"] == h["examples"] == sum(len(r) for r in rows.values())
