"""Which models probkv supports, and switching a model to probkv's attention function."""

from __future__ import annotations

import inspect
import types

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.models.llama.modeling_llama import LlamaModel

from probkv.hf import guards
from probkv.hf.attention import ATTN_IMPLEMENTATION, probkv_attention_forward, probkv_mask
from probkv.hf.cache import ProbKVCache

# model_type -> what probkv evicts. Gemma-3 keeps its sliding-window (local) layers as they are.
SUPPORTED_MODEL_TYPES = {
    "llama": "all layers",
    "mistral": "all layers (sliding_window must be None)",
    "qwen2": "global-attention layers",
    "qwen3": "global-attention layers (QK-norm)",
    "gemma3_text": "global-attention layers; sliding-window layers are kept",
}
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

# transformers 5.24 renamed the forward and ``generate`` argument ``past_key_values`` to
# ``cache`` (the old name still works there, deprecated); 5.19, the newest vLLM 0.32 accepts,
# knows only ``past_key_values`` and would put ``cache=`` into ``**kwargs`` unread, so the
# cache would silently not be used. A prepared model takes ``cache=`` on every supported
# version: on the older ones its ``forward`` and ``generate`` pass it on under the old name.
CACHE_ARGUMENT = (
    "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
)


def check_model_supported(model) -> None:
    """Refuse, by name, any model probkv has not been verified on."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"probkv does not support model type {model_type!r} ({type(model).__name__}); "
            f"supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"{model_type} with attn_logit_softcapping={config.attn_logit_softcapping} is not supported"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{model_type} with use_bidirectional_attention=True is not supported")
    layer_types = getattr(config, "layer_types", None)
    sliding = getattr(config, "sliding_window", None)
    if model_type == "mistral" and sliding is not None:
        raise ValueError(
            f"mistral with sliding_window={sliding}: every layer uses a sliding window, so there is "
            "no global-attention layer to evict"
        )
    if layer_types is not None and "full_attention" not in layer_types:
        raise ValueError(f"{model_type}: no global-attention layer in layer_types={layer_types}")
    if model.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"model dtype {model.dtype} is not supported; use float32 or bfloat16")


def register_attention() -> None:
    """Register the ``"probkv"`` attention and mask functions (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, probkv_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, probkv_mask)


def prepare_model(model):
    """Check ``model`` is supported and switch it to ``attn_implementation="probkv"``.

    With a plain cache (or none) the model then computes exactly what SDPA computes; with a
    ``ProbKVCache`` its global-attention layers are evicted and corrected. ``model.generate``
    then shows a ``ProbKVCache`` the whole prompt before transformers slices off what the
    cache holds, so a prompt that does not continue it is refused by name, and the cache
    records the ids it holds afterwards (``ProbKVCache.before_generate``). Returns the model.
    """
    check_model_supported(model)
    register_attention()
    if attention_implementation(model) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if getattr(model.generate, "__func__", None) is not _checked_generate:
        model.generate = types.MethodType(_checked_generate, model)
    if CACHE_ARGUMENT != "cache" and getattr(model.forward, "__func__", None) is not _forward:
        model.forward = types.MethodType(_forward, model)
    return model


def _renamed(kwargs: dict) -> dict:
    """``kwargs`` with ``cache=`` passed under this transformers' own name (``CACHE_ARGUMENT``)."""
    if CACHE_ARGUMENT == "cache" or "cache" not in kwargs:
        return kwargs
    if kwargs.get(CACHE_ARGUMENT) is not None:
        raise ValueError(f"pass the cache once: got both cache= and {CACHE_ARGUMENT}=")
    kwargs = dict(kwargs)
    kwargs[CACHE_ARGUMENT] = kwargs.pop("cache")
    return kwargs


def _forward(self, *args, **kwargs):
    """``forward`` of a prepared model on a transformers before 5.24 (``CACHE_ARGUMENT``).
    Those versions pass no attention kwargs to ``cache.update``, where the cache checks that
    the input continues what it holds (``guards.check_continues``): the check runs here."""
    kwargs = _renamed(kwargs)
    cache = kwargs.get(CACHE_ARGUMENT)
    if isinstance(cache, ProbKVCache):
        guards.check_continues(cache.get_seq_length(), kwargs)
    return type(self).forward(self, *args, **kwargs)


def _checked_generate(self, *args, **kwargs):
    """``generate`` of a prepared model (``prepare_model``): the class's own, with the cache's
    checks of the prompt's ids before and its record of them after."""
    kwargs = _renamed(kwargs)
    cache = kwargs.get(CACHE_ARGUMENT)
    ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if isinstance(cache, ProbKVCache):
        guards.check_no_copies(kwargs.get("generation_config") or self.generation_config, kwargs)
    tracks = isinstance(cache, ProbKVCache) and isinstance(ids, torch.Tensor)
    tracks = tracks and cache.before_generate(ids, kwargs.get("attention_mask"))
    out = type(self).generate(self, *args, **kwargs)
    if tracks:
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        if sequences.ndim == 2 and sequences.shape[0] == ids.shape[0]:
            cache.after_generate(sequences)
    return out


def attention_implementation(model) -> str:
    """The attention implementation ``model`` runs (transformers keeps it in the config's
    ``_attn_implementation``, which ``set_attn_implementation`` writes: read here only)."""
    return model.config._attn_implementation


def is_prepared(model) -> bool:
    return attention_implementation(model) == ATTN_IMPLEMENTATION
