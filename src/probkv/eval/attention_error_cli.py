"""``probkv attention-error``: the attention-error experiment from the command line (S7).

Writes one JSON file ``{"header": {...}, "rows": [...]}``; the rows and what every number
means are documented in :mod:`probkv.eval.attention_error` (and repeated in the header's
``definitions``). ``probkv plot`` draws them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from probkv.cli.args import add_dtype_argument, output_path, positive_int
from probkv.eval.outputs import check_output_file, remove_quietly

TAUS = "1,2,5,10,50"
RATIOS = "0.25,0.5,0.75,0.9"


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
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value!r}")
    return n


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """The ``attention-error`` subcommand."""
    from probkv.eval.attention_error import (
        PREFILL_SCORES,
        PROMPT_FORMATS,
        WITH_REPLACEMENT_WEIGHTS,
    )
    from probkv.models import DEFAULT_MODEL
    from probkv.policies.probabilistic import SAMPLERS, SCOPES

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
    parser.set_defaults(handler=run_attention_error)
    add_task_command(subparsers)


def add_task_command(subparsers: argparse._SubParsersAction) -> None:
    """``task-attention-error``: whole methods on the examples ``probkv eval`` runs."""
    from probkv.cli.args import add_example_arguments, comma_list, ratio_list
    from probkv.models import DEFAULT_MODEL

    parser = subparsers.add_parser(
        "task-attention-error",
        help="attention error of whole methods (kvzip, prob:kvzip, ...) on task examples",
        description=(
            "For each example (generated --tasks or a --data file, split as probkv eval splits "
            "it), method, ratio and seed: evict the context through the integration, teacher "
            "force the question and the full model's greedy answer, and average the per-head "
            "attention error (S7, Eq. 11, compounded across layers and tokens) over the "
            "question's and the answer's tokens. See probkv.eval.method_attention_error."
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
    parser.set_defaults(handler=run_task_attention_error)


def run_task_attention_error(args: argparse.Namespace) -> int:
    """Load the model and the examples, measure each example, write the JSON."""
    import torch

    from probkv.cli.args import check_example_arguments
    from probkv.eval import method_attention_error as mae
    from probkv.eval.attention_prompts import decode_tokens
    from probkv.eval.config import RunConfig
    from probkv.eval.job import job_prompt_ids, split_prompt
    from probkv.eval.plan import load_run_examples
    from probkv.hf import prepare_model, repeat_prompt
    from probkv.models import load_model, max_positions
    from probkv.models.dtypes import MODEL_DTYPES, resolve_dtype_name

    mae.validate_methods(args.methods, args.ratios, args.seeds)
    check_example_arguments(args)
    config = RunConfig(  # checks the example source the way probkv eval does
        model=args.model,
        methods=tuple(args.methods),
        ratios=tuple(args.ratios),
        data=args.data,
        data_format=args.data_format,
        tasks=tuple(args.tasks or ()),
        lengths=tuple(args.lengths or ()),
        per_task=args.per_task,
        seed=args.seed,
        question_aware=args.question_aware,
        max_examples=args.max_examples,
        dtype=args.dtype,
    )
    out = check_output_file(args.out, "--out")
    start = time.perf_counter()
    dtype = resolve_dtype_name(args.dtype)
    model, tokenizer = load_model(args.model, dtype=MODEL_DTYPES[dtype])
    prepare_model(model)
    examples = load_run_examples(config, tokenizer)
    rebuild = repeat_prompt(tokenizer)
    log = lambda message: print(f"[task-attention-error] {message}", file=sys.stderr)  # noqa: E731
    log(f"{len(examples)} examples; model dtype: {dtype} (--dtype {args.dtype})")
    rows, prompts = [], []
    for example in examples:
        context, question, _ = job_prompt_ids(example, tokenizer, max_positions(model.config))
        prefilled, fed = split_prompt(context, question, args.question_aware)
        prompt = ae_prompt(prefilled, fed, example.id)
        decode = decode_tokens(model, prompt, len(fed) + args.answer_tokens)
        prompts.append(
            {
                "example": example.id,
                "prompt_tokens": len(prefilled),
                "fed_tokens": len(fed),
                "answer_text": tokenizer.decode(list(decode[len(fed) :])),
            }
        )
        rows += mae.measure_method_errors(
            model,
            torch.tensor(prefilled),
            torch.tensor(decode),
            num_fed=len(fed),
            methods=args.methods,
            ratios=args.ratios,
            seeds=args.seeds,
            repeat_prompt=rebuild,
            example=example.id,
            progress=log,
        )
    summary = mae.mean_over_examples(rows)
    header = {
        "experiment": "task-attention-error (S7, Eq. 11, compounded; probkv.eval."
        "method_attention_error)",
        "model": args.model,
        "dtype": dtype,
        "arguments": {
            "methods": args.methods,
            "ratios": args.ratios,
            "seeds": args.seeds,
            "tasks": args.tasks,
            "lengths": args.lengths,
            "per_task": args.per_task,
            "seed": args.seed,
            "data": args.data,
            "question_aware": args.question_aware,
            "max_examples": args.max_examples,
            "answer_tokens": args.answer_tokens,
        },
        "examples": prompts,
        "runtime_s": round(time.perf_counter() - start, 2),
    }
    write_json(out, {"header": header, "rows": rows, "summary": summary})
    print(format_summary(summary))
    print(f"wrote {len(rows)} rows ({len(examples)} examples) to {out}")
    return 0


def ae_prompt(prefilled, fed, example_id: str):
    """The example as an ``AttentionPrompt``: the evicted part, then the fed tokens."""
    from probkv.eval.attention_prompts import AttentionPrompt

    return AttentionPrompt(tuple(prefilled), tuple(fed), f"example:{example_id}", "paper")


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


def run_attention_error(args: argparse.Namespace) -> int:
    """Load the model, build the prompt and decode tokens, measure, write the JSON."""
    from probkv.eval import attention_error as ae
    from probkv.eval.paper_prompt import PAPER_QUESTION
    from probkv.hf import prepare_model
    from probkv.models import load_model, load_tokenizer, model_max_positions
    from probkv.models.dtypes import MODEL_DTYPES, resolve_dtype_name

    # the estimators to measure, as validate_arguments and measure_attention_error take them
    estimators = {
        "ratios": args.ratios,
        "taus": args.taus,
        "seeds": args.seeds,
        "proposal": args.proposal,
        "weights": args.weights,
        "sampler": args.sampler,
        "scope": args.scope,
        "steps": args.steps,
    }
    _, _, weights = ae.validate_arguments(**estimators)
    # Everything the user gave is checked before the model loads: a run that can only fail
    # at its end (an unwritable --out, a prompt past the model's positions) costs nothing.
    out = check_output_file(args.out, "--out")
    question = PAPER_QUESTION if args.question is None else args.question
    if not question.strip():
        raise ValueError("--question is empty; give a question or omit --question")
    text = None if args.prompt_file is None else read_prompt_file(args.prompt_file)
    start = time.perf_counter()
    limit = model_max_positions(args.model)
    if args.prompt_tokens is not None:  # refused before a haystack is even built
        check_positions("--prompt-tokens", args.prompt_tokens, args.steps, limit)
    tokenizer = load_tokenizer(args.model)
    prompt = build_prompt(args, ae, tokenizer, text, question)
    check_positions("the prompt", len(prompt.context_ids), args.steps, limit)
    dtype = resolve_dtype_name(args.dtype)
    model, tokenizer = load_model(args.model, dtype=MODEL_DTYPES[dtype])
    prepare_model(model)
    decode = ae.decode_tokens(model, prompt, max(args.steps, 1))
    log = lambda message: print(f"[attention-error] {message}", file=sys.stderr)  # noqa: E731
    log(f"prompt: {len(prompt.context_ids)} tokens ({prompt.source}, {prompt.format} format)")
    log(f"model dtype: {dtype} (--dtype {args.dtype})")
    rows = ae.measure_attention_error(model, prompt.context_ids, decode, **estimators, progress=log)
    arguments = {
        **estimators,
        "weights": weights,
        "prompt_file": None if args.prompt_file is None else str(args.prompt_file),
        "prompt_tokens": args.prompt_tokens,
        "question": question,
        "dtype": dtype,
    }
    header = ae.results_header(
        model_name=args.model,
        prompt=prompt,
        decode_ids=decode,
        tokenizer=tokenizer,
        arguments=arguments,
        num_heads=rows[0]["num_heads"],
    )
    header["dtype"] = dtype
    header["runtime_s"] = round(time.perf_counter() - start, 2)
    write_json(out, {"header": header, "rows": rows})
    print(format_table(rows))
    print(f"wrote {len(rows)} rows to {out}")
    return 0


def build_prompt(args: argparse.Namespace, ae, tokenizer, text: str | None, question: str):
    """The measured prompt: ``--prompt-file``'s text, a ``--prompt-tokens`` haystack, or the
    paper's Appendix E text (tokenizer only: built before the model loads)."""
    from probkv.eval.paper_prompt import PAPER_TEXT

    if text is not None:
        return ae.text_prompt(
            tokenizer, text, question, format=args.format or "chat", source="file"
        )
    if args.prompt_tokens is not None:
        return ae.haystack_prompt(
            tokenizer, args.prompt_tokens, format=args.format or "chat", question=question
        )
    return ae.text_prompt(
        tokenizer, PAPER_TEXT, question, format=args.format or "paper", source="paper"
    )


