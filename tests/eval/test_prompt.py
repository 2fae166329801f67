"""Prompt assembly: the context/question cut and what "length" counts (S7)."""

from __future__ import annotations

import pytest

from probkv.eval.examples import Example
from probkv.eval.prompt import build_prompt, prompt_length, prompt_token_ids


def _example(**kw):
    fields = {
        "id": "e1",
        "task": "t",
        "context": "Some context. It is long.",
        "question": "\n\nWhat is it?",
        "answers": ["x"],
        "max_new_tokens": 8,
        "answer_prefix": "Answer:",
    }
    fields.update(kw)
    return Example(**fields)


def test_chat_template_is_cut_at_the_end_of_the_context(simple_tokenizer):
    ex = _example()
    prompt = build_prompt(ex, simple_tokenizer)
    assert prompt.templated
    assert prompt.context == "<|system|>\nBe brief.\n<|user|>\nSome context. It is long."
    assert prompt.question == "\n\nWhat is it?<|end|>\n<|assistant|>\nAnswer:"
    full = simple_tokenizer.apply_chat_template(
        [{"role": "user", "content": ex.context + ex.question}], add_generation_prompt=True
    )
    assert prompt.context + prompt.question == full + ex.answer_prefix


def test_token_ids_and_length(simple_tokenizer, plain_tokenizer):
    ex = _example()
    context_ids, question_ids = prompt_token_ids(ex, simple_tokenizer)
    # Context: <|system|> Be brief . <|user|> Some context . It is long . = 12 tokens.
    assert len(context_ids) == 12
    # Question: What is it ? <|end|> <|assistant|> Answer : = 8 tokens.
    assert len(question_ids) == 8
    assert prompt_length(ex, simple_tokenizer) == 20
    # No chat template: raw texts, BOS added to the context only, prefix on a new line.
    prompt = build_prompt(ex, plain_tokenizer)
    assert (prompt.context, prompt.question) == (ex.context, ex.question + "\nAnswer:")
    context_ids, question_ids = prompt_token_ids(ex, plain_tokenizer)
    bos = plain_tokenizer.vocab["<|bos|>"]
    assert context_ids[0] == bos and bos not in question_ids
    # BOS + 7 context tokens; 4 question + 2 prefix tokens.
    assert (len(context_ids), len(question_ids)) == (8, 6)


def test_example_can_opt_out_of_the_chat_template(simple_tokenizer):
    ex = _example(chat_template=False, answer_prefix="")
    prompt = build_prompt(ex, simple_tokenizer)
    assert not prompt.templated
    assert (prompt.context, prompt.question) == (ex.context, ex.question)


def test_reserved_marker_is_refused(simple_tokenizer):
    with pytest.raises(ValueError, match="cut marker"):
        build_prompt(_example(context="a\x00probkv-context-end\x00b"), simple_tokenizer)


@pytest.mark.slow
def test_smollm2_chat_template_split(smollm2_tokenizer):
    ex = _example()
    prompt = build_prompt(ex, smollm2_tokenizer)
    assert prompt.context.startswith("<|im_start|>system\n")
    assert prompt.context.endswith("<|im_start|>user\n" + ex.context)
    assert prompt.question == ex.question + "<|im_end|>\n<|im_start|>assistant\n" + ex.answer_prefix
    context_ids, question_ids = prompt_token_ids(ex, smollm2_tokenizer)
    # The cut falls on a token boundary: the two parts tokenize to the whole.
    whole = smollm2_tokenizer.encode(prompt.context + prompt.question, add_special_tokens=False)
    assert context_ids + question_ids == whole
