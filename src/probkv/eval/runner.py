"""The evaluation runner behind ``probkv eval`` (SPEC S7): methods x ratios x examples.

Each (method, ratio, example) is one *job*: prefill the example's context, evict with the
method at that compression ratio, answer the question greedily, score the answer. A run writes
into one folder ``DIR``:

- ``config.json``: the run's arguments. A rerun with the same ``DIR`` resumes; a different
  configuration is refused unless ``force=True`` (``--force``), which moves the previous run's
  files into ``DIR/previous-N/`` and starts afresh (nothing is deleted). The configuration's
  identity is :data:`IDENTITY_KEYS` (a data file by its SHA-256, not its path); workers,
  threads and prefill reuse are execution details and may change between reruns.
- ``results.jsonl``: one JSON line per finished job, appended as it finishes (flush + fsync
  per line, one writer). A rerun skips the jobs already there, keyed on ``(id, method,
  ratio)``; a last line cut short by a crash is detected and removed, any other damage is an
  error naming the line. Fields: see :data:`ROW_FIELDS`.
- ``examples.jsonl``: the generated examples (``--tasks``), exactly what the model saw, for
  comparison with other libraries; a rerun checks the generator still produces them.
- ``summary.json`` and ``summary.md``: :func:`summarize` and :func:`summary_markdown`.

Decisions (documented here once; the CLI help and the README point to them):

- Question-agnostic by default (S7): the context alone is prefilled and evicted, then the
  question is fed and the answer generated (``probkv.hf.compress`` + ``probkv.hf.answer``).
  ``question_aware=True`` evicts after context + question instead. In both modes the last
  prompt token is fed after eviction (the first answer token needs a query position), so
  question-aware eviction sees every prompt token but the last.
- ``full`` is the plain model (transformers' ``DynamicCache``, SDPA attention): no eviction.
  It does not depend on the ratio, so it runs once per example and its rows have
  ``ratio = 0.0``; the summary shows it as the reference next to every ratio.
- The win score (S7) ranks the *eviction* methods of one ratio on the examples all of them
  have finished; ``full`` is not ranked (it is the upper reference, as in the paper).
- Prefill reuse: the prefill (model forward and the policy's observation, S2) depends only on
  the method's score and score parameters, not on the ratio or the policy's other options
  (sampling, weights, tau, budgets). Jobs of one example that share a score are run from one
  prefill: the observed, not yet evicted cache is copied and evicted once per job, exactly as
  ``compress`` would (each layer on its own for per-layer policies, all layers at once for the
  global scope). ``prefill_s`` of such a job is the shared prefill time plus its own eviction
  time, and ``shared_prefill`` says how many jobs shared it. ``reuse_prefill=False`` gives
  every job its own prefill (the tests check both give the same rows).
- Every prefill computes logits for its last position only (``logits_to_keep=1``, as
  ``probkv.hf.compress`` and ``observe`` do), so prefill times compare fairly across methods.
- ``seed`` in the rows is the run's seed (task generation); a probabilistic policy's own
  seed is an option of its method name (``prob:min-h/seed=3``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import queue
import statistics
import sys
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from probkv._checks import check_choice, check_positive_int, check_ratio
from probkv.eval.data import FORMATS, load_examples
from probkv.eval.examples import Example, score_example, write_examples
from probkv.eval.prompt import prompt_token_ids
from probkv.eval.tasks import TASK_NAMES, generate_examples
from probkv.eval.winscore import average_total_score, score_table, win_scores

FULL = "full"
CONFIG_FILE = "config.json"
RESULTS_FILE = "results.jsonl"
EXAMPLES_FILE = "examples.jsonl"
SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
LOCK_FILE = ".lock"

#: Configuration fields that define a run's results; a resume needs them all equal.
IDENTITY_KEYS = (
    "model",
    "methods",
    "ratios",
    "data_sha256",
    "data_format",
    "tasks",
    "lengths",
    "per_task",
    "seed",
    "question_aware",
    "max_examples",
)

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
_SUMMARY_KEYS = ("effective_ratio", "cache_bytes", "prefill_s", "decode_s")


# -- configuration ------------------------------------------------------------------------------


def canonical_method(spec: str) -> str:
    """The registry's canonical name of a method spec (``probkv.policies.method_name``);
    unknown names and options raise ValueError listing the valid ones."""
    from probkv.policies import method_name, parse_method

    return method_name(parse_method(spec, 0.5))


def _tuple_of(value: Any, name: str) -> tuple:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a list, got {value!r}")
    return tuple(value)


def _no_duplicates(values: Sequence, name: str) -> None:
    seen = set()
    for v in values:
        if v in seen:
            raise ValueError(f"{name} lists {v!r} twice; give each once")
        seen.add(v)


@dataclass(frozen=True)
class RunConfig:
    """What a run evaluates (its identity, see :data:`IDENTITY_KEYS`).

    Attributes:
        model: registry name, ``.gguf`` file or Hugging Face folder (``probkv.models``).
        methods: method names (``probkv.policies.parse_method`` grammar), stored canonical.
        ratios: target compression ratios in [0, 1) (S1), stored sorted.
        data: a JSONL file (``probkv.eval.load_examples``); exclusive with ``tasks``.
        data_format: ``"auto"``, ``"probkv"`` or ``"longbench"``.
        tasks: generated task names (``probkv.eval.TASK_NAMES``), with ``lengths`` (prompt
            tokens), ``per_task`` examples per task and length, and ``seed``.
        question_aware: evict after the question instead of before it (module docstring).
        max_examples: keep only the first N examples (after loading or generating).
    """

    model: str
    methods: tuple[str, ...]
    ratios: tuple[float, ...]
    data: str | None = None
    data_format: str = "auto"
    tasks: tuple[str, ...] = ()
    lengths: tuple[int, ...] = ()
    per_task: int = 5
    seed: int = 0
    question_aware: bool = False
    max_examples: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        methods = _tuple_of(self.methods, "methods")
        if not methods:
            raise ValueError("methods must name at least one method, e.g. full,snapkv,prob:min-h")
        methods = tuple(canonical_method(m) for m in methods)
        _no_duplicates(methods, "methods (canonical names)")
        object.__setattr__(self, "methods", methods)
        ratios = tuple(check_ratio(r, "ratio") for r in _tuple_of(self.ratios, "ratios"))
        if not ratios:
            raise ValueError("ratios must list at least one compression ratio in [0, 1)")
        _no_duplicates(ratios, "ratios")
        object.__setattr__(self, "ratios", tuple(sorted(ratios)))
        check_choice(self.data_format, FORMATS, "data_format")
        tasks = _tuple_of(self.tasks, "tasks")
        lengths = _tuple_of(self.lengths, "lengths")
        object.__setattr__(self, "tasks", tasks)
        object.__setattr__(self, "lengths", lengths)
        if (self.data is None) == (not tasks):
            raise ValueError("give either data (a JSONL file) or tasks (generated), not both")
        if self.data is not None:
            if not isinstance(self.data, str) or not self.data:
                raise ValueError(f"data must be a file path, got {self.data!r}")
            if lengths:
                raise ValueError("lengths apply to generated tasks, not to a data file")
        else:
            for task in tasks:
                check_choice(task, TASK_NAMES, "task")
            _no_duplicates(tasks, "tasks")
            if not lengths:
                raise ValueError("generated tasks need lengths (prompt tokens), e.g. 2048,4096")
            for n in lengths:
                check_positive_int(n, "length")
            _no_duplicates(lengths, "lengths")
            check_positive_int(self.per_task, "per_task")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.question_aware, bool):
            raise ValueError(f"question_aware must be True or False, got {self.question_aware!r}")
        if self.max_examples is not None:
            check_positive_int(self.max_examples, "max_examples")

    def jobs_per_example(self) -> list[tuple[str, float]]:
        """The (method, ratio) pairs every example is run with (``full`` once, at ratio 0)."""
        return [(m, r) for m in self.methods for r in ((0.0,) if m == FULL else self.ratios)]

    def to_json(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def config_identity(config: RunConfig) -> dict[str, Any]:
    """The fields a resume compares (:data:`IDENTITY_KEYS`)."""
    out = config.to_json()
    out["data_sha256"] = None if config.data is None else file_sha256(config.data)
    return {k: out[k] for k in IDENTITY_KEYS}


def load_run_examples(config: RunConfig, tokenizer: Any = None) -> list[Example]:
    """The run's examples, in order: a data file's (refused with file, line and field if
    malformed), or the generated tasks (task by task, length by length); the first
    ``max_examples``. ``tokenizer`` is needed for generated tasks only."""
    if config.data is not None:
        examples = load_examples(config.data, format=config.data_format)
    else:
        if tokenizer is None:
            raise ValueError("generated tasks need the model's tokenizer (tokenizer=...)")
        examples = [
            ex
            for task in config.tasks
            for length in config.lengths
            for ex in generate_examples(
                task,
                tokenizer=tokenizer,
                length=length,
                num_examples=config.per_task,
                seed=config.seed,
            )
        ]
    return examples[: config.max_examples] if config.max_examples else examples


# -- jobs ------------------------------------------------------------------------------------


def job_key(example_id: str, method: str, ratio: float) -> tuple[str, str, float]:
    return (example_id, method, float(ratio))


@dataclass(frozen=True)
class Unit:
    """Jobs of one example that run from one prefill: ``full`` alone, or methods that observe
    the same score (``jobs``: (method, ratio) pairs)."""

    example: Example
    jobs: tuple[tuple[str, float], ...]


def _observation_key(method: str, ratio: float) -> tuple:
    from probkv.policies import parse_method

    policy = parse_method(method, ratio)
    return (policy.score, tuple(sorted(policy.score_params.items())))


def plan_units(
    examples: Sequence[Example],
    jobs: Sequence[tuple[str, float]],
    done: Iterable[tuple[str, str, float]] = (),
    *,
    reuse_prefill: bool = True,
) -> list[Unit]:
    """The units of the jobs not in ``done``, example after example (so a partial run has
    complete examples). With ``reuse_prefill``, jobs of one example with the same observation
    (score and its parameters) form one unit; otherwise every job is its own unit."""
    finished = set(done)
    units = []
    for ex in examples:
        pending = [(m, r) for m, r in jobs if job_key(ex.id, m, r) not in finished]
        groups: dict[Any, list[tuple[str, float]]] = {}
        for i, (m, r) in enumerate(pending):
            key = ("job", i) if m == FULL or not reuse_prefill else _observation_key(m, r)
            groups.setdefault(key, []).append((m, r))
        units.extend(Unit(ex, tuple(g)) for g in groups.values())
    return units


@dataclass(frozen=True)
class JobSettings:
    """What every job of a run shares (picklable, sent to worker processes)."""

    model: str
    question_aware: bool = False
    seed: int = 0


def split_prompt(
    context_ids: Sequence[int], question_ids: Sequence[int], question_aware: bool
) -> tuple[list[int], list[int]]:
    """Token ids prefilled before eviction and fed after it (module docstring): the context
    and the question (question-agnostic), or all but the last prompt token and that token
    (question-aware). The part fed after eviction is never empty."""
    ids = [*context_ids, *question_ids]
    if len(ids) < 2:
        raise ValueError(f"a prompt needs at least 2 tokens (one to prefill, one after), got {ids}")
    # An empty context (question-agnostic): the question's first token is prefilled.
    cut = len(ids) - 1 if question_aware or not question_ids else max(len(context_ids), 1)
    return ids[:cut], ids[cut:]


def _pad_id(tokenizer: Any) -> int | None:
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if pad is not None else getattr(tokenizer, "eos_token_id", None)


def _cache_layer_bytes(cache) -> int:
    """Bytes of the key and value tensors of a transformers ``DynamicCache``."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None and hasattr(t, "numel"):
                total += t.numel() * t.element_size()
    return total


