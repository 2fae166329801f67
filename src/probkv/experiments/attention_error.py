"""The attention-error experiment: how far evicted attention is from full attention (S7).

The paper's Section 6 / Figure 2 (Eq. 11), with the S9 variants. A prompt ``x`` of ``t`` tokens
is prefilled and evicted; the decode tokens ``d_1, d_2, ...`` follow it (``d_1`` is the first
response token). For every global-attention layer and every query head ``h`` the error of an
estimate ``o_hat`` of the full-cache attention output ``o`` (both ``[d_v]``, before the output
projection) is ``mean_k |o[k] - o_hat[k]|`` over the head dimension; a number in the results is
that error averaged over all query heads of all evicted layers (``num_heads`` of them: 30 layers
x 9 = 270 for SmolLM2; Gemma-3's sliding-window layers are not evicted, so not counted).

Estimators (rows' ``estimator``):

- ``topk``: H2O, the top-k of the ``h2o`` score (S5), no correction, whatever the proposal.
- ``topk_proposal``: the top-k of the chosen proposal's score (S9; equals ``topk`` for ``h2o``).
- ``uncorrected``: a kept set sampled from the proposal (S3), no weights: ``o_I``.
- ``corrected``: the same kept set (same seed) with the log-weights of S4/S9 at temperature
  ``tau``: ``mu_n``. Uncorrected and corrected share the kept set at each seed, so their
  difference is the weights alone.

Two measurements (rows' ``step``):

- ``step = 1`` (integer): per-layer error at the first decode token, not compounded. One
  full-cache forward over ``x, d_1, ..., d_N`` (teacher forced, ``N = max(steps, 1)``) is
  captured; every layer's real post-RoPE queries, keys and values come from it (causal: its
  first ``t`` rows are exactly the prefill of ``x``). Each policy selects from those tensors
  through the integration's own eviction path: ``probkv.scores.observation.observe_layer`` on the
  first ``t`` rows, then ``probkv.policies.select_layers`` (per layer in head scope, all layers
  at once in global scope), so the kept sets are those ``probkv.hf.compress`` keeps for the
  same tensors (tests/eval/test_attention_error.py checks it). The decode query of
  ``d_1`` attends to the kept prefix entries (logits ``+ log w``) and to itself (no weight),
  ``probkv.estimation.corrected_attention``. The reference ``o`` is the same function with every
  entry kept and no weight. So layer ``l``'s inputs are the full model's, errors do not add up
  across layers: this is the paper's Eq. 11.
- ``step = "1..N"`` (string, with ``--steps N``): compounded decode error. The full-cache
  model's tokens ``d_1..d_N`` are teacher forced through the full-cache model (one captured
  forward) and through the evicted model (``probkv.hf.compress(model, x, policy)``, then the
  tokens one by one with probkv's real attention). At each step every evicted layer's per-head
  output is compared with the full model's at the same position; the errors of step ``n`` are
  averaged over heads, then over ``n = 1..N``. Here layer ``l`` reads what the evicted layers
  below it computed, and step ``n`` what the evicted model wrote at earlier steps: errors
  compound across layers and steps.

Per row: ``mae_mean`` is the mean over seeds of that per-seed error; ``mae_std`` the population
standard deviation (ddof = 0) over seeds of the per-seed errors (0 for the deterministic top-k
rows, computed once, ``seeds = 1``); ``effective_ratio`` the achieved compression ratio (S3),
``1 - kept / t`` averaged over the KV heads of the evicted layers and over seeds; ``tau`` is
``None`` except for ``corrected``; ``proposal``, ``weights`` and ``sampler`` describe the row's
own estimator (``weights`` and ``sampler`` are ``None`` where the estimator has none: top-k rows
have neither, uncorrected rows have no weights; pps weights are ``"pps"``, ``1 / P_i``).

Prompts (:class:`AttentionPrompt`, the ``paper`` and ``chat`` formats) are built in
:mod:`probkv.experiments.attention_prompts` and re-exported here.

Capture: ``probkv.hf.capture_attention`` runs one ordinary forward of the prepared model with a
recorder that probkv's own attention function fills with every layer's real tensors (no
forward hooks, no re-projection, no other attention implementation).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from probkv import estimation, scores
from probkv._checks import (
    check_choice,
    check_positive_int,
    check_ratio,
    check_tau,
    check_token_ids,
)
from probkv.estimation.selection import RaggedSelection
from probkv.experiments.attention_prompts import (
    PROMPT_FORMATS,
    AttentionPrompt,
    decode_tokens,
    haystack_prompt,
    paper_prompt,
    text_prompt,
)
from probkv.policies import (
    EvictionPolicy,
    FullCache,
    LayerObservation,
    ProbabilisticPolicy,
    TopKPolicy,
    select_layers,
)
from probkv.policies.probabilistic import SAMPLERS, SCOPES
from probkv.scores.observation import observe_layer

if TYPE_CHECKING:
    from probkv.hf import LayerCapture

# The integration (probkv.hf: capture, ProbKVCache, compress) imports transformers, which takes
# seconds, and ``probkv --help`` imports this module for its constants: the functions that run a
# model import probkv.hf when called.


__all__ = [
    "DEFINITIONS",
    "ESTIMATORS",
    "PROMPT_FORMATS",
    "ROW_FIELDS",
    "WITH_REPLACEMENT_WEIGHTS",
    "AttentionPrompt",
    "decode_output",
    "decode_tokens",
    "evicting_layers",
    "haystack_prompt",
    "head_errors",
    "measure_attention_error",
    "observe",
    "paper_prompt",
    "prefix_log_weights",
    "results_header",
    "select",
    "text_prompt",
    "validate_arguments",
]

ESTIMATORS = ("topk", "topk_proposal", "uncorrected", "corrected")
# proposals whose statistics come from the prefill itself (not a reconstruction pass, S10.1)
PREFILL_SCORES = tuple(n for n in scores.SCORE_NAMES if not scores.needs_reconstruction(n))
WITH_REPLACEMENT_WEIGHTS = ("counts", "inclusion")
#: Keys of every result row, in this order (``probkv plot`` reads them).
ROW_FIELDS = (
    "ratio",
    "estimator",
    "tau",
    "mae_mean",
    "mae_std",
    "step",
    "effective_ratio",
    "num_heads",
    "proposal",
    "weights",
    "sampler",
    "seeds",
)
#: The JSON header's explanation of each number (written with the results).
DEFINITIONS = {
    "error": "per query head: mean over the head dimension of |o - o_hat|, o the full-cache "
    "attention output (before o_proj), o_hat the estimator's; averaged over all query heads "
    "of all evicted (global-attention) layers (num_heads)",
    "step 1": "first decode token d_1, per layer, not compounded: every layer's queries, keys "
    "and values come from the full-cache forward; the decode query attends to the kept prefix "
    "(+ log w) and to itself (paper Eq. 11)",
    "step 1..N": "compounded: d_1..d_N teacher forced through probkv.hf.compress(model, x, "
    "policy) and through the full-cache model; per-step errors averaged over heads, then over "
    "the N steps",
    "mae_mean": "mean over seeds of the per-seed error",
    "mae_std": "population standard deviation (ddof=0) over seeds of the per-seed error; "
    "0 for deterministic top-k rows (computed once, seeds=1)",
    "effective_ratio": "achieved compression ratio 1 - kept/t, mean over KV heads of the "
    "evicted layers and over seeds",
    "estimators": "topk = H2O top-k; topk_proposal = top-k of the proposal's score; "
    "uncorrected = sampled kept set, no weights; corrected = same kept set (same seed), "
    "log-weights / tau",
}


# ---------------------------------------------------------------------------------- capture


def evicting_layers(model) -> list[int]:
    """Indices of the layers probkv evicts (global attention), as ``ProbKVCache`` picks them."""
    from probkv import hf  # transformers, imported on use (see the module note

    return list(hf.ProbKVCache(model.config, FullCache()).evicting_layers)


# ---------------------------------------------------------------------------------- measuring


def observe(
    capture: LayerCapture, *, score: str, length: int, rank: int, score_params: dict | None = None
) -> LayerObservation:
    """The policy's observation of one layer's prefill from captured tensors: ``score`` (S2,
    S5) over the first ``length`` entries, by the integration's own ``observe_layer``."""
    t = length
    _, observation = observe_layer(
        capture.query[:, :t],
        capture.key[:, :t],
        capture.value[:, :t],
        scale=capture.scale,
        score=score,
        score_params=score_params,
        layer_idx=capture.layer_idx,
        rank=rank,
    )
    return observation


