"""Decode attention over a ragged evicted prefix: one batched segment softmax vs the per-head
loop it replaced (``probkv.hf.attention``, S4).

One decode step (q = 1) of one layer at SmolLM2-135M's shape (Hq = 9, Hkv = 3, d = 64),
float32, one torch thread; the prefix keeps ``(1 - r) t`` entries on average per head with
per-head counts spread +-40% (ragged, as Ada-KV budgets or sampling with replacement leave
them), and a tail of 16 tokens. Prints microseconds per call (best of rounds, the two paths
interleaved) and loop / batched. The result decides ``RAGGED_BATCHED_ON_CPU``.

    .venv/bin/python benchmarks/bench_ragged_decode.py [--t 2048 4096 8192] [--ratios 0.5 0.75]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

import probkv.hf.attention as attention_module
from probkv.hf.attention import evicted_attention
from probkv.hf.prefix import RaggedPrefix

HQ, HKV, D, TAIL = 9, 3, 64, 16


def make_layer(t: int, ratio: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mean = (1 - ratio) * t
    spread = torch.linspace(-0.4, 0.4, HKV)
    lengths = [max(1, round(mean * (1 + s))) for s in spread.tolist()]
    n = sum(lengths)
    prefix = RaggedPrefix(
        keys=torch.randn(n, D, generator=gen),
        values=torch.randn(n, D, generator=gen),
        log_weights=torch.rand(n, generator=gen),
        lengths=lengths,
    )
    layer = SimpleNamespace(
        prefix=prefix,
        num_heads=HKV,
        tail_keys=torch.randn(1, HKV, TAIL, D, generator=gen),
        tail_values=torch.randn(1, HKV, TAIL, D, generator=gen),
    )
    return layer, torch.randn(HQ, 1, D, generator=gen)


def best_us(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--t", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    attention_module.RAGGED_BATCHED_ON_CPU = True  # time the batched op on CPU too
    print(f"torch {torch.__version__}, 1 thread, float32, Hq={HQ} Hkv={HKV} d={D}, q=1")
    print(
        f"{'t':>6} {'r':>5} {'entries':>8} {'loop us':>9} {'batched us':>11} {'loop/batched':>13}"
    )
    for t in args.t:
        for ratio in args.ratios:
            layer, query = make_layer(t, ratio)
            scale = D**-0.5
            times = {"loop": float("inf"), "batched": float("inf")}
            for _ in range(args.rounds):
                for name, batched in (("loop", False), ("batched", True)):
                    attention_module.RAGGED_BATCHED_ON_CPU = batched
                    times[name] = min(
                        times[name],
                        best_us(lambda a=(layer, query, scale): evicted_attention(*a), args.reps),
                    )
            n = sum(layer.prefix.lengths)
            print(
                f"{t:>6} {ratio:>5} {n:>8} {times['loop']:>9.1f} {times['batched']:>11.1f} "
                f"{times['loop'] / times['batched']:>13.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