def _layer_rows(cache) -> list[dict[str, Any]]:
    """Per evicted layer: its effective ratio (S3) and the last query's attention mass on the
    kept entries, mean over KV heads (S6 diagnostic), from ``cache.reports()``."""
    return [
        {
            "layer": r.layer_idx,
            "effective_ratio": r.effective_ratio,
            "retained_attention_mass": sum(r.retained_attention_mass)
            / max(len(r.retained_attention_mass), 1),
        }
        for r in cache.reports()
    ]


def run_unit(model, tokenizer, unit: Unit, settings: JobSettings) -> Iterator[dict[str, Any]]:
    """Run one unit's jobs; yield one results row per job as it finishes (see ROW_FIELDS).

    ``model`` must be prepared (``probkv.hf.prepare_model``)."""
    import torch

    from probkv.hf import compress, observe, repeat_prompt
    from probkv.policies import parse_method
    from probkv.scores import needs_reconstruction

    ex = unit.example
    context_ids, question_ids = prompt_token_ids(ex, tokenizer)
    before, after = split_prompt(context_ids, question_ids, settings.question_aware)
    before_t = torch.tensor([before], dtype=torch.long)
    after_t = torch.tensor([after], dtype=torch.long)
    gen_kw = {"max_new_tokens": ex.max_new_tokens, "pad_token_id": _pad_id(tokenizer)}
    common = {
        "context_tokens": len(context_ids),
        "question_tokens": len(question_ids),
        "compressed_tokens": len(before),
        "question_aware": settings.question_aware,
        "seed": settings.seed,
        "model": settings.model,
    }

    def row(method: str, ratio: float, new_ids, measured: dict[str, Any]) -> dict[str, Any]:
        prediction = tokenizer.decode(new_ids, skip_special_tokens=True).strip()
        out = {
            "id": ex.id,
            "task": ex.task,
            "method": method,
            "ratio": float(ratio),
            "prediction": prediction,
            "answers": list(ex.answers),
            "score": score_example(ex, prediction),
            **measured,
            "generated_tokens": int(new_ids.numel()),
            **common,
        }
        return {k: out[k] for k in ROW_FIELDS if k in out}

    if unit.jobs[0][0] == FULL:
        if len(unit.jobs) != 1:
            raise ValueError(f"the full-cache job runs alone, got the unit {unit.jobs}")
        yield row(FULL, unit.jobs[0][1], *_run_full(model, before_t, after_t, gen_kw))
        return

    # KVzip-style scores (S10.1) reconstruct the context with the tokenizer's repeat prompt.
    first = parse_method(*unit.jobs[0])
    rec = {"repeat_prompt": repeat_prompt(tokenizer)} if needs_reconstruction(first.score) else {}
    if len(unit.jobs) == 1:
        method, ratio = unit.jobs[0]
        start = time.perf_counter()
        cache = compress(model, before_t, parse_method(method, ratio), **rec)
        prefill_s = time.perf_counter() - start
        yield row(method, ratio, *_decode(model, cache, after_t, gen_kw, prefill_s, 1))
        return

    # Shared prefill: observe once, copy the observed cache and evict it once per job.
    start = time.perf_counter()
    observed = observe(model, before_t, first.score, first.score_params, **rec)
    shared_s = time.perf_counter() - start
    for i, (method, ratio) in enumerate(unit.jobs):
        policy = parse_method(method, ratio)
        start = time.perf_counter()
        cache = observed if i == len(unit.jobs) - 1 else copy.deepcopy(observed)
        with torch.no_grad():
            cache.evict(policy)
        prefill_s = shared_s + time.perf_counter() - start
        yield row(method, ratio, *_decode(model, cache, after_t, gen_kw, prefill_s, len(unit.jobs)))


