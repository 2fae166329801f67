"""Surrogate scores (S11): a cheap per-position function fitted to a teacher's log-scores.

A reconstruction score (KVzip, S10.1) needs a second pass over the context. A surrogate
``s_hat_l(x_i)`` predicts it from what layer ``l`` already holds for position ``i`` during
its own prefill, so it costs one small matrix product per layer, needs no second pass, and
applies to generated tokens as they arrive. One module per job:

- ``form``: the features (``kv_features``, ...) and the two forms, ``LinearSurrogate`` and
  KVzap's two-layer ``MLPSurrogate``, with their prediction straight from keys and values.
- ``fit``: ``RidgeStats`` / ``fit_ridge`` (closed form), ``fit_mlp`` (from the linear fit),
  and the held-out checks ``spearman`` and ``kept_overlap``.
- ``fitted``: ``SurrogateScorer``, one model's fitted layers with its identity, recipe,
  metrics and default thresholds per method.
- ``shard``: ``ScorerShard``, a scorer on one tensor-parallel rank.
- ``score``: the score function ``kvzap`` (a row of ``probkv.scores.SCORE_TABLE``).
- ``scorer_file``: ``save_scorer`` / ``load_scorer`` and the scorers shipped in the package.
"""

from probkv.scores.surrogate.fit import (
    RidgeStats,
    fit_mlp,
    fit_ridge,
    keep_count,
    kept_overlap,
    spearman,
)
from probkv.scores.surrogate.fitted import THRESHOLD_METHODS, SurrogateScorer, config_digest
from probkv.scores.surrogate.form import (
    ATTENTION_FEATURE_KINDS,
    FEATURE_KINDS,
    FORM_CLASSES,
    FORM_TENSORS,
    FORMS,
    MIN_LOG_SCORE,
    LinearSurrogate,
    MLPSurrogate,
    key_pair_norms,
    kv_features,
    unrotate_keys,
    unrotated_features,
)
from probkv.scores.surrogate.score import check_scorer, kvzap
from probkv.scores.surrogate.scorer_file import (
    FILE_FORMAT,
    RECIPE_VERSION,
    SCORER_DIR,
    content_digest,
    load_scorer,
    save_scorer,
    scorer_names,
    scorer_tensors,
    shipped_scorers,
)
from probkv.scores.surrogate.shard import ScorerShard

__all__ = [
    "ATTENTION_FEATURE_KINDS",
    "FEATURE_KINDS",
    "FILE_FORMAT",
    "FORMS",
    "FORM_CLASSES",
    "FORM_TENSORS",
    "MIN_LOG_SCORE",
    "RECIPE_VERSION",
    "SCORER_DIR",
    "THRESHOLD_METHODS",
    "LinearSurrogate",
    "MLPSurrogate",
    "RidgeStats",
    "ScorerShard",
    "SurrogateScorer",
    "check_scorer",
    "config_digest",
    "content_digest",
    "fit_mlp",
    "fit_ridge",
    "keep_count",
    "kept_overlap",
    "key_pair_norms",
    "kv_features",
    "kvzap",
    "load_scorer",
    "save_scorer",
    "scorer_names",
    "scorer_tensors",
    "shipped_scorers",
    "spearman",
    "unrotate_keys",
    "unrotated_features",
]
