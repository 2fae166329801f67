"""The score function ``kvzap`` (S11; a row of ``probkv.scores.SCORE_TABLE``): a scorer's
prediction of KVzip's score, with KVzip's forced sinks."""

from __future__ import annotations

import torch

from probkv._checks import check_positive_int
from probkv.scores.functions import FORCED_LOG_SCORE, Scores
from probkv.scores.surrogate.fitted import SurrogateScorer
from probkv.scores.surrogate.shard import ScorerShard


def check_scorer(value: object, name: str) -> SurrogateScorer | ScorerShard:
    if not isinstance(value, (SurrogateScorer, ScorerShard)):
        raise ValueError(
            f"{name} must be a probkv.scores.surrogate.SurrogateScorer (load_scorer(path)), got "
            f"{type(value).__name__}"
        )
    return value


def kvzap(
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    layer_idx: int | None,
    surrogate: SurrogateScorer | ScorerShard | None = None,
    sinks: int = 4,
) -> Scores:
    """The surrogate of KVzip's score (S11): ``surrogate``'s prediction of layer
    ``layer_idx``'s log max reconstruction attention from its keys and values, on KVzip's
    scale (clamped to ``[log FLOOR, 0]``); the first ``sinks`` entries are forced, as KVzip's."""
    if surrogate is None:
        raise ValueError(
            "score 'kvzap' needs a trained scorer: probkv.hf and probkv.vllm load the one "
            "shipped for the model, or pass "
            "score_params={'surrogate': probkv.scores.surrogate.load_scorer(path)}"
        )
    check_scorer(surrogate, "surrogate")
    if layer_idx is None:
        raise ValueError("score 'kvzap' needs the layer index (layer_idx)")
    check_positive_int(sinks, "sinks", allow_zero=True)
    log_scores = surrogate.predict(layer_idx, key, value)
    hkv, t = log_scores.shape
    f = min(sinks, t)
    if f == 0:
        return Scores(log_scores)
    log_scores[:, :f] = FORCED_LOG_SCORE
    forced = torch.zeros(hkv, t, dtype=torch.bool, device=log_scores.device)
    forced[:, :f] = True
    return Scores(log_scores, forced)
