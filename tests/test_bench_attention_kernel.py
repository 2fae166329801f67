"""benchmarks/bench_attention_kernel.py's per-op profile runs and names the kernel's ops (no
timing is checked: speed is read from the benchmark's own output)."""

from __future__ import annotations

import torch

torch.set_num_threads(1)


def test_profile_lists_the_ops_of_both_routes(load_benchmark, capsys):
    load_benchmark("bench_attention_kernel").profile_one(128, torch.float32)
    out = capsys.readouterr().out
    assert "profile, float32, t = 128" in out
    assert "sdpa: total" in out and "out+cs: total" in out
    assert "aten::bmm" in out and "aten::_softmax" in out and "aten::baddbmm" in out
