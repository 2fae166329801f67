"""Chunked prefill with eviction at the prompt's end (issue 11; S2): memory and time.

For a long prompt on SmolLM2-135M this runs ``model.generate(ids, cache=ProbKVCache(...,
prompt_length=t), max_new_tokens=N)`` once in one prefill forward and once with
``prefill_chunk_size``, each in a fresh process, and prints side by side: the peak resident
memory above the loaded model during ``generate`` (RSS sampled every millisecond by a
thread), its ratio, the prefill + decode time ratio, and whether both generated the same
tokens and evicted the same entries (they must: the chunks' statistics add up to the
one-pass statistics).

    .venv/bin/python benchmarks/bench_chunked_prefill.py [--length 4096] [--chunk 512]
        [--method snapkv] [--threads 1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import threading
import time

import torch

from probkv.models.dtypes import DTYPE_CHOICES


def rss_mib() -> float:
    """Resident memory of this process now, MiB (Linux /proc)."""
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_one(args: argparse.Namespace) -> dict:
    """One variant, in this process: generate, then report memory, time and fingerprints."""
    from probkv.hf import ProbKVCache, prepare_model
    from probkv.models import load_model
    from probkv.models.dtypes import resolve_dtype
    from probkv.policies import parse_method

    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, dtype=resolve_dtype(args.dtype))
    prepare_model(model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, args.length), generator=gen)
    with torch.inference_mode():  # warm-up: every weight resident before measuring
        model(input_ids=ids[:, :16])
    before = rss_mib()
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak[0] = max(peak[0], rss_mib())

    sampler = threading.Thread(target=sample, daemon=True)
    cache = ProbKVCache(model.config, parse_method(args.method, 0.5), prompt_length=args.length)
    chunk = {"prefill_chunk_size": args.chunk} if args.chunk else {}
    sampler.start()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            max_new_tokens=8,
            do_sample=False,
            **chunk,
        )
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    kept = hashlib.sha256()
    for i in cache.evicting_layers:
        kept.update(torch.tensor(cache.layers[i].prefix.lengths).numpy().tobytes())
        kept.update(cache.layers[i].prefix.keys.float().numpy().round(4).tobytes())
    return {
        "peak_mib": peak[0],
        "model_mib": before,
        "seconds": seconds,
        "tokens": out[0, args.length :].tolist(),
        "kept": kept.hexdigest()[:16],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--method", default="snapkv")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--dtype", choices=DTYPE_CHOICES, default="auto", help="model dtype (probkv.models.dtypes)"
    )
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args)))
        return
    results = {}
    for name, chunk in (("one forward", 0), (f"chunks of {args.chunk}", args.chunk)):
        argv = [sys.executable, __file__, "--one", "--model", args.model, "--method", args.method]
        argv += [
            "--length",
            str(args.length),
            "--chunk",
            str(chunk),
            "--threads",
            str(args.threads),
            "--dtype",
            args.dtype,
        ]
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"{args.model} (--dtype {args.dtype}), {args.method} at r = 0.5, prompt {args.length} "
        "tokens, 8 new tokens"
    )
    for name, r in results.items():
        print(
            f"  {name:>16}: peak {r['peak_mib']:7.0f} MiB (before generate {r['model_mib']:5.0f}),"
            f" {r['seconds']:6.1f} s, kept {r['kept']}"
        )
    one, chunked = results.values()
    extra_one = one["peak_mib"] - one["model_mib"]
    extra_chunked = chunked["peak_mib"] - chunked["model_mib"]
    print(
        f"  chunked / one forward: peak above the loaded model {extra_chunked / extra_one:.2f}x"
        f" ({extra_chunked:.0f} / {extra_one:.0f} MiB),"
        f" time {chunked['seconds'] / one['seconds']:.2f}x; same tokens: "
        f"{one['tokens'] == chunked['tokens']}, same kept entries: {one['kept'] == chunked['kept']}"
    )


if __name__ == "__main__":
    main()
