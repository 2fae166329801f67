"""Where a prompt ends: one forward or several (chunked prefill; S2).

``generate(..., prefill_chunk_size=N)`` and forward loops may read a long prompt in several
forwards, so that the prefill's peak memory is one chunk's attention. Eviction must still see
the whole prompt. An ``EvictingLayer`` therefore stays in ``PREFILL`` while the prompt is being
read: each chunk's rows attend to every earlier entry, exactly like the one-pass kernel, and
``probkv.scores.observation.PrefillStatistics`` accumulates what the score needs (column sums over
all rows; the last rows a score reads). The observation equals the one-pass observation of the
whole prompt; eviction follows it.

How the cache knows the prompt ended:

- ``ProbKVCache(config, policy, prompt_length=N)`` (``probkv.hf.compress`` and ``observe``
  pass it): the prompt is the first ``N`` tokens, in one forward or several. Each layer is
  observed during its last chunk, and a layerwise policy evicts it right there (the full
  cache of all layers never exists at once). Every score accumulates exactly.
- Without ``prompt_length`` (e.g. ``model.generate(ids, cache=ProbKVCache(...))``): every
  prefill forward leaves a provisional observation of the prompt so far (``OBSERVED``). A
  further forward of several tokens is another chunk of the prompt (the layers go back to
  ``PREFILL``); the prompt ends at the first forward of a single token (``generate``'s first
  decode step), at ``cache.end_prefill()`` or at ``cache.evict()``. Consequences: a last
  chunk of a single token counts as the first decode step; a forward loop that feeds a
  context and then a question must call ``cache.end_prefill()`` in between to evict before
  the question (``compress`` + ``answer`` do this); and ``h2o-h`` and ``min-h``, whose
  harmonic row weights depend on the prompt's final length, refuse a second chunk (the error
  names the score and asks for ``prompt_length``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from probkv.policies.base import EvictionPolicy, validate_common
from probkv.scores.observation import LayerObservation, PrefillStatistics, observe_layer


@dataclass
class PromptReading:
    """An ``EvictingLayer``'s reading of its prompt, owned by this module and the layer.

    ``length``: the prompt's length if known (``prompt_length``; of a left-padded batch, its
    padded length); ``pads``: each sequence's left padding (``[0]`` for one unpadded
    prompt), read from the attention mask at the first prompt forward; ``chunks``: per
    sequence, the statistics of the chunks seen so far (a prompt read in several forwards);
    ``complete``: the observation covers the whole prompt; ``observations``: per sequence,
    held until eviction (a provisional one is computed from ``chunks`` when first read);
    ``last_query_attention``: ``p_t`` kept from the prefill of a reconstruction score until
    its pass has run (S10.1)."""

    length: int | None = None
    chunks: list[PrefillStatistics] | None = None
    complete: bool = False
    observations: list[LayerObservation] | None = None
    last_query_attention: torch.Tensor | None = None
    pads: list[int] | None = None


def prompt_pads(mask: torch.Tensor | None, batch: int, t: int) -> list[int]:
    """Each sequence's left padding in a prompt forward over ``t`` entries, from the 4D mask
    the attention function receives (``[B, 1, q, t]``, bool or additive; ``None``: nothing is
    padded). The last query row sees every entry of its sequence but the padding; padding
    anywhere but on the left (right padding, holes) is refused by name."""
    if mask is None:
        return [0] * batch
    last = mask[:, 0, -1, -t:]
    real = last if last.dtype == torch.bool else last == 0
    pads = []
    for b in range(batch):
        p = int((~real[b]).sum())
        if p >= t or not bool(real[b, p:].all()):
            raise ValueError(
                f"sequence {b} of the batch is not left-padded (its attention mask has "
                f"{t - p} ones of {t}, not all at the end): probkv evicts batches padded on "
                "the left, as transformers pads for generation (tokenizer padding_side='left')"
            )
        pads.append(p)
    return pads


def observe_prompt_chunk(
    layer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """A prefill forward of a ``PromptLayer`` in phase ``PREFILL``: its attention output,
    and the observation once the prompt is known to end here, or provisionally when its end
    is unknown (module docstring). ``query [B, Hq, q, d]``: the chunk's rows; ``key``/``value
    [B, Hkv, t, d]``: every entry so far, the chunk's last; ``mask``: the forward's 4D
    attention mask (left padding, ``prompt_pads``). Each sequence is observed alone on its
    rows without padding, exactly as it would be in a batch of one (S11 batches: no statistic
    pools across sequences); padding rows get a zero output."""
    batch, _, q, _ = query.shape
    t = key.shape[2]
    reading: PromptReading = layer.prompt
    pads = prompt_pads(mask, batch, t)
    if reading.pads is None:
        reading.pads = pads
    elif pads != reading.pads:
        raise ValueError(
            f"a prompt chunk is padded differently ({pads}) from the first ({reading.pads}): "
            "only the prompt's start may be padded"
        )
    final = reading.length is not None and t == reading.length
    outs, observations = [], []
    for b, pad in enumerate(pads):
        start = max(0, pad - (t - q))  # the chunk's first row that is not padding
        if start >= q:
            raise ValueError(
                f"sequence {b} is padded over a whole prompt chunk ({pad} padding tokens): "
                "read a padded batch's prompt in one forward or in longer chunks"
            )
        out, observation = _observe_sequence(
            layer, b, query[b, :, start:], key[b, :, pad:], value[b, :, pad:], scale, final
        )
        if start:
            out = torch.cat([out.new_zeros(out.shape[0], start, out.shape[2]), out], dim=1)
        outs.append(out)
        observations.append(observation)
    if final:
        layer.observed(observations)
    elif reading.length is None:
        # Provisional (the prompt may go on): computed from the statistics only if read.
        layer.observed(None, final=False)
    return torch.stack(outs)


def _observe_sequence(layer, b: int, query, key, value, scale: float, final: bool):
    """Sequence ``b``'s chunk (no padding): its output, and its observation if ``final``."""
    reading: PromptReading = layer.prompt
    policy = layer.policy
    if reading.chunks is None and final:
        # The whole prompt in one forward (the usual case): observed in one pass.
        return observe_layer(
            query,
            key,
            value,
            scale=scale,
            score=policy.score,
            score_params=policy.score_params,
            layer_idx=layer.layer_idx,
            rank=layer.rank,
        )
    if reading.chunks is None:
        reading.chunks = [
            PrefillStatistics(
                policy.score,
                policy.score_params,
                scale,
                prompt_length=None if reading.length is None else reading.length - pad,
            )
            for pad in reading.pads
        ]
    chunks = reading.chunks[b]
    out = chunks.add_chunk(query, key, value)
    if not final:
        return out, None
    return out, chunks.observe(key, value, query=query, layer_idx=layer.layer_idx, rank=layer.rank)


@dataclass(frozen=True)
class ObserveOnly(EvictionPolicy):
    """Observes ``score`` during prefill and defers eviction to ``ProbKVCache.evict(policy)``:
    one prefill, then a copy of the observed cache per method (see ``probkv.hf.observe``)."""

    def __post_init__(self) -> None:
        validate_common(self)

    @property
    def layerwise(self) -> bool:
        return False

    def select(self, observations, *, num_layers):
        raise ValueError(
            "this cache was only observed (probkv.hf.observe): call cache.evict(policy) with "
            "a policy that observes the same score before generating"
        )
