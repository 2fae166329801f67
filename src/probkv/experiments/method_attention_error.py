"""Attention error of whole methods on task examples (S7): does a ``prob:`` method's output
stay closer to the full cache's than its top-k version's, on the prompts the task scores use?

:mod:`probkv.experiments.attention_error` measures estimators of one proposal on one prompt, from the
prefill's own statistics. This module measures any method name that ``probkv eval`` takes
(``kvzip``, ``prob:kvzip/core=0.75``, ``snapkv``, ...) on the examples ``probkv eval`` runs,
through the same integration path as the task scores:

- The example's prompt is split as a job splits it (``probkv.eval.job``): question-agnostic,
  the context ``x`` is prefilled and evicted, then the question's tokens are fed;
  question-aware, everything but the last prompt token is evicted. The decode tokens
  ``d_1..d_N`` are the fed tokens, then the full-cache model's greedy answer
  (``answer_tokens`` of them, end-of-sequence suppressed).
- One full-cache forward over ``x, d_1..d_N`` is captured (the reference). The context is
  observed once per score (``probkv.hf.observe``, with the reconstruction pass for ``kvzip``,
  ``h2o-rec``, ``min-rec``), copied and evicted once per (method, ratio, seed), exactly as the
  eval's units do; then ``d_1..d_N`` are teacher forced through the evicted model in one
  forward (causal: the same as one token at a time, tested).
- Error of a token: per query head of every evicted layer, ``mean_k |o[k] - o_hat[k]|`` over
  the head dimension (Eq. 11), averaged over all those heads. Errors compound: each layer
  reads what the evicted layers below it computed, each token what the evicted model wrote.
  A row averages the token errors of one ``part`` of ``d``: ``question`` (the fed tokens),
  ``answer`` (the greedy answer) or ``all``.

Rows (``METHOD_ROW_FIELDS``): per example, method, ratio and part, the mean over seeds of the
per-seed error (``mae_mean``), its population standard deviation (``mae_std``; 0 for
deterministic methods, run once), the effective ratio (S3, mean over seeds), the number of
heads averaged and of tokens in the part. Sampled methods (``ProbabilisticPolicy``) run with
``seed = 0..seeds-1`` in place of their own seed.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from probkv._checks import check_positive_int, check_ratio, check_token_ids
from probkv.eval.config import RunConfig
from probkv.eval.outputs import check_output_file, write_json
from probkv.eval.winscore import sign_test_p
from probkv.experiments.attention_error import evicting_layers
from probkv.policies import (
    EvictionPolicy,
    FullCache,
    ProbabilisticPolicy,
    method_name,
    parse_method,
    top_k_versions,
)

PARTS = ("question", "answer", "all")
#: Keys of every result row, in this order.
METHOD_ROW_FIELDS = (
    "example",
    "method",
    "ratio",
    "part",
    "mae_mean",
    "mae_std",
    "effective_ratio",
    "num_heads",
    "tokens",
    "seeds",
)


def validate_methods(methods: Sequence[str], ratios: Sequence[float], seeds: int) -> list[str]:
    """Check method names (``parse_method``, which names a bad one), ratios and seeds before
    any work; return the canonical names (``method_name``, as ``probkv eval`` reports them).
    ``full`` is refused (it is the reference: its error is 0 by definition), and so is a
    method given twice under two spellings (``prob:kvzip`` and ``prob:kvzip/block=1``)."""
    given = [m.strip() for m in methods if m.strip()]
    if not given:
        raise ValueError("methods must name at least one method, e.g. kvzip,prob:kvzip")
    methods = []
    for method in given:
        policy = parse_method(method, ratio=0.5)
        if isinstance(policy, FullCache):
            raise ValueError(
                f"method {method!r} is the full cache, the reference of every error; "
                "give eviction methods only"
            )
        methods.append(method_name(policy))
    repeated = sorted({m for m in methods if methods.count(m) > 1})
    if repeated:
        raise ValueError(
            f"methods lists {', '.join(repeated)} twice (canonical names); give each once"
        )
    ratios = [check_ratio(r, "ratios") for r in ratios]
    if not ratios or any(r == 0 for r in ratios):
        raise ValueError(f"ratios must be in (0, 1) and not empty, got {list(ratios)}")
    check_positive_int(seeds, "seeds")
    return methods


def policy_seeds(policy: EvictionPolicy, seeds: int) -> list[EvictionPolicy]:
    """The policies one (method, ratio) runs: ``seeds`` copies with ``seed = 0..seeds-1`` for a
    sampled method, the policy itself once for a deterministic one."""
    if isinstance(policy, ProbabilisticPolicy):
        return [dataclasses.replace(policy, seed=s) for s in range(seeds)]
    return [policy]


@torch.no_grad()
def token_errors(model, cache, decode: torch.Tensor, reference, layers) -> torch.Tensor:
    """``[N]``: the error of each of the ``N`` decode tokens teacher forced in one forward
    through ``cache`` (evicted), against ``reference[i] [Hq, N, d_v]`` of layer ``layers[i]``;
    averaged over every query head of the evicted layers (module docstring)."""
    from probkv import hf  # transformers, imported on use

    captures = hf.capture_attention(model, decode, cache=cache, keep_tensors=False)
    per_layer = [
        (ref.float() - captures[i].output.float()).abs().mean(-1)  # [Hq, N]
        for ref, i in zip(reference, layers)
    ]
    return torch.cat(per_layer).mean(0)


@torch.no_grad()
def measure_method_errors(
    model,
    context_ids: Sequence[int] | torch.Tensor,
    decode_ids: Sequence[int] | torch.Tensor,
    *,
    num_fed: int,
    methods: Sequence[str],
    ratios: Sequence[float],
    seeds: int = 3,
    repeat_prompt=None,
    example: str = "",
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """The rows of one example (module docstring; keys ``METHOD_ROW_FIELDS``).

    ``context_ids``: the evicted prompt ``x``; ``decode_ids``: ``d_1..d_N``, of which the first
    ``num_fed`` are the fed prompt tokens (part ``question``) and the rest the answer.
    ``repeat_prompt``: the reconstruction prompt (``probkv.hf.repeat_prompt(tokenizer)``),
    needed by the reconstruction scores.
    """
    from probkv import hf  # transformers, imported on use

    methods = validate_methods(methods, ratios, seeds)
    context = check_token_ids(context_ids, "context_ids")[0]
    decode = check_token_ids(decode_ids, "decode_ids")[0]
    n = decode.numel()
    if not 0 <= num_fed <= n:
        raise ValueError(f"num_fed must be in [0, {n}] (decode tokens), got {num_fed}")
    hf.prepare_model(model)
    t = context.numel()
    layers = evicting_layers(model)
    captures = hf.capture_attention(model, torch.cat([context, decode]), keep_tensors=False)
    reference = [captures[i].output[:, t:] for i in layers]
    num_heads = sum(r.shape[0] for r in reference)
    del captures
    parts = {"question": slice(0, num_fed), "answer": slice(num_fed, n), "all": slice(0, n)}
    observed: dict[tuple, object] = {}
    rows: list[dict] = []
    for method in methods:
        for ratio in ratios:
            errors: dict[str, list[float]] = {part: [] for part in PARTS}
            effective: list[float] = []
            policies = policy_seeds(parse_method(method, ratio=ratio), seeds)
            for policy in policies:
                key = (policy.score, repr(sorted(policy.score_params.items())))
                if key not in observed:  # one prefill (+ reconstruction) per score
                    observed[key] = hf.observe(
                        model,
                        context.unsqueeze(0),
                        policy.score,
                        policy.score_params,
                        repeat_prompt=repeat_prompt,
                    )
                cache = observed[key].copy()
                cache.evict(policy)
                per_token = token_errors(model, cache, decode, reference, layers)
                effective.append(cache.effective_ratio())
                for part, span in parts.items():
                    if span.stop > span.start:
                        errors[part].append(float(per_token[span].mean()))
            for part in PARTS:
                values = errors[part]
                if not values:
                    continue  # no token in this part (e.g. no answer tokens asked for)
                row = {
                    "example": example,
                    "method": method,
                    "ratio": ratio,
                    "part": part,
                    "mae_mean": statistics.fmean(values),
                    "mae_std": statistics.pstdev(values) if len(values) > 1 else 0.0,
                    "effective_ratio": statistics.fmean(effective),
                    "num_heads": num_heads,
                    "tokens": parts[part].stop - parts[part].start,
                    "seeds": len(values),
                }
                rows.append({k: row[k] for k in METHOD_ROW_FIELDS})
            if progress is not None:
                progress(f"{example or 'example'}: {method} at r = {ratio}: done")
    return rows


def mean_over_examples(rows: Sequence[dict]) -> list[dict]:
    """Per (method, ratio, part): the mean of ``mae_mean`` over examples, with the number of
    examples and of wins (``lower``) and losses (``higher``) against the method's top-k version
    where both ran (a ``prob:<score>...`` method against ``probkv.policies.top_k_versions``,
    the first that ran), with the sign test of the two (``p``, ``winscore.sign_test_p``)."""
    by: dict[tuple, dict[str, float]] = {}
    for row in rows:
        by.setdefault((row["method"], row["ratio"], row["part"]), {})[row["example"]] = row[
            "mae_mean"
        ]
    out = []
    for (method, ratio, part), values in by.items():
        summary = {
            "method": method,
            "ratio": ratio,
            "part": part,
            "mae_mean": statistics.fmean(values.values()),
            "examples": len(values),
            "reference": None,
            "lower": None,
            "higher": None,
            "p": None,
        }
        for reference in top_k_versions(method):
            other = by.get((reference, ratio, part))
            if other:
                common = [e for e in values if e in other]
                summary["reference"] = reference
                summary["lower"] = sum(values[e] < other[e] for e in common)
                summary["higher"] = sum(values[e] > other[e] for e in common)
                summary["p"] = sign_test_p(summary["lower"], summary["higher"])
                break
        out.append(summary)
    return out


@dataclasses.dataclass(frozen=True)
class TaskAttentionErrorRun:
    """One ``probkv task-attention-error`` run, as given: the methods and ratios measured with
    ``seeds`` seeds, ``answer_tokens`` greedy answer tokens of the full model, and the example
    source of ``probkv eval`` (``data`` or generated ``tasks`` at ``lengths``; checked by
    :meth:`config`, the way ``probkv eval`` checks it)."""

    model: str
    methods: Sequence[str]
    ratios: Sequence[float]
    out: str | Path
    seeds: int = 3
    answer_tokens: int = 16
    data: str | None = None
    data_format: str = "auto"
    tasks: Sequence[str] | None = None
    lengths: Sequence[int] | None = None
    per_task: int = 3
    seed: int = 0
    question_aware: bool = False
    max_examples: int | None = None
    dtype: str = "auto"

    def config(self) -> RunConfig:
        """The examples' configuration (``RunConfig`` checks the example source)."""
        return RunConfig(
            model=self.model,
            methods=tuple(self.methods),
            ratios=tuple(self.ratios),
            data=self.data,
            data_format=self.data_format,
            tasks=tuple(self.tasks or ()),
            lengths=tuple(self.lengths or ()),
            per_task=self.per_task,
            seed=self.seed,
            question_aware=self.question_aware,
            max_examples=self.max_examples,
            dtype=self.dtype,
        )


