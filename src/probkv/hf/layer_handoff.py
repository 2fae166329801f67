"""How an evicting layer reaches probkv's attention function within one layer's forward.

transformers calls ``cache.update(...)`` and then the registered attention function, and
gives the function no reference to the cache. From 5.24 on, ``update`` receives the forward's
attention kwargs (``kwargs=``), the dict later unpacked into the attention function: the
layer puts itself into it under ``KWARGS_KEY``. Earlier versions (5.19, the newest vLLM 0.32
accepts) pass no kwargs; the layer is then left in a per-thread slot that the attention
function of the same layer index takes, once (a layer's ``update`` and its attention run
back to back in one thread, and a layer refuses a second ``update`` before its attention).
"""

from __future__ import annotations

import threading

KWARGS_KEY = "probkv_layer"
_slot = threading.local()


def hand_over(layer, attention_kwargs: dict | None) -> None:
    """Make ``layer`` the one the next attention call of its layer index reads."""
    if attention_kwargs is not None:
        attention_kwargs[KWARGS_KEY] = layer
    else:
        _slot.layer = layer


def take(module, handed):
    """The evicting layer for this attention call: ``handed`` through the kwargs, else the
    one left in the slot for this module's layer index (taken once), else ``None``."""
    if handed is not None:
        return handed
    layer = getattr(_slot, "layer", None)
    if layer is None or layer.layer_idx != getattr(module, "layer_idx", None):
        return None
    _slot.layer = None
    return layer