def select(
    policy: EvictionPolicy, observations: Sequence[LayerObservation]
) -> list[RaggedSelection]:
    """The policy's selections of these (all the model's evicting) layers, through the entry
    point ``ProbKVCache`` uses (``probkv.policies.select_layers``): one layer at a time when
    the policy is layerwise (head scope: the integration's random streams), else all layers
    at once (global scope, S3)."""
    return select_layers(policy, observations, num_layers=len(observations))


def prefix_log_weights(selection: RaggedSelection, length: int) -> torch.Tensor:
    """``[Hkv, t]`` float32: each kept entry's log-weight (0 without correction), ``-inf`` for
    evicted entries (excluded from the softmax)."""
    return selection.dense_log_weights(length)


def decode_output(capture: LayerCapture, log_weights: torch.Tensor, position: int) -> torch.Tensor:
    """``[Hq, d_v]`` float32: the output of captured query row ``position`` (``>= t``) over the
    prefix entries ``0..t-1`` with ``log_weights [Hkv, t]`` (S4; ``-inf`` = evicted) and every
    entry ``t..position`` with no weight, one softmax (``estimation.corrected_attention``)."""
    h, t = log_weights.shape
    n = position + 1
    if not t <= position < capture.key.shape[1]:
        raise ValueError(f"position must be in [{t}, {capture.key.shape[1]}), got {position}")
    device = capture.key.device
    lw = torch.cat([log_weights.to(device), torch.zeros(h, n - t, device=device)], dim=1)
    query = capture.query[:, position : position + 1].float()
    out = estimation.corrected_attention(
        query, capture.key[:, :n].float(), capture.value[:, :n].float(), lw, scale=capture.scale
    )
    return out[:, 0]


