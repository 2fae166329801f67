"""Cost of context scoring against a plain prefill: KVzip's reconstruction pass (S10.1) and
kvzap, its surrogate trained here and computed inside the prefill (S11).

On SmolLM2-135M with contexts of 2k and 4k tokens (8k if asked) this prints, measured side by
side in one run (alternating the variants, best of ``--repeats``):

- plain prefill (transformers' SDPA + DynamicCache, logits of the last position only);
- ``probkv.hf.compress`` with each method of ``--methods`` at r = 0.5 (``--ratios``), and its
  ratio to the plain prefill. ``kvzip``: the prefill, the reconstruction pass (one forward per
  chunk of ``chunk_tokens`` context tokens, each attending to the cache, so about ``t`` more
  tokens: 2-3 prefills expected) and the global top-k (target: <= 3x at 4k). ``kvzap``: the
  prefill, in which every layer's attention function predicts its KV heads' scores from its own
  keys and values (one ``[t, f] x [f, Hkv]`` product per layer), and the same global top-k
  (target: <= 1.10x at 4k). ``prob:kvzap``, ``snapkv`` for scale, and any other method (e.g.
  ``prob:kvzip/calibrate=0.01``, whose weight fit after the draw grows with the entries kept).

Each variant is timed twice: wall clock, and the process's CPU time (``time.process_time``),
which on a shared machine is far less sensitive to other processes taking the cores (with one
torch thread, the default, the process's CPU time is the work done). The CPU (its kind: AVX2,
AVX512-BF16, AMX) belongs with any figure.

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


def _timed(run) -> tuple[float, float]:
    """``(wall seconds, CPU seconds of this process)`` of ``run()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


@torch.no_grad()
def plain_prefill(model, ids) -> tuple[float, float]:
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    return _timed(lambda: model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1))


def compressed(model, ids, method: str, prompt, ratio: float) -> tuple[float, float]:
    prepare_model(model)
    policy = parse_method(method, ratio)
    return _timed(lambda: compress(model, ids, policy, repeat_prompt=prompt))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--repeats", type=int, default=2, help="repeats (best of)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", default="kvzip,kvzap,prob:kvzap,snapkv")
    parser.add_argument(
        "--ratios", type=ratio_list, default=[0.5], help="compression ratios, comma-separated"
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="model dtype (probkv.models.dtypes)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=resolve_dtype(args.dtype))
    prompt = repeat_prompt(tokenizer)
    runs = [(m, r) for m in args.methods.split(",") for r in args.ratios]
    print(
        f"model {args.model}, torch threads {torch.get_num_threads()}, "
        f"{resolve_dtype_name(args.dtype)} (--dtype {args.dtype}), batch 1"
    )
    gen = torch.Generator().manual_seed(0)
    for t in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(100, model.config.vocab_size - 100, (1, t), generator=gen)
        for method, ratio in runs:  # warm up: load kvzap's scorer, first-call costs
            compressed(model, ids[:, :64], method, prompt, ratio)
        inf = (float("inf"), float("inf"))
        plain = inf
        best: dict[tuple[str, float], tuple[float, float]] = {}
        for _ in range(args.repeats):  # alternate the variants so machine noise hits them alike
            plain = tuple(map(min, plain, plain_prefill(model, ids)))
            for method, ratio in runs:
                seconds = compressed(model, ids, method, prompt, ratio)
                best[(method, ratio)] = tuple(map(min, best.get((method, ratio), inf), seconds))
        print(
            f"\n== context {t} tokens ==\nplain prefill (sdpa, full cache): wall {plain[0]:.2f} s,"
            f" CPU {plain[1]:.2f} s"
        )
        for method, ratio in runs:
            wall, cpu = best[(method, ratio)]
            print(
                f"  {method:12s} r = {ratio:<4g} prefill+scoring+evict wall {wall:7.2f} s "
                f"({wall / plain[0]:.2f}x)   CPU {cpu:7.2f} s ({cpu / plain[1]:.2f}x)"
            )


if __name__ == "__main__":
    main()
