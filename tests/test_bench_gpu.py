"""benchmarks/bench_gpu.py: refuses without CUDA, and its CPU smoke mode runs end to end on a
tiny random model (no timing is checked: speed is read from the benchmark's own output)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs a machine without CUDA")
def test_refuses_without_cuda(capsys):
    assert load_script().main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_cpu_smoke_mode_on_a_tiny_model(capsys):
    argv = ["--device", "cpu", "--lengths", "96", "--tiny", "llama"]
    argv += ["--decode-tokens", "2", "--repeats", "1", "--dtype", "float32"]
    assert load_script().main(argv) == 0
    out = capsys.readouterr().out
    for method in ("snapkv", "h2o", "prob:min-h", "prob:h2o"):
        assert f"  {method} " in out
    assert out.count("ideal/measured") == 4  # 2 ratios x 2 decode variants
    assert "lse route out+cs" in out


def test_bad_device_is_refused():
    with pytest.raises(ValueError, match="--device must be cuda, cuda:N or cpu, got 'tpu'"):
        load_script().main(["--device", "tpu"])
