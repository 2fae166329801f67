"""benchmarks/bench_dtype.py runs end to end on a tiny random model in both dtypes (no timing
is checked: speed is read from the benchmark's own output)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def test_runs_on_a_tiny_model(load_benchmark, tiny_dir, tmp_path, capsys):
    argv = ["--model", tiny_dir, "--length", "500", "--per-task", "1", "--repeats", "1"]
    argv += ["--tasks", "niah_single_1", "--methods", "full,snapkv", "--seeds", "1"]
    argv += ["--attention-ratios", "0.5", "--out", str(tmp_path / "out")]
    assert load_benchmark("bench_dtype").main(argv) == 0
    out = capsys.readouterr().out
    assert "--dtype auto resolves to" in out
    assert "float32 / bfloat16 = " in out
    assert "  snapkv " in out and "  full " in out
    assert out.count(" corrected ") == 1  # one ratio, one tau
    for name in ("float32", "bfloat16"):
        config = (tmp_path / "out" / name / "config.json").read_text()
        assert f'"dtype": "{name}"' in config


def test_bad_skip_is_refused(load_benchmark):
    with pytest.raises(ValueError, match=r"--skip takes prefill, tasks, error; got \['x'\]"):
        load_benchmark("bench_dtype").main(["--skip", "x"])