@dataclasses.dataclass(frozen=True)
class TaskAttentionErrorResult:
    rows: list[dict]
    summary: list[dict]
    examples: int
    path: Path


def run_task_attention_error(
    run: TaskAttentionErrorRun, *, log: Callable[[str], None] = lambda message: None
) -> TaskAttentionErrorResult:
    """``probkv task-attention-error``: load the model and the run's examples (split as
    ``probkv eval`` splits them), measure every example, write ``{"header", "rows",
    "summary"}`` to ``run.out`` (checked before the model loads)."""
    from probkv.eval.job import job_prompt_ids, split_prompt
    from probkv.eval.plan import load_run_examples
    from probkv.experiments.attention_prompts import AttentionPrompt, decode_tokens
    from probkv.hf import prepare_model, repeat_prompt  # transformers: only when a run starts
    from probkv.models import load_model, max_positions
    from probkv.models.dtypes import MODEL_DTYPES, resolve_dtype_name

    validate_methods(run.methods, run.ratios, run.seeds)
    config = run.config()
    path = check_output_file(run.out, "--out")
    start = time.perf_counter()
    dtype = resolve_dtype_name(run.dtype)
    model, tokenizer = load_model(run.model, dtype=MODEL_DTYPES[dtype])
    prepare_model(model)
    examples = load_run_examples(config, tokenizer)
    rebuild = repeat_prompt(tokenizer)
    log(f"{len(examples)} examples; model dtype: {dtype} (--dtype {run.dtype})")
    rows, prompts = [], []
    for example in examples:
        context, question, _ = job_prompt_ids(example, tokenizer, max_positions(model.config))
        prefilled, fed = split_prompt(context, question, run.question_aware)
        # the example as an AttentionPrompt: the evicted part, then the fed tokens
        prompt = AttentionPrompt(tuple(prefilled), tuple(fed), f"example:{example.id}", "paper")
        decode = decode_tokens(model, prompt, len(fed) + run.answer_tokens)
        prompts.append(
            {
                "example": example.id,
                "prompt_tokens": len(prefilled),
                "fed_tokens": len(fed),
                "answer_text": tokenizer.decode(list(decode[len(fed) :])),
            }
        )
        rows += measure_method_errors(
            model,
            torch.tensor(prefilled),
            torch.tensor(decode),
            num_fed=len(fed),
            methods=run.methods,
            ratios=run.ratios,
            seeds=run.seeds,
            repeat_prompt=rebuild,
            example=example.id,
            progress=log,
        )
    summary = mean_over_examples(rows)
    arguments = ("methods", "ratios", "seeds", "tasks", "lengths", "per_task", "seed", "data")
    arguments += ("question_aware", "max_examples", "answer_tokens")
    header = {
        "experiment": "task-attention-error (S7, Eq. 11, compounded; probkv.eval."
        "method_attention_error)",
        "model": run.model,
        "dtype": dtype,
        "arguments": {name: getattr(run, name) for name in arguments},
        "examples": prompts,
        "runtime_s": round(time.perf_counter() - start, 2),
    }
    write_json(path, {"header": header, "rows": rows, "summary": summary})
    return TaskAttentionErrorResult(rows, summary, len(examples), path)
