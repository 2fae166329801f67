"""Tiny random models and an offline tokenizer, built in code, for tests (no downloads).

Every architecture probkv supports has a tiny version here: Llama, Mistral, Qwen2, Qwen3
(QK-norm) and Gemma3 text (sliding-window and global layers mixed). They are all GQA with
``g = Hq // Hkv = 2`` query heads per KV head (docs/architecture.md), head_dim 16, 2-4 layers,
and weights drawn from a seeded generator with an init scale large enough that attention is
far from uniform, so that a test can tell when eviction (S1) changed the output.

``tiny_tokenizer()`` is a byte-level tokenizer with a small chat template; its vocabulary
(``TINY_VOCAB_SIZE`` ids) is the vocabulary of every tiny model, so the evaluation harness can
run end to end on them. ``write_tiny_gguf`` writes the tiny Llama as a ``.gguf`` file, so that
GGUF conversion (probkv.models) is testable in a fraction of a second.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from probkv._checks import check_choice

#: Architecture names accepted by :func:`tiny_model`, in a stable order.
TINY_ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma3")

#: Special tokens of the tiny tokenizer, at ids 0.. in this order; the 256 bytes follow.
TINY_SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<s>",
    "</s>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
)
TINY_PAD_ID, TINY_BOS_ID, TINY_EOS_ID = 0, 1, 2
TINY_VOCAB_SIZE: int = len(TINY_SPECIAL_TOKENS) + 256

#: Each message is ``<|role|>content</s>``; the whole conversation starts with ``<s>``.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

#: Init std of every weight matrix. With hidden size 64 and head_dim 16 this gives query-key
#: logits of standard deviation ~2 (transformers' default 0.02 gives ~0.01: uniform attention).
TINY_INIT_STD = 0.15

#: Gain of the per-head query and key norms (QK-norm, Qwen3 and Gemma3). The norms fix the scale
#: of q and k, so without a gain the logits have std ~1 and attention stays nearly uniform;
#: a gain of 1.5 on both multiplies the logits by 2.25 (std ~2, like the other tiny models).
TINY_QK_NORM_GAIN = 1.5

# Shared shape of every tiny model: GQA with 4 query heads on 2 KV heads (g = 2).
_COMMON: dict[str, Any] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "initializer_range": TINY_INIT_STD,
    "bos_token_id": TINY_BOS_ID,
    "eos_token_id": TINY_EOS_ID,
    "pad_token_id": TINY_PAD_ID,
}


def _llama() -> tuple[type, type, dict[str, Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaConfig, LlamaForCausalLM, {"num_hidden_layers": 2}


def _mistral() -> tuple[type, type, dict[str, Any]]:
    from transformers import MistralConfig, MistralForCausalLM

    # sliding_window=None: every layer is global, as in Mistral-7B-v0.2 and later.
    return MistralConfig, MistralForCausalLM, {"num_hidden_layers": 2, "sliding_window": None}


def _qwen2() -> tuple[type, type, dict[str, Any]]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2Config, Qwen2ForCausalLM, {"num_hidden_layers": 2, "use_sliding_window": False}


def _qwen3() -> tuple[type, type, dict[str, Any]]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # Qwen3 normalises queries and keys per head (QK-norm) before RoPE.
    return Qwen3Config, Qwen3ForCausalLM, {"num_hidden_layers": 3, "use_sliding_window": False}


def _gemma3() -> tuple[type, type, dict[str, Any]]:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # Two sliding-window layers (window 8, so a 32-token prompt exercises it) and two global ones.
    return (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "num_hidden_layers": 4,
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            "sliding_window": 8,
            "query_pre_attn_scalar": 16,
        },
    )


_ARCHITECTURES: dict[str, Callable[[], tuple[type, type, dict[str, Any]]]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma3": _gemma3,
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _check_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in _DTYPES.values():
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype!r}")
    return dtype


def tiny_config(arch: str, **overrides: Any):
    """The ``PretrainedConfig`` of the tiny ``arch`` model, with ``overrides`` applied.

    An override must name an existing config field (``num_hidden_layers=3``,
    ``sliding_window=4``, ...): a misspelt name raises ``ValueError`` instead of being ignored.
    """
    check_choice(arch, TINY_ARCHITECTURES, "arch")
    config_cls, _, specific = _ARCHITECTURES[arch]()
    fields = config_cls()
    unknown = sorted(k for k in overrides if not hasattr(fields, k))
    if unknown:
        raise ValueError(
            f"unknown {config_cls.__name__} field(s) {unknown} in overrides; "
            f"pass existing fields such as num_hidden_layers, sliding_window, head_dim"
        )
    kwargs = {**_COMMON, **specific, **overrides}
    return config_cls(**kwargs)


def tiny_model(
    arch: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> torch.nn.Module:
    """A randomly initialised tiny causal LM of architecture ``arch`` (one of
    ``TINY_ARCHITECTURES``), in eval mode, with ``attn_implementation="sdpa"``.

    The weights depend only on ``seed`` and the config (drawn under a forked RNG, so the
    caller's global RNG state is left untouched). ``overrides`` change config fields, see
    :func:`tiny_config`. Vocabulary: ``TINY_VOCAB_SIZE``, matching :func:`tiny_tokenizer`.
    """
    _check_dtype(dtype)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    config = tiny_config(arch, **overrides)
    _, model_cls, _ = _ARCHITECTURES[arch]()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    _set_qk_norm_gain(model, TINY_QK_NORM_GAIN)
    return model.to(dtype).eval()


@torch.no_grad()
def _set_qk_norm_gain(model: torch.nn.Module, gain: float) -> None:
    """Give every ``q_norm``/``k_norm`` the effective gain ``gain``. Gemma's RMSNorm scales by
    ``1 + weight`` (weights start at 0), the others by ``weight`` (weights start at 1)."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("q_norm", "k_norm"):
            offset = 1.0 if type(module).__name__.startswith("Gemma") else 0.0
            module.weight.fill_(gain - offset)


def tiny_tokenizer():
    """A byte-level tokenizer built in code (no files), with ``TINY_VOCAB_SIZE`` ids.

    Ids ``0..5`` are ``TINY_SPECIAL_TOKENS`` (pad, bos ``<s>``, eos ``</s>``, and the chat role
    markers); ids ``6..261`` are the 256 bytes, so any text round-trips. No merges: one token
    per byte. Plain ``tokenizer(text)`` adds no BOS; the chat template (``TINY_CHAT_TEMPLATE``)
    writes it.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_symbols = list(bytes_to_unicode().values())
    vocab = {token: i for i, token in enumerate([*TINY_SPECIAL_TOKENS, *byte_symbols])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=TINY_CHAT_TEMPLATE,
    )


def save_tiny_model_folder(
    folder: str | os.PathLike[str], arch: str = "llama", **model_kwargs: Any
) -> Path:
    """Save ``tiny_model(arch, **model_kwargs)`` and ``tiny_tokenizer()`` into ``folder`` (a
    Hugging Face model folder any probkv command can load) and return its path."""
    folder = Path(folder)
    tiny_model(arch, **model_kwargs).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _llama_rope_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's storage order of a query/key projection (rows of each head interleaved);
    transformers undoes it when loading a GGUF."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_gguf(path: str | os.PathLike[str], *, seed: int = 0, **overrides: Any) -> Path:
    """Write ``tiny_model("llama", seed=seed, **overrides)`` and ``tiny_tokenizer()`` as a GGUF
    file (float32 tensors, byte-level "gpt2" vocabulary, the chat template) and return its path.

    Loading the file with transformers gives back exactly the same weights and token ids.
    """
    import gguf

    model = tiny_model("llama", seed=seed, **overrides)
    tokenizer = tiny_tokenizer()
    cfg = model.config
    path = Path(path)
    sd = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("probkv-tiny-llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = tokenizer.convert_ids_to_tokens(list(range(TINY_VOCAB_SIZE)))
    writer.add_token_list(tokens)
    # Token type 3 = control (special), 1 = normal; zero scores let the reader accept no merges.
    writer.add_token_types([3 if i < len(TINY_SPECIAL_TOKENS) else 1 for i in range(len(tokens))])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(TINY_BOS_ID)
    writer.add_eos_token_id(TINY_EOS_ID)
    writer.add_pad_token_id(TINY_PAD_ID)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)

    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        writer.add_tensor("output.weight", sd["lm_head.weight"])
    names = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(cfg.num_hidden_layers):
        layer = model.model.layers[i].self_attn
        q = _llama_rope_permute(layer.q_proj.weight.detach().float(), cfg.num_attention_heads)
        k = _llama_rope_permute(layer.k_proj.weight.detach().float(), cfg.num_key_value_heads)
        writer.add_tensor(f"blk.{i}.attn_q.weight", q.numpy())
        writer.add_tensor(f"blk.{i}.attn_k.weight", k.numpy())
        for gguf_name, hf_name in names.items():
            writer.add_tensor(
                f"blk.{i}.{gguf_name}.weight", sd[f"model.layers.{i}.{hf_name}.weight"]
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_scorer(
    num_kv_heads: int = 2,
    head_dim: int = 8,
    value_dim: int | None = None,
    layers: tuple[int, ...] = (0,),
    *,
    seed: int = 0,
):
    """A random kvzap scorer (``probkv.scores.surrogate.SurrogateScorer``, S11) for ``layers`` of
    ``num_kv_heads`` KV heads with keys of ``head_dim`` and values of ``value_dim`` (default
    ``head_dim``): predictions around ``log(1/100)``, for tests of code that iterates over
    every score (every layer has the same fit)."""
    from probkv.scores import surrogate as sg

    dv = head_dim if value_dim is None else value_dim
    f = num_kv_heads * (dv + head_dim // 2)
    gen = torch.Generator().manual_seed(seed)
    fit = sg.LinearSurrogate(
        torch.zeros(f),
        torch.ones(f),
        0.3 * torch.randn(f, num_kv_heads, generator=gen),
        torch.full((num_kv_heads,), -4.6),
    )
    fits = dict.fromkeys(layers, fit)  # one fit for every layer
    shapes = {"model_type": "tiny", "num_key_value_heads": num_kv_heads, "head_dim": head_dim}
    model = {"name": "tiny", "shapes": shapes, "digest": sg.config_digest(shapes)}
    return sg.SurrogateScorer("kv", fits, model, {"teacher": "kvzip"})
