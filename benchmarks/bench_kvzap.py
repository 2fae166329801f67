"""Cost of kvzap's scoring and eviction (S11) against a plain prefill, per scorer file.

kvzap's target (issue 42): scoring + eviction <= 1.10x a plain prefill at 4k. This prints,
measured side by side in one run (the variants alternated, best of ``--repeats``), for each
scorer of ``--scorers`` (the shipped one by default; ``label=FILE`` pairs to compare, e.g. a
linear and an MLP file):

- plain prefill (transformers' SDPA + DynamicCache, logits of the last position only);
- ``probkv.hf.compress`` with each method of ``--methods`` (``kvzap``, ``prob:kvzap``,
  ``kvzap/threshold=-5`` ...) at ``--ratio``, that scorer in its ``score_params``, and the
  ratio of its time to the plain prefill's.

Each variant is timed as wall clock and as the process's CPU time (``time.process_time``: with
one torch thread, the default, the work done, far steadier on a shared machine). Report the CPU
kind (AVX2, AVX512-BF16, AMX) and the load beside any figure.

    .venv/bin/python benchmarks/bench_kvzap.py [--lengths 4096] [--scorers old=A.pt,new=B.pt]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from transformers import DynamicCache

from probkv.hf import compress, prepare_model, repeat_prompt
from probkv.models import load_model
from probkv.models.dtypes import DTYPE_CHOICES, resolve_dtype, resolve_dtype_name
from probkv.policies import parse_method
from probkv.scores.scorer_lookup import scorer_for_config
from probkv.scores.surrogate import load_scorer


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


def with_scorer(method: str, ratio: float, scorer):
    policy = parse_method(method, ratio)
    params = {**policy.score_params, "surrogate": scorer}
    return dataclasses.replace(policy, score_params=params)


def scorers_arg(text: str) -> list[tuple[str, str]]:
    """``label=FILE`` pairs, comma-separated; ``shipped`` alone: the package's scorer."""
    out = []
    for part in text.split(","):
        if part == "shipped":
            out.append(("shipped", ""))
            continue
        label, sep, path = part.partition("=")
        if not sep or not label or not path:
            raise argparse.ArgumentTypeError(
                f"--scorers takes 'shipped' or label=FILE pairs, comma-separated; got {part!r}"
            )
        out.append((label, path))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="4096")
    parser.add_argument("--repeats", type=int, default=3, help="repeats (best of)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", default="kvzap,prob:kvzap")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--scorers", type=scorers_arg, default=[("shipped", "")])
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=resolve_dtype(args.dtype))
    prompt = repeat_prompt(tokenizer)
    scorers = [
        (label, load_scorer(path) if path else scorer_for_config(model.config))
        for label, path in args.scorers
    ]
    runs = [
        (f"{label}:{m}", with_scorer(m, args.ratio, s))
        for label, s in scorers
        for m in args.methods.split(",")
    ]
    print(
        f"model {args.model}, torch threads {torch.get_num_threads()}, "
        f"{resolve_dtype_name(args.dtype)}, batch 1, r = {args.ratio}; scorers "
        + ", ".join(f"{label} ({s.form}, {len(s.layers)} layers)" for label, s in scorers)
    )
    gen = torch.Generator().manual_seed(0)
    for t in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(100, model.config.vocab_size - 100, (1, t), generator=gen)
        prepare_model(model)
        for _, policy in runs:  # warm up: first-call costs
            compress(model, ids[:, :64], policy, repeat_prompt=prompt)
        inf = (float("inf"), float("inf"))
        plain = inf
        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.repeats):  # alternate the variants so machine noise hits them alike
            plain = tuple(map(min, plain, plain_prefill(model, ids)))
            prepare_model(model)
            for name, policy in runs:
                seconds = _timed(
                    lambda p=policy, x=ids: compress(model, x, p, repeat_prompt=prompt)
                )
                best[name] = tuple(map(min, best.get(name, inf), seconds))
        print(
            f"\n== context {t} tokens ==\nplain prefill (sdpa, full cache): wall {plain[0]:.2f} s,"
            f" CPU {plain[1]:.2f} s"
        )
        for name, _ in runs:
            wall, cpu = best[name]
            print(
                f"  {name:32s} wall {wall:7.2f} s ({wall / plain[0]:.2f}x)   "
                f"CPU {cpu:7.2f} s ({cpu / plain[1]:.2f}x)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
