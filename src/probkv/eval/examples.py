"""The evaluation example record and its JSONL form (SPEC S7).

An :class:`Example` is one prompt to answer: a ``context`` (the long part, which is prefilled
and then compressed) followed by a ``question`` (fed after eviction, so eviction is
question-agnostic by default), the reference ``answers`` and the ``metric`` that scores a
prediction against them. How the two parts become model input (chat template, answer prefix)
is defined once in :mod:`probkv.eval.prompt`.

JSONL form (probkv's own format, one example per line)::

    {"id": "...", "task": "...", "context": "...", "question": "...", "answers": ["..."],
     "max_new_tokens": 32, "metric": "string_match_all", "answer_prefix": "...",
     "all_classes": null, "first_line_only": false, "chat_template": true, "metadata": {...}}

``metric`` and everything after it are optional; :func:`probkv.eval.data.load_examples` fills
defaults per task. The model sees ``context + question`` verbatim: a question should start
with its own separator (e.g. a blank line), as the generated tasks and LongBench templates do.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from probkv.eval.scorers import check_metric, score

# Field order of the JSONL form.
REQUIRED_FIELDS = ("id", "task", "context", "question", "answers", "max_new_tokens")
OPTIONAL_FIELDS = (
    "metric",
    "answer_prefix",
    "all_classes",
    "first_line_only",
    "chat_template",
    "metadata",
)


def field_error(name: str, message: str, value: Any) -> ValueError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ValueError(f"field {name!r} {message}, got {shown}")


def check_str_field(name: str, value: Any, *, non_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise field_error(name, "must be a string", value)
    if non_empty and not value.strip():
        raise field_error(name, "must be a non-empty string", value)
    return value


def check_str_list_field(name: str, value: Any, *, non_empty: bool) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise field_error(name, "must be a list of strings", value)
    if non_empty and len(value) == 0:
        raise field_error(name, "must be a non-empty list of strings", value)
    for item in value:
        if not isinstance(item, str):
            raise field_error(name, "must contain only strings", value)
    return tuple(value)


@dataclass(frozen=True)
class Example:
    """One evaluation example (SPEC S7). Field checks raise ValueError naming the field.

    Attributes:
        id: unique id within a data set (the runner keys finished jobs on it).
        task: the split it belongs to (a generated task name, a LongBench dataset, ...).
        context: the text that is prefilled and compressed.
        question: the text fed after eviction; starts with its own separator.
        answers: reference strings (non-empty).
        max_new_tokens: generation budget (>= 1).
        metric: scorer name from :data:`probkv.eval.scorers.SCORERS`.
        answer_prefix: text the answer starts with, placed after the chat template's
            generation prompt (e.g. "The special magic number for X ... is").
        all_classes: class names for the ``classification`` metric, else ``None``.
        first_line_only: score only the first line of the prediction (LongBench does this
            for trec, triviaqa, samsum and lsht).
        chat_template: wrap the prompt in the tokenizer's chat template when it has one
            (LongBench's few-shot and code tasks use plain completion).
        metadata: free-form JSON data (generator settings, needle depths, ...).
    """

    id: str
    task: str
    context: str
    question: str
    answers: tuple[str, ...]
    max_new_tokens: int
    metric: str = "string_match_all"
    answer_prefix: str = ""
    all_classes: tuple[str, ...] | None = None
    first_line_only: bool = False
    chat_template: bool = True
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_str_field("id", self.id, non_empty=True)
        check_str_field("task", self.task, non_empty=True)
        check_str_field("context", self.context)
        check_str_field("question", self.question)
        object.__setattr__(
            self, "answers", check_str_list_field("answers", self.answers, non_empty=True)
        )
        mnt = self.max_new_tokens
        if isinstance(mnt, bool) or not isinstance(mnt, int):
            raise field_error("max_new_tokens", "must be an integer", mnt)
        if mnt < 1:
            raise field_error("max_new_tokens", "must be >= 1", mnt)
        try:
            check_metric(self.metric)
        except ValueError as err:
            raise ValueError(f"field 'metric': {err}") from None
        check_str_field("answer_prefix", self.answer_prefix)
        if self.all_classes is not None:
            classes = check_str_list_field("all_classes", self.all_classes, non_empty=True)
            object.__setattr__(self, "all_classes", classes)
        if self.metric == "classification" and self.all_classes is None:
            raise field_error("all_classes", "is required by metric 'classification'", None)
        for name in ("first_line_only", "chat_template"):
            if not isinstance(getattr(self, name), bool):
                raise field_error(name, "must be true or false", getattr(self, name))
        if not isinstance(self.metadata, Mapping):
            raise field_error("metadata", "must be a JSON object", self.metadata)
        object.__setattr__(self, "metadata", dict(self.metadata))

    def to_json(self) -> dict[str, Any]:
        """The JSONL record (plain JSON types)."""
        return {
            "id": self.id,
            "task": self.task,
            "context": self.context,
            "question": self.question,
            "answers": list(self.answers),
            "max_new_tokens": self.max_new_tokens,
            "metric": self.metric,
            "answer_prefix": self.answer_prefix,
            "all_classes": None if self.all_classes is None else list(self.all_classes),
            "first_line_only": self.first_line_only,
            "chat_template": self.chat_template,
            "metadata": dict(self.metadata),
        }

    def reference_prediction(self) -> str:
        """A perfect prediction: the answers joined (scores 1.0 under the string-match metrics)."""
        return ", ".join(self.answers)


def score_example(example: Example, prediction: str) -> float:
    """Score a prediction for ``example`` with its metric, in [0, 1] (SPEC S7).

    Applies LongBench's post-processing first when ``example.first_line_only`` is set: only
    the first line after any leading newlines is scored."""
    if not isinstance(prediction, str):
        raise ValueError(f"prediction must be a string, got {type(prediction).__name__}")
    if example.first_line_only:
        prediction = prediction.lstrip("\n").split("\n")[0]
    return score(example.metric, prediction, example.answers, example.all_classes)


def write_examples(path: str | os.PathLike[str], examples: Iterable[Example]) -> int:
    """Write examples as JSONL (UTF-8, one object per line); returns how many were written.
    Refuses duplicate ids."""
    seen: set[str] = set()
    lines = []
    for ex in examples:
        if not isinstance(ex, Example):
            raise ValueError(f"examples must be Example records, got {type(ex).__name__}")
        if ex.id in seen:
            raise ValueError(f"duplicate example id {ex.id!r}; ids must be unique")
        seen.add(ex.id)
        try:
            lines.append(json.dumps(ex.to_json(), ensure_ascii=False, allow_nan=False))
        except (TypeError, ValueError) as err:
            raise ValueError(f"example {ex.id!r}: field 'metadata' is not JSON ({err})") from None
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return len(lines)


def iter_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, object)`` for each non-blank line of a JSONL file (1-based line
    numbers). Invalid JSON or a line that is not a JSON object raises a ValueError naming the
    file and the line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data file {str(p)!r} does not exist or is not a file")
    with p.open(encoding="utf-8-sig") as f:  # tolerate a byte-order mark
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line, parse_constant=_reject_constant)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{p}:{lineno}: invalid JSON ({err.msg} at column {err.colno})"
                ) from None
            except ValueError as err:
                raise ValueError(f"{p}:{lineno}: invalid JSON ({err})") from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"{p}:{lineno}: each line must be a JSON object, got {type(record).__name__}"
                )
            yield lineno, record


def _reject_constant(name: str) -> float:
    # NaN / Infinity are not JSON; Python's json accepts them by default.
    raise ValueError(f"{name} is not valid JSON")
