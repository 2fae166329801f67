"""Output paths, checked before any work (the model load, a task generation, a figure).

A command that would only find out at the end that it cannot write its results wastes the
whole run. :func:`check_output_folder` and :func:`check_output_file` find out first: the
path must not exist as the wrong kind of thing, no component above it may be a file, and the
folder it goes in (or, when that does not exist yet, its nearest existing ancestor) must
accept a new entry. That is tested by creating and removing a temporary entry there, the
only check that also holds for root, read-only mounts, immutable folders and virtual file
systems such as ``/proc``. Nothing is left behind and no missing folder is created.

Errors are ``ValueError`` naming the command-line flag and the path (the CLI prints them and
exits with status 2).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

__all__ = ["check_output_file", "check_output_folder", "remove_quietly", "write_json"]


def _as_path(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` as a ``Path``; an empty string is refused (``Path("")`` is the current
    folder, which an empty ``--out ""`` almost surely did not mean)."""
    if not os.fspath(path).strip():
        raise ValueError(
            f"{flag} {os.fspath(path)!r} is an empty path; give a file or folder name "
            "(. for the current folder)"
        )
    return Path(path)


def _nearest_existing(path: Path, flag: str) -> Path:
    """The nearest existing ancestor of ``path`` (itself excluded), which must be a folder."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(
                    f"{flag} {str(path)!r}: {parent} is a file, not a folder, so nothing can be "
                    "written below it"
                )
            return parent
    return Path(".")  # pragma: no cover - a relative path's parents end at "."


def _probe(folder: Path, flag: str, path: Path) -> None:
    """Create and remove a temporary folder in ``folder``: can an entry be added there?"""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".probkv-probe-", dir=folder))
    except OSError as err:
        raise ValueError(
            f"{flag} {str(path)!r}: cannot write in {folder} ({err.strerror}); choose a "
            "writable location"
        ) from None


def check_output_folder(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` as a ``Path`` if a folder can be created (or written) there; else a
    ValueError naming ``flag`` and the path (module docstring)."""
    path = _as_path(path, flag)
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{flag} {str(path)!r} exists and is not a folder")
        _probe(path, flag, path)
    else:
        _probe(_nearest_existing(path, flag), flag, path)
    return path


def check_output_file(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` as a ``Path`` if a file can be written there (its folder created if
    needed); else a ValueError naming ``flag`` and the path (module docstring)."""
    path = _as_path(path, flag)
    if path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a folder; give a file name")
    if path.parent.exists():
        if not path.parent.is_dir():
            raise ValueError(
                f"{flag} {str(path)!r}: {path.parent} is a file, not a folder, so nothing can "
                "be written below it"
            )
        _probe(path.parent, flag, path)
    else:
        _probe(_nearest_existing(path, flag), flag, path)
    return path


def remove_quietly(path: Path) -> None:
    """Remove a temporary file after a failure (it may never have been created)."""
    with contextlib.suppress(OSError):
        path.unlink()


def write_json(path: Path, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically (temporary file, then rename); on failure the
    temporary file is removed and a ``ValueError`` names ``--out`` and the path."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        remove_quietly(tmp)
        raise ValueError(f"--out {str(path)!r}: cannot write it ({err.strerror})") from None
    except BaseException:
        remove_quietly(tmp)
        raise
