"""argparse value types shared by the ``probkv`` subcommands (``probkv.cli.main`` and the command
modules it registers). Each raises ``argparse.ArgumentTypeError`` naming the bad value."""

from __future__ import annotations

import argparse
import os

#: ``--threads`` accepts at most this many torch CPU threads per logical CPU of the machine.
THREADS_PER_CPU = 4


def max_threads() -> int:
    """The largest ``--threads`` accepted: :data:`THREADS_PER_CPU` times ``os.cpu_count()``.
    Past the CPU count torch's intra-op threads only contend for the same cores (one thread
    per process measured fastest on the 2-core development machines); a few times the count
    still lets oversubscription be measured, while absurd values are refused before torch
    sees them (``torch.set_num_threads(99999)`` makes the next matrix product segfault in
    OpenMP's thread pool)."""
    return THREADS_PER_CPU * (os.cpu_count() or 1)


def thread_count(value: str) -> int:
    """argparse type of ``--threads``: an integer in ``1..max_threads()``."""
    n = positive_int(value)
    limit = max_threads()
    if n > limit:
        raise argparse.ArgumentTypeError(
            f"must be at most {limit} ({THREADS_PER_CPU} x the {os.cpu_count() or 1} CPUs of "
            f"this machine: more threads only contend for the same cores), got {value!r}"
        )
    return n


def output_path(value: str) -> str:
    """argparse type of an ``--out`` path: any non-blank string (an empty ``--out ""`` would
    mean the current folder, which nobody asks for by typing nothing)."""
    if not value.strip():
        raise argparse.ArgumentTypeError(
            f"must be a file or folder path, got {value!r} (an empty path); use --out . "
            "for the current folder"
        )
    return value


def positive_int(value: str) -> int:
    """argparse type: an integer >= 1 (error message names the bad value)."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}")
    return n


def comma_list(value: str) -> list[str]:
    """argparse type: a non-empty comma-separated list (``a,b,c``)."""
    items = [v.strip() for v in value.split(",")]
    if not value.strip() or any(not v for v in items):
        raise argparse.ArgumentTypeError(f"must be a comma-separated list, got {value!r}")
    return items


def ratio_list(value: str) -> list[float]:
    """argparse type: comma-separated compression ratios in [0, 1)."""
    out = []
    for item in comma_list(value):
        try:
            r = float(item)
        except ValueError:
            r = -1.0
        if not 0.0 <= r < 1.0:
            raise argparse.ArgumentTypeError(
                f"ratios must be numbers in [0, 1) (fraction evicted), got {item!r}"
            )
        out.append(r)
    return out


def float_list(text: str) -> list[float]:
    """argparse type: comma-separated numbers (``0.25,0.5``); names the bad item."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    out = []
    for item in items:
        try:
            out.append(float(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r} is not a number") from None
    return out


def non_negative_int(value: str) -> int:
    """argparse type: an integer >= 0 (error message names the bad value)."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value!r}")
    return n


def length_list(value: str) -> list[int]:
    """argparse type: comma-separated positive integers (prompt lengths in tokens)."""
    return [positive_int(item) for item in comma_list(value)]


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--dtype float32|bfloat16|auto`` (default auto) on a command that loads a model
    (:mod:`probkv.models.dtypes`; argparse names a bad value and the allowed ones)."""
    from probkv.models.dtypes import DEFAULT_DTYPE, DTYPE_CHOICES

    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default=DEFAULT_DTYPE,
        help=f"model dtype (default {DEFAULT_DTYPE}: bfloat16 where this CPU computes it "
        "natively, with AMX-BF16 or AVX512-BF16 units, else float32; models load on the CPU); "
        "attention scores, proposals and log-weights stay float32",
    )


def add_example_arguments(parser: argparse.ArgumentParser, *, per_task: int) -> None:
    """The example source of ``eval`` and ``task-attention-error``: ``--data`` or generated
    ``--tasks`` (required, one of them), ``--data-format``, ``--lengths``, ``--per-task``
    (default ``per_task``), ``--seed``, ``--question-aware``, ``--max-examples``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="JSONL file (probkv's format or LongBench's)")
    source.add_argument(
        "--tasks", type=comma_list, help="generated task names, comma-separated, or 'all'"
    )
    parser.add_argument(
        "--data-format",
        choices=("auto", "probkv", "longbench"),
        default="auto",
        help="format of --data (default: detected)",
    )
    parser.add_argument(
        "--lengths", type=length_list, help="prompt lengths in tokens for --tasks, e.g. 2048,4096"
    )
    parser.add_argument(
        "--per-task",
        type=positive_int,
        default=per_task,
        help=f"examples per task and length (default {per_task})",
    )
    parser.add_argument("--seed", type=int, default=0, help="task generation seed (default 0)")
    parser.add_argument(
        "--question-aware",
        action="store_true",
        help="evict after context + question (default: before the question is seen)",
    )
    parser.add_argument(
        "--max-examples", type=positive_int, help="only the first N examples (after loading)"
    )


def check_example_arguments(args: argparse.Namespace) -> None:
    """``--lengths`` goes with ``--tasks`` and only with it (``ValueError`` naming the flag)."""
    if args.tasks is not None and args.lengths is None:
        raise ValueError("--tasks needs --lengths (prompt lengths in tokens), e.g. 2048,4096")
    if args.data is not None and args.lengths is not None:
        raise ValueError("--lengths applies to generated --tasks, not to --data")
