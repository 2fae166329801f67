"""Decode-time correction (S4, S9).

The importance log-weights and the corrected attention, re-exported here, are in
:mod:`probkv.estimation.correction`; calibrated weights in
:mod:`probkv.estimation.calibration`; a layer's kept entries and their weights
(``RaggedSelection``) in :mod:`probkv.estimation.selection`.
"""

from probkv.estimation.correction import (
    compose_log_weights,
    corrected_attention,
    corrected_attention_reference,
    counts_log_weights,
    inclusion_log_weights,
    kish_effective_sample_size,
    pps_log_weights,
    ragged_corrected_attention,
)
from probkv.sampling import (
    Count,
)

__all__ = [
    "Count",
    "compose_log_weights",
    "corrected_attention",
    "corrected_attention_reference",
    "counts_log_weights",
    "inclusion_log_weights",
    "kish_effective_sample_size",
    "pps_log_weights",
    "ragged_corrected_attention",
]