def head_errors(reference: torch.Tensor, estimate: torch.Tensor) -> torch.Tensor:
    """``[Hq]``: mean over the head dimension of ``|reference - estimate|`` (S7, Eq. 11)."""
    return (reference.float() - estimate.float()).abs().mean(-1)


def _effective_ratio(selections: Sequence[RaggedSelection], length: int) -> float:
    """``1 - kept / t`` averaged over every KV head of every layer (S3)."""
    lengths = torch.cat([s.lengths for s in selections]).double()
    return float(1.0 - (lengths / length).mean())


@dataclass(frozen=True)
class _Estimate:
    """One estimator configuration (a row): what to build for each seed."""

    estimator: str
    tau: float | None
    proposal: str
    weights: str | None
    sampler: str | None
    deterministic: bool

    def policy(self, ratio: float, seed: int, scope: str, weights_field: str) -> EvictionPolicy:
        """The policy of this estimator at ``ratio`` and ``seed`` (``weights_field``: the
        ``ProbabilisticPolicy.weights`` value, given to the with-replacement sampler only:
        pps has no weights option)."""
        if self.estimator in ("topk", "topk_proposal"):
            return TopKPolicy(score=self.proposal, ratio=ratio)
        # pps has no weights option (always 1 / P); without correction there is no tau
        options = {"weights": weights_field} if self.sampler == "with_replacement" else {}
        if self.tau is not None:
            options["tau"] = self.tau
        return ProbabilisticPolicy(
            score=self.proposal,
            ratio=ratio,
            scope=scope,
            sampler=self.sampler,
            correct=self.tau is not None,
            seed=seed,
            **options,
        )


