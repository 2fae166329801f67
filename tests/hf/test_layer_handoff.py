"""probkv.hf.layer_handoff and the transformers-version shim of probkv.hf.model: on every supported
transformers (5.19, which vLLM 0.32 needs, to 5.24) a prepared model takes ``cache=`` and its
evicting layers reach probkv's attention function."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaModel

from probkv.hf import ProbKVCache, layer_handoff, prepare_model
from probkv.hf import model as model_module
from probkv.models.testing import tiny_model
from probkv.policies import parse_method


def test_the_kwargs_dict_carries_the_layer_when_transformers_passes_one():
    layer, kwargs = SimpleNamespace(layer_idx=3), {}
    layer_handoff.hand_over(layer, kwargs)
    assert kwargs[layer_handoff.KWARGS_KEY] is layer
    assert (
        layer_handoff.take(SimpleNamespace(layer_idx=3), kwargs[layer_handoff.KWARGS_KEY]) is layer
    )


def test_the_slot_hands_the_layer_once_and_only_to_its_own_layer_index():
    layer = SimpleNamespace(layer_idx=2)
    layer_handoff.hand_over(layer, None)
    assert layer_handoff.take(SimpleNamespace(layer_idx=5), None) is None  # another layer: not its
    assert layer_handoff.take(SimpleNamespace(layer_idx=2), None) is layer
    assert layer_handoff.take(SimpleNamespace(layer_idx=2), None) is None  # taken once


def test_the_cache_argument_is_this_transformers_own_name():
    params = inspect.signature(LlamaModel.forward).parameters
    assert model_module.CACHE_ARGUMENT in params
    expected = "cache" if "cache" in params else "past_key_values"
    assert expected == model_module.CACHE_ARGUMENT


def test_cache_and_its_old_name_together_are_refused():
    if model_module.CACHE_ARGUMENT == "cache":
        assert model_module._renamed({"cache": 1}) == {"cache": 1}
        return
    with pytest.raises(ValueError, match="pass the cache once"):
        model_module._renamed({"cache": 1, "past_key_values": 2})
    assert model_module._renamed({"cache": 1}) == {"past_key_values": 1}


def test_a_prepared_model_evicts_through_cache_on_this_transformers():
    model = prepare_model(tiny_model("llama", seed=0))
    ids = torch.randint(
        3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0)
    )
    cache = ProbKVCache(model.config, parse_method("snapkv/window=8", ratio=0.5), prompt_length=40)
    out = model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 42)
    assert 0.4 < cache.effective_ratio() < 0.6  # evicted: the cache was used
