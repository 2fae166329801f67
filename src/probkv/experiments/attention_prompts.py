"""The attention-error experiment's prompts and decode tokens (S7; paper Appendix E).

:class:`AttentionPrompt` is the prompt ``x`` that is prefilled and evicted, plus the tokens
forced after it. The ``paper`` format is the paper's Appendix E literally (``x`` = the plain
tokenized text, ``d_1`` = the first token of the question, then the rest of the question and
the full-cache model's greedy continuation); the ``chat`` format puts text and question in the
chat template with the assistant turn opened, and ``d_1..d_N`` are the full-cache model's
greedy answer (end-of-sequence suppressed so there are exactly ``N``). The experiment itself
is :mod:`probkv.experiments.attention_error`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from probkv._checks import check_choice, check_positive_int
from probkv.eval import haystack
from probkv.experiments.paper_prompt import PAPER_QUESTION, PAPER_TEXT
from probkv.models import chat_prompt_ids

PROMPT_FORMATS = ("paper", "chat")


@dataclass(frozen=True)
class AttentionPrompt:
    """The experiment's input.

    ``context_ids``: the prompt ``x`` (``t`` tokens), prefilled and then evicted.
    ``forced_ids``: tokens that follow ``x`` as given, before any generated one (``paper``
    format: the question's tokens, so ``d_1`` is its first token; ``chat``: none, ``d_1`` is the
    model's first answer token). ``source`` and ``format`` describe it for the results header.
    """

    context_ids: tuple[int, ...]
    forced_ids: tuple[int, ...]
    source: str
    format: str

    def __post_init__(self) -> None:
        if not self.context_ids:
            raise ValueError("the prompt x has no tokens")
        check_choice(self.format, PROMPT_FORMATS, "format")


def text_prompt(
    tokenizer, text: str, question: str, *, format: str = "paper", source: str = "text"
) -> AttentionPrompt:
    """The prompt for ``text`` and ``question``.

    ``format="paper"`` (Appendix E): ``x`` = ``text`` tokenized as a plain string (with the
    tokenizer's own special tokens, e.g. a BOS), forced tokens = ``question`` without special
    tokens. ``format="chat"``: ``x`` = the chat template of the user message ``text + "\\n\\n" +
    question`` with the assistant turn opened (plain encoding without a chat template), no forced
    tokens.
    """
    check_choice(format, PROMPT_FORMATS, "format")
    for name, value in (("text", text), ("question", question)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if format == "paper":
        context = tokenizer.encode(text, add_special_tokens=True)
        forced = tokenizer.encode(question, add_special_tokens=False)
    else:
        context = chat_prompt_ids(tokenizer, text + "\n\n" + question)[0].tolist()
        forced = []
    return AttentionPrompt(tuple(context), tuple(forced), source, format)


def paper_prompt(tokenizer, *, format: str = "paper") -> AttentionPrompt:
    """The paper's Appendix E text and question (:mod:`probkv.experiments.paper_prompt`)."""
    return text_prompt(tokenizer, PAPER_TEXT, PAPER_QUESTION, format=format, source="paper")


def haystack_prompt(
    tokenizer, num_tokens: int, *, format: str = "chat", question: str | None = None, seed: int = 0
) -> AttentionPrompt:
    """A long prompt of at most ``num_tokens`` tokens (``x``: chat template included): probkv's
    seeded prose haystack (:mod:`probkv.eval.haystack`) with the Appendix E text inserted at
    the sentence boundary nearest to the middle, then ``question`` (default: Appendix E's).
    The haystack is the largest number of words that fits; the result is within a few tokens
    of ``num_tokens``."""
    check_positive_int(num_tokens, "num_tokens")
    question = PAPER_QUESTION if question is None else question
    stream = haystack.word_stream("prose", seed)

    def build(words: int) -> AttentionPrompt:
        text = stream.render(words, [(0.5, PAPER_TEXT)])
        return text_prompt(tokenizer, text, question, format=format, source="haystack")

    best = build(0)
    if len(best.context_ids) > num_tokens:
        raise ValueError(
            f"num_tokens={num_tokens} is too small: the Appendix E text and question alone take "
            f"{len(best.context_ids)} tokens in the {format!r} format"
        )
    lo, hi = 0, None  # lo fits; hi does not (None: not found yet, search upwards)
    step = 64
    while hi is None or hi - lo > 1:
        probe = lo + step if hi is None else (lo + hi) // 2
        candidate = build(probe)
        if len(candidate.context_ids) <= num_tokens:
            lo, best = probe, candidate
            step *= 2
        else:
            hi = probe
    return best


@torch.no_grad()
def decode_tokens(model, prompt: AttentionPrompt, steps: int) -> tuple[int, ...]:
    """``d_1..d_N`` with ``N = steps``: the prompt's forced tokens, then the full-cache model's
    greedy continuation of ``x`` + those (end-of-sequence suppressed, so exactly ``N``)."""
    check_positive_int(steps, "steps")
    forced = prompt.forced_ids[:steps]
    missing = steps - len(forced)
    if missing == 0:
        return tuple(forced)
    ids = torch.tensor([list(prompt.context_ids) + list(forced)], device=model.device)
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=missing,
        min_new_tokens=missing,
        do_sample=False,
        pad_token_id=pad,
    )
    return tuple(forced) + tuple(out[0, ids.shape[1] :].tolist())
