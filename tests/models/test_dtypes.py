"""Model dtypes (probkv.models.dtypes): names checked, ``auto`` resolved from the hardware, and a
bfloat16 model keeps scores, proposals and log-weights in float32."""

from __future__ import annotations

import argparse

import pytest
import torch

from probkv.cli.args import add_dtype_argument
from probkv.hf import observe, prepare_model
from probkv.models import dtypes
from probkv.models.testing import TINY_VOCAB_SIZE, tiny_model


def test_names_are_checked():
    for name in dtypes.DTYPE_CHOICES:
        assert dtypes.check_dtype_name(name) == name
    with pytest.raises(
        ValueError, match=r"dtype must be one of auto, float32, bfloat16, got 'fp16'"
    ):
        dtypes.check_dtype_name("fp16")
    with pytest.raises(ValueError, match=r"--dtype must be one of .*, got torch.float32"):
        dtypes.check_dtype_name(torch.float32, "--dtype")
    assert dtypes.dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match=r"got torch\.float16"):
        dtypes.dtype_name(torch.float16)


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        (frozenset({"avx2", "fma"}), False),
        (frozenset({"avx512f", "avx512_bf16"}), True),
        (frozenset({"amx_tile", "amx_bf16"}), True),
        (frozenset(), False),
    ],
)
def test_cpu_bfloat16_units_from_flags(flags, native):
    assert dtypes.cpu_has_native_bfloat16(flags) is native


@pytest.mark.parametrize("native", [True, False])
def test_auto_follows_the_hardware(monkeypatch, native):
    monkeypatch.setattr(dtypes, "cpu_has_native_bfloat16", lambda: native)
    expected = "bfloat16" if native else "float32"
    assert dtypes.resolve_dtype_name("auto") == expected
    assert dtypes.resolve_dtype("auto") == dtypes.MODEL_DTYPES[expected]
    # An explicit name is never second-guessed.
    assert dtypes.resolve_dtype_name("float32") == "float32"
    assert dtypes.resolve_dtype_name("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="got 'half'"):
        dtypes.resolve_dtype_name("half")


def test_cli_argument_names_bad_values(capsys):
    parser = argparse.ArgumentParser(prog="x")
    add_dtype_argument(parser)
    assert parser.parse_args([]).dtype == "auto"
    assert parser.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "fp8"])
    err = capsys.readouterr().err
    assert "invalid choice: 'fp8'" in err and "auto" in err and "bfloat16" in err


@pytest.mark.parametrize("score", ["min-h", "snapkv", "h2o"])
def test_bfloat16_model_observes_float32_scores(score):
    """In a bfloat16 model the cache holds bfloat16 keys and values, while the observed
    log-scores (the proposal's input, S2) are float32 and close to the float32 model's."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, TINY_VOCAB_SIZE, (1, 48), generator=gen)
    observed = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = prepare_model(tiny_model("llama", seed=0, dtype=dtype))
        observed[dtype] = observe(model, ids, score)
    for i in observed[torch.bfloat16].evicting_layers:
        layer16 = observed[torch.bfloat16].layers[i]
        layer32 = observed[torch.float32].layers[i]
        assert layer16.dtype == torch.bfloat16  # the keys and values it holds
        scores16 = layer16.observation.log_scores
        assert scores16.dtype == torch.float32
        torch.testing.assert_close(scores16, layer32.observation.log_scores, atol=0.1, rtol=0.05)