def _estimates(proposal: str, weights: str, sampler: str, taus: Sequence[float]) -> list[_Estimate]:
    out = [
        _Estimate("topk", None, "h2o", None, None, True),
        _Estimate("topk_proposal", None, proposal, None, None, True),
        _Estimate("uncorrected", None, proposal, None, sampler, False),
    ]
    distinct = dict.fromkeys(float(tau) for tau in taus)
    out += [_Estimate("corrected", tau, proposal, weights, sampler, False) for tau in distinct]
    return out


def _row(
    est: _Estimate,
    ratio: float,
    step: int | str,
    errors: Sequence[float],
    ratios: Sequence[float],
    num_heads: int,
) -> dict:
    row = {
        "ratio": ratio,
        "estimator": est.estimator,
        "tau": est.tau,
        "mae_mean": statistics.fmean(errors),
        "mae_std": statistics.pstdev(errors) if len(errors) > 1 else 0.0,
        "step": step,
        "effective_ratio": statistics.fmean(ratios),
        "num_heads": num_heads,
        "proposal": est.proposal,
        "weights": est.weights,
        "sampler": est.sampler,
        "seeds": len(errors),
    }
    return {key: row[key] for key in ROW_FIELDS}


def _check_same_kept(reference, other) -> None:
    """Uncorrected and corrected must keep the same entries at one seed (the comparison is
    about the weights). The policies draw the same samples whatever ``tau``; this checks it:
    on the selections (step 1) or on the kept counts per head (compounded run)."""
    if isinstance(reference, list) and reference and isinstance(reference[0], RaggedSelection):
        same = all(
            torch.equal(a.lengths, b.lengths) and torch.equal(a.indices, b.indices)
            for a, b in zip(reference, other)
        )
    else:
        same = reference == other
    if not same:
        raise RuntimeError("corrected and uncorrected kept sets differ at the same seed")


def validate_arguments(
    *,
    ratios: Sequence[float],
    taus: Sequence[float],
    seeds: int,
    proposal: str,
    weights: str | None,
    sampler: str,
    scope: str,
    steps: int,
) -> tuple[list[float], list[float], str]:
    """Check the experiment's arguments before any work (``ValueError`` naming the bad one);
    returns ``(ratios, taus, weights)`` with ``weights`` resolved (``"counts"`` by default,
    ``"pps"`` for the pps sampler)."""
    ratios = [check_ratio(r, "ratios") for r in ratios]
    if not ratios:
        raise ValueError("ratios must not be empty")
    repeated = sorted({r for r in ratios if ratios.count(r) > 1})
    if repeated:  # every row would be measured and written twice (eval refuses them too)
        raise ValueError(f"ratios lists {', '.join(map(str, repeated))} twice; give each once")
    taus = [check_tau(tau, "taus") for tau in taus]
    if any(math.isinf(tau) for tau in taus):
        raise ValueError("taus must be finite (tau = inf is the uncorrected estimator, reported)")
    check_positive_int(seeds, "seeds")
    check_positive_int(steps, "steps", allow_zero=True)
    # the experiment observes each layer's own prefill; the S10.1 scores need the
    # reconstruction pass of probkv.hf.compress, which it does not run
    check_choice(proposal, PREFILL_SCORES, "proposal")
    check_choice(sampler, SAMPLERS, "sampler")
    check_choice(scope, SCOPES, "scope")
    if sampler == "pps":
        if weights not in (None, "pps"):
            raise ValueError(
                f"weights={weights!r} applies to the with_replacement sampler; pps always "
                "weighs by 1 / P_i (S9): omit weights"
            )
        weights = "pps"
    else:
        weights = check_choice(
            "counts" if weights is None else weights, WITH_REPLACEMENT_WEIGHTS, "weights"
        )
    return ratios, taus, weights


