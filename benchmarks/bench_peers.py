"""probkv in vLLM against a CPU serving peer that evicts too: OpenVINO GenAI's continuous
batching with cache eviction (issue 55), on the same generated prompts, scored the same way.

Run from the vLLM environment, under the bench lock on a shared machine:

    VLLM_CPU_OMP_THREADS_BIND=nobind flock /tmp/bench.lock .venv-vllm/bin/python \\
        benchmarks/bench_peers.py --ov-model smollm2-ov --lengths 2048 --ratios 0.5,0.75

The prompts are probkv's own generated tasks (``--tasks``, ``--lengths``, ``--per-task``,
``--seed``: ``probkv eval``'s generator, its prompt token ids and ``max_new_tokens``), question
inside the prompt, greedy. probkv's side is one vLLM engine with probkv's plugin
(``probkv.vllm.engine.VllmRunner``, blocks of 32, float32, memory for 8 requests of the
longest prompt, its default; prefix caching off, so no run reuses another's prefill), the
whole batch once with ``full`` and once per method and ratio. The peer's side runs in its own
Python environment (``--ov-python``; without it the script makes ``--ov-venv`` with
``python -m venv <dir> && <dir>/bin/pip install 'openvino-genai==2026.4.*'`` from PyPI (``OV_PIP``;
openvino and openvino-tokenizers come with it; measured with 2026.4.1); it never touches
probkv's environments): ``openvino_genai.ContinuousBatchingPipeline`` on the model exported
from the folder probkv loads (``--ov-model``; export it offline with ``HF_HUB_OFFLINE=1
optimum-cli export openvino --model <probkv's converted folder> --task
text-generation-with-past --weight-format fp32 <dir>``), fed the same token ids, the whole
batch once plain and once per ratio with ``SchedulerConfig.use_cache_eviction`` and
``CacheEvictionConfig(start_size, recent_size, max_cache_size, aggregation_mode)``.
``max_cache_size`` is matched to probkv's kept positions (``matched_cache_size``: the blocks
probkv keeps at that ratio, 32 positions each, over the prompts' mean). Both engines get one
CPU thread (``--threads``; OpenVINO's unpinned) and KV memory for 8 full requests at once.
``VLLM_CPU_OMP_THREADS_BIND=nobind`` above: vLLM's default binding pins its one thread to core
0, starved there when another session's vLLM engine holds that core.

Printed side by side per ratio: answers kept (the sum over prompts of min(score, the engine's
own full cache's score) over that full cache's total, as ``probkv eval``'s summary counts
them) and requests/s with eviction over the same engine's plain run. Everything goes to
``--out`` (JSON). The peer's worker is this file run by the peer's Python with
``--ov-worker SPEC OUT`` (it imports only the standard library and OpenVINO GenAI).
"""

# No `from __future__ import annotations`: the tests load this script without registering it
# in sys.modules.
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 32  # positions per KV block: vLLM's CPU backend here and OpenVINO's CPU plugin
OV_PIP = "'openvino-genai==2026.4.*'"  # the docstring's pip line
AGGREGATIONS = ("SUM", "NORM_SUM")
CONCURRENT = 8  # requests at once in either engine (probkv.vllm.engine.DEFAULT_CONCURRENT)
DEFAULT_TASKS = "niah_single_1,niah_single_2,niah_multikey_1"


