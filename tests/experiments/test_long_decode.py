"""probkv.experiments.long_decode and ``probkv long-decode`` on tiny models (S10.5, issue 12)."""

from __future__ import annotations

import json

import pytest
import torch

from probkv import models
from probkv.cli import main as cli
from probkv.experiments.long_decode import LongDecodeConfig, long_decode, prose_text, summarise
from probkv.models.testing import tiny_model, write_tiny_gguf


def test_rows_compare_every_method_to_the_full_cache():
    model = tiny_model("llama", seed=0)
    ids = torch.randint(0, 200, (1, 70), generator=torch.Generator().manual_seed(0))
    config = LongDecodeConfig(
        prompt_tokens=30,
        tokens=40,
        budget=(12, 24),
        every=4,
        methods=("h2o", "prob:h2o-h"),
        seeds=2,
    )
    rows = long_decode(model, ids, config)
    assert [(r["method"], r["budget"], r["seed"]) for r in rows] == [
        ("full", None, None),
        ("h2o", 12, None),
        ("prob:h2o-h", 12, 0),
        ("prob:h2o-h", 12, 1),
        ("h2o", 24, None),
        ("prob:h2o-h", 24, 0),
        ("prob:h2o-h", 24, 1),
    ]
    full = rows[0]
    assert full["nll_gap"] == 0.0 and full["peak_entries_per_head"] == 69
    assert all(v == 0.0 for v in full["attention_error"].values())
    assert list(full["attention_error"]) == ["0", "12", "25", "38"]
    for r in rows[1:]:
        assert r["nll_full"] == full["nll"] and math_ok(r["nll"])
        assert r["peak_entries_per_head"] <= r["budget"] + 4
        assert r["stages"] >= 2
        assert max(r["attention_error"].values()) > 0
    assert rows[2]["nll"] != rows[3]["nll"]  # seeds differ
    table = summarise(rows)
    assert [(t["method"], t["budget"], t["seeds"]) for t in table][2] == ("prob:h2o-h", 12, 2)


def math_ok(x: float) -> bool:
    return x == x and x not in (float("inf"), float("-inf"))


def test_config_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="budget"):
        LongDecodeConfig(prompt_tokens=4, tokens=4, budget=0)
    with pytest.raises(ValueError, match="no-such"):
        LongDecodeConfig(prompt_tokens=4, tokens=4, budget=2, methods=("no-such",))
    with pytest.raises(ValueError, match="error_steps"):
        LongDecodeConfig(prompt_tokens=4, tokens=4, budget=2, error_steps=(9,))
    with pytest.raises(ValueError, match="tokens must be >= 2, got 1"):
        LongDecodeConfig(prompt_tokens=4, tokens=1, budget=2)
    with pytest.raises(ValueError, match="budget lists 16 more than once"):
        LongDecodeConfig(prompt_tokens=4, tokens=4, budget=(16, 8, 16))
    # duplicates by canonical name: snapkv and topk:snapkv are one method
    with pytest.raises(ValueError, match="methods lists snapkv more than once"):
        LongDecodeConfig(prompt_tokens=4, tokens=4, budget=2, methods=("snapkv", "topk:snapkv"))
    # a method no decode budget can hold is refused with the others, before any run
    for bad in ("kvzip", "ada_snapkv", "prob:h2o/scope=global"):
        with pytest.raises(ValueError, match=f"method '{bad}': a decode budget"):
            LongDecodeConfig(prompt_tokens=4, tokens=4, budget=2, methods=("h2o", bad))


def test_prose_is_seeded_english():
    assert prose_text(50, 1) == prose_text(50, 1) != prose_text(50, 2)
    assert len(prose_text(50, 1).split()) == 50


def test_cli_writes_rows_and_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "ld.json"
    argv = ["long-decode", "--model", str(gguf), "--text", "prose:3", "--prompt-tokens", "24"]
    argv += ["--tokens", "20", "--budget", "8,16", "--every", "4", "--methods", "tova,prob:tova"]
    assert cli.main([*argv, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["header"]["experiment"] == "long-decode"
    assert {r["method"] for r in data["rows"]} == {"full", "tova", "prob:tova"}
    for key in ("nll", "nll_full", "peak_entries_per_head", "peak_cache_bytes", "tokens_per_s"):
        assert all(key in r for r in data["rows"])
    assert cli.main(["plot", str(out)]) == 0
    assert out.with_suffix(".png").stat().st_size > 0
    assert cli.main([*argv[:-6], "--budget", "8", "--out", str(out), "--text", "nofile"]) == 2
    assert "nofile" in capsys.readouterr().err
    torch.set_num_threads(threads)


def test_the_vllm_engine_checks_its_methods_by_the_plugins_rules():
    # aggregate is an option of the model-wide scope the vLLM plugin always uses; the hf
    # engine's default scope (per head) refuses it
    config = LongDecodeConfig(16, 4, 8, methods=("tova/aggregate=max",), engine="vllm")
    assert config.methods == ("tova/aggregate=max",)
    with pytest.raises(ValueError, match="aggregate='max' is an option of the model-wide scope"):
        LongDecodeConfig(16, 4, 8, methods=("tova/aggregate=max",))
    with pytest.raises(ValueError, match="engine must be 'hf' or 'vllm', got 'sglang'"):
        LongDecodeConfig(16, 4, 8, engine="sglang")
