"""benchmarks/bench_batch.py runs end to end on a tiny random model: decode at two batch
sizes for the full cache, one ratio and one decode budget, and the eval at batch size 4 vs 1 (no timing is
checked: speed is read from the benchmark's own output)."""

from __future__ import annotations

import torch

torch.set_num_threads(1)


def test_decode_and_eval_tables(load_benchmark, tiny_dir, capsys):
    argv = ["--model", tiny_dir, "--length", "120", "--batches", "1", "3", "--ratios", "0.5"]
    argv += ["--budgets", "32:4"]
    argv += ["--new-tokens", "3", "--eval-examples", "2", "--eval-length", "600"]
    argv += ["--eval-tasks", "niah_single_1,niah_single_2"]
    argv += ["--eval-methods", "snapkv", "--eval-ratios", "0.5"]
    assert load_benchmark("bench_batch").main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("| full |") == 2 and out.count("| prob:snapkv r=0.5 |") == 2
    assert out.count("| prob:snapkv B=32 K=4 |") == 2
    assert "same predictions: True" in out
