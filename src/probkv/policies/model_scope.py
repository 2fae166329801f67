"""``scope=model`` (S11): one kept set of whole blocks for every layer and KV head.

What a paged KV cache (vLLM's blocks span every layer and head of a request) can free. Shared
by ``TopKPolicy`` (top-k over blocks) and ``ProbabilisticPolicy`` (block pps with
Horvitz-Thompson weights ``-log P_b``); the block maths is ``probkv.sampling.model_blocks``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from probkv import budgets
from probkv._checks import check_positive_int
from probkv.estimation.selection import RaggedSelection
from probkv.sampling import model_blocks
from probkv.scores.observation import LayerObservation

SCOPE = "model"
DEFAULT_BLOCK = 16  # vLLM's default KV block size
DEFAULT_AGGREGATE = "sum"
DEFAULTS: dict[str, object] = {
    "block": DEFAULT_BLOCK,
    "aggregate": DEFAULT_AGGREGATE,
    "sink_blocks": 1,  # the sinks' block: streaming_llm and every score keep it
    "recent_tokens": 0,
}


OPTIONS = ("block", "aggregate", "sink_blocks", "recent_tokens")
"""The options of the model-wide scope, ``None`` (not set) with any other scope."""


def check_options(scope: str, *, where: str, **given) -> dict[str, object]:
    """The model scope's ``OPTIONS`` from ``given`` (``None``: the default) with
    ``scope="model"``; refused by name with any other scope, where they could change nothing.
    ``sink_blocks``: the first blocks kept by rule (attention sinks); ``recent_tokens``: the
    last positions whose blocks are kept by rule; both count in the budget."""
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise TypeError(f"unknown model-scope option {unknown[0]!r}; valid: {', '.join(OPTIONS)}")
    values = {key: given.get(key) for key in OPTIONS}
    if scope != SCOPE:
        for key, value in values.items():
            if value is not None:
                raise ValueError(
                    f"{key}={value!r} is an option of the model-wide scope (scope='model', "
                    f"one kept set of blocks for all layers and heads) of {where}, got "
                    f"scope={scope!r}; omit {key}"
                )
        return values
    filled = {key: DEFAULTS[key] if value is None else value for key, value in values.items()}
    model_blocks.span_designs.check_block(filled["block"])
    model_blocks.check_aggregate(filled["aggregate"])
    check_positive_int(filled["sink_blocks"], "sink_blocks", allow_zero=True)
    check_positive_int(filled["recent_tokens"], "recent_tokens", allow_zero=True)
    return filled


def common_length(observations: Sequence[LayerObservation]) -> int:
    lengths = {obs.length for obs in observations}
    if len(lengths) != 1:
        raise ValueError(
            f"scope='model' keeps one set of positions for every layer: it needs every layer "
            f"observed over the same prefix, got lengths {sorted(lengths)}"
        )
    return lengths.pop()


def select(
    observations: Sequence[LayerObservation],
    pis: Sequence[torch.Tensor],
    policy,
    *,
    choose: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]],
    tau: float = 1.0,
) -> list[RaggedSelection]:
    """The same blocks for every observation, by ``policy``'s ``ratio`` and model-scope
    ``OPTIONS``; the protected blocks (``model_blocks.protected_blocks``) join the forced ones. ``pis``: each layer's ``[H, t]`` proposal (zero at forced entries,
    ``obs.forced``); the last block, when partial, is forced too: a paged cache writes the next
    tokens into it, so an engine that lists only the kept blocks (S12) must keep it; ``choose(mass, forced, k)`` gives the kept blocks (bool ``[K]``) and their
    inclusion probabilities (``None``: no weights); the log-weights are ``-log P_b / tau``."""
    block = policy.block
    t = common_length(observations)
    mass = model_blocks.block_masses(pis, block, policy.aggregate)
    forced = model_blocks.forced_blocks([obs.forced for obs in observations], t, block)
    if t % block:  # the last, partial block takes the next tokens in a paged cache (S12)
        forced[-1] = True
    k = model_blocks.block_budget(budgets.uniform_budget(t, policy.ratio), t, block)
    forced |= model_blocks.protected_blocks(
        t, block, k, sink_blocks=policy.sink_blocks, recent_tokens=policy.recent_tokens
    )
    kept_blocks, inclusion = choose(mass, forced, k)
    kept = model_blocks.expand(kept_blocks, t, block)
    logw = None
    if inclusion is not None:
        logw = -model_blocks.expand(inclusion, t, block).log() / tau
        logw = torch.where(kept, logw, 0.0).float()
    out = []
    for obs in observations:
        h, device = obs.num_heads, obs.log_scores.device
        mask = kept.to(device).expand(h, t)
        w = None if logw is None else logw.to(device).expand(h, t)
        out.append(RaggedSelection.from_masks(mask, w))
    return out
