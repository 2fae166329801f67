"""benchmarks/bench_integration.py runs end to end on a tiny random model: every score's
prefill against the plain one, decode against its ideal (no timing is checked: speed is read
from the benchmark's own output)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from probkv.scores import SCORE_NAMES
from probkv.testing import tiny_model, tiny_tokenizer

torch.set_num_threads(1)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_integration.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_integration", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama-integration")
    tiny_model("llama", max_position_embeddings=4096).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def test_every_score_and_the_decode_ideal(tiny_folder, capsys):
    argv = ["--model", tiny_folder, "--lengths", "96", "--decode-tokens", "2"]
    argv += ["--repeats", "1", "--dtype", "float32"]
    assert load_script().main(argv) == 0
    out = capsys.readouterr().out
    assert "float32 (--dtype float32)" in out
    for score in SCORE_NAMES:
        method = "kvzip" if score == "kvzip" else f"topk:{score}"
        assert f"  {method} " in out, method
    assert out.count("prefill+scoring+evict") == len(SCORE_NAMES) + 3
    assert out.count("measured/ideal") == 6  # 2 ratios x 3 decode variants
    assert out.count("correction cost") == 2


def test_unknown_score_is_refused(tiny_folder):
    with pytest.raises(ValueError, match=r"--scores: unknown \['nope'\]"):
        load_script().main(["--model", tiny_folder, "--scores", "nope"])
