"""How scoring time and peak memory grow with the prompt's length, against a plain prefill.

For each length of ``--lengths`` (tokens of random ids) this runs, each in a fresh process
(``--child``: its own peak memory, no allocator state carried over), the plain prefill
(transformers' SDPA + DynamicCache, logits of the last position only) and
``probkv.hf.compress`` with each method of ``--methods`` at ``--ratio`` (prefill + scoring +
eviction). Each process loads the model, warms up on 64 tokens, resets its peak resident set
(``/proc/self/clear_refs``), runs once and reports:

- wall and CPU seconds (``time.process_time``: with one torch thread, the work done, far less
  sensitive to other processes on a shared machine than the wall clock);
- the peak resident set during the run (``VmHWM``) and the working memory above the resident
  set just before it (the model's weights excluded).

It prints, per length, each method's time and memory as ratios over the plain prefill's at the
same length, then the growth exponent of each variant: the slope of log CPU seconds over log
length, least squares over the lengths (a prefill with quadratic attention tends to 2, a
linear one to 1), and its difference from the plain prefill's. ``--out FILE`` appends every
process's result as a JSON line and skips the (length, variant) pairs already in it, so a long
run can go in pieces.

    .venv/bin/python benchmarks/bench_length.py --model gemma3-270m \\
        --lengths 1024,2048,4096,8192,16384,32768 [--out runs.jsonl]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_METHODS = "snapkv,kvzap,prob:kvzap,kvzip,prob:kvzip,streaming_llm"
PLAIN = "plain"


def _rss_kib(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` of this process, KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Set this process's peak resident set (``VmHWM``) to its current one."""
    Path("/proc/self/clear_refs").write_text("5")


def child(model_name: str, length: int, variant: str, ratio: float, dtype: str) -> dict:
    """One variant at one length in this process: times and memory (see the module doc)."""
    import torch
    from transformers import DynamicCache

    from probkv.hf import compress, prepare_model, repeat_prompt
    from probkv.models import load_model
    from probkv.models.dtypes import resolve_dtype
    from probkv.policies import parse_method

    torch.set_num_threads(1)
    model, tokenizer = load_model(model_name, dtype=resolve_dtype(dtype))
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and length > limit:
        raise ValueError(f"--lengths {length} is over {model_name}'s {limit} positions")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size - 100, (1, length), generator=gen)
    if variant == PLAIN:
        model.set_attn_implementation("sdpa")

        def run(x):
            cache = DynamicCache(config=model.config)
            model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
    else:
        prepare_model(model)
        policy, prompt = parse_method(variant, ratio), repeat_prompt(tokenizer)

        def run(x):
            compress(model, x, policy, repeat_prompt=prompt)

    with torch.no_grad():
        run(ids[:, :64])  # warm up: first-call costs, kvzap's scorer
        _reset_peak()
        before = _rss_kib("VmRSS")
        wall, cpu = time.perf_counter(), time.process_time()
        run(ids)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = _rss_kib("VmHWM")
    return {
        "model": model_name,
        "length": length,
        "variant": variant,
        "ratio": ratio if variant != PLAIN else 0.0,
        "dtype": str(next(model.parameters()).dtype),
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_mib": peak / 1024,
        "working_mib": (peak - before) / 1024,
    }


def run_child(args, length: int, variant: str) -> dict:
    """``child`` in a fresh interpreter (the environment inherited: PYTHONPATH included)."""
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--dtype", args.dtype]
    cmd += ["--lengths", str(length), "--methods", variant, "--ratio", str(args.ratio)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise RuntimeError(f"{variant} at {length} tokens failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def growth_exponent(lengths: list[int], seconds: list[float]) -> float:
    """Least-squares slope of ``log seconds`` over ``log length`` (two lengths at least)."""
    if len(lengths) < 2:
        return math.nan
    x = [math.log(t) for t in lengths]
    y = [math.log(max(s, 1e-9)) for s in seconds]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    den = sum((a - mx) ** 2 for a in x)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / den if den else math.nan


def report(results: list[dict], lengths: list[int], variants: list[str]) -> list[str]:
    """The tables: per length, each variant over the plain prefill; then growth exponents."""
    by = {(r["length"], r["variant"]): r for r in results}
    lines = []
    for t in lengths:
        plain = by.get((t, PLAIN))
        if plain is None:
            continue
        lines.append(
            f"\n== {t} tokens == plain prefill: wall {plain['wall_s']:.2f} s, CPU "
            f"{plain['cpu_s']:.2f} s, peak {plain['peak_mib']:.0f} MiB (working "
            f"{plain['working_mib']:.0f} MiB)"
        )
        for v in variants:
            r = by.get((t, v))
            if r is None or v == PLAIN:
                continue
            lines.append(
                f"  {v:14s} wall {r['wall_s']:8.2f} s ({r['wall_s'] / plain['wall_s']:.2f}x)  "
                f"CPU {r['cpu_s']:8.2f} s ({r['cpu_s'] / plain['cpu_s']:.2f}x)  peak "
                f"{r['peak_mib']:6.0f} MiB ({r['peak_mib'] / plain['peak_mib']:.2f}x)  working "
                f"{r['working_mib']:6.0f} MiB "
                f"({r['working_mib'] / max(plain['working_mib'], 1e-9):.2f}x)"
            )
    lines.append("\ngrowth exponent (slope of log CPU s over log length; minus the plain's):")
    base = None
    for v in variants:
        pts = [(t, by[(t, v)]["cpu_s"]) for t in lengths if (t, v) in by]
        e = growth_exponent([p[0] for p in pts], [p[1] for p in pts])
        base = e if v == PLAIN else base
        diff = "" if v == PLAIN or base is None else f"  ({e - base:+.2f})"
        lines.append(f"  {v:14s} {e:5.2f}{diff}   over {[p[0] for p in pts]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--methods", default=DEFAULT_METHODS)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--dtype", default="auto", help="model dtype (probkv.models.dtypes)")
    parser.add_argument("--out", help="JSON lines of every run; runs already in it are skipped")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if any(t < 64 for t in lengths):
        parser.error(f"--lengths must be >= 64 tokens each (the warm-up's), got {args.lengths}")
    if args.child:
        print(json.dumps(child(args.model, lengths[0], args.methods, args.ratio, args.dtype)))
        return 0
    variants = [PLAIN, *args.methods.split(",")]
    out = Path(args.out) if args.out else None
    results = []
    if out is not None and out.exists():
        results = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
        results = [r for r in results if r["model"] == args.model]
    done = {(r["length"], r["variant"]) for r in results}
    print(f"model {args.model}, ratio {args.ratio}, one torch thread, each run in its own process")
    for t in lengths:
        for v in variants:
            if (t, v) in done:
                continue
            r = run_child(args, t, v)
            results.append(r)
            print(
                f"  ran {v} at {t}: CPU {r['cpu_s']:.2f} s, peak {r['peak_mib']:.0f} MiB",
                flush=True,
            )
            if out is not None:
                with out.open("a") as f:
                    f.write(json.dumps(r) + "\n")
    print("\n".join(report(results, lengths, variants)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
