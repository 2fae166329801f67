"""The ``probkv`` command line.

Subcommands live in the modules listed in ``COMMAND_MODULES``; this file only wires them.
A module contributes subcommands by defining::

    def add_commands(subparsers: argparse._SubParsersAction) -> None:
        parser = subparsers.add_parser("name", help="one line")
        parser.add_argument(...)
        parser.set_defaults(handler=run_name)   # run_name(args) -> int exit status

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
import importlib
import sys
import time
from collections.abc import Sequence

import torch

from probkv import __version__
from probkv.cli.args import add_dtype_argument, positive_int, thread_count
from probkv.models import (
    DEFAULT_MODEL,
    ModelNotInstalledError,
    cache_root,
    chat_prompt_ids,
    load_model,
    load_tokenizer,
    model_max_positions,
    model_names,
    model_status,
    resolve_model,
)
from probkv.models.dtypes import MODEL_DTYPES, resolve_dtype_name
from probkv.scores.surrogate import scorer_names

#: Modules that contribute subcommands, in ``--help`` order; add yours here. Names, not
#: imports: the registry is data that tests and plugins extend, and ``probkv.cli.main`` has no
#: import-time dependency on the modules it wires (they import ``probkv.cli.args``, never
#: this file, so there is no cycle). ``build_parser`` imports them all.
COMMAND_MODULES: tuple[str, ...] = (
    "probkv.cli.main",
    "probkv.eval.attention_error_cli",
    "probkv.eval.commands",
    "probkv.eval.long_decode_cli",
    "probkv.eval.train_scorer_cli",
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
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).add_commands(subparsers)
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


# -- built-in subcommands --------------------------------------------------------------------


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """The foundation's subcommands: ``generate`` and ``models``."""
    gen = subparsers.add_parser(
        "generate",
        help="greedy generation with a model (no eviction)",
        description=_run_generate.__doc__,
    )
    gen.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"registry name, .gguf or folder (default {DEFAULT_MODEL})",
    )
    gen.add_argument("--prompt", default="What is the capital of France?", help="user message")
    gen.add_argument("--max-new-tokens", type=positive_int, default=32, help="default 32")
    add_dtype_argument(gen)
    gen.set_defaults(handler=_run_generate)

    models = subparsers.add_parser(
        "models", help="list the registry models, installed or not, and their cache state"
    )
    models.add_argument(
        "--path",
        metavar="NAME",
        help="print only the Hugging Face folder of model NAME, converting its GGUF first if "
        "needed (what vLLM's --model takes)",
    )
    models.set_defaults(handler=_run_models)


def _run_generate(args: argparse.Namespace) -> int:
    """Load a model (converting its GGUF once into the cache) and answer a prompt greedily."""
    if not args.prompt.strip():  # checked before the model loads
        raise ValueError("--prompt is empty; give the user message, e.g. --prompt 'Hello?'")
    start = time.perf_counter()
    resolved = resolve_model(args.model)
    dtype = resolve_dtype_name(args.dtype)
    ids = chat_prompt_ids(load_tokenizer(resolved.path), args.prompt)
    check_generation_fits(ids.shape[1], args.max_new_tokens, model_max_positions(resolved.path))
    model, tokenizer = load_model(resolved.path, dtype=MODEL_DTYPES[dtype])
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else tokenizer.eos_token_id,
        )
    gen_s = time.perf_counter() - start
    new = out[0, ids.shape[1] :]
    print(f"model: {args.model} ({resolved.origin}: {resolved.path}), {dtype}")
    print(f"prompt: {args.prompt}")
    print(f"answer: {tokenizer.decode(new, skip_special_tokens=True).strip()}")
    print(
        f"load {load_s:.2f} s ({resolved.origin}); prompt {ids.shape[1]} tokens; "
        f"generated {new.numel()} tokens in {gen_s:.2f} s ({new.numel() / gen_s:.1f} tokens/s)"
    )
    return 0


def check_generation_fits(prompt_tokens: int, max_new_tokens: int, limit: int) -> None:
    """Refuse (ValueError) a prompt that, with ``--max-new-tokens``, needs more than the
    model's ``limit`` positions: past them the model has no position to give a token (its
    answer would come out empty after the whole prefill). Checked before the model loads."""
    if prompt_tokens + max_new_tokens > limit:
        raise ValueError(
            f"the prompt has {prompt_tokens} tokens and --max-new-tokens is {max_new_tokens}: "
            f"{prompt_tokens + max_new_tokens} positions, above the model's limit of {limit} "
            "(max_position_embeddings, prompt plus generated tokens); shorten --prompt or "
            "lower --max-new-tokens"
        )


def _run_models(args: argparse.Namespace) -> int:
    """Print every registry model: installed or not (with the install command), cache state,
    and whether a kvzap scorer is shipped for it (S11). With ``--path NAME``: only that
    model's folder, converted first if needed."""
    if args.path is not None:
        print(resolve_model(args.path).path)
        return 0
    print(f"cache: {cache_root()}")
    scorers = scorer_names()
    for name in model_names():
        status = model_status(name)
        default = " (default)" if name == DEFAULT_MODEL else ""
        print(f"{name}{default}: {status.description}")
        if not status.installed:
            print(f"    not installed; install with: {status.install_command}")
        elif status.state == "cached":
            print(f"    installed; cached at {status.cached}")
        elif status.state in ("corrupt", "stale"):
            print(
                f"    installed; cached copy is {status.state} ({status.problem}); "
                "the next load converts it again"
            )
        else:
            print("    installed; not converted yet (first load converts it, ~20-60 s)")
        scorer = "shipped" if name in scorers else "none (train one: probkv train-scorer)"
        print(f"    kvzap scorer (S11): {scorer}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
