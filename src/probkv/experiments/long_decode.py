"""Teacher-forced long decoding under a decode budget (S10.5): what a fixed memory costs.

The first ``P`` tokens of a text are the prompt; the next ``N`` are fed one at a time, as if
generated, into a ``ProbKVCache`` held to ``B`` entries per KV head (``max_entries=B``,
``every=K``; ``probkv.hf.decode_budget``). Per method: the mean negative log-likelihood of
the ``N`` tokens, the same with the full cache, the peak entries per head and bytes held, the
decode throughput and, at a few steps, the attention outputs' relative error against the
full cache's at the same step (the same tokens; errors compound through the layers, S7).

The full cache is probkv's own cache without eviction (``full``: the prompt and every token
kept with weight 1; decode through the same attention path), so the gap measures eviction
alone. Tensors stay on the model's device; one sequence (batch 1).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from probkv._checks import check_positive_int
from probkv.eval.haystack.stream import word_stream
from probkv.eval.outputs import check_output_file, write_json
from probkv.hf import AttentionRecorder, ProbKVCache, prepare_model
from probkv.hf.capture import CAPTURE_KWARG
from probkv.hf.decode_budget import DecodeBudget
from probkv.policies import method_name, parse_method

FULL = "full"


@dataclass(frozen=True)
class LongDecodeConfig:
    """``prompt_tokens`` (P), ``tokens`` (N), ``budget`` (B: one, or a tuple of budgets, each
    run with every method against one full-cache run), ``every`` (K), ``methods``
    (registry names; ``full`` is always run first), ``seeds`` per sampled method,
    ``error_steps``: decode forwards (0-based, ``N - 1`` of them) whose attention error is
    recorded (default: four, evenly spread over the run); ``engine``: ``hf`` (methods checked
    here against a transformers decode budget) or ``vllm`` (checked by the plugin's rules,
    model-wide blocks, in :func:`run_long_decode_vllm`)."""

    prompt_tokens: int
    tokens: int
    budget: int | tuple[int, ...]
    every: int = 16
    methods: tuple[str, ...] = ("streaming_llm", "h2o", "tova", "prob:h2o-h")
    seeds: int = 1
    error_steps: tuple[int, ...] | None = None
    engine: str = "hf"

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "tokens", "every", "seeds"):
            check_positive_int(getattr(self, name), name)
        if self.tokens < 2:
            raise ValueError(
                f"tokens must be >= 2, got {self.tokens}: the prompt's forward predicts the "
                "first token, so only from the second on does a decode step run under the budget"
            )
        budgets = (self.budget,) if isinstance(self.budget, int) else tuple(self.budget)
        if not budgets:
            raise ValueError("budget is empty; give at least one budget, e.g. 256")
        for b in budgets:
            check_positive_int(b, "budget")
        _refuse_duplicates("budget", [str(b) for b in budgets])
        object.__setattr__(self, "budget", budgets[0] if len(budgets) == 1 else budgets)
        if self.engine not in ("hf", "vllm"):
            raise ValueError(f"engine must be 'hf' or 'vllm', got {self.engine!r}")
        if not self.methods:
            raise ValueError("methods is empty; give at least one method name, e.g. h2o")
        names = []
        for m in self.methods:
            if m == FULL:
                continue
            if self.engine != "hf":  # the plugin's own rules (scope=model) check the names
                names.append(m)
                continue
            policy = parse_method(m)  # unknown names fail before any work
            try:  # and so does a method no decode budget can hold (every one, before any run)
                DecodeBudget(budgets[0], self.every).check_policy(policy)
            except ValueError as err:
                raise ValueError(f"method {m!r}: {err}") from None
            names.append(method_name(policy))
        _refuse_duplicates("methods", names)
        steps = self.error_steps
        if steps is None:
            last = self.tokens - 2
            steps = tuple(sorted({last * i // 3 for i in range(4)})) if last >= 0 else ()
        # N tokens: the prompt's forward predicts the first, N - 1 decode forwards the rest
        bad = [s for s in steps if not 0 <= s < self.tokens - 1]
        if bad:
            raise ValueError(
                f"error_steps {bad} are outside the {self.tokens - 1} decode forwards (0-based)"
            )
        object.__setattr__(self, "error_steps", tuple(steps))

    @property
    def budgets(self) -> tuple[int, ...]:
        return (self.budget,) if isinstance(self.budget, int) else self.budget


def _refuse_duplicates(field: str, names: Sequence[str]) -> None:
    """A name given twice would run twice and be summarised as two seeds: refused."""
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(
            f"{field} lists {', '.join(repeated)} more than once; give each once (sampled "
            "methods take --seeds for repeated runs)"
        )


def prose_text(words: int, seed: int = 0) -> str:
    """``words`` words of the seeded procedural English prose probkv ships (S7 haystack)."""
    return word_stream("prose", seed).render(words)


def text_token_ids(tokenizer, text: str, count: int) -> torch.Tensor:
    """The first ``count`` token ids of ``text`` (``[1, count]``), or a ``ValueError`` saying
    how many it has."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[1] < count:
        raise ValueError(
            f"the text has {ids.shape[1]} tokens; prompt_tokens + tokens = {count} are needed"
        )
    return ids[:, :count]


