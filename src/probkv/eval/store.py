"""A run's folder on disk (S7): the files, their durability, and what a resume checks.

- ``config.json``: the run's configuration and identity (:mod:`probkv.eval.config`). A
  folder holding another configuration is refused unless forced; forcing moves the previous
  run's files into ``previous-N/`` (nothing is deleted).
- ``results.jsonl``: one JSON line per finished job (:data:`ROW_FIELDS`), appended with flush
  + fsync per line by one writer (:func:`locked`). A last line cut short by a crash is
  detected and removed; any other damage is an error naming the line.
- ``examples.jsonl``: generated examples, written once and compared on every resume.
- ``summary.json``, ``summary.md``: written by :mod:`probkv.eval.summary`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from probkv import __version__
from probkv.eval.config import IDENTITY_KEYS, RunConfig, describe_difference
from probkv.eval.examples import Example, write_examples
from probkv.eval.plan import job_key

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock
    fcntl = None

CONFIG_FILE = "config.json"
RESULTS_FILE = "results.jsonl"
EXAMPLES_FILE = "examples.jsonl"
SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
LOCK_FILE = ".lock"
_RUN_FILES = (CONFIG_FILE, RESULTS_FILE, EXAMPLES_FILE, SUMMARY_JSON, SUMMARY_MD)

#: Fields of every results row (``layers`` only for evicting methods).
ROW_FIELDS = (
    "id",  # example id
    "task",  # split (generated task name, LongBench dataset, ...)
    "method",  # canonical name (probkv.policies.method_name)
    "ratio",  # target compression ratio r (0.0 for full)
    "prediction",  # generated text (special tokens removed, stripped)
    "answers",  # reference strings
    "score",  # in [0, 1], the example's metric (S7)
    "effective_ratio",  # fraction of prefix entries evicted, mean over layers and heads (S3)
    "cache_bytes",  # bytes the cache holds right after eviction (before the question)
    "prefill_s",  # prefill + eviction, seconds
    "decode_s",  # question forward + generation, seconds
    "shared_prefill",  # how many jobs shared this job's prefill (1: none)
    "context_tokens",  # tokens of the context part of the prompt
    "question_tokens",  # tokens of the question part (chat template closing included)
    "compressed_tokens",  # prompt tokens in the cache when it was evicted (t, S1)
    "generated_tokens",
    "question_aware",
    "seed",  # the run's seed (task generation)
    "model",
    "layers",  # per evicting layer: {"layer", "effective_ratio", "retained_attention_mass"}
)
_REQUIRED_ROW_KEYS = ("id", "task", "method", "ratio", "score")


def check_row(row: Any, where: str) -> dict[str, Any]:
    """``row`` if it is a results row with the fields a resume and a summary key on;
    otherwise ValueError starting with ``where``."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: each results line must be a JSON object")
    missing = [k for k in _REQUIRED_ROW_KEYS if k not in row]
    if missing:
        raise ValueError(f"{where}: results row lacks the field(s) {missing}")
    ratio = row["ratio"]
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise ValueError(f"{where}: field 'ratio' must be a number, got {ratio!r}")
    return row


