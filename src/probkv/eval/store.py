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
from probkv.eval.config import RunConfig, describe_difference, stored_identity
from probkv.eval.examples import Example, iter_jsonl, write_examples
from probkv.eval.outputs import remove_quietly
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
    "freed_bytes",  # vLLM only: KV bytes its block pool got back from this request's eviction
    "prefill_s",  # prefill + eviction, seconds
    "decode_s",  # question forward + generation, seconds
    "shared_prefill",  # how many jobs shared this job's prefill (1: none)
    "context_tokens",  # tokens of the context part of the prompt (after any truncation)
    "truncated_tokens",  # context tokens cut from its middle to fit (--truncate-middle), or 0
    "question_tokens",  # tokens of the question part (chat template closing included)
    "compressed_tokens",  # prompt tokens in the cache when it was evicted (t, S1)
    "generated_tokens",
    "question_aware",
    "seed",  # the run's seed (task generation)
    "model",
    "dtype",  # the model's dtype, "float32" or "bfloat16" (absent in rows of older probkv)
    "engine",  # "hf" or "vllm" (absent in rows of older probkv: hf)
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
    for key in ("id", "task", "method"):
        if not isinstance(row[key], str):
            raise ValueError(f"{where}: field {key!r} must be a string, got {row[key]!r}")
    return row


def read_results(path: str | os.PathLike[str], *, repair: bool = False) -> list[dict[str, Any]]:
    """The rows of a results file. A last line without its newline is what a crash leaves:
    it is ignored if it is not a complete JSON object, and with ``repair=True`` cut from the
    file (or, if complete, given its newline). Any other bad line, a missing field or a
    repeated ``(id, method, ratio)`` raises ValueError naming the file and line."""
    return [row for _, row in read_numbered_results(path, repair=repair)]


def line_label(path: str | os.PathLike[str], lineno: int) -> str:
    """How errors name a results row: ``"line N of FILE"`` (1-based)."""
    return f"line {lineno} of {path}"


def read_numbered_results(
    path: str | os.PathLike[str], *, repair: bool = False
) -> list[tuple[int, dict[str, Any]]]:
    """:func:`read_results` with each row's 1-based line number: ``[(line, row), ...]``."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    rows: list[tuple[int, dict[str, Any]]] = []
    seen: dict[tuple, int] = {}

    def add(row: dict[str, Any], lineno: int) -> None:
        where = f"{path}:{lineno}"
        key = job_key(row["id"], row["method"], row["ratio"])
        if key in seen:
            raise ValueError(f"{where}: job {key} is already on line {seen[key]}")
        seen[key] = lineno
        rows.append((lineno, row))

    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            reason = "nested too deeply" if isinstance(err, RecursionError) else err
            raise ValueError(
                f"{path}:{lineno}: invalid JSON in the results ({reason}); only a last line cut "
                "short by a crash is repaired automatically"
            ) from None
        add(check_row(row, f"{path}:{lineno}"), lineno)
    if tail.strip():
        lineno = len(lines) + 1
        try:
            row = check_row(json.loads(tail), f"{path}:{lineno}")
        except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError included
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
    """Replace ``path`` by ``text`` in one step (a reader sees the old or the new file); on
    failure the temporary file is removed."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise


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


def read_examples_file(path: Path) -> list[dict[str, Any]]:
    """The records of a run folder's ``examples.jsonl``; a damaged file is a ValueError
    naming the file and the line (:func:`probkv.eval.examples.iter_jsonl`)."""
    try:
        return [record for _, record in iter_jsonl(path)]
    except ValueError as err:
        raise ValueError(f"{err}: the run's generated examples are damaged") from None


def _check_examples_file(path: Path, examples: Sequence[Example]) -> None:
    """Write the generated examples once; on a resume, check they are still the same."""
    if path.exists():
        stored = read_examples_file(path)
        if stored != [ex.to_json() for ex in examples]:
            raise ValueError(
                f"the task generator now produces different examples than {path} (a different "
                "probkv version?); rerun with --force or choose another --out"
            )
        return
    tmp = path.with_name(path.name + ".tmp")
    try:
        write_examples(tmp, examples)
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise


