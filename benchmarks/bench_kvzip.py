"""Cost of KVzip's reconstruction scoring against a plain prefill (S10.1).

On SmolLM2-135M with contexts of 2k and 4k tokens this prints, measured side by side in one
run (alternating the variants, best of ``--repeats``):

- plain prefill (transformers' SDPA + DynamicCache, logits of the last position only);
- ``probkv.hf.compress`` with ``kvzip`` at r = 0.5 (``--ratios``): prefill, the reconstruction
  pass (one forward per chunk of ``chunk_tokens`` context tokens, each attending to the cache)
  and the global top-k eviction; and its ratio to the plain prefill (target: <= 3x at 4k);
- the same with ``snapkv`` for scale, and any other method of ``--methods`` (e.g.
  ``prob:kvzip/calibrate=0.01``, whose weight fit after the draw grows with the entries kept
  per head, so with ``1 - r``).

The pass feeds about ``t`` more tokens through the model, each attending to ``t`` cached
entries plus its chunk, so about 2-2.5 prefills are expected. Threads: one by default.

    .venv/bin/python benchmarks/bench_kvzip.py [--lengths 2048,4096] [--ratios 0.5] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

from probkv.cli.args import ratio_list
from probkv.hf import compress, prepare_model, repeat_prompt
from probkv.models import load_model
from probkv.models.dtypes import DTYPE_CHOICES, resolve_dtype, resolve_dtype_name
from probkv.policies import parse_method


@torch.no_grad()
def plain_prefill(model, ids) -> float:
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


def compressed(model, ids, method: str, prompt, ratio: float) -> float:
    prepare_model(model)
    start = time.perf_counter()
    compress(model, ids, parse_method(method, ratio), repeat_prompt=prompt)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--repeats", type=int, default=2, help="repeats (best of)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", default="kvzip,snapkv")
    parser.add_argument(
        "--ratios", type=ratio_list, default=[0.5], help="compression ratios, comma-separated"
    )
    parser.add_argument(
        "--dtype", choices=DTYPE_CHOICES, default="auto", help="model dtype (probkv.models.dtypes)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=resolve_dtype(args.dtype))
    prompt = repeat_prompt(tokenizer)
    methods = args.methods.split(",")
    runs = [(m, r) for m in methods for r in args.ratios]
    print(
        f"model {args.model}, torch threads {torch.get_num_threads()}, "
        f"{resolve_dtype_name(args.dtype)} (--dtype {args.dtype}), batch 1"
    )
    gen = torch.Generator().manual_seed(0)
    for t in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(100, model.config.vocab_size - 100, (1, t), generator=gen)
        plain = float("inf")
        best: dict[tuple[str, float], float] = {}
        for _ in range(args.repeats):  # alternate the variants so machine noise hits them alike
            plain = min(plain, plain_prefill(model, ids))
            for method, ratio in runs:
                seconds = compressed(model, ids, method, prompt, ratio)
                best[(method, ratio)] = min(best.get((method, ratio), float("inf")), seconds)
        print(f"\n== context {t} tokens ==\nplain prefill (sdpa, full cache): {plain:.2f} s")
        for method, ratio in runs:
            seconds = best[(method, ratio)]
            print(
                f"  {method:10s} r = {ratio:<4g} prefill+scoring+evict {seconds:7.2f} s   "
                f"ratio {seconds / plain:.2f}x"
            )


if __name__ == "__main__":
    main()
