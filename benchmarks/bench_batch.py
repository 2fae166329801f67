"""Batches of prompts (S11 batches): decode throughput and KV bytes at batch sizes 1, 4, 16,
full cache vs probkv eviction, and ``probkv eval``'s examples per second at batch size 4 vs 1.

One run, side by side, on the CPU, float32, one torch thread per process (say the CPU with
any figure). Every rate is given twice: per second of wall clock and per second of the
process's CPU time (``time.process_time``); with one torch thread the CPU time is the work
done, far steadier than the wall clock on a machine shared with other processes.

Part 1: ``B`` prompts of about ``--length`` tokens (probkv's seeded prose, lengths
spread -10%..0% so the batch is padded), prefilled together, then ``--new-tokens`` greedy tokens
generated for every sequence; generated tokens per second of decode (prefill excluded) and the
KV bytes held after prefill, for the full cache (transformers' ``DynamicCache``) and
``--method`` at each ratio, and held to each decode budget of ``--budgets B:K`` (S10.5:
``max_entries=B``, ``every=K``, the bytes held after the last token); ratios are to B = 1 of
the same cache. Part 2: ``probkv eval`` on ``--eval-examples`` generated examples of each of
``--eval-tasks``, every method of ``--eval-methods`` at every ratio of ``--eval-ratios`` (with
``full``; prefills shared per example and score, as ``probkv eval`` does), batch size 4 vs 1
(same rows: checked), examples per second and their ratio, and how batch size 1 splits its
time between prefill and decode: batching shares a decode step's weights between sequences,
while a prefill is matrix-matrix work already, so the gain grows with the decode's share (the
issue's picture: many methods and ratios per prompt).

    .venv/bin/python benchmarks/bench_batch.py [--length 2048] [--batches 1 4 16]
        [--ratios 0.5 0.75] [--budgets 128:8] [--new-tokens 32] [--model smollm2-135m]
        [--no-eval | --no-decode]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from probkv.experiments.long_decode import prose_text
from probkv.hf import compress, generate, pad_left, prepare_model
from probkv.models import load_model
from probkv.policies import parse_method


def prompts(tokenizer, length: int, batch: int) -> list[torch.Tensor]:
    text = prose_text(length * 2, seed=0)
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    spread = torch.linspace(-0.1, 0.0, batch) if batch > 1 else torch.zeros(1)
    return [ids[i * 7 : i * 7 + int(length * (1 + s))] for i, s in enumerate(spread.tolist())]


def _dynamic_bytes(cache) -> int:
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (layer.keys, layer.values)
        if t is not None and hasattr(t, "numel")
    )


class Clock:
    """Wall-clock and CPU seconds since it started (``stop``)."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


@torch.no_grad()
def run_full(model, seqs, new_tokens: int) -> tuple[tuple[float, float], int]:
    """((decode wall, CPU seconds), KV bytes after prefill) of the plain model on a padded
    batch."""
    ids, mask = pad_left(seqs)
    cache = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    model(
        input_ids=ids[:, :-1],
        attention_mask=mask[:, :-1],
        position_ids=positions[:, :-1],
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    held = _dynamic_bytes(cache)
    clock = Clock()
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        cache=cache,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
    )
    return clock.stop(), held


