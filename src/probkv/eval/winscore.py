"""Win score and average total score (S7; paper Section 7).

A score table holds one score in [0, 1] per (task, example, method)::

    table[task][example_id][method] = score

(:func:`score_table` builds it from result rows). Every example must be scored for the same
set of methods.

**Win score.** For each example the ``n`` methods are ranked by score, 0 = worst and
``n - 1`` = best. The paper: "If multiple methods achieve the same score, they are all given
the rank corresponding to a win against the other tied methods." So a tie counts as a win
for each of the tied methods, and a method's rank is the number of *other* methods whose
score is lower than or equal to its own: ``rank(m) = #{m' != m : s(m') <= s(m)}``. Scores
``[1, 1, 0]`` give ranks ``[2, 2, 0]`` (not ``[1, 1, 0]``), and a row where all methods tie
gives every method ``n - 1``. This is what makes the paper's win-score curves rise at extreme
compression ("ties are also rewarded"), where all methods fail alike. Ranks are averaged over
the examples of each task, then over tasks (each task counts equally), and divided by
``n - 1`` into [0, 1]. Ties are exact float equality (scores of identical predictions are
identical floats).

**Average total score.** Split (task) averages weighted by each split's share of the
examples, ``sum_s (N_s / N) * mean_s`` (which equals the mean over all examples).

**Answers kept of the full cache's** (not in the paper). ``sum_i min(s_i, f_i) / sum_i f_i``
over the examples both have, ``f`` the full cache's score: the share of what the model
answers with its whole cache that it still answers after eviction. An example that eviction
gets right and the full cache gets wrong (luck: the evicted prompt reads differently) adds
nothing, where it lifts the average score and the win score; such examples are counted apart.

**Head to head** (not in the paper). Two methods on the examples both have: examples won,
lost and tied, the win score of the two ranked alone, and an exact two-sided sign test of
"neither is better" (ties dropped). Ranked alone, ``A``'s win score minus ``B``'s is the
task-weighted mean of ``(won - lost) / examples``, so "A's win score >= B's" (the bar a
``prob:`` method must clear against its top-k version) is a statement about the won-lost
count, and the sign test says whether that count is more than the noise of a tie.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ScoreTable = Mapping[str, Mapping[str, Mapping[str, float]]]


def _check_score(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"score of {where} must be a finite number, got {value!r}")
    return float(value)


def _check_table(table: ScoreTable) -> tuple[str, ...]:
    """Validate the table; return the (sorted) method names shared by every example."""
    if not isinstance(table, Mapping) or not table:
        raise ValueError(
            "score table must be a non-empty mapping task -> example -> method -> score"
        )
    methods: tuple[str, ...] | None = None
    for task, examples in table.items():
        if not isinstance(examples, Mapping) or not examples:
            raise ValueError(f"task {task!r} has no examples in the score table")
        for example, scores in examples.items():
            if not isinstance(scores, Mapping):
                raise ValueError(
                    f"scores of task {task!r}, example {example!r} must be a mapping method -> score"
                )
            for method, value in scores.items():
                _check_score(value, f"task {task!r}, example {example!r}, method {method!r}")
            names = tuple(sorted(scores))
            if methods is None:
                methods = names
            elif names != methods:
                missing = sorted(set(methods) - set(names))
                extra = sorted(set(names) - set(methods))
                raise ValueError(
                    f"task {task!r}, example {example!r} is scored for different methods than the "
                    f"rest of the table (missing {missing}, extra {extra}); every example needs "
                    "the same methods"
                )
    return methods or ()


def example_ranks(scores: Mapping[str, float]) -> dict[str, int]:
    """Ranks of the methods on one example: ``#{other methods with score <= own score}``
    (0 = worst, ``n - 1`` = best; ties count as wins for every tied method, S7)."""
    values = {m: _check_score(s, f"method {m!r}") for m, s in scores.items()}
    return {
        m: sum(1 for other, s in values.items() if other != m and s <= v) for m, v in values.items()
    }


def win_scores_per_task(table: ScoreTable) -> dict[str, dict[str, float]]:
    """Per task, each method's mean rank over the task's examples divided by ``n - 1``."""
    methods = _check_table(table)
    n = len(methods)
    if n < 2:
        raise ValueError(f"a win score needs at least 2 methods, got {list(methods)}")
    out: dict[str, dict[str, float]] = {}
    for task, examples in table.items():
        totals = dict.fromkeys(methods, 0.0)
        for scores in examples.values():
            for method, rank in example_ranks(scores).items():
                totals[method] += rank
        out[task] = {m: totals[m] / len(examples) / (n - 1) for m in methods}
    return out


def win_scores(table: ScoreTable) -> dict[str, float]:
    """The win score of each method in [0, 1]: per-task normalised mean ranks, averaged over
    tasks with equal weight (S7)."""
    per_task = win_scores_per_task(table)
    methods = next(iter(per_task.values())).keys()
    return {m: sum(task[m] for task in per_task.values()) / len(per_task) for m in methods}


def task_averages(table: ScoreTable) -> dict[str, dict[str, float]]:
    """Mean score per task and method."""
    methods = _check_table(table)
    return {
        task: {m: sum(s[m] for s in examples.values()) / len(examples) for m in methods}
        for task, examples in table.items()
    }


def average_total_score(split_scores: Mapping[str, Sequence[float]]) -> float:
    """One method's average total score: split averages weighted by each split's share of the
    examples, ``sum_s (N_s / N) mean_s`` (S7). ``split_scores`` maps split -> scores."""
    if not isinstance(split_scores, Mapping) or not split_scores:
        raise ValueError("split_scores must be a non-empty mapping split -> list of scores")
    for split, scores in split_scores.items():
        if isinstance(scores, (str, bytes)) or not isinstance(scores, Sequence) or len(scores) == 0:
            raise ValueError(
                f"split {split!r} must have a non-empty list of scores, got {scores!r}"
            )
        for value in scores:
            _check_score(value, f"split {split!r}")
    total = sum(len(s) for s in split_scores.values())
    return sum(len(s) / total * (sum(s) / len(s)) for s in split_scores.values())


def average_total_scores(table: ScoreTable) -> dict[str, float]:
    """The average total score of every method of a score table (splits = tasks)."""
    methods = _check_table(table)
    return {
        m: average_total_score({task: [s[m] for s in ex.values()] for task, ex in table.items()})
        for m in methods
    }


def score_table(
    rows: Iterable[Mapping[str, Any]],
    *,
    task_key: str = "task",
    example_key: str = "id",
    method_key: str = "method",
    score_key: str = "score",
) -> dict[str, dict[str, dict[str, float]]]:
    """Build a score table from result rows (e.g. the runner's ``results.jsonl`` for one
    ratio). A repeated (task, example, method) raises ValueError."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for i, row in enumerate(rows):
        try:
            task, example, method = row[task_key], row[example_key], row[method_key]
            value = row[score_key]
        except (KeyError, TypeError):
            raise ValueError(
                f"row {i} must have the keys {task_key!r}, {example_key!r}, {method_key!r}, "
                f"{score_key!r}, got {row!r}"
            ) from None
        scores = table.setdefault(task, {}).setdefault(example, {})
        if method in scores:
            raise ValueError(
                f"row {i}: duplicate score for task {task!r}, example {example!r}, method {method!r}"
            )
        scores[method] = _check_score(value, f"row {i}")
    return table


