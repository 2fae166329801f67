"""The foundation's subcommands, ``generate`` and ``models`` (registered in
``probkv.cli.main``): a greedy answer with no eviction, and the registry models' state."""

from __future__ import annotations

import argparse
import time

import torch

from probkv.cli.args import add_dtype_argument, positive_int
from probkv.models import (
    DEFAULT_MODEL,
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


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """The foundation's subcommands: ``generate`` and ``models``."""
    gen = subparsers.add_parser(
        "generate",
        help="greedy generation with a model (no eviction)",
        description=run_generate.__doc__,
    )
    gen.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"registry name, .gguf or folder (default {DEFAULT_MODEL})",
    )
    gen.add_argument("--prompt", default="What is the capital of France?", help="user message")
    gen.add_argument("--max-new-tokens", type=positive_int, default=32, help="default 32")
    add_dtype_argument(gen)
    gen.set_defaults(handler=run_generate)

    models = subparsers.add_parser(
        "models", help="list the registry models, installed or not, and their cache state"
    )
    models.add_argument(
        "--path",
        metavar="NAME",
        help="print only the Hugging Face folder of model NAME, converting its GGUF first if "
        "needed (what vLLM's --model takes)",
    )
    models.set_defaults(handler=run_models)


def run_generate(args: argparse.Namespace) -> int:
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


def run_models(args: argparse.Namespace) -> int:
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