def folder_conflict(out: Path, identity: Mapping[str, Any]) -> tuple[str, str] | None:
    """Why ``out`` cannot take the run of ``identity`` as it is: ``(error, what)`` where
    ``what`` names the files ``--force`` would move away, or ``None`` when it can (absent,
    empty, or the same run). A folder with run files but no readable ``config.json`` cannot:
    its rows may be another configuration's, and resuming would mix them."""
    if not out.is_dir():
        return None
    previous, problem = read_config(out)
    present = _run_files_present(out)
    if problem is not None and (present or (out / CONFIG_FILE).exists()):
        return (
            f"{out} holds the files of a run ({', '.join(present or [CONFIG_FILE])}) but "
            f"{problem}, so its rows may come from another configuration",
            f"files of an unidentified run ({problem})",
        )
    if previous is not None and stored_identity(previous) != identity:
        difference = describe_difference(stored_identity(previous), identity)
        return (
            f"{out} holds a run with a different configuration ({difference})",
            f"previous run ({difference})",
        )
    if (out / EXAMPLES_FILE).is_file():  # checked before the model loads, not at the resume
        try:
            read_examples_file(out / EXAMPLES_FILE)
        except ValueError as err:
            return str(err), f"run with a damaged {EXAMPLES_FILE}"
    return None


def check_folder(out: Path, identity: Mapping[str, Any], *, force: bool = False) -> None:
    """Refuse (ValueError) a folder that holds another run, or run files without a readable
    configuration, unless ``force`` (:func:`folder_conflict`). The runner calls it before
    loading the model, and :func:`prepare_folder` again under the lock."""
    conflict = folder_conflict(out, identity)
    if conflict is not None and not force:
        raise ValueError(
            f"{conflict[0]}; rerun with --force to move it to a previous-N/ subfolder and "
            "start afresh, or choose another --out"
        )


def prepare_folder(
    out: Path,
    config: RunConfig,
    identity: Mapping[str, Any],
    examples: Sequence[Example],
    *,
    force: bool = False,
) -> None:
    """Make ``out`` (locked by the caller) hold this run: a folder with another configuration,
    or with run files and no readable configuration, is refused (:func:`check_folder`), or
    with ``force`` moved to ``previous-N/``; ``config.json`` is written if absent and, for
    generated tasks, ``examples.jsonl`` written or checked."""
    check_folder(out, identity, force=force)
    conflict = folder_conflict(out, identity)
    if conflict is not None:
        moved = _archive(out)
        print(f"[probkv] {conflict[1]} moved to {moved}", file=sys.stderr)
    config_path = out / CONFIG_FILE
    if not config_path.exists():
        record = {**config.to_json(), **identity, "probkv_version": __version__}
        write_atomic(config_path, json.dumps(record, indent=2) + "\n")
    if config.data is None:
        _check_examples_file(out / EXAMPLES_FILE, examples)


def read_config(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(record, None)`` for a folder's readable ``config.json``, else ``(None, problem)``
    where ``problem`` says what is wrong with it (missing, unreadable, not a run record)."""
    path = folder / CONFIG_FILE
    if not path.exists():
        return None, f"it has no {CONFIG_FILE}"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"its {CONFIG_FILE} cannot be read ({err})"
    except RecursionError:
        return None, f"its {CONFIG_FILE} cannot be read (JSON nested too deeply)"
    if not isinstance(record, dict) or not isinstance(record.get("methods"), list):
        return None, f"its {CONFIG_FILE} is not a probkv eval configuration"
    return record, None


def _run_files_present(folder: Path) -> list[str]:
    """The run files other than the configuration that ``folder`` holds (non-empty)."""
    return [
        name
        for name in _RUN_FILES
        if name != CONFIG_FILE and (folder / name).is_file() and (folder / name).stat().st_size > 0
    ]


def load_run(
    run_dir: str | os.PathLike[str],
) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """``(rows, config, labels)`` of a run folder, read-only (a crash-cut last line is
    ignored); ``labels`` name the rows in errors (``"line N of FILE"``). A folder whose
    ``config.json`` is missing or unreadable is refused: nothing says whose rows it holds."""
    folder = Path(run_dir)
    results = folder / RESULTS_FILE
    if not results.is_file():
        raise ValueError(f"{folder} has no {RESULTS_FILE}; is it a probkv eval --out folder?")
    numbered = read_numbered_results(results)
    config, problem = read_config(folder)
    if config is None and numbered:
        raise ValueError(
            f"{folder} holds rows in {RESULTS_FILE} but {problem}: nothing says which run "
            "they belong to, so they are not plotted; plot a folder written by probkv eval"
        )
    rows = [r for _, r in numbered]
    return rows, config or {}, [line_label(results, n) for n, _ in numbered]
