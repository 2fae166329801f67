"""``probkv demo`` (issue 6 item 6): its configuration, its table, and a run on a tiny model."""

from __future__ import annotations

import pytest
import torch

from probkv.eval import demo
from probkv.eval.plan import plan_units
from probkv.eval.store import RESULTS_FILE, SUMMARY_MD
from probkv.eval.summary import summarize
from probkv.models import DEFAULT_MODEL
from probkv.models.testing import save_tiny_model_folder

torch.set_num_threads(1)


def test_demo_config():
    cfg = demo.demo_config()
    assert cfg.model == DEFAULT_MODEL
    assert cfg.ratios == (0.5,)
    # Full cache, two top-k baselines, min-h with and without correction (S2, S4), and the
    # best question-agnostic methods, context reconstruction top-k and sampled (S10.1).
    assert {"full", "snapkv", "streaming_llm", "prob:min-h", "prob:min-h/correct=false"} <= set(
        cfg.methods
    )
    assert {"kvzip", "prob:kvzip"} <= set(cfg.methods)
    assert cfg.tasks == ("niah_single_1", "niah_single_2", "niah_multikey_1")
    assert 1000 <= cfg.lengths[0] <= 2000
    # The global-scope variant observes what prob:min-h observes: it shares its prefill.
    units = plan_units(
        [pytest.importorskip("probkv.eval").Example("x", "t", "c", "q", ("a",), 4)],
        cfg.jobs_per_example(),
    )
    # full | streaming | snapkv x2 | kvzip x2 (one reconstruction pass, S10.1) | min-h x3
    assert sorted(len(u.jobs) for u in units) == [1, 1, 2, 2, 3]
    assert not cfg.question_aware and demo.demo_config(question_aware=True).question_aware


def test_demo_table():
    rows = []
    cases = [("full", 1.0, 0.0), ("snapkv", 0.0, 0.5), ("prob:min-h", 0.5, 0.49)]
    for method, score, eff in [*cases, ("prob:snapkv", 1.0, 0.5)]:
        rows.append(
            {
                "id": "e",
                "task": "niah_single_1",
                "method": method,
                "ratio": 0.0 if method == "full" else 0.5,
                "score": score,
                "effective_ratio": eff,
                "cache_bytes": 2**20 * (1 - eff),
                "prefill_s": 2.0,
                "decode_s": 1.0,
            }
        )
    table = demo.demo_table(summarize(rows))
    lines = table.splitlines()
    assert lines[0].startswith(
        "| method | niah_single_1 | average | kept of full | vs top-k | effective r | cache |"
    )
    assert lines[2] == (
        "| full (no eviction) | 1.00 | 1.000 | — | — | 0.000 ± 0.000 | 1.0 MiB | 2.0 | 1.0 |"
    )
    assert lines[3].startswith("| snapkv | 0.00 | 0.000 | 0% | — |")
    assert lines[4] == (
        "| prob:min-h | 0.50 | 0.500 | 50% | — | 0.490 ± 0.000 | 522.2 KiB | 2.0 | 1.0 |"
    )  # its top-k did not run
    assert lines[5].startswith("| prob:snapkv | 1.00 | 1.000 | 100% | +1-0 snapkv |")


def test_run_demo_on_a_tiny_model(tmp_path, capsys):
    folder = save_tiny_model_folder(tmp_path / "tiny", "llama", max_position_embeddings=4096)
    out = tmp_path / "demo-out"
    runs = demo.run_demo(out, model=str(folder), workers=1, length=500, per_task=1, progress=False)
    assert [(r.setting, r.question_aware) for r in runs] == list(demo.DEMO_SETTINGS)
    for run in runs:
        report, figures = run.report, run.figures
        assert report.jobs_total == report.jobs_run == 3 * len(demo.DEMO_METHODS)
        names = sorted(p.name for p in figures.paths)
        assert names == [
            "compression_ratio_table.png",
            "layer_effective_ratio.png",
            "score_vs_ratio.png",
            "score_vs_ratio_by_task.png",
            "win_score_vs_ratio.png",
        ]
        assert all(p.parent == out / run.setting and p.stat().st_size > 0 for p in figures.paths)
        assert (out / run.setting / SUMMARY_MD).is_file()
    # Run again with other settings: the old run is moved aside, not mixed in or lost.
    again = demo.run_demo(out, model=str(folder), workers=1, length=500, per_task=2, progress=False)
    first = runs[0].report
    assert again[0].report.jobs_skipped == 0 and again[0].report.jobs_total == 2 * first.jobs_total
    assert (out / runs[0].setting / "previous-1" / RESULTS_FILE).is_file()
