"""How an :class:`~probkv.eval.examples.Example` becomes model input (S7).

The prompt is cut in two at the end of the context, because eviction happens in between:

- ``context`` part: the chat template's opening (system prompt, user header) + ``example.context``.
  This is prefilled and then compressed.
- ``question`` part: ``example.question`` + the chat template's closing (end of the user turn,
  assistant header) + ``example.answer_prefix``. This is fed after eviction (question-agnostic
  eviction, the default of the runner).

The user message is ``example.context + example.question`` verbatim. Without a chat template
(the tokenizer has none, or ``example.chat_template`` is false, as for LongBench's few-shot
and code tasks) the parts are the raw texts, and a non-empty answer prefix goes on a new line.

Token ids: the context part is tokenized with the tokenizer's special tokens (BOS) only when no
chat template is used (a chat template writes its own); the question part never adds them.

**Prompt length** (what ``length`` means for the task generator): the number of tokens of both
parts, i.e. everything the model has read when it produces the first answer token: chat
template overhead + context + question + answer prefix. Generated tokens are not counted
(RULER's ``max_seq_length`` also counts the generation budget; ours does not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from probkv.eval.examples import Example

# Marks the context/question cut inside the rendered chat template; cannot occur in text.
_CUT = "\x00probkv-context-end\x00"


@dataclass(frozen=True)
class Prompt:
    """The two texts of a prompt: ``context`` (prefilled, compressed) and ``question`` (fed
    after eviction). ``templated`` says whether a chat template was applied."""

    context: str
    question: str
    templated: bool


def uses_chat_template(example: Example, tokenizer: Any) -> bool:
    """Whether the prompt of ``example`` goes through the tokenizer's chat template."""
    return bool(example.chat_template and getattr(tokenizer, "chat_template", None))


def build_prompt(example: Example, tokenizer: Any) -> Prompt:
    """Split the model input for ``example`` into its context and question texts (see the
    module docstring). ``tokenizer`` needs ``chat_template`` and ``apply_chat_template``
    (transformers' interface) to use a chat template; otherwise plain text is used."""
    if not isinstance(example, Example):
        raise ValueError(f"example must be an Example, got {type(example).__name__}")
    if not uses_chat_template(example, tokenizer):
        suffix = "\n" + example.answer_prefix if example.answer_prefix else ""
        return Prompt(example.context, example.question + suffix, templated=False)
    if _CUT in example.context or _CUT in example.question:
        raise ValueError(f"example {example.id!r} contains the reserved NUL-delimited cut marker")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": example.context + _CUT + example.question}],
        tokenize=False,
        add_generation_prompt=True,
    )
    if not isinstance(rendered, str) or rendered.count(_CUT) != 1:
        raise ValueError(
            "the tokenizer's chat template did not render the user message verbatim "
            f"(example {example.id!r}); set chat_template=false for this example"
        )
    context, question = rendered.split(_CUT)
    return Prompt(context, question + example.answer_prefix, templated=True)


def _encode(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    if not text and not special:
        return []
    return list(tokenizer.encode(text, add_special_tokens=special))


def prompt_token_ids(example: Example, tokenizer: Any) -> tuple[list[int], list[int]]:
    """Token ids of the context part and of the question part (see the module docstring)."""
    prompt = build_prompt(example, tokenizer)
    context_ids = _encode(tokenizer, prompt.context, special=not prompt.templated)
    question_ids = _encode(tokenizer, prompt.question, special=False)
    return context_ids, question_ids


def prompt_length(example: Example, tokenizer: Any) -> int:
    """Prompt length in tokens: context part + question part (what generators fit to a length)."""
    context_ids, question_ids = prompt_token_ids(example, tokenizer)
    return len(context_ids) + len(question_ids)
