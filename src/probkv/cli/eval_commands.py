"""The ``eval``, ``plot`` and ``demo`` subcommands (registered in ``probkv.cli.main``).

- ``probkv eval``: :func:`probkv.eval.runner.run_eval` (see that module for the files it
  writes, resuming, and the decisions on ``full``, the win score and question-aware eviction).
- ``probkv plot PATH``: the figures of a run folder, or of an attention-error JSON file.
- ``probkv demo``: :mod:`probkv.experiments.demo`.

The handlers import the modules that load transformers (the runner, the demo) or matplotlib
(the plots) when they run, so that ``probkv --help`` loads neither.
"""

from __future__ import annotations

import argparse
import errno
import sys
import time
from pathlib import Path

from probkv.cli.args import (
    add_dtype_argument,
    add_example_arguments,
    check_example_arguments,
    comma_list,
    output_path,
    positive_int,
    ratio_list,
)
from probkv.eval.config import RunConfig
from probkv.eval.engines import ENGINES, check_engine_run
from probkv.eval.outputs import check_output_file, check_output_folder
from probkv.eval.store import RESULTS_FILE, SUMMARY_JSON, SUMMARY_MD
from probkv.eval.summary import summary_markdown
from probkv.eval.tasks import TASK_NAMES
from probkv.models import DEFAULT_MODEL

# Defaults of `probkv demo` (equal to probkv.experiments.demo's; see add_commands).
DEMO_OUT = "demo-out"
DEMO_WORKERS = 2
DEMO_PER_TASK = 3
DEMO_LENGTH = 1200

