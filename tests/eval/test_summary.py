"""Run summary (probkv.eval.summary): average total score, win score on common examples,
effective ratios, the Markdown tables; checked against values computed by hand (S7)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from probkv.eval.summary import format_bytes, summarize, summary_markdown, write_summary


def hand_rows():
    """Two tasks (A: a1, a2; B: b1), full + m1 + m2 at r = 0.5, m1 also at r = 0.25."""

    def row(id_, task, method, ratio, score, eff, nbytes):
        return {
            "id": id_,
            "task": task,
            "method": method,
            "ratio": ratio,
            "score": score,
            "effective_ratio": eff,
            "cache_bytes": nbytes,
            "prefill_s": 1.0,
            "decode_s": 2.0,
            "model": "hand",
        }

    rows = []
    for id_, task, s_full, s1, s2, e1 in [
        ("a1", "A", 1.0, 1.0, 0.0, 0.48),
        ("a2", "A", 1.0, 0.5, 0.5, 0.50),
        ("b1", "B", 0.0, 0.0, 1.0, 0.52),
    ]:
        rows.append(row(id_, task, "full", 0.0, s_full, 0.0, 400))
        rows.append(row(id_, task, "m1", 0.5, s1, e1, 200))
        rows.append(row(id_, task, "m2", 0.5, s2, 0.5, 100))
    rows.append(row("a1", "A", "m1", 0.25, 1.0, 0.25, 300))
    return rows


def test_summary_by_hand():
    summary = summarize(
        hand_rows(), config={"methods": ["full", "m1", "m2"], "ratios": [0.25, 0.5]}
    )
    entries = {(e["method"], e["ratio"]): e for e in summary["entries"]}
    assert set(entries) == {("full", 0.0), ("m1", 0.25), ("m1", 0.5), ("m2", 0.5)}
    m1, m2, full = entries[("m1", 0.5)], entries[("m2", 0.5)], entries[("full", 0.0)]
    assert m1["task_scores"] == {"A": 0.75, "B": 0.0}
    assert m2["task_scores"] == {"A": 0.25, "B": 1.0}
    # S7 average total score: task means weighted by share, (2/3)*0.75 + (1/3)*0 = 0.5.
    assert m1["average_total"] == pytest.approx(0.5)
    assert m2["average_total"] == pytest.approx(2 / 3 * 0.25 + 1 / 3 * 1.0)
    assert full["average_total"] == pytest.approx(2 / 3)
    assert m1["effective_ratio_mean"] == pytest.approx(0.5)
    assert m1["effective_ratio_std"] == pytest.approx(0.02)  # sample std of 0.48, 0.50, 0.52
    assert m1["cache_bytes_mean"] == 200 and full["cache_bytes_mean"] == 400
    assert entries[("m1", 0.25)]["num_examples"] == 1
    # Win score at r = 0.5 (n = 2 methods, full not ranked; ties are wins for both):
    # a1: m1 1, m2 0; a2: tie, both 1; b1: m1 0, m2 1. Task A: m1 1.0, m2 0.5; task B: m1 0,
    # m2 1. Tasks weigh equally: m1 0.5, m2 0.75.
    (win,) = summary["win_scores"]
    assert win["ratio"] == 0.5 and win["num_examples"] == 3
    assert win["scores"] == pytest.approx({"m1": 0.5, "m2": 0.75})
    # r = 0.25 has one method only: no win score there.
    assert summary["tasks"] == {"A": 2, "B": 1} and summary["num_examples"] == 3
    # Answers kept of full's: full answers a1, a2 (b1 scores 0). m1 keeps 1 + 0.5 of 2 (a2
    # below full); m2 keeps 0 + 0.5 (a1, a2 below), and its b1 win over full is luck, not kept.
    assert m1["kept_of_full"] == {"examples": 3, "kept": 0.75, "below": 1, "above": 0}
    assert m2["kept_of_full"] == {"examples": 3, "kept": 0.25, "below": 2, "above": 1}
    assert entries[("m1", 0.25)]["kept_of_full"]["kept"] == 1.0
    assert "kept_of_full" not in full
    md = summary_markdown(summary)
    assert "| m1 | 1.000 (-0 / +0) | 0.750 (-1 / +0) |" in md
    assert "| m2 | — | 0.250 (-2 / +1) |" in md
    assert "| m1 | 1.000 | 0.500 |" in md  # average total per ratio
    assert "| m2 | — | 0.750 |" in md  # win score table
    assert "| m1 | 0.5 | 0.500 ± 0.020 |" in md


def test_a_thresholds_effective_ratio_is_given_per_task_and_length():
    """S11: a threshold's ratio adapts to the prompt, so the summary gives its mean per task
    and prompt length (rounded to a power of two), and a Markdown table of the methods whose
    ratio strays from the target; a fixed ratio gets no row there."""
    rows = []
    for id_, task, tokens, eff in [
        ("a1", "A", (2000, 40), 0.70),
        ("a2", "A", (2010, 40), 0.72),
        ("a3", "A", (4060, 40), 0.60),
        ("b1", "B", (2000, 48), 0.85),
    ]:
        for method, ratio, e in [("thr", 0.0, eff), ("fixed", 0.5, 0.5), ("full", 0.0, 0.0)]:
            rows.append(
                {
                    "id": id_,
                    "task": task,
                    "method": method,
                    "ratio": ratio,
                    "score": 1.0,
                    "effective_ratio": e,
                    "cache_bytes": 100,
                    "prefill_s": 1.0,
                    "decode_s": 1.0,
                    "context_tokens": tokens[0],
                    "question_tokens": tokens[1],
                }
            )
    summary = summarize(rows, config={"methods": ["full", "thr", "fixed"], "ratios": [0.0, 0.5]})
    entries = {e["method"]: e for e in summary["entries"]}
    assert entries["thr"]["effective_ratio_by_split"] == pytest.approx(
        {"A @ 2k": 0.71, "A @ 4k": 0.60, "B @ 2k": 0.85}
    )
    assert entries["fixed"]["effective_ratio_by_split"] == pytest.approx(
        {"A @ 2k": 0.5, "A @ 4k": 0.5, "B @ 2k": 0.5}
    )
    md = summary_markdown(summary)
    table = md.split("## Effective ratio per task and length")[1]
    assert "| method | target r | A @ 2k | A @ 4k | B @ 2k |" in table
    assert "| thr | 0 | 0.710 | 0.600 | 0.850 |" in table
    assert "fixed" not in table and "full" not in table


def test_summary_win_score_uses_common_examples():
    rows = [r for r in hand_rows() if not (r["method"] == "m2" and r["id"] == "b1")]
    summary = summarize(rows)
    (win,) = summary["win_scores"]
    # Only a1 and a2 (task A) were finished by both: m1 ranks 1, 1; m2 ranks 0, 1.
    assert win["num_examples"] == 2
    assert win["scores"] == pytest.approx({"m1": 1.0, "m2": 0.5})
    assert not summary["complete"] or summary["jobs_total"] == len(rows)


def test_summary_compares_each_prob_method_with_its_top_k_versions():
    """prob:kvzip against kvzip and topk:kvzip, prob:h2o against h2o (topk:h2o's canonical
    name), each on the examples both finished; other methods get no row."""
    base = {"effective_ratio": 0.5, "cache_bytes": 1, "prefill_s": 1.0, "decode_s": 1.0}
    scores = {  # example -> method -> score, one task
        "e1": {"prob:kvzip": 1.0, "kvzip": 0.0, "topk:kvzip": 1.0, "prob:h2o": 0.0, "h2o": 1.0},
        "e2": {"prob:kvzip": 1.0, "kvzip": 0.0, "topk:kvzip": 0.0, "prob:h2o": 0.0, "h2o": 1.0},
        "e3": {"prob:kvzip": 0.5, "kvzip": 0.5, "topk:kvzip": 1.0, "prob:h2o": 0.0},
        "e4": {"prob:kvzip": 0.0, "kvzip": 1.0, "snapkv": 1.0},
    }  # fmt: skip
    rows = [
        {"id": e, "task": "T", "method": m, "ratio": 0.75, "score": v, **base}
        for e, by in scores.items()
        for m, v in by.items()
    ]
    summary = summarize(rows)
    pairs = {(h["method"], h["reference"]): h for h in summary["head_to_head"]}
    assert set(pairs) == {
        ("prob:kvzip", "topk:kvzip"),
        ("prob:kvzip", "kvzip"),
        ("prob:h2o", "h2o"),
    }
    z = pairs[("prob:kvzip", "kvzip")]
    assert (z["examples"], z["won"], z["lost"], z["tied"]) == (4, 2, 1, 1)
    assert z["p"] == pytest.approx(1.0)  # n = 3, min 1: 2 * 4 / 8
    assert (z["win_score"], z["reference_win_score"]) == (0.75, 0.5)
    t = pairs[("prob:kvzip", "topk:kvzip")]
    assert (t["examples"], t["won"], t["lost"], t["tied"]) == (3, 1, 1, 1)
    h = pairs[("prob:h2o", "h2o")]
    assert (h["examples"], h["won"], h["lost"], h["p"]) == (2, 0, 2, 0.5)
    md = summary_markdown(summary)
    assert "| prob:kvzip | kvzip | +2-1 (p = 1; 0.750 / 0.500) |" in md
    assert "| prob:h2o | h2o | +0-2 (p = 0.5; 0.000 / 1.000) |" in md
    # a name this probkv cannot parse (an older results file) is summarised without a pair
    old = [{**r, "method": "prob:gone"} for r in rows if r["method"] == "prob:h2o"]
    assert summarize(old)["head_to_head"] == []


def test_summary_without_full_has_no_kept_share():
    summary = summarize([r for r in hand_rows() if r["method"] != "full"])
    assert all("kept_of_full" not in e for e in summary["entries"])
    assert "Answers kept" not in summary_markdown(summary)


def test_summary_rejects_empty_and_incomplete_rows():
    with pytest.raises(ValueError, match="no results rows"):
        summarize([])
    row = hand_rows()[0]
    del row["cache_bytes"]
    with pytest.raises(
        ValueError, match=r"row 0: results row lacks the field\(s\) \['cache_bytes'\]"
    ):
        summarize([row])


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(96 * 1024) == "96.0 KiB"
    assert format_bytes(25.5 * 2**20) == "25.5 MiB"


# -- the same bytes as before the summary was split into parts ------------------------------

GOLDEN = Path(__file__).parent / "golden"


def golden_rows() -> list[dict]:
    """Fixed rows of 3 tasks x 5 examples, full and six eviction methods (prob: ones with
    their top-k versions) at three ratios, some jobs missing (a partial run)."""
    rng = random.Random(7)
    methods = ["full", "snapkv", "prob:snapkv", "h2o", "prob:h2o", "prob:min-h/tau=2", "tova"]
    rows = []
    for task in ("niah_single_1", "qa", "vt"):
        for i in range(5):
            for m in methods:
                for r in [0.0] if m == "full" else [0.25, 0.5, 0.9]:
                    if m != "full" and rng.random() < 0.08:
                        continue
                    rows.append(
                        {
                            "id": f"{task}-{i}",
                            "task": task,
                            "method": m,
                            "ratio": r,
                            "score": rng.choice([0.0, 0.5, 1.0, rng.random()]),
                            "effective_ratio": r + rng.random() * 0.01,
                            "cache_bytes": rng.randint(1000, 5 * 2**20),
                            "prefill_s": rng.random(),
                            "decode_s": rng.random(),
                            "model": "m",
                            "layers": [
                                {"layer": k, "effective_ratio": r * rng.random()} for k in range(3)
                            ],
                        }
                    )
    return rows


GOLDEN_CONFIG = {
    "model": "m",
    "methods": ["full", "snapkv", "prob:snapkv", "h2o", "prob:h2o", "prob:min-h/tau=2", "tova"],
    "ratios": [0.25, 0.5, 0.9],
}


def test_summary_files_are_the_bytes_of_the_golden_run(tmp_path):
    """summary.json and summary.md of fixed rows equal the files written (by probkv before
    summarize and summary_markdown were split into parts) in tests/eval/golden/."""
    write_summary(tmp_path, golden_rows(), config=GOLDEN_CONFIG, jobs_total=400)
    for name in ("summary.json", "summary.md"):
        assert (tmp_path / name).read_bytes() == (GOLDEN / name).read_bytes(), name