def _decode(model, cache, after_t, gen_kw, prefill_s: float, shared: int):
    """Measure the evicted cache, then answer from it: ``(generated ids, measurements)``."""
    from probkv.hf import answer

    measured = {
        "effective_ratio": cache.effective_ratio(),
        "cache_bytes": cache.nbytes(),
        "prefill_s": prefill_s,
        "shared_prefill": shared,
        "layers": _layer_rows(cache),
    }
    start = time.perf_counter()
    new_ids = answer(model, cache, after_t, **gen_kw)
    measured["decode_s"] = time.perf_counter() - start
    return new_ids, measured


def _run_full(model, before_t, after_t, gen_kw):
    """The plain model: transformers' DynamicCache and SDPA (a prepared model sends plain
    caches to SDPA), no eviction: ``(generated ids, measurements)``."""
    import torch
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        start = time.perf_counter()
        model(input_ids=before_t, cache=cache, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - start
        measured = {
            "effective_ratio": 0.0,
            "cache_bytes": _cache_layer_bytes(cache),
            "prefill_s": prefill_s,
            "shared_prefill": 1,
        }
        ids = torch.cat([before_t, after_t], dim=1)
        start = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            do_sample=False,
            **gen_kw,
        )
        measured["decode_s"] = time.perf_counter() - start
    return out[0, ids.shape[1] :], measured


