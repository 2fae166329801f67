"""Tiny random models and the offline tokenizer (probkv.models.testing)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probkv.models.testing import (
    TINY_ARCHITECTURES,
    TINY_BOS_ID,
    TINY_EOS_ID,
    TINY_PAD_ID,
    TINY_SPECIAL_TOKENS,
    TINY_VOCAB_SIZE,
    tiny_config,
    tiny_model,
    tiny_tokenizer,
    write_tiny_gguf,
)

PROMPT = "The quick brown fox jumps over the lazy dog, then sleeps."


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> torch.Tensor:
    return tokenizer(PROMPT, return_tensors="pt")["input_ids"]


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_tiny_model_shape_contract(arch):
    """GQA with g > 1, small head_dim, 2-4 layers, sdpa, float32, eval (docs/architecture.md)."""
    model = tiny_model(arch)
    cfg = model.config
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.num_attention_heads // cfg.num_key_value_heads > 1
    assert 16 <= cfg.head_dim <= 32
    assert 2 <= cfg.num_hidden_layers <= 4
    assert cfg.vocab_size == TINY_VOCAB_SIZE
    assert cfg._attn_implementation == "sdpa"
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_tiny_model_forward_and_generate(arch, prompt_ids):
    model = tiny_model(arch)
    with torch.no_grad():
        logits = model(prompt_ids).logits
    assert logits.shape == (1, prompt_ids.shape[1], TINY_VOCAB_SIZE)
    assert torch.isfinite(logits).all()
    out = model.generate(
        prompt_ids,
        attention_mask=torch.ones_like(prompt_ids),
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        pad_token_id=TINY_PAD_ID,
    )
    assert out.shape == (1, prompt_ids.shape[1] + 6)
    assert torch.equal(out[:, : prompt_ids.shape[1]], prompt_ids)
    assert int(out.max()) < TINY_VOCAB_SIZE


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_tiny_model_is_deterministic_by_seed(arch):
    before = torch.get_rng_state()
    a, b, c = tiny_model(arch, seed=3), tiny_model(arch, seed=3), tiny_model(arch, seed=4)
    assert torch.equal(before, torch.get_rng_state()), "the caller's global RNG was consumed"
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_tiny_model_bfloat16(arch, prompt_ids):
    model = tiny_model(arch, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with torch.no_grad():
        logits = model(prompt_ids).logits
    assert torch.isfinite(logits.float()).all()


def _global_layers(model) -> list[int]:
    types = getattr(model.config, "layer_types", None)
    n = model.config.num_hidden_layers
    return [i for i in range(n) if types is None or types[i] == "full_attention"]


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_tiny_attention_is_far_from_uniform(arch, prompt_ids):
    """The init scale makes attention peaked, so eviction (S1) is visible in the output.

    Normalised entropy H(p) / log t of the last query's attention is 1 for uniform attention;
    averaged over the heads of every global layer it must be at most 0.9.
    """
    model = tiny_model(arch)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(prompt_ids, output_attentions=True).attentions
    t = prompt_ids.shape[1]
    for layer in _global_layers(model):
        p = attentions[layer][0, :, -1, :]  # [Hq, t]
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1) / math.log(t)
        assert float(entropy.mean()) <= 0.9, (arch, layer, entropy.tolist())


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_masking_early_tokens_changes_the_output(arch, prompt_ids):
    """Hiding half of the prefix from attention moves the last logits far above float32
    rounding (~1e-6 relative), so tests can detect what an eviction did."""
    model = tiny_model(arch)
    t = prompt_ids.shape[1]
    mask = torch.ones_like(prompt_ids)
    mask[0, 1 : t // 2] = 0
    with torch.no_grad():
        full = model(prompt_ids).logits[0, -1]
        masked = model(prompt_ids, attention_mask=mask).logits[0, -1]
    assert float((full - masked).abs().max()) > 1e-2 * float(full.std())


def test_gemma3_mixes_sliding_and_global_layers(prompt_ids):
    """Sliding-window layers see only the last ``sliding_window`` keys; global layers see all,
    and the tiny prompt is longer than the window so tests exercise both."""
    model = tiny_model("gemma3")
    cfg = model.config
    assert {"sliding_attention", "full_attention"} <= set(cfg.layer_types)
    window = cfg.sliding_window
    t = prompt_ids.shape[1]
    assert t > 2 * window
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(prompt_ids, output_attentions=True).attentions
    for layer, kind in enumerate(cfg.layer_types):
        last = attentions[layer][0, :, -1, :]  # [Hq, t]
        outside = last[:, : t - window].sum(-1)
        if kind == "sliding_attention":
            assert torch.all(outside == 0), (layer, outside)
        else:
            assert torch.all(outside > 0), (layer, outside)


def test_architecture_specifics():
    assert tiny_config("mistral").sliding_window is None
    assert tiny_config("qwen2").sliding_window is None
    qwen3 = tiny_model("qwen3")
    assert hasattr(qwen3.model.layers[0].self_attn, "q_norm")
    assert type(tiny_model("gemma3")).__name__ == "Gemma3ForCausalLM"


def test_overrides_and_bad_input():
    assert tiny_model("llama", num_hidden_layers=3).config.num_hidden_layers == 3
    assert tiny_config("gemma3", sliding_window=4).sliding_window == 4
    with pytest.raises(ValueError, match="num_hiden_layers"):
        tiny_config("llama", num_hiden_layers=3)
    with pytest.raises(ValueError, match=r"'llama'.*got 'gpt2'"):
        tiny_model("gpt2")
    with pytest.raises(ValueError, match="dtype"):
        tiny_model("llama", dtype=torch.float16)
    with pytest.raises(ValueError, match="seed"):
        tiny_model("llama", seed=1.5)


def test_tiny_tokenizer_vocabulary(tokenizer):
    assert len(tokenizer) == TINY_VOCAB_SIZE
    assert tokenizer.convert_ids_to_tokens(list(range(len(TINY_SPECIAL_TOKENS)))) == list(
        TINY_SPECIAL_TOKENS
    )
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        TINY_PAD_ID,
        TINY_BOS_ID,
        TINY_EOS_ID,
    )
    # One token per UTF-8 byte, no BOS added to plain text.
    assert len(tokenizer("héllo")["input_ids"]) == len("héllo".encode())


def test_tiny_tokenizer_chat_template(tokenizer):
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert tokenizer.decode(ids) == "<s><|user|>hi</s><|assistant|>"
    assert ids[0] == TINY_BOS_ID and ids[-1] == TINY_SPECIAL_TOKENS.index("<|assistant|>")


_TOKENIZER = tiny_tokenizer()  # hypothesis examples share one (function fixtures are not reset)


@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=40))
def test_tiny_tokenizer_round_trips_any_text(text):
    tokenizer = _TOKENIZER
    ids = tokenizer(text)["input_ids"]
    assert all(0 <= i < TINY_VOCAB_SIZE for i in ids)
    assert tokenizer.decode(ids) == text


def test_write_tiny_gguf_metadata(tmp_path):
    import gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", seed=1, num_hidden_layers=3)
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "llama"
    blocks = reader.fields["llama.block_count"]
    assert int(blocks.parts[blocks.data[0]][0]) == 3
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "blk.2.attn_q.weight", "output.weight"} <= names
