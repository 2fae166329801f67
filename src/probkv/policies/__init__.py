"""Eviction methods as small declarative objects, and the registry of their names."""

from probkv.policies.base import (
    DEFAULT_SCORE_PARAMS,
    EvictionPolicy,
    LayerObservation,
    select_layers,
)
from probkv.policies.probabilistic import ProbabilisticPolicy
from probkv.policies.registry import (
    FullCache,
    method_name,
    method_names,
    method_options,
    parse_method,
    top_k_versions,
)
from probkv.policies.topk import TopKPolicy

__all__ = [
    "DEFAULT_SCORE_PARAMS",
    "EvictionPolicy",
    "FullCache",
    "LayerObservation",
    "ProbabilisticPolicy",
    "TopKPolicy",
    "method_name",
    "method_names",
    "method_options",
    "parse_method",
    "select_layers",
    "top_k_versions",
]