def read_results(path: str | os.PathLike[str], *, repair: bool = False) -> list[dict[str, Any]]:
    """The rows of a results file. A last line without its newline is what a crash leaves:
    it is ignored if it is not a complete JSON object, and with ``repair=True`` cut from the
    file (or, if complete, given its newline). Any other bad line, a missing field or a
    repeated ``(id, method, ratio)`` raises ValueError naming the file and line."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    rows: list[dict[str, Any]] = []
    seen: dict[tuple, int] = {}

    def add(row: dict[str, Any], lineno: int) -> None:
        where = f"{path}:{lineno}"
        key = job_key(row["id"], row["method"], row["ratio"])
        if key in seen:
            raise ValueError(f"{where}: job {key} is already on line {seen[key]}")
        seen[key] = lineno
        rows.append(row)

    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(
                f"{path}:{lineno}: invalid JSON in the results ({err}); only a last line cut "
                "short by a crash is repaired automatically"
            ) from None
        add(check_row(row, f"{path}:{lineno}"), lineno)
    if tail.strip():
        lineno = len(lines) + 1
        try:
            row = check_row(json.loads(tail), f"{path}:{lineno}")
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            row = None
        if row is not None:
            add(row, lineno)
        if repair:
            with path.open("r+b") as f:
                if row is None:
                    f.truncate(len(data) - len(tail))
                    print(
                        f"[probkv] {path}: removed an incomplete last line (a crash cut it short)",
                        file=sys.stderr,
                    )
                else:
                    f.seek(0, os.SEEK_END)
                    f.write(b"\n")
                f.flush()
                os.fsync(f.fileno())
    return rows


def append_row(f, row: Mapping[str, Any]) -> None:
    """Append one results line and make it durable (flush + fsync) before returning."""
    f.write(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` in one step (a reader sees the old or the new file)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """One runner per output folder at a time (two would duplicate jobs)."""
    if fcntl is None:  # pragma: no cover - not POSIX: no lock
        yield
        return
    with (folder / LOCK_FILE).open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ValueError(
                f"another probkv eval is writing to {folder}; wait for it or choose another --out"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _archive(folder: Path) -> Path:
    """Move a previous run's files (and figures) into ``folder/previous-N/``."""
    n = 1
    while (folder / f"previous-{n}").exists():
        n += 1
    target = folder / f"previous-{n}"
    target.mkdir()
    for p in folder.iterdir():
        if p.is_file() and (p.name in _RUN_FILES or p.suffix == ".png"):
            os.replace(p, target / p.name)
    return target


def _check_examples_file(path: Path, examples: Sequence[Example]) -> None:
    """Write the generated examples once; on a resume, check they are still the same."""
    if path.exists():
        stored = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        if stored != [ex.to_json() for ex in examples]:
            raise ValueError(
                f"the task generator now produces different examples than {path} (a different "
                "probkv version?); rerun with --force or choose another --out"
            )
        return
    tmp = path.with_name(path.name + ".tmp")
    write_examples(tmp, examples)
    os.replace(tmp, path)


def prepare_folder(
    out: Path,
    config: RunConfig,
    identity: Mapping[str, Any],
    examples: Sequence[Example],
    *,
    force: bool = False,
) -> None:
    """Make ``out`` (locked by the caller) hold this run: a folder with another configuration
    is refused, or with ``force`` moved to ``previous-N/``; ``config.json`` is written if
    absent and, for generated tasks, ``examples.jsonl`` written or checked."""
    config_path = out / CONFIG_FILE
    if config_path.exists():
        previous = json.loads(config_path.read_text(encoding="utf-8"))
        if {k: previous.get(k) for k in IDENTITY_KEYS} != identity:
            difference = describe_difference(previous, identity)
            if not force:
                raise ValueError(
                    f"{out} holds a run with a different configuration ({difference}); "
                    "rerun with --force to move it to a previous-N/ subfolder and start "
                    "afresh, or choose another --out"
                )
            moved = _archive(out)
            print(f"[probkv] previous run moved to {moved} ({difference})", file=sys.stderr)
    if not config_path.exists():
        record = {**config.to_json(), **identity, "probkv_version": __version__}
        write_atomic(config_path, json.dumps(record, indent=2) + "\n")
    if config.data is None:
        _check_examples_file(out / EXAMPLES_FILE, examples)


def load_run(run_dir: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(rows, config)`` of a run folder, read-only (a crash-cut last line is ignored)."""
    folder = Path(run_dir)
    results = folder / RESULTS_FILE
    if not results.is_file():
        raise ValueError(f"{folder} has no {RESULTS_FILE}; is it a probkv eval --out folder?")
    config_path = folder / CONFIG_FILE
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    return read_results(results), config
