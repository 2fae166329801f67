"""bfloat16 against float32 on this machine (issue 13): prefill time, task scores, attention error.

Prints, in one run (one torch thread by default, ``--threads``):

1. prefill time of the plain model (transformers' SDPA + DynamicCache, logits of the last
   position only) in float32 and in bfloat16, the two alternated, best of ``--repeats``, and
   the ratio float32 / bfloat16 (above 1: bfloat16 is faster);
2. task scores: the same ``probkv eval`` run (generated needle tasks, ``--methods`` at
   ``--ratio``) in each dtype, into ``OUT/float32`` and ``OUT/bfloat16`` (resumable), side by
   side: the average score per method in each dtype, the paired difference per example with
   its standard error (the noise it is judged against), how many answers are identical, and
   the mean prefill + eviction time of the jobs in each dtype and their ratio;
3. attention error (``probkv attention-error``'s measurement on the paper's Appendix E prompt)
   of top-k and of sampled eviction with and without correction, in each dtype.

What ``--dtype auto`` resolves to on this machine (and why) is printed first
(:mod:`probkv.models.dtypes`). Absolute times depend on the machine and its load; read the ratios.

    .venv/bin/python benchmarks/bench_dtype.py [--length 2048] [--per-task 4]
        [--methods full,snapkv,prob:min-h] [--ratio 0.5] [--out bench-dtype-out]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from probkv.eval.runner import RunConfig, run_eval
from probkv.eval.store import RESULTS_FILE, read_results
from probkv.experiments import attention_error as ae
from probkv.experiments.attention_prompts import decode_tokens, text_prompt
from probkv.experiments.paper_prompt import PAPER_QUESTION, PAPER_TEXT
from probkv.hf import prepare_model
from probkv.models import load_model
from probkv.models.dtypes import MODEL_DTYPES, cpu_has_native_bfloat16, resolve_dtype_name

DTYPES = ("float32", "bfloat16")
TASKS = "niah_single_1,niah_single_2,niah_multikey_1"


@torch.no_grad()
def plain_prefill_s(model, ids) -> float:
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


def bench_prefill(models: dict, length: int, repeats: int) -> None:
    vocab = models["float32"].config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, vocab - 100, (1, length), generator=gen)
    best = {name: math.inf for name in models}
    for _ in range(repeats):  # alternated, so machine noise hits both alike
        for name, model in models.items():
            best[name] = min(best[name], plain_prefill_s(model, ids))
    print(f"\n== plain prefill, {length} tokens (best of {repeats}, alternated) ==")
    for name in models:
        print(f"  {name:9s} {best[name]:8.2f} s")
    print(f"  float32 / bfloat16 = {best['float32'] / best['bfloat16']:.2f}x")


def _paired(rows32: list[dict], rows16: list[dict], method: str):
    """Per example of ``method``: (score float32, score bfloat16, same answer)."""
    by_id = {r["id"]: r for r in rows16 if r["method"] == method}
    return [
        (r["score"], by_id[r["id"]]["score"], r["prediction"] == by_id[r["id"]]["prediction"])
        for r in rows32
        if r["method"] == method and r["id"] in by_id
    ]


def bench_tasks(args: argparse.Namespace) -> None:
    rows = {}
    for name in DTYPES:
        config = RunConfig(
            model=args.model,
            methods=tuple(args.methods.split(",")),
            ratios=(args.ratio,),
            tasks=tuple(args.tasks.split(",")),
            lengths=(args.length,),
            per_task=args.per_task,
            dtype=name,
        )
        folder = Path(args.out) / name
        start = time.perf_counter()
        report = run_eval(config, folder, threads=args.threads, progress=False)
        print(
            f"[bench_dtype] {name}: {report.jobs_run} jobs run, {report.jobs_skipped} resumed "
            f"({time.perf_counter() - start:.0f} s) in {folder}",
            file=sys.stderr,
        )
        rows[name] = read_results(folder / RESULTS_FILE)
    n = len({r["id"] for r in rows["float32"]})
    print(
        f"\n== task scores: {args.tasks}, {n} examples of {args.length} tokens, r = {args.ratio}, "
        "question-agnostic, greedy =="
    )
    print(
        f"  {'method':16s} {'float32':>8s} {'bfloat16':>8s} {'diff':>7s} {'+-se':>6s} "
        f"{'same answer':>11s} {'prefill f32 s':>13s} {'bf16 s':>7s} {'f32/bf16':>8s}"
    )
    for method in args.methods.split(","):
        pairs = _paired(rows["float32"], rows["bfloat16"], method)
        if not pairs:
            continue
        diffs = [b - a for a, b, _ in pairs]
        se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
        prefill = {
            name: statistics.mean(r["prefill_s"] for r in rows[name] if r["method"] == method)
            for name in DTYPES
        }
        print(
            f"  {method:16s} {statistics.mean(a for a, _, _ in pairs):8.3f} "
            f"{statistics.mean(b for _, b, _ in pairs):8.3f} {statistics.mean(diffs):+7.3f} "
            f"{se:6.3f} {sum(s for _, _, s in pairs):>5d} / {len(pairs):<3d} "
            f"{prefill['float32']:13.2f} {prefill['bfloat16']:7.2f} "
            f"{prefill['float32'] / prefill['bfloat16']:7.2f}x"
        )


def bench_attention_error(models: dict, tokenizer, ratios: list[float], seeds: int) -> None:
    prompt = text_prompt(tokenizer, PAPER_TEXT, PAPER_QUESTION, format="paper", source="paper")
    print(
        f"\n== attention error: Appendix E prompt ({len(prompt.context_ids)} tokens), h2o "
        f"proposal, with_replacement, tau = 1, {seeds} seeds (mean absolute error per head) =="
    )
    results = {}
    for name, model in models.items():
        prepare_model(model)
        decode = decode_tokens(model, prompt, 1)
        results[name] = ae.measure_attention_error(
            model, prompt.context_ids, decode, ratios=ratios, taus=(1.0,), seeds=seeds
        )
    print(f"  {'r':>5s} {'estimator':14s} {'float32':>9s} {'bfloat16':>9s} {'bf16/f32':>8s}")
    for a, b in zip(results["float32"], results["bfloat16"]):
        print(
            f"  {a['ratio']:5.2f} {a['estimator']:14s} {a['mae_mean']:9.5f} {b['mae_mean']:9.5f} "
            f"{b['mae_mean'] / a['mae_mean']:8.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--repeats", type=int, default=2, help="plain prefill repeats (best of)")
    ap.add_argument("--tasks", default=TASKS, help=f"generated tasks (default {TASKS})")
    ap.add_argument("--per-task", type=int, default=4, help="examples per task (default 4)")
    ap.add_argument("--methods", default="full,snapkv,prob:min-h")
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--attention-ratios", default="0.5,0.75")
    ap.add_argument("--seeds", type=int, default=2, help="seeds of the sampled estimators")
    ap.add_argument("--out", default="bench-dtype-out", help="folder of the two eval runs")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: prefill,tasks,error")
    args = ap.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - {"prefill", "tasks", "error"}
    if unknown:
        raise ValueError(f"--skip takes prefill, tasks, error; got {sorted(unknown)}")
    torch.set_num_threads(args.threads)
    auto = resolve_dtype_name("auto")
    print(
        f"model {args.model}, torch {torch.__version__}, torch threads {torch.get_num_threads()}, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, CPU bfloat16 units "
        f"(AMX-BF16/AVX512-BF16): {'yes' if cpu_has_native_bfloat16() else 'no'}; "
        f"--dtype auto resolves to {auto} here"
    )
    models, tokenizer = {}, None
    if not {"prefill", "error"} <= skip:
        for name in DTYPES:
            models[name], tokenizer = load_model(args.model, dtype=MODEL_DTYPES[name])
    if "prefill" not in skip:
        bench_prefill(models, args.length, args.repeats)
    if "tasks" not in skip:
        bench_tasks(args)
    if "error" not in skip:
        ratios = [float(x) for x in args.attention_ratios.split(",")]
        bench_attention_error(models, tokenizer, ratios, args.seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
