"""Content digests, the manifest of a converted folder and GGUF checks (probkv.models.files).

The end-to-end behaviour (a damaged conversion is rebuilt on load) is tested in test_models.py;
these tests pin each check on small hand-made folders.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

from probkv.models.files import (
    MANIFEST_NAME,
    InvalidGGUFError,
    assemble_parts,
    check_gguf,
    check_gguf_header,
    folder_problem,
    sha256_of_file,
    write_manifest,
)
from probkv.models.testing import write_tiny_gguf

KEY = "m-0123456789abcdef-tf5.24.0-c1"
SOURCE = "ab" * 32


def test_sha256_of_file_streams_across_blocks(tmp_path):
    data = bytes(range(256)) * 9000  # ~2.2 MiB: three 1 MiB blocks
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert sha256_of_file(path) == hashlib.sha256(data).hexdigest()


@pytest.fixture
def folder(tmp_path) -> Path:
    out = tmp_path / KEY
    out.mkdir()
    (out / "config.json").write_text('{"num_hidden_layers": 2}')
    (out / "model.safetensors").write_bytes(b"\x00" * 5000)
    write_manifest(out, {"key": KEY, "source_sha256": SOURCE})
    return out


def test_manifest_records_size_and_digest_of_every_file(folder):
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["key"] == KEY and manifest["source_sha256"] == SOURCE
    assert manifest["files"] == {"config.json": 24, "model.safetensors": 5000}
    assert manifest["sha256"]["model.safetensors"] == hashlib.sha256(b"\x00" * 5000).hexdigest()
    assert not (folder / (MANIFEST_NAME + ".tmp")).exists()
    assert folder_problem(folder, KEY, SOURCE) is None
    assert folder_problem(folder, KEY) is None  # the source digest is optional


def _edit_manifest(folder: Path, **changes) -> None:
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    for name, value in changes.items():
        if value is None:
            del manifest[name]
        else:
            manifest[name] = value
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_each_problem_is_named(folder):
    assert folder_problem(folder, "other-key") == (
        "corrupt",
        f"its manifest names another cache key ({KEY!r})",
    )
    assert folder_problem(folder, KEY, "cd" * 32) == (
        "corrupt",
        "its manifest names another source GGUF digest",
    )
    (folder / "model.safetensors").write_bytes(b"\x01" * 5000)  # same size, other bytes
    assert folder_problem(folder, KEY) == (
        "corrupt",
        "the content of model.safetensors does not match its recorded sha256",
    )
    (folder / "model.safetensors").write_bytes(b"\x00" * 4999)
    assert folder_problem(folder, KEY) == (
        "corrupt",
        "model.safetensors has 4999 bytes, the manifest records 5000",
    )
    _edit_manifest(folder, sha256=None)
    assert folder_problem(folder, KEY) == (
        "stale",
        "it was written by an older probkv, without content digests",
    )
    (folder / MANIFEST_NAME).write_text("{not json")
    assert folder_problem(folder, KEY)[0] == "corrupt"
    (folder / MANIFEST_NAME).write_text("[]")
    assert "not valid" in folder_problem(folder, KEY)[1]
    (folder / MANIFEST_NAME).unlink()
    assert "no manifest" in folder_problem(folder, KEY)[1]


def test_a_digest_for_every_file_is_required(folder):
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    del manifest["sha256"]["config.json"]
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert folder_problem(folder, KEY) == (
        "corrupt",
        "its manifest does not list a digest for every file",
    )


def test_extra_and_missing_files_are_named(folder):
    (folder / "adapter_config.json").write_text("{}")
    (folder / "config.json").unlink()
    kind, reason = folder_problem(folder, KEY)
    assert kind == "corrupt"
    assert "missing ['config.json']" in reason and "extra ['adapter_config.json']" in reason


def test_assemble_parts_checks_the_digest(tmp_path):
    parts = [tmp_path / "a", tmp_path / "b"]
    parts[0].write_bytes(b"GGUF")
    parts[1].write_bytes(b"rest")
    assemble_parts(parts, tmp_path / "whole", hashlib.sha256(b"GGUFrest").hexdigest())
    assert (tmp_path / "whole").read_bytes() == b"GGUFrest"
    with pytest.raises(RuntimeError, match="the parts changed while being read"):
        assemble_parts(parts, tmp_path / "again", "0" * 64)


def test_gguf_checks(tmp_path):
    good = write_tiny_gguf(tmp_path / "good.gguf")
    check_gguf_header(good)
    check_gguf(good)
    data = good.read_bytes()
    cases = {
        "text.gguf": (b"hello, this is not a model\n", "does not start with the GGUF magic"),
        "short.gguf": (b"GGU", "does not start with the GGUF magic"),
        "version.gguf": (b"GGUF" + struct.pack("<I", 99) + data[8:], "unknown GGUF version 99"),
        "cut.gguf": (data[: len(data) - 100], "not a valid GGUF file"),
        "meta.gguf": (data[:40], "truncated or damaged"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(InvalidGGUFError, match=message) as info:
            check_gguf(path)
        assert str(path) in str(info.value)
    with pytest.raises(InvalidGGUFError, match="cannot read the model file"):
        check_gguf_header(tmp_path / "absent.gguf")


# -- Hugging Face folders -----------------------------------------------------------------------


def _safetensors(path: Path, tensors: dict[str, int]) -> Path:
    """A safetensors file with float32 tensors of the given sizes (elements)."""
    import torch
    from safetensors.torch import save_file

    save_file({k: torch.zeros(n) for k, n in tensors.items()}, str(path))
    return path


def test_check_model_folder_reads_sharded_and_single_weights(tmp_path):
    from probkv.models.files import InvalidModelFolderError, check_model_folder

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    _safetensors(tmp_path / "a.safetensors", {"x": 10})
    _safetensors(tmp_path / "b.safetensors", {"y": 20})
    index = {"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    check_model_folder(tmp_path)  # intact: no error
    data = (tmp_path / "b.safetensors").read_bytes()
    (tmp_path / "b.safetensors").write_bytes(data[:-4])
    with pytest.raises(InvalidModelFolderError, match=r"b\.safetensors cannot be loaded: its tens"):
        check_model_folder(tmp_path)
    (tmp_path / "b.safetensors").write_bytes(data[:5])
    with pytest.raises(InvalidModelFolderError, match="fewer than the 8 of a safetensors header"):
        check_model_folder(tmp_path)
    (tmp_path / "b.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(InvalidModelFolderError, match="header claims"):
        check_model_folder(tmp_path)
    header = json.dumps({"y": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "x"]}})
    (tmp_path / "b.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode())
    with pytest.raises(InvalidModelFolderError, match="'y' has no valid data_offsets"):
        check_model_folder(tmp_path)
    (tmp_path / "b.safetensors").unlink()
    with pytest.raises(InvalidModelFolderError, match=r"names files the folder lacks: \['b\.saf"):
        check_model_folder(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(InvalidModelFolderError, match=r"config\.json is not a JSON object"):
        check_model_folder(tmp_path)