def _csv(text, kind, what):
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(
            f"--{what}: expected comma-separated {kind.__name__}s, got {text!r}"
        ) from None
    if not values:
        raise SystemExit(f"--{what}: empty")
    return values


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ov-model", help="the OpenVINO export of probkv's model folder")
    ap.add_argument("--ov-python", help="the peer's Python (default: make --ov-venv)")
    ap.add_argument("--ov-venv", default=str(Path.home() / ".cache/probkv/ov-venv"))
    ap.add_argument("--model", default="smollm2-135m", help="probkv's model (probkv models)")
    ap.add_argument("--tasks", default=DEFAULT_TASKS)
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--per-task", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="task generation seed")
    ap.add_argument(
        "--methods", default="snapkv,tova,prob:snapkv", help="probkv's methods (plugin names)"
    )
    ap.add_argument("--ratios", default="0.5,0.75")
    ap.add_argument("--start-size", type=int, default=32, help="the peer's kept first positions")
    ap.add_argument("--recent-size", type=int, default=128, help="the peer's kept last positions")
    ap.add_argument("--aggregation", default="NORM_SUM", help="the peer's score: SUM, NORM_SUM")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads of each engine")
    ap.add_argument("--out", default="results/bench_peers.json")
    ap.add_argument("--ov-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ov_worker:
        return args
    check_args(args)
    return args


def check_args(args):
    """Refuse (SystemExit naming the value and what is allowed) what the run cannot do."""
    if not args.ov_model:
        raise SystemExit("--ov-model is required: the folder optimum-cli exported")
    args.task_list = _csv(args.tasks, str, "tasks")
    args.length_list = _csv(args.lengths, int, "lengths")
    args.method_list = _csv(args.methods, str, "methods")
    args.ratio_list = _csv(args.ratios, float, "ratios")
    if "full" in args.method_list:
        raise SystemExit("--methods: 'full' is every engine's plain run already; omit it")
    for r in args.ratio_list:
        if not 0.0 < r < 1.0:
            raise SystemExit(f"--ratios: each ratio must be in (0, 1), got {r}")
    for name in ("start_size", "recent_size"):
        value = getattr(args, name)
        if value < BLOCK or value % BLOCK:
            raise SystemExit(
                f"--{name.replace('_', '-')}: a positive multiple of {BLOCK} (the peer's "
                f"block), got {value}"
            )
    if args.aggregation not in AGGREGATIONS:
        raise SystemExit(
            f"--aggregation: one of {', '.join(AGGREGATIONS)}, got {args.aggregation!r}"
        )
    shortest = min(args.length_list)
    if shortest < 4 * (args.start_size + args.recent_size):
        raise SystemExit(
            f"--lengths: {shortest} leaves the peer nothing to evict at r = 0.75 beside "
            f"start_size + recent_size = {args.start_size + args.recent_size}; use >= "
            f"{4 * (args.start_size + args.recent_size)}"
        )
    for name in ("per_task", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: >= 1, got {getattr(args, name)}")


def kept_blocks(length, ratio):
    """Blocks probkv's model-wide selection keeps of a ``length``-token prompt at ``ratio``:
    the per-head budget in whole blocks of 32 (``probkv.sampling.model_blocks``)."""
    from probkv.budgets import uniform_budget
    from probkv.sampling.model_blocks import block_budget

    return block_budget(uniform_budget(length, ratio), length, BLOCK)


def matched_cache_size(lengths, ratio, start_size, recent_size):
    """The peer's ``max_cache_size`` for prompts of ``lengths`` tokens at ``ratio``: probkv's
    kept positions (``kept_blocks`` x 32) over the prompts' mean, in whole blocks, and above
    the peer's protected ``start_size + recent_size`` by at least one block (it refuses less)."""
    if not lengths:
        raise ValueError("matched_cache_size needs at least one prompt length")
    mean = sum(kept_blocks(t, ratio) * BLOCK for t in lengths) / len(lengths)
    size = BLOCK * max(1, round(mean / BLOCK))
    return max(size, start_size + recent_size + BLOCK)


def kept_share(scores, full_scores):
    """Answers kept of the full cache's (``probkv.eval.winscore.kept_of_full``: sum of
    min(score, full) over the full total; NaN when the full cache answers nothing)."""
    from probkv.eval.winscore import kept_of_full

    if len(scores) != len(full_scores):
        raise ValueError(f"{len(scores)} scores against {len(full_scores)} full-cache scores")
    kept = kept_of_full(dict(enumerate(scores)), dict(enumerate(full_scores)))["kept"]
    return math.nan if kept is None else kept


def build_prompts(args, tokenizer, limit):
    """``[(example, prompt ids)]``: ``probkv eval``'s generated examples and its prompt token
    ids (context then question, as ``--engine vllm`` feeds them)."""
    from probkv.eval.job import job_prompt_ids
    from probkv.eval.tasks import generate_examples

    out = []
    for task in args.task_list:
        for length in args.length_list:
            for ex in generate_examples(
                task, tokenizer=tokenizer, length=length, num_examples=args.per_task, seed=args.seed
            ):
                context, question, _ = job_prompt_ids(ex, tokenizer, limit)
                out.append((ex, [*context, *question]))
    return out


def score_answers(prompts, outputs, tokenizer):
    """Each prompt's answer decoded (special tokens skipped, stripped) and scored by its
    example's metric, as ``probkv eval`` scores a results row."""
    from probkv.eval.examples import score_example

    if len(prompts) != len(outputs):
        raise ValueError(f"{len(outputs)} outputs for {len(prompts)} prompts")
    scores = []
    for (ex, _), ids in zip(prompts, outputs):
        text = tokenizer.decode(list(ids), skip_special_tokens=True).strip()
        scores.append(float(score_example(ex, text)))
    return scores


def ov_configs(args, lengths):
    """The peer's runs: plain, then one with eviction per ratio (``max_cache_size`` matched)."""
    configs = [{"name": "plain", "eviction": None}]
    for r in args.ratio_list:
        size = matched_cache_size(lengths, r, args.start_size, args.recent_size)
        configs.append({
            "name": f"evict r={r:g}",
            "ratio": r,
            "eviction": {
                "start_size": args.start_size,
                "recent_size": args.recent_size,
                "max_cache_size": size,
                "aggregation": args.aggregation,
            },
        })  # fmt: skip
    return configs


def ov_worker(spec_path, out_path):
    """In the peer's environment: each config's pipeline over every prompt in one
    ``generate`` call (greedy); its new token ids and wall time to ``out_path``."""
    import openvino as ov
    import openvino_genai as genai

    spec = json.loads(Path(spec_path).read_text())
    longest = max(len(p) + n for p, n in zip(spec["prompts"], spec["max_new"]))
    blocks = CONCURRENT * -(-longest // BLOCK)
    results = []
    for config in spec["configs"]:
        sched = genai.SchedulerConfig()
        sched.num_kv_blocks = blocks  # CONCURRENT of the longest request, as probkv's side
        sched.max_num_seqs = CONCURRENT
        sched.dynamic_split_fuse = True
        ev = config["eviction"]
        if ev is not None:
            sched.use_cache_eviction = True
            mode = getattr(genai.AggregationMode, ev["aggregation"])
            sched.cache_eviction_config = genai.CacheEvictionConfig(
                ev["start_size"], ev["recent_size"], ev["max_cache_size"], mode
            )
        # unpinned: a pinned thread shares whatever core it is given with the other sessions
        props = {"INFERENCE_NUM_THREADS": spec["threads"], "ENABLE_CPU_PINNING": False}
        pipe = genai.ContinuousBatchingPipeline(spec["model"], sched, "CPU", props)
        params = []
        for n in spec["max_new"]:
            gc = genai.GenerationConfig()
            gc.max_new_tokens = n
            gc.eos_token_id = spec["eos"]
            params.append(gc)
        inputs = [ov.Tensor(_int64_rows([p])) for p in spec["prompts"]]
        start = time.perf_counter()
        outs = pipe.generate(inputs, params)
        wall = time.perf_counter() - start
        print(f"OpenVINO GenAI {config['name']}: {wall:.1f} s", flush=True)
        ids = [list(o.m_generation_ids[0]) for o in outs]
        results.append({"name": config["name"], "wall_s": wall, "token_ids": ids})
        del pipe
    Path(out_path).write_text(json.dumps({"version": genai.__version__, "runs": results}))


def _int64_rows(rows):
    import numpy as np  # the peer's environment has numpy (openvino needs it)

    return np.asarray(rows, dtype=np.int64)


def ov_python(args):
    """The peer's Python: ``--ov-python``, else ``--ov-venv`` made from PyPI on first use."""
    if args.ov_python:
        return args.ov_python
    venv = Path(args.ov_venv)
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(f"{venv}/bin/pip install {OV_PIP}", shell=True, check=True)
    return str(python)


def run_peer(args, prompts, tokenizer, workdir):
    """The peer's runs in its own environment (``ov_worker``); its output per config."""
    spec = {
        "model": str(Path(args.ov_model).resolve()),
        "prompts": [ids for _, ids in prompts],
        "max_new": [ex.max_new_tokens for ex, _ in prompts],
        "eos": tokenizer.eos_token_id,
        "threads": args.threads,
        "configs": ov_configs(args, [len(ids) for _, ids in prompts]),
    }
    spec_path, out_path = Path(workdir) / "ov_spec.json", Path(workdir) / "ov_out.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    cmd = [ov_python(args), str(Path(__file__).resolve()), "--ov-worker", spec_path, out_path]
    subprocess.run([str(c) for c in cmd], check=True, env=env)
    out = json.loads(out_path.read_text())
    for run, config in zip(out["runs"], spec["configs"]):
        run["config"] = config
    return out


def run_probkv(args, prompts, model_path):
    """probkv's runs in one vLLM engine: ``full``, then each method at each ratio; per run
    its new token ids, wall time and the mean kept positions (from the plugin's report)."""
    from probkv.vllm.engine import Request, VllmRunner

    longest = max(len(ids) + ex.max_new_tokens for ex, ids in prompts)
    # prefix caching off: each run prefills its prompts itself
    runner = VllmRunner(
        model_path, dtype="float32", max_model_len=longest, seed=args.seed, prefix_caching=False
    )
    runs = []
    try:
        for method, ratio in [("full", 0.0)] + [
            (m, r) for r in args.ratio_list for m in args.method_list
        ]:
            requests = [
                Request(tuple(ids), method, ratio, ex.max_new_tokens) for ex, ids in prompts
            ]
            start = time.perf_counter()
            results = runner.run(requests)
            wall = time.perf_counter() - start
            print(f"probkv {method} r={ratio:g}: {wall:.1f} s", flush=True)
            kept = [(1 - r.effective_ratio) * len(ids) for r, (_, ids) in zip(results, prompts)]
            runs.append({
                "name": "full" if method == "full" else f"{method} r={ratio:g}",
                "method": method, "ratio": ratio, "wall_s": wall,
                "kept_positions": sum(kept) / len(kept),
                "token_ids": [list(r.token_ids) for r in results],
            })  # fmt: skip
    finally:
        runner.close()
    return runs


def table(args, prompts, probkv_runs, peer, tokenizer):
    """Markdown rows, one per (engine, configuration): kept positions, answers kept of the
    engine's own full cache's (kept of the full cache's right ones; all right ones), req/s
    and its ratio over the engine's plain run."""
    n = len(prompts)
    lines = [
        "| engine | run | kept positions (mean) | answers kept | req/s | / plain |",
        "|---|---|---|---|---|---|",
    ]
    rows = []
    for engine, runs in (("probkv (vLLM)", probkv_runs), ("OpenVINO GenAI", peer["runs"])):
        full = score_answers(prompts, runs[0]["token_ids"], tokenizer)
        plain = n / runs[0]["wall_s"]
        for run in runs:
            scores = score_answers(prompts, run["token_ids"], tokenizer)
            rate = n / run["wall_s"]
            ev = run.get("config", {}).get("eviction")
            kept = run.get("kept_positions")
            if ev is not None:
                kept = ev["max_cache_size"]
            share = kept_share(scores, full)
            kept_answers = sum(min(s, f) for s, f in zip(scores, full))
            rows.append({"engine": engine, "run": run["name"], "kept_positions": kept,
                         "scores": scores, "kept_share": share, "req_s": rate})  # fmt: skip
            shown = f"{kept:.0f}" if kept is not None else "all"
            lines.append(
                f"| {engine} | {run['name']} | {shown} | {share:.1%} ({kept_answers:g} of "
                f"{sum(full):g}; {sum(scores):g} right) | {rate:.3f} | {rate / plain:.2f}x |"
            )
    return lines, rows


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.ov_worker:
        return ov_worker(*args.ov_worker)
    from probkv.models import load_tokenizer, model_max_positions, resolve_model

    tokenizer = load_tokenizer(args.model)
    prompts = build_prompts(args, tokenizer, model_max_positions(args.model))
    print(f"{len(prompts)} prompts, lengths {sorted({len(i) for _, i in prompts})}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as workdir:
        peer = run_peer(args, prompts, tokenizer, workdir)
    probkv_runs = run_probkv(args, prompts, str(resolve_model(args.model).path))
    lines, rows = table(args, prompts, probkv_runs, peer, tokenizer)
    print("\n".join(lines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": sys.argv[1:], "openvino_genai": peer["version"],
                               "rows": rows}, indent=1))  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