def _policies(config: LongDecodeConfig) -> list[tuple[str, object, int | None, int | None]]:
    """``(name, policy, seed, budget)`` per run: ``full``, then per budget each method
    (sampled ones once per seed)."""
    runs: list[tuple[str, object, int | None, int | None]] = [(FULL, None, None, None)]
    for budget in config.budgets:
        for m in config.methods:
            if m == FULL:
                continue
            policy = parse_method(m)
            name = method_name(policy)
            if hasattr(policy, "seed"):
                for s in range(config.seeds):
                    seeded = dataclasses.replace(policy, seed=policy.seed + s)
                    runs.append((name, seeded, s, budget))
            else:
                runs.append((name, policy, None, budget))
    return runs


@torch.no_grad()
def run_one(
    model, ids: torch.Tensor, policy, config: LongDecodeConfig, budget: int | None = None
) -> tuple[dict, dict[int, dict[int, torch.Tensor]]]:
    """One teacher-forced run (module docstring): its row (without ``method``/``nll_full``)
    and the attention outputs ``{step: {layer: [Hq, 1, d_v]}}`` at ``config.error_steps``.
    ``budget``: default the config's first."""
    from probkv.policies.registry import FullCache

    p, n = config.prompt_tokens, config.tokens
    if policy is None:
        cache = ProbKVCache(model.config, FullCache(), prompt_length=p)
    else:
        cache = ProbKVCache(
            model.config,
            policy,
            prompt_length=p,
            max_entries=config.budgets[0] if budget is None else budget,
            every=config.every,
        )
    logits = model(input_ids=ids[:, :p], cache=cache, use_cache=True).logits[0, -1]
    nll = [_nll(logits, ids[0, p])]
    outputs: dict[int, dict[int, torch.Tensor]] = {}
    peak_bytes = cache.nbytes()
    start = time.perf_counter()
    for step in range(n - 1):
        kwargs = {}
        if step in config.error_steps:
            kwargs[CAPTURE_KWARG] = AttentionRecorder(keep_tensors=False)
        token = ids[:, p + step : p + step + 1]
        logits = model(input_ids=token, cache=cache, use_cache=True, **kwargs).logits[0, -1]
        nll.append(_nll(logits, ids[0, p + step + 1]))
        if kwargs:
            captures = kwargs[CAPTURE_KWARG].captures
            outputs[step] = {i: c.output for i, c in captures.items()}
        if policy is None:
            peak_bytes = max(peak_bytes, cache.nbytes())
    elapsed = time.perf_counter() - start
    layers = [cache.layers[i] for i in cache.evicting_layers]
    if policy is None:
        peak_entries = max(layer.physical_length() for layer in layers)
    else:
        peak_entries = max(layer.decode_state.peak_entries for layer in layers)
        # each layer's peak, summed: a bound on the bytes held at once
        peak_bytes = sum(layer.decode_state.peak_bytes for layer in layers)
    row = {
        "nll": float(sum(nll) / len(nll)),
        "peak_entries_per_head": int(peak_entries),
        "peak_cache_bytes": int(peak_bytes),
        "tokens_per_s": (n - 1) / elapsed if elapsed > 0 else math.inf,
        "stages": None if policy is None else max(layer.decode_state.stages for layer in layers),
    }
    return row, outputs


def _nll(logits: torch.Tensor, target: torch.Tensor) -> float:
    return float(-torch.log_softmax(logits.float(), -1)[target])


def attention_errors(
    outputs: dict[int, dict[int, torch.Tensor]], reference: dict[int, dict[int, torch.Tensor]]
) -> dict[str, float]:
    """Per recorded step: the mean over layers of ``||o - o_full|| / ||o_full||``."""
    errors = {}
    for step, layers in outputs.items():
        rel = [
            float((out.float() - reference[step][i].float()).norm())
            / max(float(reference[step][i].float().norm()), 1e-30)
            for i, out in layers.items()
        ]
        errors[str(step)] = sum(rel) / len(rel)
    return errors


