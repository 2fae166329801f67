"""Worker processes (probkv.eval.workers): two workers give the rows and summary of one."""

from __future__ import annotations

from probkv.eval.runner import run_eval
from probkv.eval.store import RESULTS_FILE, read_results


def test_two_workers_give_the_same_results(tiny_dir, data_file, tmp_path, run_config, keyed):
    cfg = run_config(tiny_dir, data_file, methods=("full", "snapkv", "prob:min-h"), ratios=(0.5,))
    one = run_eval(cfg, tmp_path / "w1", progress=False, workers=1)
    two = run_eval(cfg, tmp_path / "w2", progress=False, workers=2)
    assert one.jobs_run == two.jobs_run == 3 * 3
    rows1 = read_results(tmp_path / "w1" / RESULTS_FILE)
    rows2 = read_results(tmp_path / "w2" / RESULTS_FILE)
    assert keyed(rows1) == keyed(rows2)
    untimed = [
        [{k: v for k, v in e.items() if not k.endswith("_s_mean")} for e in r.summary["entries"]]
        for r in (one, two)
    ]
    assert untimed[0] == untimed[1]
    assert one.summary["win_scores"] == two.summary["win_scores"]
