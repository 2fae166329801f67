"""Eviction methods as small declarative objects, and the registry of their names."""

from probkv.policies.base import EvictionPolicy, LayerObservation
from probkv.policies.probabilistic import ProbabilisticPolicy
from probkv.policies.registry import FullCache, method_name, method_names, parse_method
from probkv.policies.topk import TopKPolicy

__all__ = [
    "EvictionPolicy",
    "FullCache",
    "LayerObservation",
    "ProbabilisticPolicy",
    "TopKPolicy",
    "method_name",
    "method_names",
    "parse_method",
]
