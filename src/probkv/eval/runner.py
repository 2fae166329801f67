"""The evaluation runner behind ``probkv eval`` (S7): methods x ratios x examples.

Each (method, ratio, example) is one *job*: prefill the example's context, evict with the
method at that compression ratio, answer the question greedily, score the answer.
:func:`run_eval` runs (or resumes) every job of a :class:`RunConfig` into one folder and
writes its summary. The parts, one module each:

- :mod:`probkv.eval.config`: :class:`RunConfig` and its identity (what a resume compares:
  a data file by its SHA-256, not its path; workers, threads and prefill reuse may change
  between reruns).
- :mod:`probkv.eval.plan`: the run's examples, and its jobs grouped into units that share
  one prefill (jobs of one example whose methods observe the same score).
- :mod:`probkv.eval.job`: running a unit with a model; question-agnostic (default) or
  question-aware eviction; ``full`` is the plain model, run once per example at ratio 0.
- :mod:`probkv.eval.store`: the folder: ``config.json`` (a different configuration is
  refused unless ``force=True``, which moves the previous run into ``previous-N/``),
  ``results.jsonl`` (one line per finished job, flush + fsync per line, one writer; a rerun
  skips the jobs already there, keyed on ``(id, method, ratio)``, after removing a last line
  cut short by a crash), ``examples.jsonl`` (generated examples, checked on resume).
- :mod:`probkv.eval.workers`: ``workers > 1`` processes, each loading the model once.
- :mod:`probkv.eval.batching`: ``batch_size > 1``: units of different examples with the same
  jobs run as one left-padded batch (the same rows as one at a time).
- :mod:`probkv.eval.summary`: ``summary.json`` and ``summary.md`` (average total score, win
  score of the eviction methods, ``full`` as the reference; target vs effective ratio).

``seed`` in the rows is the run's seed (task generation); a probabilistic policy's own seed
is an option of its method name (``prob:min-h/seed=3``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from probkv._checks import check_positive_int
from probkv.eval.config import FULL, RunConfig, config_identity
from probkv.eval.engines import check_engine_model, check_engine_run, engine_for
from probkv.eval.examples import Example
from probkv.eval.job import (
    check_prompts,
    load_prepared_model,
)
from probkv.eval.outputs import check_output_folder
from probkv.eval.plan import job_key, load_run_examples, plan_units
from probkv.eval.store import (
    RESULTS_FILE,
    SUMMARY_JSON,
    SUMMARY_MD,
    append_row,
    check_folder,
    line_label,
    locked,
    prepare_folder,
    read_numbered_results,
)
from probkv.eval.summary import format_bytes, summarize, summary_markdown, write_summary
from probkv.models import (
    load_tokenizer,
    max_positions,
    model_max_positions,
    resolve_model,
)

__all__ = [
    "FULL",
    "SUMMARY_JSON",
    "SUMMARY_MD",
    "RunConfig",
    "RunReport",
    "format_bytes",
    "run_eval",
    "summarize",
    "summary_markdown",
]


@dataclass
class RunReport:
    """What :func:`run_eval` did: the folder, job counts and the summary it wrote."""

    out_dir: Path
    jobs_total: int
    jobs_skipped: int  # already in results.jsonl when the run started
    jobs_run: int
    summary: dict[str, Any] = field(default_factory=dict)


def check_lengths(lengths: Sequence[int], limit: int) -> None:
    """Refuse generated-task lengths (prompt tokens) beyond the model's ``limit`` positions
    before any task is generated (the examples' generation budgets are checked after)."""
    too_long = [n for n in lengths if n >= limit]
    if too_long:
        raise ValueError(
            f"lengths {too_long} (--lengths): a prompt of that many tokens does not "
            f"fit the model, whose limit is {limit} positions (prompt plus generated tokens, "
            "max_position_embeddings); choose lengths below it"
        )


def run_eval(
    config: RunConfig,
    out_dir: str | os.PathLike[str],
    *,
    workers: int = 1,
    threads: int = 1,
    force: bool = False,
    reuse_prefill: bool = True,
    progress: bool = True,
    tensor_parallel_size: int | None = None,
    batch_size: int = 1,
) -> RunReport:
    """Run (or resume) an evaluation into ``out_dir`` and write its summary (module docstring).

    Everything is checked before any job runs or any file in ``out_dir`` changes: the data
    file (malformed files are refused with file, line and field), the methods, the folder's
    previous configuration. ``workers`` processes (1: this process) each load the model
    once and use ``threads`` torch threads. ``reuse_prefill=False`` gives every job its own
    prefill (same rows, slower; :mod:`probkv.eval.plan`). ``batch_size > 1`` runs units of
    several examples with the same jobs together (same rows; :mod:`probkv.eval.batching`).
    ``config.engine`` names the engine that runs the jobs (:mod:`probkv.eval.engines`: ``hf``,
    or ``vllm``, one vLLM engine over ``tensor_parallel_size`` ranks, which batches requests
    itself, so ``batch_size`` is the HF engine's); it refuses what it cannot run, first.

    The steps, in order: :func:`_check_run` (before loading anything), :func:`_load_model`,
    :func:`_run_examples`, then, with the folder locked, :func:`_finished_rows` (the rows a
    previous run left), the engine's ``rows`` (the pending units' rows, :mod:`probkv.eval.engines`) and
    :func:`_append_rows`; the summary is written last.
    """
    out, examples, identity = _check_run(
        config,
        out_dir,
        workers=workers,
        threads=threads,
        force=force,
        reuse_prefill=reuse_prefill,
        tensor_parallel_size=tensor_parallel_size,
        batch_size=batch_size,
    )
    model, tokenizer, limit = _load_model(config, workers, threads)
    examples = _run_examples(config, examples, tokenizer, limit)
    out.mkdir(parents=True, exist_ok=True)
    with locked(out):
        prepare_folder(out, config, identity, examples, force=force)
        jobs = config.jobs_per_example()
        planned = {job_key(ex.id, m, r) for ex in examples for m, r in jobs}
        results = out / RESULTS_FILE
        rows, labels, next_line = _finished_rows(results, planned)
        done = {job_key(r["id"], r["method"], r["ratio"]) for r in rows}
        units = plan_units(examples, jobs, done, reuse_prefill=reuse_prefill)
        skipped = len(done)
        run = 0
        if units:
            bar = tqdm(
                total=len(planned),
                initial=skipped,
                unit="job",
                desc="probkv eval",
                disable=not progress,
                file=sys.stderr,
                dynamic_ncols=True,
            )
            stream = engine_for(config).rows(  # the pending units' rows, lazily
                config,
                units,
                model,
                tokenizer,
                limit,
                workers=workers,
                threads=threads,
                batch_size=batch_size,
                tensor_parallel_size=tensor_parallel_size,
            )
            with bar:
                run = _append_rows(results, stream, rows, labels, next_line, bar)
        summary = write_summary(
            out, rows, config=config, jobs_total=len(planned), row_labels=labels
        )
    return RunReport(out, len(planned), skipped, run, summary)


def _check_run(
    config: RunConfig,
    out_dir: str | os.PathLike[str],
    *,
    workers: int,
    threads: int,
    force: bool,
    reuse_prefill: bool,
    tensor_parallel_size: int | None,
    batch_size: int,
) -> tuple[Path, list[Example] | None, dict[str, Any]]:
    """:func:`run_eval`'s checks before any model loads or any file changes: the arguments,
    the engine's limits, the output folder, a data file's examples (``None`` for generated
    tasks, which need the tokenizer), the folder's previous configuration, the model's name.
    Returns the folder, the data file's examples and the run's identity."""
    check_positive_int(workers, "workers")
    check_positive_int(batch_size, "batch_size")
    check_positive_int(threads, "threads")
    check_engine_run(
        config,
        workers=workers,
        threads=threads,
        reuse_prefill=reuse_prefill,
        tensor_parallel_size=tensor_parallel_size,
        batch_size=batch_size,
    )
    out = check_output_folder(out_dir, "--out")  # before any work (probkv.eval.outputs)
    examples = load_run_examples(config) if config.data is not None else None
    identity = config_identity(config)
    check_folder(out, identity, force=force)  # another run's folder: refused before loading
    resolve_model(config.model)  # unknown or not installed: refused here, not in a worker
    check_engine_model(config, tensor_parallel_size=tensor_parallel_size)
    return out, examples, identity


def _load_model(config: RunConfig, workers: int, threads: int) -> tuple[Any, Any, int]:
    """The model (``None`` where the engine loads it elsewhere: workers, vLLM), its tokenizer
    and its limit in positions."""
    if engine_for(config).loads_model(workers):
        model, tokenizer = load_prepared_model(config.model, threads, config.dtype)
        return model, tokenizer, max_positions(model.config)
    # the workers load the model; this process needs its tokenizer and limit only
    return None, load_tokenizer(config.model), model_max_positions(config.model)


def _run_examples(
    config: RunConfig, examples: list[Example] | None, tokenizer: Any, limit: int
) -> list[Example]:
    """The run's examples (generated here when no data file gave them), their prompts
    checked against the model's ``limit``."""
    if examples is None:
        check_lengths(config.lengths, limit)
        examples = load_run_examples(config, tokenizer)
    check_prompts(examples, tokenizer, limit, truncate_middle=config.truncate_middle)
    return examples


def _finished_rows(
    results: Path, planned: set[tuple[str, str, float]]
) -> tuple[list[dict[str, Any]], list[str], int]:
    """The rows of ``planned`` jobs already in ``results`` (a line cut short by a crash
    repaired first), the labels that name them in errors, and the next line's number."""
    numbered = [
        (n, r)
        for n, r in read_numbered_results(results, repair=True)
        if job_key(r["id"], r["method"], r["ratio"]) in planned
    ]
    rows = [r for _, r in numbered]
    labels = [line_label(results, n) for n, _ in numbered]  # names rows in errors
    next_line = results.read_bytes().count(b"\n") + 1 if results.exists() else 1
    return rows, labels, next_line


def _append_rows(
    results: Path,
    stream: Iterator[dict[str, Any]],
    rows: list[dict[str, Any]],
    labels: list[str],
    next_line: int,
    bar: tqdm,
) -> int:
    """Append each row of ``stream`` to ``results`` as it comes (and to ``rows``, labelled by
    its line); returns how many were run."""
    run = 0
    with results.open("a", encoding="utf-8") as f:
        for row in stream:
            append_row(f, row)
            rows.append(row)
            labels.append(line_label(results, next_line))
            next_line += 1
            run += 1
            bar.update(1)
    return run