def check_positions(what: str, prompt_tokens: int, steps: int, limit: int) -> None:
    """Refuse a prompt that, with the ``max(steps, 1)`` decode tokens measured after it,
    needs more than the model's ``limit`` positions (ValueError naming ``what``)."""
    need = prompt_tokens + max(steps, 1)
    if need > limit:
        raise ValueError(
            f"{what} ({prompt_tokens} tokens) plus {max(steps, 1)} decode token(s) (--steps) "
            f"need {need} positions, above the model's limit of {limit} "
            "(max_position_embeddings); use a shorter prompt"
        )


def read_prompt_file(path: Path) -> str:
    """The text of ``--prompt-file``: UTF-8 and not blank, else a ValueError naming the flag."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"--prompt-file {str(path)!r}: cannot read it ({err.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--prompt-file {str(path)!r}: not valid UTF-8 (byte 0x{data[err.start]:02x} at "
            f"offset {err.start}); give a UTF-8 text file"
        ) from None
    if not text.strip():
        raise ValueError(f"--prompt-file {str(path)!r} is empty; give a file with the prompt text")
    return text


def write_json(path: Path, payload: dict) -> None:
    """Write ``payload`` atomically (temporary file, then rename); on failure the temporary
    file is removed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        remove_quietly(tmp)
        raise ValueError(f"--out {str(path)!r}: cannot write it ({err.strerror})") from None
    except BaseException:
        remove_quietly(tmp)
        raise


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
