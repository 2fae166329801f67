"""Speed and memory of probkv inside a real model (issues 4 and 13; S3, S4, S6, S10.1).

On SmolLM2-135M and contexts of 2k, 4k and 8k tokens this prints, measured side by side in one
run:

- prefill + scoring + eviction time divided by plain prefill time (transformers' SDPA +
  DynamicCache) for every score (``topk:<score>``; ``kvzip``, KVzip's global top-k, for the
  reconstruction score ``kvzip``, and the other reconstruction scores run their pass too) and
  for ``snapkv``, ``prob:min-h`` and ``prob:min-h/scope=global`` (variants alternated, best of
  ``--repeats``; ``--scores`` narrows the list, ``--no-prefill`` skips this part);
- decode milliseconds per token with the full cache and after eviction at r = 0.5 and 0.75
  (``--ratios``; ``prob:min-h`` corrected and not, ``topk:min-h``), each against its *ideal*:
  a plain cache (SDPA + DynamicCache) holding as many entries as the evicted cache keeps per
  KV head (a prompt of that length), decoded over the same steps. The variants of one ratio
  and the full cache are decoded round-robin, one step each in turn and the order rotating
  every round, so machine noise and order effects hit them alike; the median step is
  reported, with measured / ideal (the cost of the ragged layout and the correction) and its
  inverse, the fraction of the ideal speed (target >= 0.9); the correction's cost as a share
  of an uncorrected step (target <= 3%), also as the median of the per-round paired ratios
  with a bootstrap interval; and the speed-up over the full cache (``--no-decode`` skips
  this part);
- cache bytes of every variant and their ratio to the full cache.

Threads: one torch thread by default (``--threads``); on the 2-core VMs one thread per process
was measured faster than two in one process. Absolute times depend on the machine; read ratios.
``--dtype`` (default auto, :mod:`probkv.models.dtypes`) is the model's dtype.

    .venv/bin/python benchmarks/bench_integration.py [--lengths 2048,4096,8192]
        [--decode-tokens 32] [--ratios 0.5,0.75] [--repeats 2] [--scores all]
        [--no-prefill | --no-decode] [--dtype auto]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from probkv.cli.args import ratio_list
from probkv.hf import ProbKVCache, compress, observe, prepare_model, repeat_prompt
from probkv.models import load_model
from probkv.models.dtypes import DTYPE_CHOICES, MODEL_DTYPES, resolve_dtype_name
from probkv.policies import parse_method
from probkv.scores import SCORE_NAMES
from probkv.scores.scorer_lookup import has_scorer

EXTRA_PREFILL_METHODS = ["snapkv", "prob:min-h", "prob:min-h/scope=global"]
# Decode variants observe the same score, so one observed prefill serves them all
# (probkv.hf.observe + cache.evict(policy), identical to compress()).
DECODE_METHODS = ["prob:min-h", "prob:min-h/correct=false", "topk:min-h"]
RATIOS = (0.5, 0.75)


def score_method(score: str) -> str:
    """The method that times ``score``'s prefill: its top-k (KVzip's own global top-k for
    ``kvzip``)."""
    return "kvzip" if score == "kvzip" else f"topk:{score}"


def cache_bytes(cache) -> int:
    if isinstance(cache, ProbKVCache):
        return cache.nbytes()
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)


@torch.no_grad()
def plain_prefill(model, ids):
    """A plain prefill (SDPA + DynamicCache): ``(seconds, cache, next-token id)``."""
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start, cache, out.logits[:, -1:].argmax(-1)


@torch.no_grad()
def evicting_prefill_s(model, ids, method: str, ratio: float, prompt) -> float:
    """Seconds of ``probkv.hf.compress`` (prefill, any reconstruction pass, eviction)."""
    prepare_model(model)
    start = time.perf_counter()
    compress(model, ids, parse_method(method, ratio), repeat_prompt=prompt)
    return time.perf_counter() - start


def kept_per_head(cache: ProbKVCache) -> int:
    """Mean entries kept per KV head over the evicted layers (rounded): the length of the
    ideal plain cache."""
    lengths = [
        n for layer in cache.layers if layer.prefix is not None for n in layer.prefix.lengths
    ]
    return max(1, round(sum(lengths) / max(1, len(lengths))))


@torch.no_grad()
def decode_round_robin(model, variants: dict, token, steps: int) -> dict[str, list[float]]:
    """Milliseconds of every greedy decode step of every ``name: (cache, evicting)``, decoded
    one step each in turn. The order rotates every round, so each variant follows every
    other equally often (a fixed order let the variant after the full cache's SDPA step pay
    for it); the attention implementation is switched outside the timed call: probkv's for a
    ProbKVCache, SDPA for a plain cache."""
    tokens = dict.fromkeys(variants, token)
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for step in range(steps):
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            cache, evicting = variants[name]
            if evicting:
                prepare_model(model)
            else:
                model.set_attn_implementation("sdpa")
            start = time.perf_counter()
            out = model(input_ids=tokens[name], cache=cache, use_cache=True)
            times[name].append(1000 * (time.perf_counter() - start))
            tokens[name] = out.logits[:, -1:].argmax(-1)
    return times


def paired_cost(slower: list[float], faster: list[float], resamples: int = 2000):
    """Median over rounds of ``slower / faster - 1`` (steps of one round ran back to back,
    so load drifts cancel) and a 95% bootstrap interval of that median (seeded)."""
    ratios = torch.tensor(slower, dtype=torch.float64) / torch.tensor(faster, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    picks = torch.randint(len(ratios), (resamples, len(ratios)), generator=gen)
    medians = ratios[picks].median(dim=1).values.sort().values
    low, high = medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]
    return ratios.median().item() - 1, low.item() - 1, high.item() - 1


def bench_prefill(model, ids, methods: list[str], repeats: int, prompt) -> None:
    # Alternate the variants so machine noise hits them alike.
    best: dict[str | None, float] = {}
    for _ in range(repeats):
        for method in [None, *methods]:
            if method is None:
                seconds = plain_prefill(model, ids)[0]
            else:
                seconds = evicting_prefill_s(model, ids, method, 0.5, prompt)
            best[method] = min(best.get(method, float("inf")), seconds)
    plain = best[None]
    print(f"prefill plain (sdpa, full cache): {plain:.2f} s")
    for method in methods:
        print(
            f"  {method:28s} prefill+scoring+evict {best[method]:7.2f} s   "
            f"ratio {best[method] / plain:.3f}"
        )


def bench_decode(model, ids, steps: int, ratios=RATIOS) -> None:
    _, full_cache, token = plain_prefill(model, ids)
    full_bytes = cache_bytes(full_cache)
    prepare_model(model)
    observed = observe(model, ids, "min-h")
    for ratio in ratios:
        variants: dict[str, tuple] = {"full": (copy.deepcopy(full_cache), False)}
        nbytes, kept = {}, {}
        for method in DECODE_METHODS:
            cache = copy.deepcopy(observed)
            cache.evict(parse_method(method, ratio))
            nbytes[method], kept[method] = cache_bytes(cache), kept_per_head(cache)
            variants[method] = (cache, True)
        # The ideal of each variant: a plain cache of as many entries per KV head.
        for n in sorted(set(kept.values())):
            variants[f"ideal {n}"] = (plain_prefill(model, ids[:, :n])[1], False)
        times = decode_round_robin(model, variants, token, steps)
        ms = {name: statistics.median(t) for name, t in times.items()}
        full_ms = ms["full"]
        print(
            f"r={ratio}: decode full cache ({ids.shape[1]} entries) {full_ms:.1f} ms/token, "
            f"cache {full_bytes / 2**20:.1f} MiB"
        )
        for method in DECODE_METHODS:
            ideal = ms[f"ideal {kept[method]}"]
            print(
                f"  r={ratio} {method:26s} {ms[method]:6.1f} ms/token  ideal ({kept[method]} "
                f"entries) {ideal:6.1f}  measured/ideal {ms[method] / ideal:.3f}  "
                f"of ideal speed {ideal / ms[method]:.3f}  speed-up {full_ms / ms[method]:.2f}x  "
                f"cache {nbytes[method] / 2**20:6.1f} MiB ({nbytes[method] / full_bytes:.3f} "
                "of full)"
            )
        corr, unc = ms["prob:min-h"], ms["prob:min-h/correct=false"]
        cost, low, high = paired_cost(times["prob:min-h"], times["prob:min-h/correct=false"])
        print(
            f"  r={ratio} correction cost: {100 * (corr - unc) / unc:+.1f}% of an uncorrected "
            f"step (ratio of medians); paired per round {100 * cost:+.1f}% "
            f"(95% bootstrap interval {100 * low:+.1f}% to {100 * high:+.1f}%, {steps} rounds)"
        )
        del variants
    del observed, full_cache


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--repeats", type=int, default=2, help="prefill repeats (best of)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument(
        "--ratios", type=ratio_list, default=list(RATIOS), help="decode compression ratios"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    parser.add_argument(
        "--scores", default="all", help="comma-separated scores whose prefill is timed (all)"
    )
    parser.add_argument("--no-prefill", action="store_true", help="decode measurements only")
    parser.add_argument("--no-decode", action="store_true", help="prefill measurements only")
    args = parser.parse_args(argv)
    scores = list(SCORE_NAMES) if args.scores == "all" else args.scores.split(",")
    unknown = [s for s in scores if s not in SCORE_NAMES]
    if unknown:
        raise ValueError(f"--scores: unknown {unknown}; known: {', '.join(SCORE_NAMES)}")
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype_name(args.dtype)
    model, tokenizer = load_model(args.model, dtype=MODEL_DTYPES[dtype])
    if args.scores == "all" and not has_scorer(model.config):
        scores.remove("kvzap")  # S11: needs a scorer trained for this model
        print(f"kvzap skipped: no scorer shipped for {args.model} (probkv train-scorer)")
    prompt = repeat_prompt(tokenizer)
    methods = [score_method(s) for s in scores] + EXTRA_PREFILL_METHODS
    print(
        f"model {args.model}, torch threads {torch.get_num_threads()}, {dtype} "
        f"(--dtype {args.dtype}), batch 1"
    )
    gen = torch.Generator().manual_seed(0)
    for t in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(100, model.config.vocab_size - 100, (1, t), generator=gen)
        print(f"\n== context {t} tokens ==", flush=True)
        if not args.no_prefill:
            bench_prefill(model, ids, methods, args.repeats, prompt)
        if not args.no_decode:
            bench_decode(model, ids, args.decode_tokens, args.ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