# -- results file -------------------------------------------------------------------------------


def _check_row(row: Any, where: str) -> dict[str, Any]:
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
        add(_check_row(row, f"{path}:{lineno}"), lineno)
    if tail.strip():
        lineno = len(lines) + 1
        try:
            row = _check_row(json.loads(tail), f"{path}:{lineno}")
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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One runner per output folder at a time (two would duplicate jobs)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock
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


_RUN_FILES = (CONFIG_FILE, RESULTS_FILE, EXAMPLES_FILE, SUMMARY_JSON, SUMMARY_MD)


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


def _describe_difference(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    keys = [k for k in IDENTITY_KEYS if old.get(k) != new.get(k)]
    return "; ".join(f"{k}: {old.get(k)!r} before, {new.get(k)!r} now" for k in keys)


# -- running --------------------------------------------------------------------------------------


@dataclass
class RunReport:
    """What :func:`run_eval` did: the folder, job counts and the summary it wrote."""

    out_dir: Path
    jobs_total: int
    jobs_skipped: int  # already in results.jsonl when the run started
    jobs_run: int
    summary: dict[str, Any] = field(default_factory=dict)


def _load_model(name: str, threads: int):
    import torch

    from probkv.hf import prepare_model
    from probkv.models import load_model

    torch.set_num_threads(threads)
    model, tokenizer = load_model(name)
    return prepare_model(model), tokenizer


def _worker_main(settings: JobSettings, threads: int, tasks, results) -> None:
    """A worker process: load the model once, run units until the ``None`` sentinel, send
    ``("row", row)`` per finished job and ``("done", n)`` per unit; ``("error", text)`` on
    failure."""
    try:
        model, tokenizer = _load_model(settings.model, threads)
        while (unit := tasks.get()) is not None:
            for row in run_unit(model, tokenizer, unit, settings):
                results.put(("row", row))
            results.put(("done", len(unit.jobs)))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def _run_in_workers(
    units: Sequence[Unit], settings: JobSettings, workers: int, threads: int
) -> Iterator[dict[str, Any]]:
    """Run units in ``workers`` spawned processes (each loads the model once); yield rows as
    they finish. A failure in a worker stops the others and raises."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    for unit in units:
        tasks.put(unit)
    procs = [
        ctx.Process(target=_worker_main, args=(settings, threads, tasks, results), daemon=True)
        for _ in range(workers)
    ]
    for _ in procs:
        tasks.put(None)
    for p in procs:
        p.start()
    expected = sum(len(u.jobs) for u in units)
    received = 0
    try:
        while received < expected:
            try:
                kind, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"a worker process died (exit code {dead[0].exitcode}); finished jobs "
                        "are saved, rerun to resume"
                    ) from None
                continue
            if kind == "error":
                # Keep what the other workers already finished, then stop.
                with contextlib.suppress(queue.Empty):
                    while True:
                        other_kind, other = results.get(timeout=0.5)
                        if other_kind == "row":
                            received += 1
                            yield other
                raise RuntimeError(f"a worker failed; finished jobs are saved:\n{payload}")
            if kind == "row":
                received += 1
                yield payload
    finally:
        for p in procs:
            if p.is_alive() and received < expected:
                p.terminate()
        for p in procs:
            p.join(timeout=30)


def run_eval(
    config: RunConfig,
    out_dir: str | os.PathLike[str],
    *,
    workers: int = 1,
    threads: int = 1,
    force: bool = False,
    reuse_prefill: bool = True,
    progress: bool = True,
) -> RunReport:
    """Run (or resume) an evaluation into ``out_dir`` and write its summary (module docstring).

    Everything is checked before any job runs or any file in ``out_dir`` changes: the data
    file (malformed files are refused with file, line and field), the methods, the folder's
    previous configuration. ``workers`` processes (1: this process) each load the model
    once and use ``threads`` torch threads.
    """
    check_positive_int(workers, "workers")
    check_positive_int(threads, "threads")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a folder")
    examples = load_run_examples(config) if config.data is not None else None
    from probkv.models import resolve_model

    resolve_model(config.model)  # unknown or not installed: refused here, not in a worker
    model = None
    if workers == 1:
        model, tokenizer = _load_model(config.model, threads)
    else:
        from probkv.models import load_tokenizer

        tokenizer = load_tokenizer(config.model)
    if examples is None:
        examples = load_run_examples(config, tokenizer)
    check_prompts(examples, tokenizer)
    identity = config_identity(config)
    out.mkdir(parents=True, exist_ok=True)
    with _locked(out):
        config_path = out / CONFIG_FILE
        if config_path.exists():
            previous = json.loads(config_path.read_text(encoding="utf-8"))
            if {k: previous.get(k) for k in IDENTITY_KEYS} != identity:
                difference = _describe_difference(previous, identity)
                if not force:
                    raise ValueError(
                        f"{out} holds a run with a different configuration ({difference}); "
                        "rerun with --force to move it to a previous-N/ subfolder and start "
                        "afresh, or choose another --out"
                    )
                moved = _archive(out)
                print(f"[probkv] previous run moved to {moved} ({difference})", file=sys.stderr)
        if not config_path.exists():
            from probkv import __version__

            record = {**config.to_json(), **identity, "probkv_version": __version__}
            _write_atomic(config_path, json.dumps(record, indent=2) + "\n")
        if config.data is None:
            _check_examples_file(out / EXAMPLES_FILE, examples)
        jobs = config.jobs_per_example()
        planned = {job_key(ex.id, m, r) for ex in examples for m, r in jobs}
        rows = [
            r
            for r in read_results(out / RESULTS_FILE, repair=True)
            if job_key(r["id"], r["method"], r["ratio"]) in planned
        ]
        done = {job_key(r["id"], r["method"], r["ratio"]) for r in rows}
        units = plan_units(examples, jobs, done, reuse_prefill=reuse_prefill)
        settings = JobSettings(config.model, config.question_aware, config.seed)
        skipped = len(done)
        run = 0
        if units:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=len(planned),
                initial=skipped,
                unit="job",
                desc="probkv eval",
                disable=not progress,
                file=sys.stderr,
                dynamic_ncols=True,
            )
            if workers == 1:
                stream = (r for u in units for r in run_unit(model, tokenizer, u, settings))
            else:
                stream = _run_in_workers(units, settings, min(workers, len(units)), threads)
            with bar, (out / RESULTS_FILE).open("a", encoding="utf-8") as f:
                for row in stream:
                    append_row(f, row)
                    rows.append(row)
                    run += 1
                    bar.update(1)
        summary = write_summary(out, rows, config=config, jobs_total=len(planned))
    return RunReport(out, len(planned), skipped, run, summary)


def check_prompts(examples: Sequence[Example], tokenizer: Any) -> None:
    """Refuse, before any job runs, an example whose prompt cannot be built or has fewer than
    2 tokens (one to prefill and evict, one to feed after eviction)."""
    for ex in examples:
        try:
            context_ids, question_ids = prompt_token_ids(ex, tokenizer)
        except ValueError as err:
            raise ValueError(f"example {ex.id!r}: {err}") from None
        n = len(context_ids) + len(question_ids)
        if n < 2:
            raise ValueError(
                f"example {ex.id!r}: its prompt has {n} token(s); a job needs at least 2 "
                "(one prefilled and evicted, one fed after eviction)"
            )


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


# -- summary ---------------------------------------------------------------------------------------


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _std(values: Sequence[float]) -> float:
    """Sample standard deviation (n - 1 denominator); 0 for a single value."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(
    rows: Sequence[Mapping[str, Any]],
    *,
    config: RunConfig | Mapping[str, Any] | None = None,
    jobs_total: int | None = None,
) -> dict[str, Any]:
    """Aggregate results rows (SPEC S7; Appendix F.2 for the compression ratios).

    Returns a JSON-ready dict:

    - ``model``, ``question_aware``, ``tasks`` (examples per task), ``num_examples``,
      ``methods`` (run order), ``ratios``, ``jobs_done``, ``jobs_total``, ``complete``;
    - ``entries``: one per (method, ratio) with rows (``full`` at ratio 0): ``num_examples``,
      ``task_scores`` (mean score per task), ``average_total`` (S7: split means weighted by
      each split's share of the examples), ``effective_ratio_mean``/``_std`` (over examples,
      n - 1 denominator), ``cache_bytes_mean``, ``prefill_s_mean``, ``decode_s_mean``;
    - ``win_scores``: per ratio, the win score (S7) of each eviction method on the examples
      every eviction method finished at that ratio (``full`` excluded; needs 2 methods);
    - ``layers``: per (method, ratio) the mean and std over examples of each evicting layer's
      effective ratio (the paper's Figure 9).
    """
    if not rows:
        raise ValueError("no results rows to summarize (the run has not finished any job)")
    cfg = config.to_json() if isinstance(config, RunConfig) else dict(config or {})
    for i, r in enumerate(rows):
        _check_row(r, f"row {i}")
        missing = [k for k in _SUMMARY_KEYS if k not in r]
        if missing:
            raise ValueError(f"row {i}: results row lacks the field(s) {missing}")
    order = list(cfg.get("methods") or [])
    order += [m for m in dict.fromkeys(r["method"] for r in rows) if m not in order]
    methods = [m for m in order if any(r["method"] == m for r in rows)]
    groups: dict[tuple[str, float], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["method"], float(r["ratio"])), []).append(r)
    tasks: dict[str, set[str]] = {}
    for r in rows:
        tasks.setdefault(r["task"], set()).add(r["id"])
    entries = []
    for method in methods:
        for ratio in sorted({k[1] for k in groups if k[0] == method}):
            group = groups[(method, ratio)]
            table = score_table(group)
            split_scores = {t: [s[method] for s in ex.values()] for t, ex in table.items()}
            entries.append(
                {
                    "method": method,
                    "ratio": ratio,
                    "num_examples": len(group),
                    "task_scores": {t: _mean(v) for t, v in sorted(split_scores.items())},
                    "average_total": average_total_score(split_scores),
                    "effective_ratio_mean": _mean([r["effective_ratio"] for r in group]),
                    "effective_ratio_std": _std([r["effective_ratio"] for r in group]),
                    "cache_bytes_mean": _mean([r["cache_bytes"] for r in group]),
                    "prefill_s_mean": _mean([r["prefill_s"] for r in group]),
                    "decode_s_mean": _mean([r["decode_s"] for r in group]),
                }
            )
    win = []
    for ratio in sorted({k[1] for k in groups if k[0] != FULL}):
        ranked = [m for m in methods if m != FULL and (m, ratio) in groups]
        if len(ranked) < 2:
            continue
        common = set.intersection(*({r["id"] for r in groups[(m, ratio)]} for m in ranked))
        if not common:
            continue
        table = score_table(r for m in ranked for r in groups[(m, ratio)] if r["id"] in common)
        win.append({"ratio": ratio, "num_examples": len(common), "scores": win_scores(table)})
    layers = []
    for (method, ratio), group in groups.items():
        per_layer: dict[int, list[float]] = {}
        for r in group:
            for item in r.get("layers") or ():
                per_layer.setdefault(int(item["layer"]), []).append(item["effective_ratio"])
        if per_layer:
            idx = sorted(per_layer)
            layers.append(
                {
                    "method": method,
                    "ratio": ratio,
                    "layer": idx,
                    "effective_ratio_mean": [_mean(per_layer[i]) for i in idx],
                    "effective_ratio_std": [_std(per_layer[i]) for i in idx],
                }
            )
    ratios = cfg.get("ratios") or sorted({k[1] for k in groups if k[0] != FULL})
    total = jobs_total if jobs_total is not None else len(rows)
    return {
        "model": cfg.get("model") or rows[0].get("model"),
        "question_aware": cfg.get("question_aware", rows[0].get("question_aware", False)),
        "tasks": {t: len(ids) for t, ids in sorted(tasks.items())},
        "num_examples": len({r["id"] for r in rows}),
        "methods": methods,
        "ratios": [float(r) for r in ratios],
        "jobs_done": len(rows),
        "jobs_total": total,
        "complete": len(rows) >= total,
        "entries": entries,
        "win_scores": win,
        "layers": layers,
    }


