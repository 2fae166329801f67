"""Which entries a KV head keeps (S3, S9, S10, S11).

The samplers, re-exported here, are in :mod:`probkv.sampling.samplers` (with replacement,
pps inclusion probabilities per head and global, systematic sampling); the number of samples
of a with-replacement eviction in :mod:`probkv.sampling.sample_size` (Algorithm 2); the
span-preserving pps designs in :mod:`probkv.sampling.span_designs` (S10.2-S10.4); model-wide
blocks in :mod:`probkv.sampling.model_blocks` (S11).
"""

from probkv.sampling.samplers import (
    MAX_EXACT_COUNT,
    ROW_SUM_TOL,
    SNAP,
    Count,
    Probabilities,
    capped,
    capped_scale,
    pps_inclusion_probabilities,
    pps_inclusion_probabilities_global,
    row_masses,
    sample_counts,
    systematic_sample,
    systematic_sample_ordered,
)

__all__ = [
    "MAX_EXACT_COUNT",
    "ROW_SUM_TOL",
    "SNAP",
    "Count",
    "Probabilities",
    "capped",
    "capped_scale",
    "pps_inclusion_probabilities",
    "pps_inclusion_probabilities_global",
    "row_masses",
    "sample_counts",
    "systematic_sample",
    "systematic_sample_ordered",
]
