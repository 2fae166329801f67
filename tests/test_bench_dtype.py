"""benchmarks/bench_dtype.py runs end to end on a tiny random model in both dtypes (no timing
is checked: speed is read from the benchmark's own output)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from probkv.testing import tiny_model, tiny_tokenizer

torch.set_num_threads(1)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_dtype.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_dtype", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama-dtype")
    tiny_model("llama", max_position_embeddings=4096).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def test_runs_on_a_tiny_model(tiny_folder, tmp_path, capsys):
    argv = ["--model", tiny_folder, "--length", "500", "--per-task", "1", "--repeats", "1"]
    argv += ["--tasks", "niah_single_1", "--methods", "full,snapkv", "--seeds", "1"]
    argv += ["--attention-ratios", "0.5", "--out", str(tmp_path / "out")]
    assert load_script().main(argv) == 0
    out = capsys.readouterr().out
    assert "--dtype auto resolves to" in out
    assert "float32 / bfloat16 = " in out
    assert "  snapkv " in out and "  full " in out
    assert out.count(" corrected ") == 1  # one ratio, one tau
    for name in ("float32", "bfloat16"):
        config = (tmp_path / "out" / name / "config.json").read_text()
        assert f'"dtype": "{name}"' in config


def test_bad_skip_is_refused():
    with pytest.raises(ValueError, match=r"--skip takes prefill, tasks, error; got \['x'\]"):
        load_script().main(["--skip", "x"])