def _fmt(value: float | None, digits: int = 3) -> str:
    return (
        "—"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else f"{value:.{digits}f}"
    )


def format_bytes(n: float) -> str:
    """``"25.5 MiB"``, ``"96.0 KiB"``, ``"512 B"``: cache sizes at a readable scale."""
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    if n >= 2**10:
        return f"{n / 2**10:.1f} KiB"
    return f"{n:.0f} B"


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return lines


def _entry(summary: Mapping[str, Any], method: str, ratio: float) -> Mapping[str, Any] | None:
    for e in summary["entries"]:
        if e["method"] == method and (method == FULL or e["ratio"] == ratio):
            return e
    return None


def summary_markdown(summary: Mapping[str, Any]) -> str:
    """The summary as Markdown tables: average total score, win score, score per task for
    each ratio, target vs effective compression ratio (Appendix F.2) and timings."""
    ratios = summary["ratios"]
    methods = summary["methods"]
    tasks = summary["tasks"]
    mode = "question-aware" if summary.get("question_aware") else "question-agnostic"
    name = lambda m: "full (no eviction)" if m == FULL else m  # noqa: E731
    lines = [
        f"# probkv eval: {summary['model']}",
        "",
        f"{summary['num_examples']} examples in {len(tasks)} tasks "
        f"({', '.join(f'{t}: {n}' for t, n in tasks.items())}); {mode} eviction; "
        f"{summary['jobs_done']}/{summary['jobs_total']} jobs done"
        + ("" if summary["complete"] else " (incomplete: rerun the same command to resume)")
        + ".",
        "",
        "## Average total score (SPEC S7)",
        "",
        "Task means weighted by each task's share of the examples. `full` does not depend on "
        "the ratio: its one value is repeated as the reference.",
        "",
    ]
    body = []
    for m in methods:
        cells = [_fmt(e["average_total"]) if (e := _entry(summary, m, r)) else "—" for r in ratios]
        body.append([name(m), *cells])
    lines += _table(["method", *(f"r = {r:g}" for r in ratios)], body)
    if summary["win_scores"]:
        ranked = [m for m in methods if m != FULL]
        lines += ["", "## Win score (SPEC S7)", ""]
        lines += [
            "Mean rank of each eviction method per example (ties count as wins), averaged per "
            "task, tasks weighted equally, normalised to [0, 1]; `full` is not ranked.",
            "",
        ]
        by_ratio = {w["ratio"]: w for w in summary["win_scores"]}
        body = []
        for m in ranked:
            body.append(
                [m, *(_fmt(by_ratio[r]["scores"].get(m)) if r in by_ratio else "—" for r in ratios)]
            )
        body.append(
            [
                "(examples)",
                *(str(by_ratio[r]["num_examples"]) if r in by_ratio else "—" for r in ratios),
            ]
        )
        lines += _table(["method", *(f"r = {r:g}" for r in ratios)], body)
    for r in ratios:
        lines += ["", f"## Score per task, r = {r:g}", ""]
        body = []
        for m in methods:
            e = _entry(summary, m, r)
            if e is None:
                continue
            body.append(
                [name(m), *(_fmt(e["task_scores"].get(t)) for t in tasks), _fmt(e["average_total"])]
            )
        lines += _table(["method", *tasks, "average total"], body)
    lines += ["", "## Target vs effective compression ratio (Appendix F.2)", ""]
    lines += [
        "Effective ratio: fraction of the prompt's cache entries evicted, mean over layers and "
        "KV heads; mean ± std over examples. Cache: bytes held right after eviction.",
        "",
    ]
    body = []
    for e in summary["entries"]:
        body.append(
            [
                name(e["method"]),
                f"{e['ratio']:g}",
                f"{e['effective_ratio_mean']:.3f} ± {e['effective_ratio_std']:.3f}",
                format_bytes(e["cache_bytes_mean"]),
                f"{e['prefill_s_mean']:.2f}",
                f"{e['decode_s_mean']:.2f}",
                str(e["num_examples"]),
            ]
        )
    lines += _table(
        [
            "method",
            "target r",
            "effective r",
            "cache",
            "prefill + evict s",
            "decode s",
            "examples",
        ],
        body,
    )
    return "\n".join(lines) + "\n"


def write_summary(
    out_dir: str | os.PathLike[str],
    rows: Sequence[Mapping[str, Any]],
    *,
    config: RunConfig | Mapping[str, Any] | None = None,
    jobs_total: int | None = None,
) -> dict[str, Any]:
    """Write ``summary.json`` and ``summary.md`` into ``out_dir``; returns the summary."""
    out = Path(out_dir)
    summary = summarize(rows, config=config, jobs_total=jobs_total)
    _write_atomic(out / SUMMARY_JSON, json.dumps(summary, indent=2) + "\n")
    _write_atomic(out / SUMMARY_MD, summary_markdown(summary))
    return summary


def load_run(run_dir: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(rows, config)`` of a run folder, read-only (a crash-cut last line is ignored)."""
    folder = Path(run_dir)
    results = folder / RESULTS_FILE
    if not results.is_file():
        raise ValueError(f"{folder} has no {RESULTS_FILE}; is it a probkv eval --out folder?")
    config_path = folder / CONFIG_FILE
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    return read_results(results), config
