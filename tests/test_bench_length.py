"""benchmarks/bench_length.py runs end to end on a tiny random model, each variant in its own
process, at two short lengths (no timing is checked: the figures are the benchmark's), and its
growth exponent is the least-squares slope on log-log axes."""

from __future__ import annotations

import json
import math

import pytest


def test_runs_each_variant_in_its_own_process_and_resumes(
    load_benchmark, tiny_dir, tmp_path, capsys
):
    bench = load_benchmark("bench_length")
    out = tmp_path / "runs.jsonl"
    argv = ["--model", tiny_dir, "--lengths", "96,192", "--methods", "kvzip"]
    assert bench.main([*argv, "--out", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert {(r["length"], r["variant"]) for r in rows} == {
        (t, v) for t in (96, 192) for v in ("plain", "kvzip")
    }
    for r in rows:
        assert r["cpu_s"] > 0 and r["wall_s"] > 0 and r["peak_mib"] > r["working_mib"] >= 0
    text = capsys.readouterr().out
    assert "== 192 tokens == plain prefill" in text and "kvzip " in text
    assert "growth exponent" in text
    # a second run with the same file runs nothing again and prints the same tables
    assert bench.main([*argv, "--out", str(out)]) == 0
    again = capsys.readouterr().out
    assert "ran " not in again
    assert again[again.index("\n== 96") :] == text[text.index("\n== 96") :]
    assert len(out.read_text().splitlines()) == len(rows)


def test_growth_exponent_is_the_log_log_slope(load_benchmark):
    bench = load_benchmark("bench_length")
    lengths = [1024, 2048, 4096, 8192]
    assert bench.growth_exponent(lengths, [3e-6 * t**1.7 for t in lengths]) == pytest.approx(1.7)
    assert math.isnan(bench.growth_exponent([1024], [1.0]))


def test_bad_lengths_are_refused(load_benchmark, capsys):
    with pytest.raises(SystemExit):
        load_benchmark("bench_length").main(["--lengths", "32,1024"])
    assert "--lengths must be >= 64 tokens each" in capsys.readouterr().err
