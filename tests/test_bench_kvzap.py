"""benchmarks/bench_kvzap.py runs end to end on a tiny random model with a linear and an MLP
scorer file made for it (no timing is checked), and refuses a malformed --scorers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoConfig

from probkv.models.testing import tiny_scorer
from probkv.scores import surrogate as sg
from probkv.scores.scorer_lookup import model_identity

torch.set_num_threads(1)


def _files(tiny_dir: str, tmp_path) -> tuple[str, str]:
    config = AutoConfig.from_pretrained(tiny_dir)
    hkv = config.num_key_value_heads
    d = config.hidden_size // config.num_attention_heads
    layers = tuple(range(config.num_hidden_layers))
    linear = tiny_scorer(hkv, d, layers=layers)
    linear = dataclasses.replace(linear, model=model_identity(config, "tiny"))
    g = torch.Generator().manual_seed(0)
    fits = {
        i: sg.MLPSurrogate(
            *(getattr(fit, k) for k in sg.FORM_TENSORS["linear"]),
            torch.randn(fit.weight.shape[0], 4, generator=g),
            torch.zeros(4),
            0.1 * torch.randn(4, hkv, generator=g),
        )
        for i, fit in linear.layers.items()
    }
    mlp = dataclasses.replace(linear, layers=fits)
    paths = str(tmp_path / "linear.pt"), str(tmp_path / "mlp.pt")
    sg.save_scorer(linear, paths[0])
    sg.save_scorer(mlp, paths[1])
    return paths


def test_runs_on_a_tiny_model(load_benchmark, tiny_dir, tmp_path, capsys):
    linear, mlp = _files(tiny_dir, tmp_path)
    argv = ["--model", tiny_dir, "--lengths", "200", "--repeats", "1"]
    argv += ["--scorers", f"a={linear},b={mlp}", "--methods", "kvzap,kvzap/threshold=-5"]
    assert load_benchmark("bench_kvzap").main(argv) == 0
    out = capsys.readouterr().out
    assert "scorers a (linear, " in out and "b (mlp, " in out
    for name in ("a:kvzap ", "b:kvzap ", "a:kvzap/threshold=-5", "b:kvzap/threshold=-5"):
        assert name in out
    assert "== context 200 tokens ==" in out


def test_bad_scorers_are_refused(load_benchmark, capsys):
    with pytest.raises(SystemExit):
        load_benchmark("bench_kvzap").main(["--scorers", "nolabel.pt"])
    assert "--scorers takes 'shipped' or label=FILE pairs" in capsys.readouterr().err
