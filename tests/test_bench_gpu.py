"""benchmarks/bench_gpu.py: refuses without CUDA, and its CPU smoke mode runs end to end on a
tiny random model (no timing is checked: speed is read from the benchmark's own output)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs a machine without CUDA")
def test_refuses_without_cuda(load_benchmark, capsys):
    assert load_benchmark("bench_gpu").main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_cpu_smoke_mode_on_a_tiny_model(load_benchmark, capsys):
    argv = ["--device", "cpu", "--lengths", "96", "--tiny", "llama"]
    argv += ["--decode-tokens", "2", "--repeats", "1", "--dtype", "float32"]
    assert load_benchmark("bench_gpu").main(argv) == 0
    out = capsys.readouterr().out
    for method in ("snapkv", "h2o", "prob:min-h", "prob:h2o"):
        assert f"  {method} " in out
    assert out.count("ideal/measured") == 4  # 2 ratios x 2 decode variants
    assert "lse route out+cs" in out


def test_bad_device_is_refused(load_benchmark):
    with pytest.raises(ValueError, match="--device must be cuda, cuda:N or cpu, got 'tpu'"):
        load_benchmark("bench_gpu").main(["--device", "tpu"])
