"""The evaluation example record and its JSONL form (S7).

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

Limits checked before any work: a data line holds at most :data:`MAX_LINE_BYTES` (checked
before it is parsed, so a huge line is never read whole), ``max_new_tokens`` is at most
:data:`MAX_NEW_TOKENS`, and :func:`check_context_fits` / :func:`fit_context` hold a prompt
plus its generation budget to the model's positions (optionally cutting the middle of the
context, as LongBench's evaluation does).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from probkv.eval.scorers import check_metric, score

#: Largest line of a data file, in bytes (16 MiB: ~4M tokens of text, far beyond any model).
MAX_LINE_BYTES = 16 * 2**20
#: Largest generation budget of an example (LongBench's largest is 512).
MAX_NEW_TOKENS = 4096

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
    """One evaluation example (S7). Field checks raise ValueError naming the field.

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
        if mnt > MAX_NEW_TOKENS:
            raise ValueError(
                f"example {self.id!r}: field 'max_new_tokens' must be <= {MAX_NEW_TOKENS} "
                f"(the bound on an example's generation budget), got {mnt}"
            )
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
    """Score a prediction for ``example`` with its metric, in [0, 1] (S7).

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


def utf8_error(path: Path, data: bytes, err: UnicodeDecodeError, first_line: int) -> ValueError:
    """A ValueError naming the file, the 1-based line and byte of a UTF-8 decoding error in
    ``data`` (which starts on line ``first_line`` of ``path``)."""
    line = first_line + data.count(b"\n", 0, err.start)
    column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
    return ValueError(
        f"{path}:{line}: not valid UTF-8 (byte 0x{data[err.start]:02x} at byte {column} of the "
        "line); data files must be UTF-8 text"
    )


def iter_jsonl(
    path: str | os.PathLike[str], *, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, object)`` for each non-blank line of a UTF-8 JSONL file (1-based
    line numbers; a byte-order mark is tolerated). Invalid UTF-8 or JSON, a line that is not a
    JSON object, or a line longer than ``max_line_bytes`` (checked before the line is read
    whole) raises a ValueError naming the file and the line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data file {str(p)!r} does not exist or is not a file")
    try:
        f = p.open("rb")
    except OSError as err:
        raise ValueError(f"cannot read data file {str(p)!r}: {err.strerror}") from None
    with f:
        lineno = 0
        # Reading at most max_line_bytes + 2 bytes (room for "\r\n") bounds the memory.
        while raw := f.readline(max_line_bytes + 2):
            lineno += 1
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            content = raw.rstrip(b"\r\n")
            if len(content) > max_line_bytes:
                raise ValueError(
                    f"{p}:{lineno}: line longer than the limit of {max_line_bytes} bytes "
                    f"({max_line_bytes / 2**20:g} MiB); split the example or shorten its context"
                )
            try:
                line = content.decode("utf-8")
            except UnicodeDecodeError as err:
                raise utf8_error(p, content, err, lineno) from None
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
            except RecursionError:  # e.g. 100,000 nested "[": deeper than the parser goes
                raise ValueError(
                    f"{p}:{lineno}: invalid JSON (nested too deeply for the JSON parser)"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"{p}:{lineno}: each line must be a JSON object, got {type(record).__name__}"
                )
            yield lineno, record


def _reject_constant(name: str) -> float:
    # NaN / Infinity are not JSON; Python's json accepts them by default.
    raise ValueError(f"{name} is not valid JSON")


# -- context limits -----------------------------------------------------------------------------


class ContextTooLongError(ValueError):
    """An example whose prompt plus generation budget exceeds the model's positions."""

    def __init__(self, example_id: str, prompt_tokens: int, max_new_tokens: int, limit: int):
        super().__init__(
            f"example {example_id!r} does not fit the model: its prompt has {prompt_tokens} "
            f"tokens and it may generate {max_new_tokens} more ({prompt_tokens + max_new_tokens}"
            f" positions), but the model's limit is {limit} positions "
            "(max_position_embeddings); shorten the example or truncate the middle of its context"
        )
        self.example_id = example_id
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.limit = limit


def _check_count(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_context_fits(
    prompt_tokens: int, max_new_tokens: int, max_positions: int, *, example_id: str
) -> None:
    """Raise :class:`ContextTooLongError` (a ValueError naming the example, its length and the
    limit) unless ``prompt_tokens + max_new_tokens <= max_positions``."""
    _check_count(prompt_tokens, "prompt_tokens", 0)
    _check_count(max_new_tokens, "max_new_tokens", 0)
    _check_count(max_positions, "max_positions", 1)
    if prompt_tokens + max_new_tokens > max_positions:
        raise ContextTooLongError(example_id, prompt_tokens, max_new_tokens, max_positions)


def truncate_middle(ids: Sequence[int], max_len: int) -> list[int]:
    """The first ``max_len // 2`` and the last ``max_len - max_len // 2`` ids of ``ids`` (all
    of them when there are at most ``max_len``): the middle of a long context is dropped and
    its instructions at both ends are kept, as LongBench's evaluation truncates prompts."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(
            f"ids must be a list of token ids, got {type(ids).__name__} (use .tolist() on a tensor)"
        )
    _check_count(max_len, "max_len", 1)
    if len(ids) <= max_len:
        return list(ids)
    head = max_len // 2
    return [*ids[:head], *ids[len(ids) - (max_len - head) :]]


def fit_context(
    context_ids: Sequence[int],
    question_ids: Sequence[int],
    max_new_tokens: int,
    max_positions: int,
    *,
    example_id: str,
    truncate: bool = False,
) -> list[int]:
    """The context ids of a prompt that fits the model: unchanged when context + question +
    ``max_new_tokens`` fit in ``max_positions``; else, with ``truncate``, the context cut in
    the middle (:func:`truncate_middle`) to the room the question and the generation budget
    leave; else (or when even that room is empty) :class:`ContextTooLongError`."""
    total = len(context_ids) + len(question_ids)
    if truncate and total + max_new_tokens > max_positions:
        room = max_positions - len(question_ids) - max_new_tokens
        if room >= 1:
            return truncate_middle(context_ids, room)
    check_context_fits(total, max_new_tokens, max_positions, example_id=example_id)
    return list(context_ids)
