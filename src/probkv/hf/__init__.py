"""Integration with Hugging Face transformers: the evicting cache and the attention function.

Only this subpackage touches transformers' internals. It uses the documented extension points:
a ``Cache`` of cache layers (``CacheLayerMixin`` protocol) and a function registered in
``AttentionInterface`` / ``AttentionMaskInterface`` under the name ``"probkv"``. Nothing is
registered at import time: ``prepare_model`` registers (idempotently) and switches the model.
Verified with transformers==5.24.0 (pinned).
"""

from probkv.hf.api import answer, compress, generate, observe, pad_left
from probkv.hf.cache import ProbKVCache
from probkv.hf.capture import AttentionRecorder, LayerCapture, capture_attention
from probkv.hf.layers import (
    BudgetedBatchLayer,
    BudgetedLayer,
    EvictedLayer,
    EvictingLayer,
    PromptLayer,
    PromptPhase,
)
from probkv.hf.model import SUPPORTED_MODEL_TYPES, check_model_supported, prepare_model
from probkv.hf.reconstruct import RepeatPrompt, reconstruct, repeat_prompt
from probkv.hf.report import LayerReport

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "AttentionRecorder",
    "BudgetedBatchLayer",
    "BudgetedLayer",
    "EvictedLayer",
    "EvictingLayer",
    "LayerCapture",
    "LayerReport",
    "ProbKVCache",
    "PromptLayer",
    "PromptPhase",
    "RepeatPrompt",
    "answer",
    "capture_attention",
    "check_model_supported",
    "compress",
    "generate",
    "observe",
    "pad_left",
    "prepare_model",
    "reconstruct",
    "repeat_prompt",
]
