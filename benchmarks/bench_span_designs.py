"""Cost of the span-preserving pps designs (S10.2-S10.4) next to S9's pps, side by side.

For SmolLM2-135M's shape (30 layers, 3 KV heads), on random log-scores with a SnapKV-like
32-entry window forced, times ``ProbabilisticPolicy.select`` for every layer (per-head scope,
the whole eviction decision from log-scores to the flattened selections) with S9's pps and with
each S10 option, and prints each time as a ratio to S9's pps measured in the same run (best of
``--reps``). A second table reports, for a 7-entry span whose entries each have ``P = 1/2``
(a needle's tokens at the edge of the budget), how often it is kept whole, over ``--draws``
seeds: position-order pps never keeps it (S10.4); a random order or blocks do, sometimes.

Usage: ``python benchmarks/bench_span_designs.py [--t 1024 4096 16384] [--reps 3]
[--threads 1]``. On a shared machine timings are noisy: compare ratios, not seconds.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from probkv.policies import LayerObservation, ProbabilisticPolicy

LAYERS, HKV, WINDOW = 30, 3, 32
OPTIONS = [
    {},
    {"order": "random"},
    {"block": 8},
    {"block": 8, "order": "random"},
    {"core": 0.5},
    {"core": 0.5, "block": 8, "order": "random"},
    {"pool": 7},
]


def observations(t: int, seed: int) -> list[LayerObservation]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(LAYERS):
        log_scores = 3.0 * torch.randn(HKV, t, generator=gen)
        forced = torch.zeros(HKV, t, dtype=torch.bool)
        forced[:, -WINDOW:] = True
        out.append(LayerObservation(layer, layer, log_scores, forced, torch.zeros(HKV, t)))
    return out


def best_of(fn, reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def name(options: dict) -> str:
    return "/".join(f"{k}={v}" for k, v in options.items()) or "S9 pps"


def timing_table(lengths: list[int], reps: int) -> None:
    print("| options | " + " | ".join(f"t = {t}" for t in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    rows: dict[str, list[str]] = {}
    for t in lengths:
        obs = observations(t, seed=t)
        ProbabilisticPolicy(score="snapkv", ratio=0.75, order="random").select(
            obs[:1], num_layers=1
        )
        base = None  # (one warm-up call above: first-call costs out of the first row)
        for options in OPTIONS:
            policy = ProbabilisticPolicy(score="snapkv", ratio=0.75, **options)
            seconds = best_of(
                lambda p=policy, obs=obs: [p.select([o], num_layers=LAYERS) for o in obs], reps
            )
            base = seconds if base is None else base
            cell = f"{seconds:.3f} s" if not options else f"{seconds / base:.2f}x"
            rows.setdefault(name(options), []).append(cell)
    for key, cells in rows.items():
        print(f"| {key} | " + " | ".join(cells) + " |")


def span_table(draws: int) -> None:
    """Spans of 7 entries with P = 1/2 each: 64 entries, uniform proposal, 32 kept. One span
    inside one 8-entry block (16..22), one across two blocks (20..26)."""
    t, spans = 64, {"16..22": slice(16, 23), "20..26": slice(20, 27)}
    obs = LayerObservation(0, 0, torch.zeros(1, t), None, torch.zeros(1, t))
    print("\n| options | " + " | ".join(f"P(span {k} kept whole)" for k in spans) + " |")
    print("|---|" + "---|" * len(spans))
    for options in OPTIONS[:-1]:
        whole = dict.fromkeys(spans, 0)
        for seed in range(draws):
            policy = ProbabilisticPolicy(score="uniform", ratio=0.5, seed=seed, **options)
            kept = policy.select([obs], num_layers=1)[0].to_mask(t)[0]
            for key, span in spans.items():
                whole[key] += int(kept[span].all())
        print(f"| {name(options)} | " + " | ".join(f"{whole[k] / draws:.3f}" for k in spans) + " |")
    print(f"\n(independent Bernoulli(1/2) sampling: 1/128 = {1 / 128:.4f}; with core=0.5 the core")
    print("is the 16 latest entries (equal scores go to the later position), the rest P = 1/3)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    timing_table(args.t, args.reps)
    span_table(args.draws)


if __name__ == "__main__":
    main()
