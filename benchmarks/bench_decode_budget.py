"""Decode throughput held to a budget vs the full cache, side by side (S10.5, issue 12).

Teacher-forced decoding of ``--tokens`` tokens of probkv's seeded English prose after a
``--prompt`` token prompt, into several caches fed the same token at every step, in turn
(so that a busy machine slows them alike): transformers' ``DynamicCache`` (SDPA), probkv's
cache without eviction (``full``), and probkv's cache held to ``--budget`` entries per KV
head, re-evicted every ``--every`` (``ProbKVCache(max_entries=B, every=K)``) with each
``--methods`` policy. Prints tokens/s over every step and over the last ``--window`` steps
(where the full cache is longest), the ratios to each full cache, and the peak entries per
head. One torch thread.

    .venv/bin/python benchmarks/bench_decode_budget.py [--tokens 2048] [--budget 256]
        [--methods h2o,prob:h2o-h] [--model smollm2-135m | --tiny]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

from probkv.experiments.long_decode import prose_text, text_token_ids
from probkv.hf import ProbKVCache, prepare_model
from probkv.policies import FullCache, parse_method


def build(args):
    if args.tiny:  # smoke mode: a tiny random model and random ids
        from probkv.models.testing import tiny_model

        model = tiny_model("llama")
        ids = torch.randint(0, 200, (1, args.prompt + args.tokens))
    else:
        from probkv.models import load_model

        model, tokenizer = load_model(args.model)
        ids = text_token_ids(
            tokenizer, prose_text(3 * (args.prompt + args.tokens)), args.prompt + args.tokens
        )
    return prepare_model(model), ids


@torch.no_grad()
def run(args) -> list[dict]:
    model, ids = build(args)
    p = args.prompt
    caches = {
        "dynamic": DynamicCache(),
        "full": ProbKVCache(model.config, FullCache(), prompt_length=p),
    }
    for m in args.methods:
        caches[m] = ProbKVCache(
            model.config,
            parse_method(m),
            prompt_length=p,
            max_entries=args.budget,
            every=args.every,
        )
    times = {name: [] for name in caches}
    for cache in caches.values():
        model(input_ids=ids[:, :p], cache=cache, use_cache=True, logits_to_keep=1)
    for step in range(args.tokens):
        token = ids[:, p + step : p + step + 1]
        for name, cache in caches.items():
            start = time.perf_counter()
            model(input_ids=token, cache=cache, use_cache=True)
            times[name].append(time.perf_counter() - start)
    rows = []
    for name, ts in times.items():
        cache = caches[name]
        peak = None
        if isinstance(cache, ProbKVCache):
            layers = [cache.layers[i] for i in cache.evicting_layers]
            if cache.decode_budget is None:
                peak = max(layer.physical_length() for layer in layers)
            else:
                peak = max(layer.decode_state.peak_entries for layer in layers)
        rows.append(
            {
                "cache": name,
                "tokens_per_s": len(ts) / sum(ts),
                "tokens_per_s_last": min(args.window, len(ts)) / sum(ts[-args.window :]),
                "peak_entries_per_head": peak,
            }
        )
    by = {r["cache"]: r for r in rows}
    for r in rows:
        for ref in ("dynamic", "full"):
            r[f"vs_{ref}"] = r["tokens_per_s"] / by[ref]["tokens_per_s"]
            r[f"vs_{ref}_last"] = r["tokens_per_s_last"] / by[ref]["tokens_per_s_last"]
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tiny", action="store_true", help="smoke mode on a tiny random model")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--window", type=int, default=256, help="last steps timed apart")
    ap.add_argument("--methods", default="h2o,prob:h2o-h")
    args = ap.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    torch.set_num_threads(1)
    rows = run(args)
    print(
        f"prompt {args.prompt}, {args.tokens} tokens, budget {args.budget}, every {args.every}; "
        f"last = the last {args.window} steps"
    )
    print(
        f"{'cache':<14}{'tok/s':>8}{'last':>8}{'vs dyn':>8}{'last':>7}{'vs full':>9}{'last':>7}  peak/head"
    )
    for r in rows:
        print(
            f"{r['cache']:<14}{r['tokens_per_s']:8.2f}{r['tokens_per_s_last']:8.2f}"
            f"{r['vs_dynamic']:8.2f}{r['vs_dynamic_last']:7.2f}{r['vs_full']:9.2f}"
            f"{r['vs_full_last']:7.2f}  {r['peak_entries_per_head']}"
        )


if __name__ == "__main__":
    main()
