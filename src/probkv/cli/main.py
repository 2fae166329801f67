"""The ``probkv`` command line.

Every subcommand lives in ``probkv.cli`` and is imported here statically (``COMMANDS``):
``generate`` and ``models`` in :mod:`probkv.cli.model_commands`; ``eval``, ``plot`` and ``demo`` in
:mod:`probkv.cli.eval_commands`; ``attention-error``, ``task-attention-error`` and
``long-decode`` in :mod:`probkv.cli.experiment_commands`; ``train-scorer`` in
:mod:`probkv.cli.train_scorer_command`. A module contributes subcommands with::

    def add_commands(subparsers: argparse._SubParsersAction) -> None:
        parser = subparsers.add_parser("name", help="one line")
        parser.add_argument(...)
        parser.set_defaults(handler=run_name)   # run_name(args) -> int exit status

and its handlers turn the parsed arguments into a call of a typed entry point (of the
harness, an experiment, the trainer): nothing outside ``probkv.cli`` reads argparse.
Argument types shared by the subcommands (``positive_int``, ...) live in ``probkv.cli.args``,
so command modules never import this file. Handlers that need transformers or matplotlib
import them when they run, so ``probkv --help`` loads neither. Every subcommand accepts
``--threads`` (torch CPU threads, default 1: on the 2-core machines probkv is developed on,
one thread per process measured faster than two; at most ``probkv.cli.args.max_threads()``,
four per CPU).

Exit status: 0 on success, 2 for a refused input (one line ``probkv CMD: error: ...``), 130
when interrupted (Ctrl-C: one line, no traceback; ``eval`` says that a rerun resumes).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import torch

from probkv import __version__
from probkv.cli import eval_commands, experiment_commands, model_commands, train_scorer_command
from probkv.cli.args import thread_count
from probkv.models import ModelNotInstalledError

#: The functions that register subcommands, in ``--help`` order; add yours here.
COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    model_commands.add_commands,
    experiment_commands.add_attention_error,
    experiment_commands.add_task_attention_error,
    eval_commands.add_commands,
    experiment_commands.add_long_decode,
    train_scorer_command.add_commands,
)

DEFAULT_THREADS = 1
#: Exit status after Ctrl-C (SIGINT), the shell's 128 + 2.
INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    """The full parser: global options plus every module's subcommands."""
    parser = argparse.ArgumentParser(
        prog="probkv",
        description="KV-cache eviction as importance sampling, with decode-time correction.",
    )
    parser.add_argument("--version", action="version", version=f"probkv {__version__}")
    parser.add_argument(
        "--threads",
        type=thread_count,
        default=DEFAULT_THREADS,
        help=f"torch CPU threads (default {DEFAULT_THREADS})",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_commands in COMMANDS:
        add_commands(subparsers)
    for name, sub in subparsers.choices.items():
        if sub.get_default("handler") is None:
            raise RuntimeError(f"subcommand {name!r} sets no handler (set_defaults(handler=...))")
        # Also accepted after the subcommand; SUPPRESS keeps the global value when omitted.
        sub.add_argument(
            "--threads", type=thread_count, default=argparse.SUPPRESS, help="torch CPU threads"
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``probkv`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"[probkv] torch threads: {torch.get_num_threads()} (--threads)", file=sys.stderr)
    try:
        return int(args.handler(args) or 0)
    except (ValueError, ModelNotInstalledError) as err:
        print(f"probkv {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a command with something to say on Ctrl-C catches it itself
        print(f"probkv {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