@torch.no_grad()
def measure_attention_error(
    model,
    context_ids: Sequence[int] | torch.Tensor,
    decode_ids: Sequence[int] | torch.Tensor,
    *,
    ratios: Sequence[float],
    taus: Sequence[float] = (1.0, 2.0, 5.0, 10.0, 50.0),
    seeds: int = 3,
    proposal: str = "h2o",
    weights: str | None = None,
    sampler: str = "with_replacement",
    scope: str = "head",
    steps: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """The attention-error rows (module docstring; keys ``ROW_FIELDS``).

    Args:
        model: a supported causal LM (batch size 1). It is switched to probkv's attention
            implementation (``probkv.hf.prepare_model``), which computes exactly what SDPA
            does without a ``ProbKVCache``.
        context_ids: the prompt ``x`` (``t`` tokens), evicted.
        decode_ids: ``d_1, ...``: at least ``max(steps, 1)`` tokens after ``x``.
        ratios: compression ratios in [0, 1) (S1).
        taus: finite weight temperatures of the ``corrected`` rows (S4).
        seeds: number of seeds ``0..seeds-1`` of the sampled estimators.
        proposal: the sampled estimators' proposal and ``topk_proposal``'s score (S2 name).
        weights: ``"counts"`` (default, the paper) or ``"inclusion"`` with the
            ``with_replacement`` sampler; omit for ``"pps"`` (S9).
        sampler: ``"with_replacement"`` (S3) or ``"pps"`` (S9).
        scope: ``"head"`` (per-head constraint, S3, the paper's Figure 2) or ``"global"``.
        steps: ``N > 0`` adds the compounded rows ``step = "1..N"``.
        progress: called with a short message after each ratio.

    Returns:
        The step-1 rows (per ratio: ``topk``, ``topk_proposal``, ``uncorrected``, then
        ``corrected`` per distinct tau), then the ``"1..N"`` rows in the same order.
    """
    ratios, taus, weights = validate_arguments(
        ratios=ratios,
        taus=taus,
        seeds=seeds,
        proposal=proposal,
        weights=weights,
        sampler=sampler,
        scope=scope,
        steps=steps,
    )
    weights_field = "inclusion" if weights == "pps" else weights  # the policy's field
    context = check_token_ids(context_ids, "context_ids")[0]
    decode = check_token_ids(decode_ids, "decode_ids")[0]
    n_steps = max(steps, 1)
    if decode.numel() < n_steps:
        raise ValueError(f"decode_ids has {decode.numel()} tokens; steps={steps} needs {n_steps}")
    from probkv import hf  # transformers, imported on use (see the module note

    hf.prepare_model(model)
    t = context.numel()
    layers = evicting_layers(model)
    captures = hf.capture_attention(model, torch.cat([context, decode[:n_steps]]))
    captured = [captures[i] for i in layers]
    num_heads = sum(c.query.shape[0] for c in captured)
    estimates = _estimates(proposal, weights, sampler, taus)
    full = [decode_output(c, torch.zeros(c.key.shape[0], t), t) for c in captured]
    observations: dict[tuple, list[LayerObservation]] = {}

    def first_step(policy: EvictionPolicy) -> tuple[float, float, list[RaggedSelection]]:
        """Step-1 error, effective ratio and selections of ``policy`` on the captured layers."""
        key = (policy.score, repr(sorted(policy.score_params.items())))
        if key not in observations:  # scores depend on the score and its parameters only
            observations[key] = [
                observe(c, score=policy.score, length=t, rank=r, score_params=policy.score_params)
                for r, c in enumerate(captured)
            ]
        selections = select(policy, observations[key])
        errors = [
            head_errors(o, decode_output(c, prefix_log_weights(s, t), t))
            for o, c, s in zip(full, captured, selections)
        ]
        return float(torch.cat(errors).mean()), _effective_ratio(selections, t), selections

    reference = [c.output[:, t : t + steps].float() for c in captured]  # full model, d_1..d_N

    def compounded(policy: EvictionPolicy) -> tuple[float, float, list[int]]:
        return _compounded_error(model, context, decode[:steps], policy, layers, reference)

    runs = [(1, first_step)] + ([(f"1..{steps}", compounded)] if steps > 0 else [])
    rows: list[dict] = []
    for step, run in runs:
        for ratio in ratios:
            policy = lambda est, seed, r=ratio: est.policy(r, seed, scope, weights_field)  # noqa: E731
            results = _over_seeds(run, policy, estimates, seeds)
            rows += [_row(e, ratio, step, *results[e], num_heads) for e in estimates]
            if progress is not None:
                progress(f"step {step}, ratio {ratio}: done")
    return rows


def _over_seeds(
    run: Callable, policy: Callable, estimates: Sequence[_Estimate], seeds: int
) -> dict[_Estimate, tuple[list[float], list[float]]]:
    """``(errors, effective ratios)`` of every estimate over seeds ``0..seeds-1`` (once for a
    deterministic one): ``run(policy(estimate, seed))`` gives ``(error, effective, kept)``."""
    results: dict[_Estimate, tuple[list[float], list[float]]] = {e: ([], []) for e in estimates}
    for seed in range(seeds):
        kept_set = None  # what uncorrected kept at this seed; corrected must keep it
        for est in estimates:
            if est.deterministic and seed > 0:
                continue  # top-k does not depend on the seed: computed once
            error, effective, kept = run(policy(est, seed))
            if not est.deterministic:
                kept_set = kept if kept_set is None else kept_set
                _check_same_kept(kept_set, kept)
            results[est][0].append(error)
            results[est][1].append(effective)
    return results


def _compounded_error(
    model,
    context: torch.Tensor,
    decode: torch.Tensor,
    policy: EvictionPolicy,
    layers: Sequence[int],
    reference_outputs: Sequence[torch.Tensor],
) -> tuple[float, float, list[int]]:
    """Teacher-force ``decode`` through the evicted model (real integration); return the
    error averaged over steps, the effective ratio and the kept count of every KV head."""
    from probkv import hf  # transformers, imported on use (see the module note

    cache = hf.compress(model, context, policy)
    per_step = []
    for n in range(decode.numel()):
        captures = hf.capture_attention(model, decode[n : n + 1], cache=cache, keep_tensors=False)
        errors = [
            head_errors(ref[:, n], captures[i].output[:, 0])
            for ref, i in zip(reference_outputs, layers)
        ]
        per_step.append(float(torch.cat(errors).mean()))
    reports = cache.reports()
    per_head = [r for report in reports for r in report.effective_ratio_per_head]
    kept = [k for report in reports for k in report.kept_per_head]
    return statistics.fmean(per_step), statistics.fmean(per_head), kept


def results_header(
    *,
    model_name: str,
    prompt: AttentionPrompt,
    decode_ids: Sequence[int],
    tokenizer=None,
    arguments: dict,
    num_heads: int | None = None,
) -> dict:
    """The JSON header written before the rows: model, prompt length, arguments, definitions."""
    decode_ids = [int(i) for i in decode_ids]
    header = {
        "experiment": "attention-error (S7, paper Eq. 11 / Figure 2)",
        "model": model_name,
        "prompt": {
            "source": prompt.source,
            "format": prompt.format,
            "prompt_tokens": len(prompt.context_ids),
            "forced_tokens": len(prompt.forced_ids),
            "decode_ids": decode_ids,
        },
        "arguments": arguments,
        "num_heads": num_heads,
        "definitions": DEFINITIONS,
    }
    if tokenizer is not None:
        header["prompt"]["decode_text"] = [tokenizer.decode([i]) for i in decode_ids]
    return header
