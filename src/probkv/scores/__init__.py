"""The eviction scores (S2, S5, S6, S10, S11).

The score table (``SCORE_TABLE``, ``compute_scores`` and what derives from the table) is in
:mod:`probkv.scores.table` and re-exported here with the score functions of
:mod:`probkv.scores.functions`, :mod:`probkv.scores.reconstruction` and
:mod:`probkv.scores.surrogate` (docs/architecture.md lists every module of the package).
"""

from probkv.scores.functions import (
    FORCED_LOG_SCORE,
    SNAPKV_GQA,
    SNAPKV_POOLING,
    Scores,
    h2o,
    h2o_harmonic,
    knorm,
    min_variance,
    min_variance_harmonic,
    snapkv,
    streaming_llm,
    tova,
    uniform,
)
from probkv.scores.reconstruction import (
    h2o_reconstruction,
    kvzip,
    min_reconstruction,
)
from probkv.scores.surrogate import (
    kvzap,
)
from probkv.scores.table import (
    RECONSTRUCTION_SCORES,
    SCORE_INPUTS,
    SCORE_NAMES,
    SCORE_SOURCES,
    SCORE_TABLE,
    Param,
    ScoreSpec,
    column_sums_needed,
    compute_scores,
    default_params,
    last_query_rows,
    needs_reconstruction,
    on_attention_scale,
    score_param_names,
    score_spec,
    tensor_param_names,
    validate_params,
)

__all__ = [
    "FORCED_LOG_SCORE",
    "RECONSTRUCTION_SCORES",
    "SCORE_INPUTS",
    "SCORE_NAMES",
    "SCORE_SOURCES",
    "SCORE_TABLE",
    "SNAPKV_GQA",
    "SNAPKV_POOLING",
    "Param",
    "ScoreSpec",
    "Scores",
    "column_sums_needed",
    "compute_scores",
    "default_params",
    "h2o",
    "h2o_harmonic",
    "h2o_reconstruction",
    "knorm",
    "kvzap",
    "kvzip",
    "last_query_rows",
    "min_reconstruction",
    "min_variance",
    "min_variance_harmonic",
    "needs_reconstruction",
    "on_attention_scale",
    "score_param_names",
    "score_spec",
    "snapkv",
    "streaming_llm",
    "tensor_param_names",
    "tova",
    "uniform",
    "validate_params",
]
