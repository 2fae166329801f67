"""The experiments' subcommands: ``attention-error``, ``task-attention-error`` and
``long-decode`` (registered in ``probkv.cli.main``).

Each handler turns its arguments into the typed entry point of its experiment
(:func:`probkv.experiments.attention_error_run.run_attention_error`,
:func:`probkv.experiments.method_attention_error.run_task_attention_error`,
:func:`probkv.experiments.long_decode.run_long_decode`), which checks every input before the model
loads and writes one JSON file ``{"header": {...}, "rows": [...]}`` (documented in the
experiment's module; ``probkv plot`` draws it), and prints its table. The entry points that
load transformers are imported when a handler runs, so ``probkv --help`` loads none.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from probkv.cli.args import (
    add_dtype_argument,
    add_example_arguments,
    check_example_arguments,
    comma_list,
    float_list,
    length_list,
    non_negative_int,
    output_path,
    positive_int,
    ratio_list,
)
from probkv.experiments import attention_error_run as ae_run
from probkv.experiments.attention_error import (
    PREFILL_SCORES,
    PROMPT_FORMATS,
    WITH_REPLACEMENT_WEIGHTS,
)
from probkv.experiments.method_attention_error import (
    TaskAttentionErrorRun,
    run_task_attention_error,
    validate_methods,
)
from probkv.models import DEFAULT_MODEL
from probkv.policies.probabilistic import SAMPLERS, SCOPES

TAUS = ",".join(f"{t:g}" for t in ae_run.TAUS)
RATIOS = ",".join(f"{r:g}" for r in ae_run.RATIOS)


def add_attention_error(subparsers: argparse._SubParsersAction) -> None:
    """``attention-error``: estimators of one proposal on one prompt (S7, S9)."""

    parser = subparsers.add_parser(
        "attention-error",
        help="attention error of top-k, uncorrected and corrected eviction (paper Figure 2)",
        description=(
            "Per-head attention error (mean absolute difference over the head dimension, "
            "averaged over every head of every evicted layer) of H2O top-k, top-k of the "
            "proposal, and sampled eviction without and with correction, per compression "
            "ratio and weight temperature (S7, S9). Default prompt: the paper's "
            "Appendix E text, whose question's first token is the measured decode token."
        ),
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"model name or folder (default {DEFAULT_MODEL})"
    )
    parser.add_argument("--ratios", type=float_list, default=RATIOS, help=f"default {RATIOS}")
    parser.add_argument("--taus", type=float_list, default=TAUS, help=f"default {TAUS}")
    parser.add_argument(
        "--seeds",
        type=positive_int,
        default=3,
        help="number K of seeds (0..K-1) of the sampled estimators (default 3)",
    )
    parser.add_argument("--out", type=output_path, required=True, help="results JSON file")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--prompt-file", type=Path, help="UTF-8 text used in place of the Appendix E text"
    )
    source.add_argument(
        "--prompt-tokens",
        type=positive_int,
        help="a prompt of about N tokens: prose haystack around the Appendix E text",
    )
    parser.add_argument(
        "--question", default=None, help="question (default: the Appendix E question)"
    )
    parser.add_argument(
        "--format",
        choices=PROMPT_FORMATS,
        default=None,
        help="paper: plain text, decode token = the question's first token (default for the "
        "Appendix E prompt); chat: chat template with the question, decode token = the "
        "model's greedy answer (default for --prompt-file and --prompt-tokens)",
    )
    parser.add_argument(
        "--proposal", choices=PREFILL_SCORES, default="h2o", help="proposal (default h2o)"
    )
    parser.add_argument(
        "--weights",
        choices=WITH_REPLACEMENT_WEIGHTS,
        default=None,
        help="with_replacement weights (default counts, the paper); not with --sampler pps",
    )
    parser.add_argument(
        "--sampler", choices=SAMPLERS, default="with_replacement", help="default with_replacement"
    )
    parser.add_argument(
        "--steps",
        type=non_negative_int,
        default=0,
        help="also the compounded error averaged over the first N decode tokens (default 0)",
    )
    parser.add_argument(
        "--scope", choices=SCOPES, default="head", help="budget scope (S3; default head)"
    )
    add_dtype_argument(parser)
    parser.set_defaults(handler=run_attention_error_command)


def add_task_attention_error(subparsers: argparse._SubParsersAction) -> None:
    """``task-attention-error``: whole methods on the examples ``probkv eval`` runs."""

    parser = subparsers.add_parser(
        "task-attention-error",
        help="attention error of whole methods (kvzip, prob:kvzip, ...) on task examples",
        description=(
            "For each example (generated --tasks or a --data file, split as probkv eval splits "
            "it), method, ratio and seed: evict the context through the integration, teacher "
            "force the question and the full model's greedy answer, and average the per-head "
            "attention error (S7, Eq. 11, compounded across layers and tokens) over the "
            "question's and the answer's tokens. See probkv.experiments.method_attention_error."
        ),
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"name, .gguf or folder (default {DEFAULT_MODEL})"
    )
    parser.add_argument(
        "--methods",
        type=comma_list,
        required=True,
        help="comma-separated eviction method names as probkv eval takes them (not full)",
    )
    parser.add_argument(
        "--ratios", type=ratio_list, default=[0.5, 0.75, 0.9], help="default 0.5,0.75,0.9"
    )
    parser.add_argument(
        "--seeds",
        type=positive_int,
        default=3,
        help="seeds 0..K-1 of the sampled methods (default 3)",
    )
    parser.add_argument("--out", type=output_path, required=True, help="results JSON file")
    add_example_arguments(parser, per_task=3)
    parser.add_argument(
        "--answer-tokens",
        type=positive_int,
        default=16,
        help="greedy answer tokens of the full model teacher forced after the question "
        "(default 16)",
    )
    add_dtype_argument(parser)
    parser.set_defaults(handler=run_task_attention_error_command)


def add_long_decode(subparsers: argparse._SubParsersAction) -> None:
    """``long-decode``: generation held to a decode budget (S10.5)."""
    parser = subparsers.add_parser(
        "long-decode",
        help="NLL, peak memory and throughput of generation held to a decode budget",
        description=(
            "Teacher-forced decoding: the first --prompt-tokens tokens of --text are the "
            "prompt, the next --tokens are fed one at a time as if generated, into a cache "
            "held to --budget entries per KV head (re-evicted every --every entries). Per "
            "method: mean NLL of the generated tokens and the full cache's, peak entries per "
            "head, peak cache bytes, tokens/s and the attention error against the full cache."
        ),
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model (default {DEFAULT_MODEL})")
    parser.add_argument(
        "--text",
        required=True,
        help="a UTF-8 text file, or prose:SEED for probkv's seeded procedural English prose",
    )
    parser.add_argument("--prompt-tokens", type=positive_int, required=True)
    parser.add_argument("--tokens", type=positive_int, required=True)
    parser.add_argument(
        "--budget",
        type=length_list,
        required=True,
        help="B, entries per KV head; several comma-separated (128,256,512) for a sweep",
    )
    parser.add_argument("--every", type=positive_int, default=16, help="K (default 16)")
    parser.add_argument(
        "--methods",
        type=comma_list,
        default=["streaming_llm", "h2o", "tova", "snapkv", "prob:h2o-h", "prob:min-h"],
        help="comma-separated method names (full is always run)",
    )
    parser.add_argument("--seeds", type=positive_int, default=1, help="seeds per sampled method")
    parser.add_argument("--out", type=output_path, required=True, help="JSON file to write")
    parser.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="hf (default): transformers, budgets per KV head; vllm: one vLLM engine with "
        "probkv's plugin, model-wide blocks of 32, top-k methods (snapkv, tova, knorm, "
        "streaming_llm), the tokens forced, vLLM's raw log-probs",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="vLLM tensor-parallel ranks (--engine vllm only; default 1)",
    )
    add_dtype_argument(parser)
    parser.set_defaults(handler=run_long_decode_command)


def run_attention_error_command(args: argparse.Namespace) -> int:
    """``probkv attention-error``: measure, write the JSON, print the table."""
    run = ae_run.AttentionErrorRun(
        model=args.model,
        out=args.out,
        ratios=args.ratios,
        taus=args.taus,
        seeds=args.seeds,
        proposal=args.proposal,
        weights=args.weights,
        sampler=args.sampler,
        scope=args.scope,
        steps=args.steps,
        prompt_file=args.prompt_file,
        prompt_tokens=args.prompt_tokens,
        question=args.question,
        format=args.format,
        dtype=args.dtype,
    )
    log = lambda message: print(f"[attention-error] {message}", file=sys.stderr)  # noqa: E731
    result = ae_run.run_attention_error(run, log=log)
    print(format_table(result.rows))
    print(f"wrote {len(result.rows)} rows to {result.path}")
    return 0


def run_task_attention_error_command(args: argparse.Namespace) -> int:
    """``probkv task-attention-error``: measure every example, write the JSON, print the
    summary."""
    validate_methods(args.methods, args.ratios, args.seeds)
    check_example_arguments(args)
    run = TaskAttentionErrorRun(
        model=args.model,
        methods=args.methods,
        ratios=args.ratios,
        out=args.out,
        seeds=args.seeds,
        answer_tokens=args.answer_tokens,
        data=args.data,
        data_format=args.data_format,
        tasks=args.tasks,
        lengths=args.lengths,
        per_task=args.per_task,
        seed=args.seed,
        question_aware=args.question_aware,
        max_examples=args.max_examples,
        dtype=args.dtype,
    )
    log = lambda message: print(f"[task-attention-error] {message}", file=sys.stderr)  # noqa: E731
    result = run_task_attention_error(run, log=log)
    print(format_summary(result.summary))
    print(f"wrote {len(result.rows)} rows ({result.examples} examples) to {result.path}")
    return 0


def run_long_decode_command(args: argparse.Namespace) -> int:
    """``probkv long-decode``: run every method, write the JSON, print the summary."""
    from probkv.experiments.long_decode import LongDecodeConfig, run_long_decode  # transformers

    if args.engine != "vllm" and args.tensor_parallel_size != 1:
        raise ValueError(
            f"--tensor-parallel-size {args.tensor_parallel_size} needs --engine vllm "
            "(the hf engine runs one process)"
        )
    config = LongDecodeConfig(
        prompt_tokens=args.prompt_tokens,
        tokens=args.tokens,
        budget=tuple(args.budget),
        every=args.every,
        methods=tuple(args.methods),
        seeds=args.seeds,
        engine=args.engine,
    )

    def progress(row: dict) -> None:
        print(
            f"{row['method']:<28} B={row['budget']!s:<5} seed={row['seed']!s:<4} nll={row['nll']:.4f} "
            f"gap={row['nll_gap']:+.4f} peak/head={row['peak_entries_per_head']} "
            f"{row['tokens_per_s']:.1f} tok/s ({row['throughput_vs_full']:.2f}x full)",
            file=sys.stderr,
            flush=True,
        )

    if args.engine == "vllm":
        from probkv.experiments.long_decode import run_long_decode_vllm

        result = run_long_decode_vllm(
            config, model=args.model, text=args.text, out=args.out, dtype=args.dtype,
            tensor_parallel_size=args.tensor_parallel_size,
        )  # fmt: skip
        for row in result.summary:
            print(
                f"{row['method']:<28} B={row['budget']!s:<5} gap {row['nll_gap']:+.4f}  "
                f"peak positions {row['peak_positions']}"
            )
        return 0
    result = run_long_decode(
        config, model=args.model, text=args.text, out=args.out, dtype=args.dtype,
        progress=progress,
    )  # fmt: skip
    for row in result.summary:
        print(
            f"{row['method']:<28} B={row['budget']!s:<5} gap {row['nll_gap']:+.4f}  peak/head "
            f"{row['peak_entries_per_head']}  throughput {row['throughput_vs_full']:.2f}x"
        )
    return 0


def format_summary(summary: list[dict]) -> str:
    """One line per (method, ratio, part): the mean error over examples and, for a
    ``prob:`` method, on how many examples it was below / above its top-k version (with the
    sign test of the two)."""
    lines = [f"{'method':<32} {'r':>5} {'part':<9} {'error':>9} {'n':>3}  vs top-k (lower-higher)"]
    for row in sorted(summary, key=lambda r: (r["part"], r["ratio"], r["method"])):
        versus = (
            ""
            if row["reference"] is None
            else (f"{row['reference']}: {row['lower']}-{row['higher']} (p = {row['p']:.2g})")
        )
        lines.append(
            f"{row['method']:<32} {row['ratio']:>5.2f} {row['part']:<9} {row['mae_mean']:>9.5f} "
            f"{row['examples']:>3}  {versus}"
        )
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    """A plain-text table: one line per row (step, ratio, estimator, tau, error, ratio)."""
    lines = [f"{'step':>6} {'r':>5} {'estimator':<22} {'mae_mean':>10} {'mae_std':>9} {'eff r':>6}"]
    for row in rows:
        name = row["estimator"] + (f" tau={row['tau']:g}" if row["tau"] is not None else "")
        lines.append(
            f"{row['step']!s:>6} {row['ratio']:>5.2f} {name:<22} {row['mae_mean']:>10.5f} "
            f"{row['mae_std']:>9.5f} {row['effective_ratio']:>6.3f}"
        )
    return "\n".join(lines)
