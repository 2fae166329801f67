"""The attention-error experiment: how far evicted attention is from full attention (SPEC S7).

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
  first ``t`` rows are exactly the prefill of ``x``). Each policy selects from those tensors (its scores and
  kept sets computed with ``probkv.scores`` / ``probkv.policies`` exactly as the integration
  would: per layer in head scope, all layers at once in global scope), and the decode query of
  ``d_1`` attends to the kept prefix entries (logits ``+ log w``) and to itself (no weight),
  ``probkv.estimator.corrected_attention``. The reference ``o`` is the same function with every
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

Prompts (:class:`AttentionPrompt`): the ``paper`` format is the paper's Appendix E literally
(``x`` = the plain tokenized text, ``d_1`` = the first token of the question, then the rest of
the question and the full-cache model's greedy continuation); the ``chat`` format puts text and question in
the chat template with the assistant turn opened, and ``d_1..d_N`` are the full-cache model's
greedy answer (end-of-sequence suppressed so there are exactly ``N``).

Capture: a function registered in transformers' ``AttentionInterface`` under
``"probkv_capture"`` wraps the model's own attention implementation for one forward and
records the real tensors it is called with (no forward hooks, no re-projection). The recorder
travels through the forward's keyword arguments, so nothing global holds state.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from probkv import attention as kernels
from probkv import estimator, scores
from probkv._checks import check_choice, check_positive_int, check_ratio, check_tau
from probkv.policies import EvictionPolicy, LayerObservation, ProbabilisticPolicy, TopKPolicy
from probkv.policies.probabilistic import SAMPLERS, SCOPES
from probkv.selection import RaggedSelection

ESTIMATORS = ("topk", "topk_proposal", "uncorrected", "corrected")
PROMPT_FORMATS = ("paper", "chat")
WITH_REPLACEMENT_WEIGHTS = ("counts", "inclusion")
CAPTURE_IMPLEMENTATION = "probkv_capture"
CAPTURE_KWARG = "probkv_capture"
#: Implementations the capture can wrap: both take transformers' SDPA masks.
CAPTURE_INNER = ("sdpa", "probkv")
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


# ------------------------------------------------------------------------------------ capture


@dataclass(frozen=True)
class LayerCapture:
    """What one attention layer computed in a captured forward (batch dimension dropped).

    ``query [Hq, q, d]`` (post-RoPE, the ``q`` new positions), ``key``/``value [Hkv, n, d]``
    (every entry the attention function saw; ``None`` when tensors were not kept), ``output
    [Hq, q, d_v]`` (the layer's attention output before the output projection) and ``scale``
    (the logit scaling the model used).
    """

    layer_idx: int
    query: torch.Tensor | None
    key: torch.Tensor | None
    value: torch.Tensor | None
    output: torch.Tensor
    scale: float


class _Recorder:
    """Collects one forward's captures; travels as the ``probkv_capture`` forward kwarg."""

    def __init__(self, inner: str, keep_tensors: bool) -> None:
        self.inner = inner
        self.keep_tensors = keep_tensors
        self.captures: dict[int, LayerCapture] = {}


def capture_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args,
    probkv_capture: _Recorder | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``"probkv_capture"`` attention implementation: run the recorder's inner
    implementation unchanged and record its real inputs and output."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = ALL_ATTENTION_FUNCTIONS["sdpa" if probkv_capture is None else probkv_capture.inner]
    out, weights = inner(module, query, key, value, attention_mask, *args, **kwargs)
    if probkv_capture is not None:
        scale = kwargs.get("scaling")
        keep = probkv_capture.keep_tensors
        probkv_capture.captures[module.layer_idx] = LayerCapture(
            layer_idx=module.layer_idx,
            query=query[0].detach() if keep else None,
            key=key[0].detach() if keep else None,
            value=value[0].detach() if keep else None,
            output=out[0].transpose(0, 1).detach(),  # [q, Hq, d_v] -> [Hq, q, d_v]
            scale=float(scale) if scale is not None else query.shape[-1] ** -0.5,
        )
    return out, weights


def register_capture() -> None:
    """Register ``"probkv_capture"`` (attention and mask functions; idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from probkv.hf.attention import probkv_mask

    AttentionInterface.register(CAPTURE_IMPLEMENTATION, capture_attention_forward)
    AttentionMaskInterface.register(CAPTURE_IMPLEMENTATION, probkv_mask)


def _as_ids(ids: Sequence[int] | torch.Tensor, name: str) -> torch.Tensor:
    """``[1, n]`` int64 from a list or a ``[n]`` / ``[1, n]`` tensor (n >= 1)."""
    tensor = torch.as_tensor(ids, dtype=torch.int64)
    if tensor.ndim == 2 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.ndim != 1 or tensor.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of token ids, got {ids!r}")
    return tensor.unsqueeze(0)


@torch.no_grad()
def capture_attention(
    model, input_ids: Sequence[int] | torch.Tensor, *, cache=None, keep_tensors: bool = True
) -> list[LayerCapture]:
    """Run one forward of ``model`` on ``input_ids`` and return every attention layer's real
    tensors, in layer order (:class:`LayerCapture`).

    The model's current attention implementation (``"sdpa"`` or ``"probkv"``) computes as
    usual; for this forward only the model is switched to ``"probkv_capture"``, which wraps it.
    ``cache=None`` runs without a cache (``use_cache=False``); otherwise the forward continues
    ``cache`` (e.g. a ``probkv.hf.ProbKVCache`` after ``compress``). ``keep_tensors=False``
    records only the outputs.
    """
    inner = model.config._attn_implementation
    if inner not in CAPTURE_INNER:
        raise ValueError(
            f"capture wraps the attention implementations {', '.join(map(repr, CAPTURE_INNER))}; "
            f"the model uses {inner!r} (load it with attn_implementation='sdpa')"
        )
    ids = _as_ids(input_ids, "input_ids").to(model.device)
    register_capture()
    recorder = _Recorder(inner, keep_tensors)
    model.set_attn_implementation(CAPTURE_IMPLEMENTATION)
    try:
        if cache is None:
            model(input_ids=ids, use_cache=False, **{CAPTURE_KWARG: recorder})
        else:
            model(input_ids=ids, cache=cache, use_cache=True, **{CAPTURE_KWARG: recorder})
    finally:
        model.set_attn_implementation(inner)
    return [recorder.captures[i] for i in sorted(recorder.captures)]


def evicting_layers(model) -> list[int]:
    """Indices of the layers probkv evicts (global attention), as ``ProbKVCache`` picks them."""
    from probkv.hf import ProbKVCache
    from probkv.policies import FullCache

    return list(ProbKVCache(model.config, FullCache()).evicting_layers)


# ------------------------------------------------------------------------------------ prompts


@dataclass(frozen=True)
class AttentionPrompt:
    """The experiment's input.

    ``context_ids``: the prompt ``x`` (``t`` tokens), prefilled and then evicted.
    ``forced_ids``: tokens that follow ``x`` as given, before any generated one (``paper``
    format: the question's tokens, so ``d_1`` is its first token; ``chat``: none, ``d_1`` is the
    model's first answer token). ``source`` and ``format`` describe it for the results header.
    """

    context_ids: tuple[int, ...]
    forced_ids: tuple[int, ...]
    source: str
    format: str

    def __post_init__(self) -> None:
        if not self.context_ids:
            raise ValueError("the prompt x has no tokens")
        check_choice(self.format, PROMPT_FORMATS, "format")


def text_prompt(
    tokenizer, text: str, question: str, *, format: str = "paper", source: str = "text"
) -> AttentionPrompt:
    """The prompt for ``text`` and ``question``.

    ``format="paper"`` (Appendix E): ``x`` = ``text`` tokenized as a plain string (with the
    tokenizer's own special tokens, e.g. a BOS), forced tokens = ``question`` without special
    tokens. ``format="chat"``: ``x`` = the chat template of the user message ``text + "\\n\\n" +
    question`` with the assistant turn opened (plain encoding without a chat template), no forced
    tokens.
    """
    check_choice(format, PROMPT_FORMATS, "format")
    for name, value in (("text", text), ("question", question)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if format == "paper":
        context = tokenizer.encode(text, add_special_tokens=True)
        forced = tokenizer.encode(question, add_special_tokens=False)
    else:
        from probkv.models import chat_prompt_ids

        context = chat_prompt_ids(tokenizer, text + "\n\n" + question)[0].tolist()
        forced = []
    return AttentionPrompt(tuple(context), tuple(forced), source, format)


def paper_prompt(tokenizer, *, format: str = "paper") -> AttentionPrompt:
    """The paper's Appendix E text and question (:mod:`probkv.eval.paper_prompt`)."""
    from probkv.eval.paper_prompt import PAPER_QUESTION, PAPER_TEXT

    return text_prompt(tokenizer, PAPER_TEXT, PAPER_QUESTION, format=format, source="paper")


def haystack_prompt(
    tokenizer, num_tokens: int, *, format: str = "chat", question: str | None = None, seed: int = 0
) -> AttentionPrompt:
    """A long prompt of at most ``num_tokens`` tokens (``x``: chat template included): probkv's
    seeded prose haystack (:mod:`probkv.eval.haystack`) with the Appendix E text inserted at
    the sentence boundary nearest to the middle, then ``question`` (default: Appendix E's).
    The haystack is the largest number of words that fits; the result is within a few tokens
    of ``num_tokens``."""
    from probkv.eval import haystack
    from probkv.eval.paper_prompt import PAPER_QUESTION, PAPER_TEXT

    check_positive_int(num_tokens, "num_tokens")
    question = PAPER_QUESTION if question is None else question
    stream = haystack.word_stream("prose", seed)

    def build(words: int) -> AttentionPrompt:
        text = stream.render(words, [(0.5, PAPER_TEXT)])
        return text_prompt(tokenizer, text, question, format=format, source="haystack")

    best = build(0)
    if len(best.context_ids) > num_tokens:
        raise ValueError(
            f"num_tokens={num_tokens} is too small: the Appendix E text and question alone take "
            f"{len(best.context_ids)} tokens in the {format!r} format"
        )
    lo, hi = 0, None  # lo fits; hi does not (None: not found yet, search upwards)
    step = 64
    while hi is None or hi - lo > 1:
        probe = lo + step if hi is None else (lo + hi) // 2
        candidate = build(probe)
        if len(candidate.context_ids) <= num_tokens:
            lo, best = probe, candidate
            step *= 2
        else:
            hi = probe
    return best


@torch.no_grad()
def decode_tokens(model, prompt: AttentionPrompt, steps: int) -> tuple[int, ...]:
    """``d_1..d_N`` with ``N = steps``: the prompt's forced tokens, then the full-cache model's
    greedy continuation of ``x`` + those (end-of-sequence suppressed, so exactly ``N``)."""
    check_positive_int(steps, "steps")
    forced = prompt.forced_ids[:steps]
    missing = steps - len(forced)
    if missing == 0:
        return tuple(forced)
    ids = torch.tensor([list(prompt.context_ids) + list(forced)], device=model.device)
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=missing,
        min_new_tokens=missing,
        do_sample=False,
        pad_token_id=pad,
    )
    return tuple(forced) + tuple(out[0, ids.shape[1] :].tolist())


# ---------------------------------------------------------------------------------- measuring


def observe(
    capture: LayerCapture, *, score: str, length: int, rank: int, score_params: dict | None = None
) -> LayerObservation:
    """The policy's observation of one layer's prefill from captured tensors: the log-scores of
    ``score`` (S2, S5) over the first ``length`` entries, as the integration computes them."""
    t = length
    query, key, value = capture.query[:, :t], capture.key[:, :t], capture.value[:, :t]
    result = scores.compute_scores(
        score, query, key, value, scale=capture.scale, **(score_params or {})
    )
    last = kernels.attention_rows(
        query[:, -1:],
        key,
        scale=capture.scale,
        row_positions=torch.tensor([t - 1], device=key.device),
    )[:, 0]
    h = key.shape[0]
    return LayerObservation(
        layer_idx=capture.layer_idx,
        rank=rank,
        log_scores=result.log_scores,
        forced=result.forced,
        last_query_attention=last.float().view(h, -1, t).mean(1),
    )


def select(
    policy: EvictionPolicy, observations: Sequence[LayerObservation]
) -> list[RaggedSelection]:
    """The policy's selections, called as ``ProbKVCache`` calls it: one layer at a time when
    the policy is layerwise (head scope: same random streams as the integration), else all
    layers at once (global scope, S3)."""
    n = len(observations)
    if policy.layerwise:
        return [policy.select([obs], num_layers=n)[0] for obs in observations]
    return policy.select(list(observations), num_layers=n)


def prefix_log_weights(selection: RaggedSelection, length: int) -> torch.Tensor:
    """``[Hkv, t]`` float32: each kept entry's log-weight (0 without correction), ``-inf`` for
    evicted entries (excluded from the softmax)."""
    heads = torch.repeat_interleave(torch.arange(selection.num_heads), selection.lengths)
    out = torch.full((selection.num_heads, length), -math.inf)
    lw = selection.log_weights
    out[heads, selection.indices] = 0.0 if lw is None else lw.float()
    return out


def decode_output(capture: LayerCapture, log_weights: torch.Tensor, position: int) -> torch.Tensor:
    """``[Hq, d_v]`` float32: the output of captured query row ``position`` (``>= t``) over the
    prefix entries ``0..t-1`` with ``log_weights [Hkv, t]`` (S4; ``-inf`` = evicted) and every
    entry ``t..position`` with no weight, one softmax (``estimator.corrected_attention``)."""
    h, t = log_weights.shape
    n = position + 1
    if not t <= position < capture.key.shape[1]:
        raise ValueError(f"position must be in [{t}, {capture.key.shape[1]}), got {position}")
    device = capture.key.device
    lw = torch.cat([log_weights.to(device), torch.zeros(h, n - t, device=device)], dim=1)
    query = capture.query[:, position : position + 1].float()
    out = estimator.corrected_attention(
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
        ``ProbabilisticPolicy.weights`` value; pps ignores it)."""
        if self.estimator in ("topk", "topk_proposal"):
            return TopKPolicy(score=self.proposal, ratio=ratio)
        return ProbabilisticPolicy(
            score=self.proposal,
            ratio=ratio,
            scope=scope,
            sampler=self.sampler,
            weights=weights_field,
            tau=1.0 if self.tau is None else self.tau,
            correct=self.tau is not None,
            seed=seed,
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
    taus = [check_tau(tau, "taus") for tau in taus]
    if any(math.isinf(tau) for tau in taus):
        raise ValueError("taus must be finite (tau = inf is the uncorrected estimator, reported)")
    check_positive_int(seeds, "seeds")
    check_positive_int(steps, "steps", allow_zero=True)
    check_choice(proposal, scores.SCORE_NAMES, "proposal")
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
    from probkv.hf import prepare_model

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
    context = _as_ids(context_ids, "context_ids")[0]
    decode = _as_ids(decode_ids, "decode_ids")[0]
    n_steps = max(steps, 1)
    if decode.numel() < n_steps:
        raise ValueError(f"decode_ids has {decode.numel()} tokens; steps={steps} needs {n_steps}")
    prepare_model(model)
    t = context.numel()
    layers = evicting_layers(model)
    captures = capture_attention(model, torch.cat([context, decode[:n_steps]]))
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
            results: dict[_Estimate, tuple[list[float], list[float]]] = {
                e: ([], []) for e in estimates
            }
            for seed in range(seeds):
                kept_set = None  # what uncorrected kept at this seed; corrected must keep it
                for est in estimates:
                    if est.deterministic and seed > 0:
                        continue  # top-k does not depend on the seed: computed once
                    error, effective, kept = run(est.policy(ratio, seed, scope, weights_field))
                    if not est.deterministic:
                        kept_set = kept if kept_set is None else kept_set
                        _check_same_kept(kept_set, kept)
                    results[est][0].append(error)
                    results[est][1].append(effective)
            rows += [_row(e, ratio, step, *results[e], num_heads) for e in estimates]
            if progress is not None:
                progress(f"step {step}, ratio {ratio}: done")
    return rows


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
    from probkv.hf import compress

    cache = compress(model, context, policy)
    per_step = []
    for n in range(decode.numel()):
        captures = capture_attention(model, decode[n : n + 1], cache=cache, keep_tensors=False)
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
        "experiment": "attention-error (SPEC S7, paper Eq. 11 / Figure 2)",
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