def sign_test_p(wins: int, losses: int) -> float:
    """Exact two-sided sign test: ``P(|X - n/2| >= |wins - n/2|)`` for ``X ~ Binomial(n, 1/2)``,
    ``n = wins + losses`` (ties dropped beforehand), i.e. ``min(1, 2 P(X <= min(wins,
    losses)))``; 1 when ``n = 0``. Integer arithmetic, exact for any ``n``."""
    for value, name in ((wins, "wins"), (losses, "losses")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    n, k = wins + losses, min(wins, losses)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1))
    return min(1.0, 2 * tail / 2**n)


def head_to_head(table: ScoreTable, method: str, reference: str) -> dict[str, Any]:
    """``method`` against ``reference`` on every example of ``table`` (module note).

    Returns ``examples``, ``won`` / ``lost`` / ``tied`` (examples where ``method`` scored
    above / below / equal to ``reference``), ``p`` (:func:`sign_test_p` of won, lost) and
    ``win_score`` / ``reference_win_score`` (:func:`win_scores` of the two ranked alone)."""
    if method == reference:
        raise ValueError(f"head to head needs two different methods, got {method!r} twice")
    methods = _check_table(table)
    missing = [m for m in (method, reference) if m not in methods]
    if missing:
        raise ValueError(f"method(s) {missing} not in the score table; it has {list(methods)}")
    pair = {
        task: {e: {m: s[m] for m in (method, reference)} for e, s in examples.items()}
        for task, examples in table.items()
    }
    diffs = [s[method] - s[reference] for ex in pair.values() for s in ex.values()]
    won, lost = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    win = win_scores(pair)
    return {
        "examples": len(diffs),
        "won": won,
        "lost": lost,
        "tied": len(diffs) - won - lost,
        "p": sign_test_p(won, lost),
        "win_score": win[method],
        "reference_win_score": win[reference],
    }


def kept_of_full(scores: Mapping[str, float], full: Mapping[str, float]) -> dict[str, Any]:
    """What one method keeps of the full cache's answers (module note), from per-example
    scores keyed by example id; only the ids both have count.

    Returns ``examples`` (ids in common), ``kept`` (``sum min(s, f) / sum f``, ``None`` when
    the full cache scores 0 on all of them), ``below`` / ``above`` (examples scored below /
    above the full cache)."""
    common = [i for i in scores if i in full]
    s = {i: _check_score(scores[i], f"example {i!r}") for i in common}
    f = {i: _check_score(full[i], f"example {i!r} (full cache)") for i in common}
    total = sum(f.values())
    return {
        "examples": len(common),
        "kept": sum(min(s[i], f[i]) for i in common) / total if total > 0 else None,
        "below": sum(s[i] < f[i] for i in common),
        "above": sum(s[i] > f[i] for i in common),
    }
