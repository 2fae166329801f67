"""``probkv long-decode``: teacher-forced long decoding under a decode budget (S10.5).

Writes one JSON file ``{"header": {...}, "rows": [...]}``; the rows are documented in
:mod:`probkv.eval.long_decode`. ``probkv plot`` draws the NLL gap against the budget.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from probkv.cli.args import (
    add_dtype_argument,
    comma_list,
    length_list,
    output_path,
    positive_int,
)


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """The ``long-decode`` subcommand."""
    from probkv.models import DEFAULT_MODEL

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
    add_dtype_argument(parser)
    parser.set_defaults(handler=run_long_decode)


def read_text(spec: str, words: int) -> str:
    """The text of ``--text``: a file, or ``prose:SEED`` (``words`` words generated)."""
    from probkv.eval.long_decode import prose_text

    if spec.startswith("prose:"):
        seed = spec.removeprefix("prose:")
        if not seed.isdigit():
            raise ValueError(f"--text prose:SEED needs an integer seed, got {spec!r}")
        return prose_text(words, int(seed))
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--text {spec!r}: no such file (or use prose:SEED)")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"--text {spec!r}: cannot read it ({err.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--text {spec!r}: not valid UTF-8 (byte 0x{data[err.start]:02x} at offset "
            f"{err.start}); give a UTF-8 text file (iconv -f latin1 -t utf-8 converts one)"
        ) from None


def check_positions(prompt_tokens: int, tokens: int, limit: int) -> None:
    """Refuse ``--prompt-tokens`` + ``--tokens`` beyond the model's ``limit`` positions
    (before the model loads: past them the run would only fail, or wrap, at the end)."""
    if prompt_tokens + tokens > limit:
        raise ValueError(
            f"--prompt-tokens {prompt_tokens} + --tokens {tokens} = {prompt_tokens + tokens} "
            f"positions, above the model's limit of {limit} (max_position_embeddings); "
            "lower them"
        )


def run_long_decode(args: argparse.Namespace) -> int:
    from probkv.eval.attention_error_cli import write_json
    from probkv.eval.long_decode import (
        LongDecodeConfig,
        long_decode,
        summarise,
        text_token_ids,
    )
    from probkv.eval.outputs import check_output_file
    from probkv.models import load_model, model_max_positions
    from probkv.models.dtypes import MODEL_DTYPES, resolve_dtype_name

    config = LongDecodeConfig(
        prompt_tokens=args.prompt_tokens,
        tokens=args.tokens,
        budget=tuple(args.budget),
        every=args.every,
        methods=tuple(args.methods),
        seeds=args.seeds,
    )
    out = check_output_file(args.out, "--out")  # every input is checked before the model loads
    need = args.prompt_tokens + args.tokens
    text = read_text(args.text, words=need * 2)
    check_positions(args.prompt_tokens, args.tokens, model_max_positions(args.model))
    dtype = resolve_dtype_name(args.dtype)
    print(f"[long-decode] model dtype: {dtype} (--dtype {args.dtype})", file=sys.stderr)
    model, tokenizer = load_model(args.model, dtype=MODEL_DTYPES[dtype])
    ids = text_token_ids(tokenizer, text, need)

    def progress(row: dict) -> None:
        print(
            f"{row['method']:<28} B={row['budget']!s:<5} seed={row['seed']!s:<4} nll={row['nll']:.4f} "
            f"gap={row['nll_gap']:+.4f} peak/head={row['peak_entries_per_head']} "
            f"{row['tokens_per_s']:.1f} tok/s ({row['throughput_vs_full']:.2f}x full)",
            file=sys.stderr,
            flush=True,
        )

    start = time.perf_counter()
    rows = long_decode(model, ids, config, progress=progress)
    header = {
        "experiment": "long-decode",
        "model": args.model,
        "dtype": dtype,
        "text": args.text,
        "prompt_tokens": args.prompt_tokens,
        "tokens": args.tokens,
        "budget": list(config.budgets),
        "every": args.every,
        "methods": list(config.methods),
        "seeds": args.seeds,
        "error_steps": list(config.error_steps),
        "seconds": time.perf_counter() - start,
    }
    write_json(out, {"header": header, "rows": rows, "summary": summarise(rows)})
    for row in summarise(rows):
        print(
            f"{row['method']:<28} B={row['budget']!s:<5} gap {row['nll_gap']:+.4f}  peak/head "
            f"{row['peak_entries_per_head']}  throughput {row['throughput_vs_full']:.2f}x"
        )
    return 0
