"""A surrogate scorer on one tensor-parallel rank (S11): its KV heads' share of every head's
prediction, summed over the ranks by a given all-reduce."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from probkv.scores.surrogate.fitted import SurrogateScorer
from probkv.scores.surrogate.form import MIN_LOG_SCORE, finish, folded_map, predict_kv


@dataclass(frozen=True)
class ScorerShard:
    """A ``SurrogateScorer`` on one tensor-parallel rank, which holds KV heads
    ``[first, first + count)`` of every layer while each head's prediction reads every KV head
    (S11). The linear term (and, in the MLP form, the hidden layer's input) is a sum over the
    heads' features, so the rank computes its heads' share of it (``partial``, ``[t, Hkv]``, or
    ``[t, Hkv + h]`` for ``h`` hidden units), ``all_reduce`` sums the ranks' shares (over the
    TP group: ``Hkv`` (+ ``h``) floats per position and layer, not the features), every rank
    applies the rest (the GELU layer), and keeps its own heads' rows: the unsplit prediction,
    up to the order of the sum."""

    scorer: SurrogateScorer
    first: int
    count: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor]

    @property
    def name(self) -> str:
        return self.scorer.name

    def partial(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``[t, Hkv]`` (MLP form: ``[t, Hkv + h]``) float32: this rank's heads'
        (``key``/``value [count, t, d]``) terms of every head's linear prediction (and of the
        hidden layer's input), without the intercepts."""
        fit = self.scorer.check_layer(layer_idx)
        if key.ndim != 3 or key.shape[0] != self.count:
            raise ValueError(
                f"a rank holding KV heads {self.first}..{self.first + self.count - 1} needs "
                f"keys [{self.count}, t, d], got {tuple(key.shape)}"
            )
        return predict_kv(fit, key, value, heads=slice(self.first, self.first + self.count))

    def predict(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """This rank's heads' predicted log-scores ``[count, t]`` (``SurrogateScorer.predict``
        of the unsplit layer, these heads' rows)."""
        fit = self.scorer.check_layer(layer_idx)
        total = self.all_reduce(self.partial(layer_idx, key, value))
        out = finish(fit, total + folded_map(fit)[1].to(total.device))
        own = out[:, self.first : self.first + self.count]
        return own.T.clamp(MIN_LOG_SCORE, 0.0).contiguous()
