"""What ``prob:``'s spare key columns cost at a head size: vLLM's CPU kernel at the model's
width against the width that holds two more columns (``probkv.vllm.weights.next_head_size``),
side by side in one run, and the KV bytes a request then holds (issue 54: Gemma-3's 256, whose
next kernel size is 512).

    .venv-vllm/bin/python benchmarks/bench_spare_columns.py            # Gemma-3 270M's shape
    .venv-vllm/bin/python benchmarks/bench_spare_columns.py --heads 9 3 --head-size 64  # SmolLM2

One torch thread, float32, block 32: ``--rows`` decode rows (one per request) over ``--length``
positions each, then one prefill chunk of ``--chunk`` rows over the same length; best of
``--reps`` interleaved rounds. Then the KV bytes per request of ``--prompt`` positions for a
model of ``--layers`` layers of which ``--global-layers`` are evicted at r = ``--ratio`` (the
rest keep a ``--window``): plain, evicted at the model's width, evicted at the padded width.
Runs in the vLLM environment only (it calls vLLM's kernel).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

BLOCK = 32


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, nargs=2, default=(4, 1), metavar=("HQ", "HKV"))
    ap.add_argument("--head-size", type=int, default=256)
    ap.add_argument("--length", type=int, default=8192, help="positions each row reads")
    ap.add_argument("--rows", type=int, default=8, help="decode rows (requests)")
    ap.add_argument("--chunk", type=int, default=256, help="rows of the prefill chunk")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--global-layers", type=int, default=3)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--ratio", type=float, default=0.5)
    return ap.parse_args(argv)


def kernel_call(hq: int, hkv: int, width: int, length: int, rows: int, causal_chunk: bool):
    """A closure running vLLM's CPU kernel once: ``rows`` sequences of one query row over
    ``length`` positions, or (``causal_chunk``) one sequence whose last ``rows`` rows are new."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dtype = torch.float32
    isa = _get_attn_isa(dtype, BLOCK, width)
    seqs = 1 if causal_chunk else rows
    blocks = -(-length // BLOCK)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(seqs * blocks, hkv, 2 * BLOCK, width, generator=g, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    table = torch.arange(seqs * blocks, dtype=torch.int32).reshape(seqs, blocks)
    per_seq = rows if causal_chunk else 1
    qsl = torch.arange(0, seqs * per_seq + 1, per_seq, dtype=torch.int32)
    sl = torch.full((seqs,), length, dtype=torch.int32)
    query = torch.randn(seqs * per_seq, hq, width, generator=g, dtype=dtype)
    out = torch.empty_like(query)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seqs, num_heads=hq, num_kv_heads=hkv, head_dim=width, seq_lens=sl,
        dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False,
    )  # fmt: skip

    def run():
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=qsl, seq_lens=sl, scale=width**-0.5, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
            scheduler_metadata=meta, s_aux=None,
        )  # fmt: skip

    return run


def best_times(calls: dict, reps: int) -> dict:
    """Best wall time (s) of each call, rounds interleaved."""
    best = dict.fromkeys(calls, float("inf"))
    for call in calls.values():
        call()  # warm-up
    for _ in range(reps):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def request_bytes(args, width: int, evicted: bool) -> int:
    """KV bytes (float32) of one request of ``--prompt`` positions: the global layers hold the
    prompt (a share ``1 - r`` of it when evicted), the windowed layers their window and a block."""
    kept = args.prompt * (1 - args.ratio) if evicted else args.prompt
    windowed = args.layers - args.global_layers
    positions = args.global_layers * kept + windowed * min(args.prompt, args.window + BLOCK)
    return int(positions * args.heads[1] * width * 2 * 4)


def main(argv=None) -> None:
    from probkv.vllm import internals
    from probkv.vllm.weights import next_head_size

    args = parse_args(argv)
    torch.set_num_threads(1)
    d = args.head_size
    wide = next_head_size(d, internals.cpu_head_sizes())
    hq, hkv = args.heads
    calls = {}
    for width in (d, wide):
        calls[("decode", width)] = kernel_call(hq, hkv, width, args.length, args.rows, False)
        calls[("prefill", width)] = kernel_call(hq, hkv, width, args.length, args.chunk, True)
    best = best_times(calls, args.reps)
    load = os.getloadavg()[0]
    print(
        f"vLLM CPU kernel, 1 thread, float32, Hq={hq} Hkv={hkv}: head size {d} -> {wide} "
        f"(two spare columns); load {load:.2f}"
    )
    for kind, what in (
        ("decode", f"{args.rows} decode rows over {args.length}"),
        ("prefill", f"a chunk of {args.chunk} rows ending at {args.length}"),
    ):
        a, b = best[(kind, d)], best[(kind, wide)]
        print(f"  {what}: {a * 1e3:.2f} ms at {d}, {b * 1e3:.2f} ms at {wide}: {b / a:.2f}x")
    plain = request_bytes(args, d, False)
    for width in (d, wide):
        got = request_bytes(args, width, True)
        print(
            f"  KV bytes of a {args.prompt}-position request at r={args.ratio} ({width} wide): "
            f"{got / 2**20:.1f} MiB, {got / plain:.2f}x plain vLLM's {plain / 2**20:.1f} MiB"
        )


if __name__ == "__main__":
    main()