#: Exit status of ``eval`` after Ctrl-C (the shell's 128 + SIGINT, as ``probkv.cli.main``'s) and
#: when the disk under --out is full (the rows written so far are intact; a rerun resumes).
INTERRUPTED = 130
DISK_FULL = 1


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register ``eval``, ``plot`` and ``demo``."""
    _add_eval(subparsers)
    _add_plot(subparsers)
    _add_demo(subparsers)


def _add_eval(subparsers: argparse._SubParsersAction) -> None:
    ev = subparsers.add_parser(
        "eval",
        help="evaluate eviction methods on tasks (results, resume, summary)",
        description=(
            "Run every (method, ratio, example) job, appending one line per finished job to "
            "OUT/results.jsonl; rerunning with the same OUT resumes. Writes OUT/summary.md and "
            "OUT/summary.json (score per task, average total score and win score, S7; "
            "target vs effective compression ratio). 'full' runs once per example (ratio 0) and "
            "is the reference, not ranked in the win score. See probkv.eval.runner."
        ),
    )
    ev.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"name, .gguf or folder (default {DEFAULT_MODEL})"
    )
    ev.add_argument(
        "--methods",
        type=comma_list,
        default=["full", "snapkv", "prob:min-h"],
        help="comma-separated method names, e.g. full,snapkv,prob:min-h/tau=2 "
        "(default full,snapkv,prob:min-h)",
    )
    ev.add_argument(
        "--ratios",
        type=ratio_list,
        default=[0.5],
        help="comma-separated compression ratios in [0, 1) (default 0.5)",
    )
    add_example_arguments(ev, per_task=5)
    ev.add_argument(
        "--out", type=output_path, required=True, help="output folder (created; reruns resume)"
    )
    ev.add_argument(
        "--truncate-middle",
        action="store_true",
        help="cut the middle of a context that does not fit the model's positions with its "
        "question and max_new_tokens, as LongBench's evaluation does (default: refuse such "
        "an example before any job runs)",
    )
    ev.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="processes, each loading the model once (default 1)",
    )
    ev.add_argument(
        "--batch-size",
        type=positive_int,
        default=1,
        help="examples with the same jobs run together as one left-padded batch, each "
        "evicted on its own (same results, kvzip's reconstruction pass included; default 1)",
    )
    ev.add_argument(
        "--force",
        action="store_true",
        help="if OUT holds a run with another configuration, move it to OUT/previous-N/ and "
        "start afresh",
    )
    ev.add_argument(
        "--no-prefill-reuse",
        action="store_true",
        help="prefill once per job instead of once per example and score (slower, same results)",
    )
    add_dtype_argument(ev)
    ev.add_argument(
        "--engine",
        choices=tuple(ENGINES),
        default="hf",
        help="hf (default): transformers, one job at a time; vllm: one vLLM engine with "
        "probkv's plugin (pip install 'probkv[vllm]'), question-aware only, whole-block "
        "model-wide eviction (probkv.eval.engines)",
    )
    ev.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        help="vLLM tensor-parallel ranks (--engine vllm only; default 1)",
    )
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.set_defaults(handler=run_eval_command)


def _add_plot(subparsers: argparse._SubParsersAction) -> None:
    pl = subparsers.add_parser(
        "plot",
        help="figures of an eval folder or of an attention-error JSON file",
        description=(
            "PATH is a probkv eval --out folder (score, win score and answers kept of the "
            "full cache's vs ratio, per-layer effective compression, target vs effective "
            "ratio table) or a probkv attention-error JSON file (error vs ratio per estimator and tau) or a probkv "
            "long-decode JSON file (NLL gap vs budget per method). PNG files."
        ),
    )
    pl.add_argument(
        "path", type=output_path, help="eval output folder, or attention-error .json file"
    )
    pl.add_argument(
        "--out",
        type=output_path,
        help="where to write (default: the folder itself / <file>.png beside the file)",
    )
    pl.set_defaults(handler=run_plot_command)


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    # The demo's defaults are literals here so that `probkv --help` does not import the demo
    # (transformers, matplotlib); tests/eval/test_commands.py checks they equal its constants.
    de = subparsers.add_parser(
        "demo",
        help="the answers each method keeps as the cache shrinks, on the default model",
        description=(
            "How much of the full cache's answers each method keeps at r = 0.5, 0.75 and 0.9, "
            "and at what prefill cost: the full cache, the best top-k baseline of each setting "
            "(streaming_llm question-agnostic, snapkv question-aware), kvzap and prob:kvzap, "
            "kvzip and prob:kvzip, and prob:min-h, on three generated needle tasks "
            "(niah_single_1, niah_single_2, niah_multikey_1), question-agnostic and "
            "question-aware. Prints the tables, where everything is and how to rerun one "
            "part; writes results, figures and the report into the output folder. "
            "Interrupted, it resumes; delete the output folder to start over."
        ),
    )
    de.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"name, .gguf or folder (default {DEFAULT_MODEL})"
    )
    de.add_argument(
        "--out", type=output_path, default=DEMO_OUT, help=f"output folder (default {DEMO_OUT})"
    )
    de.add_argument(
        "--workers",
        type=positive_int,
        default=DEMO_WORKERS,
        help=f"processes, each with --threads threads (default {DEMO_WORKERS})",
    )
    de.add_argument(
        "--per-task",
        type=positive_int,
        default=DEMO_PER_TASK,
        help=f"examples per task (default {DEMO_PER_TASK})",
    )
    de.add_argument(
        "--length",
        type=positive_int,
        default=DEMO_LENGTH,
        help=f"prompt length in tokens (default {DEMO_LENGTH})",
    )
    add_dtype_argument(de)
    de.add_argument("--no-progress", action="store_true", help="no progress bar")
    de.set_defaults(handler=run_demo_command)


def run_eval_command(args: argparse.Namespace) -> int:
    """``probkv eval``: build the configuration (everything checked first), run, summarise."""
    from probkv.eval.runner import run_eval  # loads transformers: only when eval runs

    check_example_arguments(args)
    tasks = () if args.tasks is None else tuple(args.tasks)
    if tasks == ("all",):
        tasks = tuple(TASK_NAMES)
    config = RunConfig(
        model=args.model,
        methods=tuple(args.methods),
        ratios=tuple(args.ratios),
        data=args.data,
        data_format=args.data_format,
        tasks=tasks,
        lengths=tuple(args.lengths or ()),
        per_task=args.per_task,
        seed=args.seed,
        question_aware=args.question_aware,
        max_examples=args.max_examples,
        truncate_middle=args.truncate_middle,
        dtype=args.dtype,
        engine=args.engine,
    )
    check_engine_run(  # run_eval checks the canonical names again; here as typed
        config,
        workers=args.workers,
        threads=args.threads,
        reuse_prefill=not args.no_prefill_reuse,
        tensor_parallel_size=args.tensor_parallel_size,
        spelled=args.methods,
        batch_size=args.batch_size,
    )
    print(f"[probkv] model dtype: {config.dtype} (--dtype {args.dtype})", file=sys.stderr)
    start = time.perf_counter()
    results = Path(args.out) / RESULTS_FILE
    try:
        report = run_eval(
            config,
            args.out,
            workers=args.workers,
            threads=args.threads,
            force=args.force,
            reuse_prefill=not args.no_prefill_reuse,
            progress=not args.no_progress,
            tensor_parallel_size=args.tensor_parallel_size,
            batch_size=args.batch_size,
        )
    except KeyboardInterrupt:
        print(f"probkv eval: interrupted; {_saved(results)}", file=sys.stderr)
        return INTERRUPTED
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(
            f"probkv eval: error: disk full at {err.filename or args.out} ({err.strerror}); "
            f"free some space; {_saved(results)}",
            file=sys.stderr,
        )
        return DISK_FULL
    print(summary_markdown(report.summary))
    out = Path(args.out)
    print(
        f"{report.jobs_run} jobs run, {report.jobs_skipped} already done, "
        f"{report.jobs_total} in all ({time.perf_counter() - start:.0f} s). Wrote "
        f"{out / SUMMARY_MD} and {out / SUMMARY_JSON}; figures: probkv plot {out}"
    )
    return 0


def _saved(results: Path) -> str:
    """What a stopped eval kept (every finished row is fsynced before the next job)."""
    if results.is_file() and results.stat().st_size > 0:
        return f"the finished jobs are saved in {results}: rerun the same command to resume"
    return "no job had finished yet: rerun the same command to start again"


def run_plot_command(args: argparse.Namespace) -> int:
    """``probkv plot``: a run folder's figures, or an attention-error file's figure. The
    output (``--out``, default beside the input) is checked before anything is read."""
    path = Path(args.path)
    flag = "--out" if args.out is not None else "PATH (the default output)"
    if path.is_dir():
        check_output_folder(path if args.out is None else args.out, flag)
    elif path.is_file():
        check_output_file(path.with_suffix(".png") if args.out is None else args.out, flag)
    from probkv.eval.plots import plot_run
    from probkv.experiments.attention_error_plot import plot_attention_error_file  # matplotlib

    if path.is_dir():
        figures = plot_run(path, args.out)
        for p in figures.paths:
            print(f"wrote {p}")
        for note in figures.skipped:
            print(f"skipped {note}", file=sys.stderr)
        return 0
    if path.is_file():
        from probkv.experiments.long_decode_plot import is_long_decode, plot_long_decode_file

        if path.suffix == ".json" and is_long_decode(_read_json_quietly(path)):
            print(f"wrote {plot_long_decode_file(path, args.out)}")
            return 0
        print(f"wrote {plot_attention_error_file(path, args.out)}")
        return 0
    raise ValueError(f"{str(path)!r} is neither an eval output folder nor a JSON file")


def _read_json_quietly(path: Path):
    """The JSON in ``path``, or ``None`` (the attention-error reader reports the problem)."""
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def run_demo_command(args: argparse.Namespace) -> int:
    """``probkv demo``: run both settings, print the report (:func:`probkv.experiments.demo.demo_report`:
    the answers-kept table first, where everything is, how to rerun one part)."""
    from probkv.experiments import demo  # loads transformers and matplotlib

    start = time.perf_counter()
    try:
        runs = demo.run_demo(
            args.out,
            model=args.model,
            workers=args.workers,
            threads=args.threads,
            length=args.length,
            per_task=args.per_task,
            dtype=args.dtype,
            progress=not args.no_progress,
        )
    except KeyboardInterrupt:
        print(
            f"probkv demo: interrupted; the finished jobs are saved in {args.out}: rerun the "
            "same command to resume",
            file=sys.stderr,
        )
        return INTERRUPTED
    text, figure = demo.demo_report(runs, args.out, workers=args.workers)
    print("\n" + text)
    for note in [*figure.skipped, *(n for run in runs for n in run.figures.skipped)]:
        print(f"skipped {note}", file=sys.stderr)
    print(
        f"{sum(r.report.jobs_run for r in runs)} jobs run, "
        f"{sum(r.report.jobs_skipped for r in runs)} resumed, "
        f"{time.perf_counter() - start:.0f} s."
    )
    return 0
