"""Speed and memory of probkv inside a real model (issue 4; S3, S4, S6).

On SmolLM2-135M and contexts of 2k, 4k and 8k tokens this prints, measured side by side in one
run (alternating the variants, best of ``--repeats``):

- prefill + eviction time divided by plain prefill time (transformers' SDPA + DynamicCache),
  for several methods; target: overhead under 10% at 8k;
- decode milliseconds per token with the full cache and after eviction at r = 0.5 and 0.75,
  corrected and uncorrected, and the speed-up over the full cache; targets: >= 1.2x at r = 0.5
  and 8k, correction under 5% of a decode step;
- cache bytes of every variant and their ratio to the full cache.

Threads: one torch thread by default (``--threads``); on the 2-core VMs one thread per process
was measured faster than two in one process. Absolute times depend on the machine; read ratios.

    .venv/bin/python benchmarks/bench_integration.py [--lengths 2048,4096,8192] [--decode-tokens 32]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import DynamicCache

from probkv.hf import ProbKVCache, observe, prepare_model
from probkv.models import load_model
from probkv.policies import parse_method

PREFILL_METHODS = ["snapkv", "prob:min-h", "prob:min-h/scope=global"]
# Decode variants observe the same score, so one observed prefill serves them all
# (probkv.hf.observe + cache.evict(policy), identical to compress()).
DECODE_METHODS = ["prob:min-h", "prob:min-h/correct=false", "topk:min-h"]


def cache_bytes(cache) -> int:
    if isinstance(cache, ProbKVCache):
        return cache.nbytes()
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)


@torch.no_grad()
def prefill(model, ids, method: str | None, ratio: float):
    """One prefill (and eviction); returns (seconds, cache, next-token id)."""
    if method is None:
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
    else:
        prepare_model(model)
        cache = ProbKVCache(model.config, parse_method(method, ratio), prompt_length=ids.shape[1])
    start = time.perf_counter()
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    if method is not None and cache.eviction_pending:
        cache.evict()
    seconds = time.perf_counter() - start
    return seconds, cache, out.logits[:, -1:].argmax(-1)


@torch.no_grad()
def decode_ms(model, cache, token, n: int, method: str | None) -> float:
    """Median milliseconds per greedy decode step (forward only) over ``n`` steps."""
    if method is None:
        model.set_attn_implementation("sdpa")
    else:
        prepare_model(model)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        out = model(input_ids=token, cache=cache, use_cache=True)
        times.append(time.perf_counter() - start)
        token = out.logits[:, -1:].argmax(-1)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--repeats", type=int, default=2, help="prefill repeats (best of)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    print(f"model {args.model}, torch threads {torch.get_num_threads()}, float32, batch 1")
    gen = torch.Generator().manual_seed(0)
    for t in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(100, model.config.vocab_size - 100, (1, t), generator=gen)
        print(f"\n== context {t} tokens ==")
        # Prefill: alternate the variants so machine noise hits them alike.
        best: dict[str | None, float] = {}
        for _ in range(args.repeats):
            for method in [None, *PREFILL_METHODS]:
                seconds, _, _ = prefill(model, ids, method, 0.5)
                best[method] = min(best.get(method, float("inf")), seconds)
        plain = best[None]
        print(f"prefill plain (sdpa, full cache): {plain:.2f} s")
        for method in PREFILL_METHODS:
            print(
                f"  {method:28s} prefill+evict {best[method]:7.2f} s   ratio {best[method] / plain:.3f}"
            )
        # Decode: the same first token for every variant, median ms over the same steps.
        _, full_cache, token = prefill(model, ids, None, 0.0)
        full_ms = decode_ms(model, full_cache, token, args.decode_tokens, None)
        full_bytes = cache_bytes(full_cache)
        del full_cache
        print(f"decode full cache: {full_ms:.1f} ms/token, cache {full_bytes / 2**20:.1f} MiB")
        prepare_model(model)
        observed = observe(model, ids, "min-h")
        for ratio in (0.5, 0.75):
            per = {}
            for method in DECODE_METHODS:
                cache = copy.deepcopy(observed)
                cache.evict(parse_method(method, ratio))
                nbytes = cache_bytes(cache)
                per[method] = decode_ms(model, cache, token, args.decode_tokens, method)
                print(
                    f"  r={ratio} {method:26s} {per[method]:6.1f} ms/token  speed-up {full_ms / per[method]:.2f}x"
                    f"  cache {nbytes / 2**20:6.1f} MiB ({nbytes / full_bytes:.3f} of full)"
                )
                del cache
            corr, unc = per["prob:min-h"], per["prob:min-h/correct=false"]
            print(
                f"  r={ratio} correction cost: {100 * (corr - unc) / unc:+.1f}% of an uncorrected step"
            )
        del observed


if __name__ == "__main__":
    main()
