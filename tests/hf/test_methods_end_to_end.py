"""Every registered method runs end to end: compress a context, answer, decode (S3-S6).

On a tiny random model of every supported architecture and on SmolLM2 (slow), at r = 0.5:
``probkv.hf.compress`` prefills and evicts with the method, ``probkv.hf.answer`` decodes a few
tokens from the compressed state. Also: Ada-KV's ragged heads are stored without padding, so
head-wise budgets save real memory (S6; kvpress's AdaKV masks evicted keys and saves none).
"""

from __future__ import annotations

import pytest
import torch

from probkv.budgets import uniform_budget
from probkv.hf import EvictingLayer, answer, compress, prepare_model
from probkv.models import chat_prompt_ids
from probkv.models.testing import TINY_ARCHITECTURES, tiny_model
from probkv.policies import FullCache, TopKPolicy, method_names, parse_method

torch.set_num_threads(1)

RATIO = 0.5
# method_names() plus options that change the code path (scope, sampler, weights, correction)
METHODS = [
    # kvzap needs a scorer trained for the model (S11; tests/hf/test_kvzap.py)
    *(m for m in method_names() if "kvzap" not in m),
    "h2o/recent=0.5",
    "snapkv/window=8/gqa=mixture",
    "ada_snapkv/window=8",
    "prob:min-h/scope=global",
    "prob:min-h/sampler=pps",
    "prob:min-h/sampler=pps/scope=global",
    "prob:h2o/correct=false",
    "prob:h2o-h/tau=2",
    "prob:snapkv/window=8/sampler=pps",
]
NEW_TOKENS = 3


def random_ids(vocab_size: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (1, n), generator=g)


def exact_budget(policy) -> bool:
    """Top-k policies and per-head pps keep exactly the uniform budget on average (pps blocks:
    within ``block - 1`` entries per head, S10.3)."""
    if isinstance(policy, TopKPolicy):
        return True
    return getattr(policy, "sampler", None) == "pps" and policy.scope == "head"


def budget_slack(policy, t: int) -> float:
    """How far an exact-budget method's effective ratio may be from the target (S10.3)."""
    block = getattr(policy, "block", None) or 1  # None: a top-k policy of head scope
    return max(block - 1, 0) / t + 1e-9


def check_compressed(cache, policy, t: int) -> None:
    """Every evicting layer holds a ragged prefix of at most t entries per head, the sizes its
    report states; exact-budget methods hit the target ratio (S3 effective ratio, S6)."""
    layers = [layer for layer in cache.layers if isinstance(layer, EvictingLayer)]
    assert layers and all(layer.is_evicted for layer in layers)
    for layer, report in zip(layers, cache.reports(), strict=True):
        assert report.prefix_length == t and report.kept_per_head == layer.prefix.lengths
        assert all(0 <= n <= t for n in layer.prefix.lengths)
        assert (layer.prefix.log_weights is None) == (
            isinstance(policy, (TopKPolicy, FullCache)) or not policy.corrected
        )
    if isinstance(policy, FullCache):
        assert cache.effective_ratio() == 0.0
    elif exact_budget(policy):
        target = 1 - uniform_budget(t, RATIO) / t
        assert abs(cache.effective_ratio() - target) < budget_slack(policy, t)


@pytest.fixture(scope="module", params=TINY_ARCHITECTURES)
def tiny(request):
    return prepare_model(tiny_model(request.param, seed=0))


@pytest.mark.parametrize("method", METHODS)
def test_every_method_compresses_and_decodes_on_every_tiny_architecture(tiny, method):
    model = tiny
    t = 48
    policy = parse_method(method, ratio=RATIO)
    context = random_ids(model.config.vocab_size, t, seed=1)
    question = random_ids(model.config.vocab_size, 5, seed=2)
    cache = compress(model, context, policy)
    check_compressed(cache, policy, t)
    out = answer(model, cache, question, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert out.shape == (NEW_TOKENS,)
    assert int(out.min()) >= 0 and int(out.max()) < model.config.vocab_size
    assert cache.get_seq_length() == t  # answer leaves the compressed state as it was


def test_ada_kv_stores_ragged_heads_without_padding(tiny):
    """S6: the evicted layers hold exactly the kept entries (flattened [sum of head lengths,
    d] keys and values), not every head padded to the longest one. Ada-KV's heads really
    differ, so padding (or kvpress-style masking of the full cache) would cost more."""
    model = tiny
    t = 96
    cache = compress(
        model,
        random_ids(model.config.vocab_size, t, seed=3),
        parse_method("ada_snapkv/window=8", ratio=RATIO),
    )
    uneven = False
    for layer in (x for x in cache.layers if isinstance(x, EvictingLayer)):
        lengths = layer.prefix.lengths
        d_k, d_v = layer.prefix.keys.shape[-1], layer.prefix.values.shape[-1]
        size = layer.prefix.keys.element_size()
        kept_bytes = sum(lengths) * (d_k + d_v) * size
        padded_bytes = max(lengths) * len(lengths) * (d_k + d_v) * size
        masked_bytes = t * len(lengths) * (d_k + d_v) * size  # full cache with masked keys
        assert layer.prefix.log_weights is None  # top-k: no weights stored
        assert layer.nbytes() == kept_bytes  # prefix only: the dense buffer was freed
        assert sum(lengths) == len(lengths) * uniform_budget(t, RATIO)
        assert kept_bytes <= padded_bytes < masked_bytes
        uneven |= len(set(lengths)) > 1
    assert uneven  # Ada-KV did move budget between heads somewhere: padding would cost more


# ------------------------------------------------------------------------------ SmolLM2

STORY = (
    "Mira kept a small notebook of the birds she saw near the river. On Monday she saw two "
    "herons and a kingfisher; on Tuesday, only ducks. Her brother Tomas counted boats instead, "
    "and he said the red ferry passed eleven times that week. "
)


@pytest.fixture(scope="module")
def smollm2_probkv(smollm2):
    """SmolLM2 switched to probkv's attention for this module, then back to SDPA (the model is
    shared by the whole session)."""
    model, tokenizer = smollm2
    prepare_model(model)
    yield model, tokenizer
    model.set_attn_implementation("sdpa")


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_every_method_compresses_and_decodes_on_smollm2(smollm2_probkv, method):
    """A ~200-token context at r = 0.5, a question, four greedy tokens."""
    model, tokenizer = smollm2_probkv
    ids = chat_prompt_ids(tokenizer, STORY * 3 + "How many herons did Mira see on Monday?")
    split = ids.shape[1] - 16  # the question and the assistant header come after eviction
    context, question = ids[:, :split], ids[:, split:]
    assert 150 <= split <= 260
    policy = parse_method(method, ratio=RATIO)
    cache = compress(model, context, policy)
    check_compressed(cache, policy, split)
    out = answer(model, cache, question, max_new_tokens=4, min_new_tokens=4)
    assert out.shape == (4,)
    assert len(tokenizer.decode(out, skip_special_tokens=True)) > 0
