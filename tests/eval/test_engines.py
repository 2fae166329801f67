"""The engine options of ``probkv eval`` (probkv.eval.engines): what each engine cannot run is
refused by name before any model or engine loads. Pure: vLLM is never imported here (its runs
are tested in tests/vllm/test_engine.py, in the vLLM environment)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from probkv.cli.main import main
from probkv.eval import engines
from probkv.eval.config import IDENTITY_KEYS, RunConfig, config_identity, stored_identity
from probkv.eval.engines import HfEngine, check_engine_run
from probkv.eval.runner import run_eval
from probkv.eval.store import read_results

BASE = {"model": "m", "methods": ("full", "snapkv", "prob:snapkv"), "ratios": (0.5,)}
BASE |= {"tasks": ("niah_single_1",), "lengths": (100,), "question_aware": True}


def config(**change) -> RunConfig:
    return RunConfig(**(BASE | change))


def test_engine_is_checked_and_part_of_the_identity():
    assert config().engine == "hf"
    assert config_identity(config(engine="vllm"))["engine"] == "vllm"
    assert "engine" in IDENTITY_KEYS
    assert stored_identity({"model": "m"})["engine"] == "hf"  # folders of older probkv
    with pytest.raises(ValueError, match=r"engine must be one of 'hf', 'vllm'; got 'sglang'"):
        check_engine_run(config(engine="sglang"))
    with pytest.raises(ValueError, match=r"engine must be an engine's name, got 3"):
        config(engine=3)


def test_hf_refuses_tensor_parallelism_and_takes_everything_else():
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 applies to --engine vllm"):
        check_engine_run(config(), tensor_parallel_size=2)
    check_engine_run(config(question_aware=False, methods=("kvzip", "ada_snapkv")), workers=2)


@pytest.mark.parametrize(
    ("change", "options", "message"),
    [
        ({"question_aware": False}, {}, r"question-aware evaluations only; add --question-aware"),
        ({}, {"workers": 2}, r"--workers 2: --engine vllm runs one engine"),
        ({}, {"threads": 2}, r"--threads 2: vLLM binds its own CPU threads"),
        ({}, {"batch_size": 4}, r"--batch-size 4: --engine vllm batches every request"),
        ({}, {"reuse_prefill": False}, r"--no-prefill-reuse applies to the hf engine"),
        ({}, {"tensor_parallel_size": 0}, r"--tensor-parallel-size must be an integer >= 1"),
        ({"methods": ("full", "kvzip")}, {}, r"method 'kvzip' cannot run in vLLM"),
        ({"methods": ("ada_snapkv",)}, {}, r"method 'ada_snapkv' cannot run in vLLM"),
        ({}, {"spelled": ("snapkv/scope=head",)}, r"sets scope=head: vLLM's blocks span"),
        ({"methods": ("kvzap",)}, {}, r"'kvzap' cannot run.*use topk:kvzap/scope=model"),
        # canonical names drop options equal to their defaults (scope=head, block=16): the
        # names as typed are checked too
        ({}, {"spelled": ("snapkv/scope=model/block=16",)}, r"sets block=16, but the engine"),
    ],
)
def test_vllm_refuses_by_name(change, options, message):
    with pytest.raises(ValueError, match=message):
        check_engine_run(config(engine="vllm", **change), **options)


def test_vllm_checks_import_no_vllm():
    # What --engine vllm can run is decided without vLLM installed or imported.
    code = (
        "import sys; from probkv.eval.config import RunConfig; "
        "from probkv.eval.engines import check_engine_run; "
        "check_engine_run(RunConfig(model='m', methods=('full', 'snapkv', 'prob:snapkv', "
        "'tova', 'prob:min-h'), ratios=(0.25, 0.75), tasks=('vt',), lengths=(100,), "
        "question_aware=True, engine='vllm'), tensor_parallel_size=2); "
        "assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_refuses_before_loading(tmp_path, capsys):
    common = ["eval", "--tasks", "niah_single_1", "--lengths", "100", "--out", str(tmp_path)]
    assert main([*common, "--tensor-parallel-size", "2"]) == 2
    assert "--tensor-parallel-size 2 applies to --engine vllm only" in capsys.readouterr().err
    assert main([*common, "--engine", "vllm", "--methods", "full,kvzip"]) == 2
    assert "add --question-aware" in capsys.readouterr().err
    aware = [*common, "--engine", "vllm", "--question-aware"]
    assert main([*aware, "--methods", "full,ada_snapkv"]) == 2
    assert "method 'ada_snapkv' cannot run in vLLM" in capsys.readouterr().err
    assert main([*aware, "--methods", "snapkv/scope=head"]) == 2  # canonical: "snapkv"
    assert "sets scope=head" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written


def _folder(tmp_path, **config):
    import json

    base = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 9}
    (tmp_path / "config.json").write_text(json.dumps(base | config | {"num_key_value_heads": 3}))
    return str(tmp_path)


def test_vllm_model_checks_from_its_config(tmp_path):
    from probkv.vllm.engine import check_model

    check_model(_folder(tmp_path), 3)  # SmolLM2's shape over 3 ranks
    with pytest.raises(ValueError, match=r"9 attention heads \(3 KV heads\) do not divide over 2"):
        check_model(_folder(tmp_path), 2)
    with pytest.raises(ValueError, match=r"architecture \['GPT2LMHeadModel'\]: supported are"):
        check_model(_folder(tmp_path, architectures=["GPT2LMHeadModel"]))
    with pytest.raises(
        ValueError, match=r"sliding-window attention \(sliding_window=512\) is supported only in"
    ):
        check_model(_folder(tmp_path, sliding_window=512))
    # Gemma-3: its global layers are evicted, its sliding ones left to vLLM (docs/vllm.md)
    gemma = {"architectures": ["Gemma3ForCausalLM"], "sliding_window": 512}
    check_model(_folder(tmp_path, **gemma, layer_types=["sliding_attention", "full_attention"]))
    with pytest.raises(ValueError, match=r"no global-attention layer to evict"):
        check_model(_folder(tmp_path, **gemma, layer_types=["sliding_attention"] * 2))


def test_vllm_kvzap_needs_a_shipped_scorer_for_the_model(tmp_path):
    """kvzap's scorer is found from the model's config (its identity); a model without one is
    refused by name before any engine starts; other methods never read the config."""
    from probkv.eval.engines import check_engine_model

    folder = _folder(
        tmp_path,
        model_type="llama",
        hidden_size=576,
        num_hidden_layers=2,
        intermediate_size=64,
        vocab_size=100,
    )
    header = b"{}"  # an empty safetensors file: the folder is a model folder
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    run = config(engine="vllm", model=folder, methods=("full", "prob:kvzap"))
    with pytest.raises(ValueError, match=r"'prob:kvzap' cannot run in vLLM.*no scorer for model"):
        check_engine_model(run)
    check_engine_model(config(engine="vllm", model=folder))


class EchoEngine(HfEngine):
    """A made-up engine (the worked example of docs/architecture.md): the HF engine's rows,
    each marked with its name, and no worker processes."""

    NAME = "echo"

    def check_run(self, config, *, workers, **options) -> None:
        super().check_run(config, workers=workers, **options)
        if workers != 1:
            raise ValueError(f"--workers {workers}: the echo engine runs in this process")

    def rows(self, *args, **kwargs):
        for row in super().rows(*args, **kwargs):
            yield {**row, "engine": self.NAME}


def test_adding_an_engine_is_one_class_and_one_entry(
    monkeypatch, tmp_path, tiny_dir, data_file, keyed, capsys
):
    """With nothing else changed, an engine registered in ENGINES is refused or run by the
    runner, and ``--engine`` takes its name."""
    monkeypatch.setitem(engines.ENGINES, "echo", EchoEngine())
    run = RunConfig(model=tiny_dir, methods=("full", "snapkv"), ratios=(0.5,), data=str(data_file))
    with pytest.raises(ValueError, match="--workers 2: the echo engine runs in this process"):
        run_eval(
            dataclasses.replace(run, engine="echo"), tmp_path / "no", workers=2, progress=False
        )
    assert not (tmp_path / "no").exists()
    run_eval(dataclasses.replace(run, engine="echo"), tmp_path / "echo", progress=False)
    run_eval(run, tmp_path / "hf", progress=False)
    echo, hf = (
        read_results(tmp_path / "echo/results.jsonl"),
        read_results(tmp_path / "hf/results.jsonl"),
    )
    assert {r["engine"] for r in echo} == {"echo"} and {r["engine"] for r in hf} == {"hf"}
    drop = ("prefill_s", "decode_s", "shared_prefill", "engine")
    assert keyed(echo, drop) == keyed(hf, drop)
    argv = ["eval", "--model", tiny_dir, "--data", str(data_file), "--methods", "full"]
    assert main([*argv, "--engine", "echo", "--out", str(tmp_path / "cli"), "--no-progress"]) == 0
    assert {r["engine"] for r in read_results(tmp_path / "cli/results.jsonl")} == {"echo"}
