"""``scope=model`` (S11): one kept set of whole blocks for every layer and KV head.

What a paged KV cache (vLLM's blocks span every layer and head of a request) can free. Shared
by ``TopKPolicy`` (top-k over blocks) and ``ProbabilisticPolicy`` (block pps with
Horvitz-Thompson weights ``-log P_b``); the block maths is ``probkv.sampling.model_blocks``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from probkv import budgets
from probkv.estimation.selection import RaggedSelection
from probkv.sampling import model_blocks
from probkv.scores.observation import LayerObservation

SCOPE = "model"
DEFAULT_BLOCK = 16  # vLLM's default KV block size
DEFAULT_AGGREGATE = "sum"


def check_options(scope: str, block, aggregate, *, where: str) -> tuple[int | None, str | None]:
    """``block`` and ``aggregate`` (defaults filled) with ``scope="model"``; refused by name
    with any other scope, where they could change nothing."""
    if scope != SCOPE:
        for key, value in (("block", block), ("aggregate", aggregate)):
            if value is not None:
                raise ValueError(
                    f"{key}={value!r} is an option of the model-wide scope (scope='model', "
                    f"one kept set of blocks for all layers and heads) of {where}, got "
                    f"scope={scope!r}; omit {key}"
                )
        return None, None
    block = model_blocks.span_designs.check_block(DEFAULT_BLOCK if block is None else block)
    aggregate = model_blocks.check_aggregate(DEFAULT_AGGREGATE if aggregate is None else aggregate)
    return block, aggregate


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
    """The same blocks for every observation, by ``policy``'s ``ratio``, ``block`` and
    ``aggregate``. ``pis``: each layer's ``[H, t]`` proposal (zero at forced entries,
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