def long_decode(model, ids: torch.Tensor, config: LongDecodeConfig, *, progress=None) -> list[dict]:
    """Rows of ``full`` and every method (one per seed for sampled methods), each with
    ``method``, ``seed``, ``nll``, ``nll_full``, ``nll_gap``, ``peak_entries_per_head``,
    ``peak_cache_bytes``, ``tokens_per_s``, ``throughput_vs_full``, ``stages`` and
    ``attention_error`` (``{step: error}``). ``ids [1, >= P + N]``."""
    need = config.prompt_tokens + config.tokens
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < need:
        raise ValueError(
            f"ids must be [1, >= {need}] (prompt_tokens + tokens), got {tuple(ids.shape)}"
        )
    prepare_model(model)
    ids = ids[:, :need].to(model.device)
    rows: list[dict] = []
    reference = None
    full_row = None
    for name, policy, seed, budget in _policies(config):
        row, outputs = run_one(model, ids, policy, config, budget)
        if policy is None:
            reference, full_row = outputs, row
        row = {
            "method": name,
            "seed": seed,
            "prompt_tokens": config.prompt_tokens,
            "tokens": config.tokens,
            "budget": budget,
            "every": None if policy is None else config.every,
            **row,
            "nll_full": full_row["nll"],
        }
        row["nll_gap"] = row["nll"] - row["nll_full"]
        row["throughput_vs_full"] = row["tokens_per_s"] / full_row["tokens_per_s"]
        row["attention_error"] = attention_errors(outputs, reference)
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


def summarise(rows: Sequence[dict]) -> list[dict]:
    """One row per method and budget: means over seeds of ``nll_gap``, ``tokens_per_s``
    ratio, the largest peak entries per head."""
    out: dict[tuple, dict] = {}
    for row in rows:
        key = (row["method"], row["budget"])
        acc = out.setdefault(key, {"method": row["method"], "runs": []})
        acc["runs"].append(row)
    table = []
    for (method, _), acc in out.items():
        runs = acc["runs"]
        table.append(
            {
                "method": method,
                "budget": runs[0]["budget"],
                "seeds": len(runs),
                "nll": sum(r["nll"] for r in runs) / len(runs),
                "nll_gap": sum(r["nll_gap"] for r in runs) / len(runs),
                **_peaks_and_speed(runs),
            }
        )
    return table


def _peaks_and_speed(runs: Sequence[dict]) -> dict:
    """The transformers engine's peak entries per head and throughput against the full cache;
    the vLLM engine's peak positions per request (its report; its throughput is
    ``benchmarks/bench_serve.py``'s: every job runs in one batch)."""
    if "peak_positions" in runs[0]:
        peaks = [r["peak_positions"] for r in runs if r["peak_positions"] is not None]
        return {"peak_positions": max(peaks) if peaks else None}
    return {
        "peak_entries_per_head": max(r["peak_entries_per_head"] for r in runs),
        "throughput_vs_full": sum(r["throughput_vs_full"] for r in runs) / len(runs),
    }


@dataclass(frozen=True)
class LongDecodeResult:
    rows: list[dict]
    summary: list[dict]
    path: Path


def run_long_decode(
    config: LongDecodeConfig,
    *,
    model: str,
    text: str,
    out: str | Path,
    dtype: str = "auto",
    progress: Callable[[dict], None] | None = None,
) -> LongDecodeResult:
    """``probkv long-decode``: ``config`` on ``model`` over ``text`` (a UTF-8 file, or
    ``prose:SEED``), every input checked before the model loads; writes ``{"header", "rows",
    "summary"}`` to ``out``."""
    from probkv.models import load_model, model_max_positions
    from probkv.models.dtypes import MODEL_DTYPES, resolve_dtype_name

    if config.engine != "hf":
        raise ValueError(f"run_long_decode runs engine='hf' configs, got {config.engine!r}")
    path = check_output_file(out, "--out")  # every input is checked before the model loads
    need = config.prompt_tokens + config.tokens
    words = read_text(text, words=need * 2)
    check_positions(config.prompt_tokens, config.tokens, model_max_positions(model))
    resolved = resolve_dtype_name(dtype)
    print(f"[long-decode] model dtype: {resolved} (--dtype {dtype})", file=sys.stderr)
    loaded, tokenizer = load_model(model, dtype=MODEL_DTYPES[resolved])
    ids = text_token_ids(tokenizer, words, need)
    start = time.perf_counter()
    rows = long_decode(loaded, ids, config, progress=progress)
    header = {
        "experiment": "long-decode",
        "model": model,
        "dtype": resolved,
        "text": text,
        "prompt_tokens": config.prompt_tokens,
        "tokens": config.tokens,
        "budget": list(config.budgets),
        "every": config.every,
        "methods": list(config.methods),
        "seeds": config.seeds,
        "error_steps": list(config.error_steps),
        "seconds": time.perf_counter() - start,
    }
    summary = summarise(rows)
    write_json(path, {"header": header, "rows": rows, "summary": summary})
    return LongDecodeResult(rows, summary, path)