@torch.no_grad()
def run_probkv(
    model, seqs, new_tokens: int, policy, budget=None
) -> tuple[tuple[float, float], int]:
    """((decode wall, CPU seconds), KV bytes after eviction) with probkv: the prompts but
    their last token compressed together, then the last tokens fed and ``new_tokens``
    generated. With a decode ``budget`` ``{"max_entries": B, "every": K}``: the bytes held at
    the end."""
    cache = compress(model, [s[:-1] for s in seqs], policy, **(budget or {}))
    held = cache.nbytes()
    last = torch.stack([s[-1:] for s in seqs])
    clock = Clock()
    if len(seqs) == 1:
        generate(model, cache, last[0], max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    else:
        generate(model, cache, last, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return clock.stop(), cache.nbytes() if budget else held


def decode_table(model, tokenizer, args) -> None:
    print(f"decode: prompts of ~{args.length} tokens, {args.new_tokens} new tokens each")
    print("| cache | B | tokens/s wall | vs B=1 | tokens/s CPU | vs B=1 | KV bytes / sequence |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    caches = [("full", None, None)] + [
        (f"{args.method} r={r}", parse_method(args.method, ratio=r), None) for r in args.ratios
    ]
    for spec in args.budgets:
        b, k = (int(x) for x in spec.split(":"))
        budget = {"max_entries": b, "every": k}
        caches.append((f"{args.method} B={b} K={k}", parse_method(args.method), budget))
    for name, policy, budget in caches:
        base = None
        for b in args.batches:
            seqs = prompts(tokenizer, args.length, b)
            if policy is None:
                seconds, held = run_full(model, seqs, args.new_tokens)
            else:
                seconds, held = run_probkv(model, seqs, args.new_tokens, policy, budget)
            rates = [b * args.new_tokens / s for s in seconds]
            base = rates if base is None else base
            wall, cpu = (f"{r:.1f} | {r / r0:.2f}x" for r, r0 in zip(rates, base))
            print(f"| {name} | {b} | {wall} | {cpu} | {held // b} |", flush=True)


def eval_table(args) -> None:
    from probkv.eval.config import RunConfig
    from probkv.eval.runner import run_eval
    from probkv.eval.store import RESULTS_FILE, read_results

    tasks = tuple(args.eval_tasks.split(","))
    config = RunConfig(
        model=args.model,
        methods=("full", *args.eval_methods.split(",")),
        ratios=tuple(float(r) for r in args.eval_ratios.split(",")),
        tasks=tasks,
        lengths=(args.eval_length,),
        per_task=args.eval_examples,
    )
    examples = args.eval_examples * len(tasks)
    rates, predictions, split = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in (1, 4):
            out = Path(tmp) / f"b{size}"
            clock = Clock()
            run_eval(config, out, progress=False, batch_size=size)
            rates[size] = [examples / s for s in clock.stop()]
            rows = read_results(out / RESULTS_FILE)
            predictions[size] = {(r["id"], r["method"], r["ratio"]): r["prediction"] for r in rows}
            shared = [r for r in rows if r.get("prefill_s") is not None]
            split[size] = (
                sum(r["prefill_s"] / r.get("shared_prefill", 1) for r in shared),
                sum(r.get("decode_s") or 0.0 for r in shared),
            )
    same = predictions[1] == predictions[4]
    prefill, decode = split[1]
    print(
        f"eval: {examples} examples of {args.eval_length} tokens ({args.eval_tasks}), full + "
        f"{args.eval_methods} at r = {args.eval_ratios}, {len(predictions[1])} jobs (model "
        f"loading included); batch size 1 spent {prefill:.1f} s in prefill and {decode:.1f} s "
        "in decode (wall clock)"
    )
    for i, clock in enumerate(("wall clock", "CPU time")):
        one, four = rates[1][i], rates[4][i]
        print(
            f"examples per second of {clock}: batch 1 {one:.3f}, batch 4 {four:.3f}, "
            f"ratio {four / one:.2f}x"
        )
    print(f"same predictions: {same}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75])
    ap.add_argument("--method", default="prob:snapkv")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--eval-examples", type=int, default=4, help="per task")
    ap.add_argument("--eval-length", type=int, default=1024)
    ap.add_argument("--eval-tasks", default="niah_single_1,vt,fwe")
    ap.add_argument("--eval-methods", default="snapkv,prob:snapkv")
    ap.add_argument("--eval-ratios", default="0.25,0.5,0.75,0.9")
    ap.add_argument("--budgets", nargs="*", default=[], help="decode budgets B:K (S10.5)")
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--no-decode", action="store_true", help="only the eval part")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if not args.no_decode:
        model, tokenizer = load_model(args.model, dtype=torch.float32)
        prepare_model(model)
        decode_table(model, tokenizer, args)
    if not args.no_eval:
        eval_table(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
