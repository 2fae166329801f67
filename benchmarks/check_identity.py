"""Bit-identity check of a refactoring: dump what the methods compute, then compare two dumps.

    python benchmarks/check_identity.py dump OUT.pt      # at one commit
    python benchmarks/check_identity.py compare A.pt B.pt  # exit 1 unless bit for bit equal

On fixed tiny random models (``probkv.models.testing``) and fixed seeds, the dump holds, per
case, every tensor and number a behaviour-preserving change must leave exactly as it was:

- ``select/...``: the maths path alone. Random post-RoPE queries, keys and values of three
  layers, observed with ``probkv.scores.observation.observe_layer`` and selected with
  ``probkv.policies.select_layers``: each layer's kept indices, per-head lengths and
  log-weights (top-k scores, every ``prob:`` design, scopes, budgets, calibrated weights);
- ``hf/...``: the transformers integration. ``probkv.hf.compress`` on a tiny Llama and a tiny
  Gemma-3 (sliding-window layers), then each evicting layer's ragged prefix (keys, values,
  log-weights, lengths: the kept entries themselves), the logits of a question forwarded
  after the compressed context and the greedy tokens of ``probkv.hf.answer``; reconstruction
  scores (kvzip), kvzap (a seeded scorer fitted to the tiny model's shapes), decode budgets
  (prefixes after the stages and the generated tokens), a left-padded batch and one
  ``observe`` shared by several policies;
- ``cli/...``: the experiments and the harness end to end through the command line, on a
  saved tiny model folder: ``eval`` (results rows), ``attention-error``,
  ``task-attention-error``, ``long-decode`` and ``train-scorer`` (their JSON files, the
  scorer's tensors), with wall-clock fields (seconds, tokens/s, throughput) dropped.

Only public names are used (``probkv.hf``, ``probkv.policies``, ``probkv.scores``,
``probkv.models``, ``probkv.cli.main``), so the same script runs before and after a change of
the modules behind them. Run both dumps with one torch build and one thread (set here).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

torch.set_num_threads(1)

# Fields of the experiments' JSON that measure time, not behaviour (and any `*_s`, `*_s_*`).
TIMING = ("seconds", "tokens_per_s", "throughput_vs_full")


def timing(key: str) -> bool:
    return key in TIMING or key.endswith("_s") or "_s_" in key


SELECT_METHODS = (
    "h2o",
    "snapkv/window=4",
    "tova",
    "streaming_llm",
    "knorm",
    "ada_snapkv/window=4",
    "pyramidkv/window=4",
    "topk:min-h",
    "h2o/layer_budgets=global",
    "prob:h2o",
    "prob:h2o-h/tau=2",
    "prob:min-h",
    "prob:min-h/scope=global",
    "prob:min-h/sampler=pps",
    "prob:min-h/sampler=pps/scope=global",
    "prob:h2o/sampler=with_replacement/weights=inclusion",
    "prob:h2o/correct=false",
    "prob:snapkv/window=4/sampler=pps",
    "prob:min-h/sampler=pps/core=0.5/block=4",
    "prob:h2o/scope=model/block=4",
    "snapkv/scope=model/block=4/window=4",
)
HF_METHODS = (
    "h2o",
    "snapkv/window=8",
    "ada_snapkv/window=8",
    "tova",
    "prob:min-h",
    "prob:h2o/scope=global",
    "prob:min-h/sampler=pps",
    "prob:h2o-h/tau=2",
    "kvzip",
    "prob:kvzip",
    "prob:kvzip/calibrate=1",
    "kvzap",
    "prob:kvzap",
)
BUDGET_METHODS = ("h2o", "tova", "prob:min-h/sampler=pps", "prob:tova/sampler=pps")


def canonical(obj, work: Path | None = None):
    """``obj`` with every timing field dropped (dicts, lists, nested) and the temporary
    folder ``work`` spelled ``WORK`` in its strings."""
    if isinstance(obj, dict):
        return {k: canonical(v, work) for k, v in obj.items() if not timing(k)}
    if isinstance(obj, list):
        return [canonical(v, work) for v in obj]
    if isinstance(obj, str) and work is not None:
        return obj.replace(str(work), "WORK")
    return obj


def first_difference(a, b, where: str = "") -> str:
    """Where two JSON values first differ (a path of keys and indices)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{where}/{k} (missing on one side)"
            if a[k] != b[k]:
                return first_difference(a[k], b[k], f"{where}/{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_difference(x, y, f"{where}[{i}]")
    return f"{where}: {str(a)[:80]} != {str(b)[:80]}"


def ids(n: int, seed: int, low: int = 7, high: int = 200) -> torch.Tensor:
    return torch.randint(low, high, (1, n), generator=torch.Generator().manual_seed(seed))


def dump_select(out: dict) -> None:
    from probkv.policies import parse_method, select_layers
    from probkv.scores.observation import observe_layer

    gen = torch.Generator().manual_seed(11)
    hq, hkv, t, d, layers = 4, 2, 48, 16, 3
    tensors = [
        tuple(torch.randn(h, t, d, generator=gen) * 1.5 for h in (hq, hkv, hkv))
        for _ in range(layers)
    ]
    for method in SELECT_METHODS:
        for ratio in (0.5, 0.8):
            policy = parse_method(method, ratio)
            observations = [
                observe_layer(
                    q, k, v, scale=d**-0.5, score=policy.score,
                    score_params=policy.score_params, layer_idx=i, rank=i,
                )[1]
                for i, (q, k, v) in enumerate(tensors)
            ]  # fmt: skip
            chosen = select_layers(policy, observations, num_layers=layers)
            for i, sel in enumerate(chosen):
                key = f"select/{method}/r={ratio}/layer{i}"
                out[key + "/indices"] = sel.indices
                out[key + "/lengths"] = torch.as_tensor(sel.lengths)
                if sel.log_weights is not None:
                    out[key + "/log_weights"] = sel.log_weights


def tiny_kvzap_scorer(config):
    """A seeded kvzap scorer fitted to ``config``'s shapes (tests/hf/test_kvzap.py's)."""
    from probkv.scores import scorer_lookup as lookup
    from probkv.scores import surrogate as sg

    hkv = config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    f = hkv * (d + d // 2)
    gen = torch.Generator().manual_seed(0)
    fit = sg.LinearSurrogate(
        torch.zeros(f), torch.ones(f), 0.3 * torch.randn(f, hkv, generator=gen),
        torch.full((hkv,), -4.0),
    )  # fmt: skip
    layers = dict.fromkeys(range(config.num_hidden_layers), fit)
    return sg.SurrogateScorer("kv", layers, lookup.model_identity(config, "tiny"), {})


def policy_for(method: str, ratio: float, model, scorer):
    from probkv.policies import parse_method

    policy = parse_method(method, ratio)
    if policy.score == "kvzap":
        params = {**policy.score_params, "surrogate": scorer}
        policy = dataclasses.replace(policy, score_params=params)
    return policy


def record_cache(out: dict, key: str, cache) -> None:
    from probkv.hf import EvictingLayer

    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, EvictingLayer) or layer.prefix is None:
            continue
        p = layer.prefix
        out[f"{key}/layer{i}/keys"] = p.keys
        out[f"{key}/layer{i}/values"] = p.values
        out[f"{key}/layer{i}/lengths"] = torch.as_tensor(p.lengths)
        if p.log_weights is not None:
            out[f"{key}/layer{i}/log_weights"] = p.log_weights


def question_logits(model, cache, question: torch.Tensor) -> torch.Tensor:
    working = copy.deepcopy(cache)
    with torch.no_grad():
        return model(input_ids=question, cache=working, use_cache=True).logits


def dump_hf(out: dict) -> None:
    from probkv.hf import answer, compress, observe, prepare_model, repeat_prompt
    from probkv.models.testing import tiny_model, tiny_tokenizer

    rebuild = repeat_prompt(tiny_tokenizer())
    context, question = ids(40, 1), ids(6, 2)
    for arch in ("llama", "gemma3"):
        model = prepare_model(tiny_model(arch, seed=0))
        scorer = tiny_kvzap_scorer(model.config)
        for method in HF_METHODS:
            key = f"hf/{arch}/{method}"
            policy = policy_for(method, 0.5, model, scorer)
            cache = compress(model, context, policy, repeat_prompt=rebuild)
            record_cache(out, key, cache)
            out[key + "/logits"] = question_logits(model, cache, question)
            out[key + "/tokens"] = answer(model, cache, question, max_new_tokens=5)
        # one observation, several policies (ratios, samplers)
        shared = observe(model, context, "min-h")
        for method in ("topk:min-h", "prob:min-h", "prob:min-h/sampler=pps"):
            for ratio in (0.25, 0.75):
                cache = copy.deepcopy(shared)
                cache.evict(policy_for(method, ratio, model, scorer))
                record_cache(out, f"hf/{arch}/observe/{method}/r={ratio}", cache)
                out[f"hf/{arch}/observe/{method}/r={ratio}/logits"] = question_logits(
                    model, cache, question
                )
    model = prepare_model(tiny_model("llama", seed=0))
    for method in BUDGET_METHODS:  # decode budgets: stages over 24 generated tokens
        key = f"hf/budget/{method}"
        cache = compress(model, context, policy_for(method, 0.0, model, None), max_entries=12,
                         every=4)  # fmt: skip
        out[key + "/tokens"] = answer(model, cache, question, max_new_tokens=24)
        record_cache(out, key + "/prompt", cache)
    batch = [ids(40, 3)[0], ids(29, 4)[0], ids(35, 5)[0]]  # left-padded batch of three
    for method in ("snapkv/window=8", "prob:min-h", "kvzip", "prob:min-h/sampler=pps"):
        key = f"hf/batch/{method}"
        cache = compress(model, batch, policy_for(method, 0.5, model, None), repeat_prompt=rebuild)
        record_cache(out, key, cache)
        questions = [ids(4, 6)[0], ids(4, 7)[0], ids(4, 8)[0]]
        out[key + "/tokens"] = answer(model, cache, questions, max_new_tokens=4)
    for method in ("h2o", "prob:min-h/sampler=pps"):  # a decode budget in a batch
        key = f"hf/batch-budget/{method}"
        cache = compress(model, batch, policy_for(method, 0.0, model, None), max_entries=10,
                         every=4)  # fmt: skip
        questions = [ids(4, 6)[0], ids(4, 7)[0], ids(4, 8)[0]]
        out[key + "/tokens"] = answer(model, cache, questions, max_new_tokens=12)


def run_cli(argv: list[str]) -> None:
    from probkv.cli import main as cli

    status = cli.main(argv)
    if status != 0:
        raise SystemExit(f"probkv {' '.join(argv)} exited {status}")


def dump_cli(out: dict, work: Path) -> None:
    from probkv.models.testing import save_tiny_model_folder

    folder = str(save_tiny_model_folder(work / "tiny", "llama"))
    data = work / "data.jsonl"
    records = [
        {"id": f"ex{i}", "task": "t", "context": "The river is wide. " * 4 + f"Code {i}7{i}.",
         "question": "\nWhat is the code?", "answers": [f"{i}7{i}"], "max_new_tokens": 4}
        for i in range(2)
    ]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    common = ["--model", folder, "--dtype", "float32"]
    run_cli(["eval", *common, "--tasks", "niah_single_1,niah_single_2", "--lengths", "400", "--per-task",
             "2", "--methods", "full,snapkv,prob:min-h,kvzip", "--ratios", "0.5,0.75",
             "--out", str(work / "eval"), "--no-progress"])  # fmt: skip
    rows = [json.loads(line) for line in (work / "eval" / "results.jsonl").read_text().split("\n")
            if line]  # fmt: skip
    key = lambda r: json.dumps([r.get("example"), r.get("method"), r.get("ratio")])  # noqa: E731
    out["cli/eval/rows"] = canonical(sorted(rows, key=key), work)
    out["cli/eval/summary"] = canonical(
        json.loads((work / "eval" / "summary.json").read_text()), work
    )
    prompt = work / "prompt.txt"
    prompt.write_text("The river is wide. " * 3, encoding="utf-8")
    run_cli(["attention-error", *common, "--prompt-file", str(prompt), "--question",
             "What is wide?", "--ratios", "0.25,0.5", "--taus", "1,2", "--seeds", "2",
             "--steps", "2", "--out", str(work / "ae.json")])  # fmt: skip
    run_cli(["attention-error", *common, "--prompt-file", str(prompt), "--sampler", "pps",
             "--proposal", "min-h", "--ratios", "0.5", "--taus", "1", "--seeds", "2",
             "--out", str(work / "ae-pps.json")])  # fmt: skip
    run_cli(["task-attention-error", *common, "--data", str(data), "--methods",
             "snapkv,prob:snapkv", "--ratios", "0.5", "--seeds", "2", "--answer-tokens", "3",
             "--out", str(work / "tae.json")])  # fmt: skip
    run_cli(["long-decode", *common, "--text", "prose:3", "--prompt-tokens", "24", "--tokens",
             "20", "--budget", "8,16", "--every", "4", "--methods", "tova,prob:tova",
             "--out", str(work / "ld.json")])  # fmt: skip
    for name in ("ae", "ae-pps", "tae", "ld"):
        out[f"cli/{name}"] = canonical(json.loads((work / f"{name}.json").read_text()), work)
    run_cli(["train-scorer", *common, "--contexts", "3", "--heldout", "2", "--length", "400",
             "--out", str(work / "s.pt")])  # fmt: skip
    from probkv.scores.surrogate import load_scorer

    scorer = load_scorer(work / "s.pt")
    for layer, fit in sorted(scorer.layers.items()):
        for field in dataclasses.fields(fit):
            out[f"cli/train-scorer/layer{layer}/{field.name}"] = getattr(fit, field.name)
    out["cli/train-scorer/metrics"] = canonical(json.loads(json.dumps(scorer.metrics)), work)


def dump(path: Path) -> None:
    out: dict = {}
    dump_select(out)
    dump_hf(out)
    with tempfile.TemporaryDirectory() as work:
        dump_cli(out, Path(work))
    torch.save(out, path)
    print(f"wrote {len(out)} entries to {path}")


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def compare(a_path: Path, b_path: Path) -> int:
    a, b = torch.load(a_path, weights_only=False), torch.load(b_path, weights_only=False)
    missing = sorted(set(a) ^ set(b))
    differ = sorted(k for k in set(a) & set(b) if not equal(a[k], b[k]))
    for k in missing:
        print(f"only in {'the first' if k in a else 'the second'}: {k}")
    for k in differ:
        tensor = isinstance(a[k], torch.Tensor) or isinstance(b[k], torch.Tensor)
        print(f"differs: {k}" + ("" if tensor else f" at {first_difference(a[k], b[k])}"))
    print(f"{len(a)} and {len(b)} entries; {len(differ)} differ, {len(missing)} unmatched")
    return 1 if missing or differ else 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "dump":
        dump(Path(argv[1]))
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        return compare(Path(argv[1]), Path(argv[2]))
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