def run_long_decode_vllm(
    config: LongDecodeConfig,
    *,
    model: str,
    text: str,
    out: str | Path,
    dtype: str = "float32",
    tensor_parallel_size: int = 1,
) -> LongDecodeResult:
    """``probkv long-decode --engine vllm``: the same forced continuation in one vLLM engine
    with probkv's plugin (``probkv.vllm.engine.long_decode_rows``: the text's tokens forced by
    a logits processor, vLLM's raw log-probs, each request held to ``max_entries`` B with a
    stage every K tokens, model-wide blocks). Top-k methods only, one row per method (the
    plugin's refusals by name, before the engine starts); rows carry ``peak_positions`` (the
    most positions the request held) instead of per-head peaks."""
    from probkv.models import load_tokenizer, model_max_positions, resolve_model
    from probkv.vllm.engine import check_budget_methods, check_model  # pure: no vLLM import

    if config.engine != "vllm":
        raise ValueError(
            f"run_long_decode_vllm needs a config with engine='vllm', got {config.engine!r}"
        )
    path = check_output_file(out, "--out")
    if config.seeds != 1:
        raise ValueError(
            f"--seeds {config.seeds}: --engine vllm runs top-k methods under a decode budget "
            "(deterministic); omit --seeds"
        )
    dtype = "float32" if dtype == "auto" else dtype
    need = config.prompt_tokens + config.tokens
    methods = [m for m in config.methods if m != FULL]
    for budget in config.budgets:
        check_budget_methods(methods, budget, config.every, tensor_parallel_size)
    folder = str(resolve_model(model).path)
    check_model(folder, tensor_parallel_size)
    words = read_text(text, words=need * 2)
    check_positions(config.prompt_tokens, config.tokens, model_max_positions(model))
    ids = text_token_ids(load_tokenizer(model), words, need)[0].tolist()
    from probkv.vllm.engine import VllmRunner, long_decode_rows

    start = time.perf_counter()
    runner = VllmRunner(
        folder, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
        max_model_len=need + 32, forcing=True, log_weights=False,
    )  # fmt: skip
    try:
        rows = long_decode_rows(
            runner, ids, prompt_tokens=config.prompt_tokens, tokens=config.tokens,
            budgets=config.budgets, every=config.every, methods=methods,
        )  # fmt: skip
    finally:
        runner.close()
    header = {
        "experiment": "long-decode",
        "engine": "vllm",
        "model": model,
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel_size,
        "text": text,
        "prompt_tokens": config.prompt_tokens,
        "tokens": config.tokens,
        "budget": list(config.budgets),
        "every": config.every,
        "methods": methods,
        "seconds": time.perf_counter() - start,
    }
    summary = summarise(rows)
    write_json(path, {"header": header, "rows": rows, "summary": summary})
    return LongDecodeResult(rows, summary, path)


def read_text(spec: str, words: int) -> str:
    """The text of ``--text``: a file, or ``prose:SEED`` (``words`` words generated)."""
    if spec.startswith("prose:"):
        seed = spec.removeprefix("prose:")
        if not seed.isdigit():
            raise ValueError(f"--text prose:SEED needs an integer seed, got {spec!r}")
        return prose_text(words, int(seed))
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--text {spec!r}: no such file (or use prose:SEED)")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"--text {spec!r}: cannot read it ({err.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--text {spec!r}: not valid UTF-8 (byte 0x{data[err.start]:02x} at offset "
            f"{err.start}); give a UTF-8 text file (iconv -f latin1 -t utf-8 converts one)"
        ) from None


def check_positions(prompt_tokens: int, tokens: int, limit: int) -> None:
    """Refuse ``--prompt-tokens`` + ``--tokens`` beyond the model's ``limit`` positions
    (before the model loads: past them the run would only fail, or wrap, at the end)."""
    if prompt_tokens + tokens > limit:
        raise ValueError(
            f"--prompt-tokens {prompt_tokens} + --tokens {tokens} = {prompt_tokens + tokens} "
            f"positions, above the model's limit of {limit} (max_position_embeddings); "
            "lower them"
        )
