"""benchmarks/bench_integration.py runs end to end on a tiny random model: every score's
prefill against the plain one, decode against its ideal (no timing is checked: speed is read
from the benchmark's own output)."""

from __future__ import annotations

import pytest
import torch

from probkv.scores import SCORE_NAMES

torch.set_num_threads(1)


def test_every_score_and_the_decode_ideal(load_benchmark, tiny_dir, capsys):
    argv = ["--model", tiny_dir, "--lengths", "96", "--decode-tokens", "2"]
    argv += ["--repeats", "1", "--dtype", "float32"]
    assert load_benchmark("bench_integration").main(argv) == 0
    out = capsys.readouterr().out
    assert "float32 (--dtype float32)" in out
    scored = [s for s in SCORE_NAMES if s != "kvzap"]  # no kvzap scorer for a tiny model
    assert "kvzap skipped: no scorer shipped" in out
    for score in scored:
        method = "kvzip" if score == "kvzip" else f"topk:{score}"
        assert f"  {method} " in out, method
    assert out.count("prefill+scoring+evict") == len(scored) + 3
    assert out.count("measured/ideal") == 6  # 2 ratios x 3 decode variants
    assert out.count("correction cost") == 2
    assert out.count("paired per round") == 2


def test_paired_cost_is_the_median_per_round_ratio(load_benchmark):
    paired_cost = load_benchmark("bench_integration").paired_cost
    faster = [10.0, 20.0, 40.0, 15.0, 30.0]
    cost, low, high = paired_cost([1.1 * x for x in faster], faster)
    assert cost == pytest.approx(0.1) and low == pytest.approx(0.1) and high == pytest.approx(0.1)
    # one round slowed by the machine does not move the paired median
    slower = [10.0, 20.0, 40.0, 15.0, 300.0]
    cost, low, high = paired_cost(slower, faster)
    assert cost == 0.0 and low == 0.0 and 0.0 <= high <= 9.0


def test_unknown_score_is_refused(load_benchmark, tiny_dir):
    with pytest.raises(ValueError, match=r"--scores: unknown \['nope'\]"):
        load_benchmark("bench_integration").main(["--model", tiny_dir, "--scores", "nope"])
