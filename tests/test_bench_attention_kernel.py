"""benchmarks/bench_attention_kernel.py's per-op profile runs and accounts for the kernel's ops
(no timing is checked: speed is read from the benchmark's own output)."""

from __future__ import annotations

import torch

torch.set_num_threads(1)


def test_profile_counts_the_ops_of_both_routes(load_benchmark, capsys):
    """t = 128 in chunks of 64 rows, 3 KV heads: 6 chunk steps, each two matmuls (logits and
    output), one softmax and one column-sum product; SDPA is one fused op."""
    ops = load_benchmark("bench_attention_kernel").profile_one(128, torch.float32)
    out = capsys.readouterr().out
    assert "profile, float32, t = 128" in out
    assert "sdpa: total" in out and "out+cs: total" in out
    chunked = ops["out+cs"]
    assert chunked["aten::bmm"][0] == 12
    assert chunked["aten::_softmax"][0] == 6
    assert chunked["aten::baddbmm_"][0] == 6
    assert ops["sdpa"]["aten::_scaled_dot_product_flash_attention_for_cpu"][0] == 1
