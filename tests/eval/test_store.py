"""A run's folder (probkv.eval.store): the results file survives crashes (a cut last line is
repaired, any other damage named), a resume runs every job exactly once, a different
configuration is refused unless forced, generated examples are checked on resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from probkv.eval import write_examples
from probkv.eval.config import RunConfig
from probkv.eval.plan import job_key
from probkv.eval.runner import run_eval
from probkv.eval.store import EXAMPLES_FILE, RESULTS_FILE, read_results


def test_read_results_repairs_only_a_cut_last_line(tmp_path):
    path = tmp_path / "results.jsonl"
    row = {"id": "a", "task": "t", "method": "m", "ratio": 0.5, "score": 1.0}
    good = json.dumps(row) + "\n"
    path.write_text(good + '{"id": "b", "ta')
    assert read_results(path) == [row]  # read-only: ignored, file untouched
    assert path.read_text().endswith('"ta')
    assert read_results(path, repair=True) == [row]
    assert path.read_text() == good
    # A complete last object without its newline is kept and gets the newline.
    path.write_text(good + json.dumps(row | {"id": "b"}))
    assert len(read_results(path, repair=True)) == 2
    assert path.read_text().endswith("}\n")
    # Damage anywhere else is an error naming the line.
    path.write_text(good + "{broken\n" + good.replace('"a"', '"c"'))
    with pytest.raises(ValueError, match=r"results.jsonl:2: invalid JSON"):
        read_results(path, repair=True)
    path.write_text(good + good)
    with pytest.raises(ValueError, match=r":2: job .* already on line 1"):
        read_results(path)
    path.write_text(json.dumps({"id": "a", "task": "t"}) + "\n")
    with pytest.raises(
        ValueError, match=r":1: results row lacks the field\(s\) \['method', 'ratio', 'score'\]"
    ):
        read_results(path)


# The CLI with results.jsonl's writer wrapped: the process SIGKILLs itself right before
# writing row KILL_AT (0-based), so the kill lands at the same row on every run, however
# fast or slow the machine (no polling of the file, no timing).
KILL_AT = 5
KILL_BEFORE_ROW = f"""
import os, signal, sys
import probkv.cli.main, probkv.eval.runner as runner
written = 0
real_append = runner.append_row
def append_row(f, row):
    global written
    if written == {KILL_AT}:
        os.kill(os.getpid(), signal.SIGKILL)
    real_append(f, row)
    written += 1
runner.append_row = append_row
sys.exit(probkv.cli.main.main())
"""


def test_resume_after_kill(tiny_dir, tmp_path, make_examples, run_methods, run_config):
    """Kill the runner (SIGKILL) after a few result lines, rerun: every job exactly once, and
    the lines written before the kill are kept as they were."""
    data = tmp_path / "data.jsonl"
    write_examples(data, make_examples(num=8, max_new_tokens=16))
    out = tmp_path / "run"
    args = [sys.executable, "-c", KILL_BEFORE_ROW, "eval", "--model", tiny_dir, "--data", str(data)]
    args += ["--methods", ",".join(run_methods), "--ratios", "0.25,0.5", "--out", str(out)]
    args += ["--no-progress", "--dtype", "float32"]  # run_config's dtype, on any machine
    total = 9 * (1 + (len(run_methods) - 1) * 2)
    results = out / RESULTS_FILE
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    before = results.read_bytes()
    written = before.count(b"\n")
    assert written == KILL_AT < total
    # A crash in the middle of a write leaves a cut line: simulate one on top of the kill.
    with results.open("ab") as f:
        f.write(b'{"id": "niah_single_1-500-0-7", "task": "niah_sin')
    cfg = run_config(tiny_dir, data)
    report = run_eval(cfg, out, progress=False)
    assert report.jobs_skipped == written and report.jobs_run == total - written
    after = results.read_bytes()
    assert after.startswith(before)  # nothing written before the crash was lost or changed
    rows = read_results(results)
    keys = [job_key(r["id"], r["method"], r["ratio"]) for r in rows]
    assert len(keys) == len(set(keys)) == total


def test_different_config_refused_unless_forced(tiny_dir, data_file, tmp_path, run_config):
    out = tmp_path / "run"
    run_eval(
        run_config(tiny_dir, data_file, methods=("full", "snapkv"), ratios=(0.5,)),
        out,
        progress=False,
    )
    first = (out / RESULTS_FILE).read_bytes()
    other = run_config(tiny_dir, data_file, methods=("full", "h2o"), ratios=(0.5,))
    with pytest.raises(
        ValueError, match=r"different configuration \(methods: \['full', 'snapkv'\]"
    ):
        run_eval(other, out, progress=False)
    report = run_eval(other, out, force=True, progress=False)
    assert (out / "previous-1" / RESULTS_FILE).read_bytes() == first
    assert report.jobs_skipped == 0
    assert {r["method"] for r in read_results(out / RESULTS_FILE)} == {"full", "h2o"}
    # Workers and prefill reuse are not part of the identity: resuming with others is fine.
    assert run_eval(other, out, progress=False, reuse_prefill=False).jobs_run == 0


def test_generated_tasks_written_and_checked(tiny_dir, tmp_path):
    out = tmp_path / "gen"
    cfg = RunConfig(
        model=tiny_dir,
        methods=("snapkv",),
        ratios=(0.5,),
        tasks=("niah_single_1", "niah_multikey_1"),
        lengths=(500,),
        per_task=1,
        max_examples=1,
    )
    report = run_eval(cfg, out, progress=False)
    stored = (out / EXAMPLES_FILE).read_text().splitlines()
    assert len(stored) == 1 and json.loads(stored[0])["id"] == "niah_single_1-500-0-0"
    assert report.jobs_total == 1
    (out / EXAMPLES_FILE).write_text(stored[0].replace("niah", "NIAH") + "\n")
    with pytest.raises(ValueError, match="different examples"):
        run_eval(cfg, out, progress=False)


def test_resume_in_another_dtype_is_refused(tiny_dir, data_file, tmp_path, run_config):
    """The dtype is part of the identity: float32 rows and bfloat16 rows never mix; a folder
    written before the dtype was recorded holds float32 rows and resumes in float32."""
    out = tmp_path / "run"
    cfg = run_config(tiny_dir, data_file, methods=("full", "snapkv"), ratios=(0.5,))
    run_eval(cfg, out, progress=False)
    rows = read_results(out / RESULTS_FILE)
    assert {r["dtype"] for r in rows} == {"float32"}
    bf16 = run_config(
        tiny_dir, data_file, methods=("full", "snapkv"), ratios=(0.5,), dtype="bfloat16"
    )
    with pytest.raises(ValueError, match=r"dtype: 'float32' before, 'bfloat16' now"):
        run_eval(bf16, out, progress=False)
    # An older folder: no dtype in config.json.
    record = json.loads((out / "config.json").read_text())
    del record["dtype"]
    (out / "config.json").write_text(json.dumps(record))
    assert run_eval(cfg, out, progress=False).jobs_skipped == len(rows)
    with pytest.raises(ValueError, match="different configuration"):
        run_eval(bf16, out, progress=False)
    report = run_eval(bf16, out, progress=False, force=True)
    assert report.jobs_skipped == 0 and report.summary["dtype"] == "bfloat16"
    assert {r["dtype"] for r in read_results(out / RESULTS_FILE)} == {"bfloat16"}
