"""Recording what probkv's attention function computes, for experiments (S7).

A forward of a prepared model (``probkv.hf.prepare_model``) may carry an ``AttentionRecorder``
as the keyword argument ``probkv_capture``; transformers hands it to the attention function
with the other attention kwargs, and ``probkv.hf.attention.probkv_attention_forward`` gives it
every layer's real post-RoPE query, key and value and its output, whichever path computed
them (SDPA without a ``ProbKVCache``, prefill observation, or evicted decode attention). No
forward hooks, no re-projection, no other attention implementation: a captured forward is an
ordinary probkv forward. The recorder travels with the forward, so nothing global holds state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from probkv.hf.api import as_token_ids
from probkv.hf.model import attention_implementation, is_prepared

CAPTURE_KWARG = "probkv_capture"


@dataclass(frozen=True)
class LayerCapture:
    """What one attention layer computed in a captured forward (batch dimension dropped).

    ``query [Hq, q, d]`` (post-RoPE, the ``q`` new positions), ``key``/``value [Hkv, n, d]``
    (every entry the attention function saw: for an evicted layer, its dense tail; ``None``
    when tensors were not kept), ``output [Hq, q, d_v]`` (the layer's attention output before
    the output projection) and ``scale`` (the logit scaling the model used).
    """

    layer_idx: int
    query: torch.Tensor | None
    key: torch.Tensor | None
    value: torch.Tensor | None
    output: torch.Tensor
    scale: float


class AttentionRecorder:
    """Collects one forward's ``LayerCapture`` per layer (``probkv_capture`` forward kwarg)."""

    def __init__(self, keep_tensors: bool = True) -> None:
        self.keep_tensors = keep_tensors
        self.captures: dict[int, LayerCapture] = {}

    def record(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        scale: float,
    ) -> None:
        """Called by the attention function with batch-free tensors (``output [Hq, q, d_v]``)."""
        keep = self.keep_tensors
        self.captures[layer_idx] = LayerCapture(
            layer_idx=layer_idx,
            query=query.detach() if keep else None,
            key=key.detach() if keep else None,
            value=value.detach() if keep else None,
            output=output.detach(),
            scale=float(scale),
        )


@torch.no_grad()
def capture_attention(
    model, input_ids: Sequence[int] | torch.Tensor, *, cache=None, keep_tensors: bool = True
) -> list[LayerCapture]:
    """Run one forward of a prepared ``model`` on ``input_ids`` and return every attention
    layer's real tensors, in layer order (:class:`LayerCapture`).

    ``cache=None`` runs without a cache (``use_cache=False``: exactly SDPA's computation);
    otherwise the forward continues ``cache`` (e.g. a ``ProbKVCache`` after ``compress``).
    ``keep_tensors=False`` records only the outputs.
    """
    if not is_prepared(model):
        raise ValueError(
            "capture records probkv's attention function: call probkv.hf.prepare_model(model) "
            f"first (the model uses {attention_implementation(model)!r})"
        )
    ids = as_token_ids(torch.as_tensor(input_ids, dtype=torch.int64)).to(model.device)
    recorder = AttentionRecorder(keep_tensors)
    if cache is None:
        model(input_ids=ids, use_cache=False, **{CAPTURE_KWARG: recorder})
    else:
        model(input_ids=ids, cache=cache, use_cache=True, **{CAPTURE_KWARG: recorder})
    return [recorder.captures[i] for i in sorted(recorder.captures)]
