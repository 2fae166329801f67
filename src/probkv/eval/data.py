"""Bring-your-own data: read examples from JSONL (S7).

``load_examples(path)`` reads either probkv's own format (see :mod:`probkv.eval.examples`)
or LongBench's (see :mod:`probkv.eval.longbench`), detected from the first record or chosen
with ``format=``. Nothing is loaded from a malformed file: the first bad line raises a
ValueError of the form ``"<file>:<line>: field 'answers' must be a non-empty list of
strings, got []"`` (invalid UTF-8 or JSON, a line over 16 MiB, a missing field, a wrong
type, empty answers, a ``max_new_tokens`` outside 1..4096, an unknown metric, a duplicate
id). Line numbers are 1-based.

Defaults in probkv's format, by task name: ``metric`` is the generated task's scorer
(``probkv.eval.tasks``), else the LongBench dataset's metric (whose first-line and
chat-template settings are also the defaults), else ``string_match_all``. Fields that are not
part of the format are kept in ``metadata``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from probkv._checks import check_choice
from probkv.eval.examples import OPTIONAL_FIELDS, REQUIRED_FIELDS, Example, iter_jsonl
from probkv.eval.longbench import (
    LONGBENCH_DATASETS,
    base_dataset_name,
    example_from_longbench,
    load_templates,
)
from probkv.eval.tasks import task_metric

FORMATS = ("auto", "probkv", "longbench")
DEFAULT_METRIC = "string_match_all"

_LONGBENCH_MARKERS = ("_id", "input", "dataset")


def task_defaults(task: str) -> dict[str, Any]:
    """Defaults of the optional fields for a task name (see the module docstring)."""
    metric = task_metric(task)
    if metric is not None:
        return {"metric": metric}
    dataset = LONGBENCH_DATASETS.get(base_dataset_name(task))
    if dataset is not None:
        return {
            "metric": dataset.metric,
            "first_line_only": dataset.first_line_only,
            "chat_template": dataset.chat_template,
        }
    return {"metric": DEFAULT_METRIC}


def detect_format(record: Mapping[str, Any]) -> str | None:
    """``"longbench"`` or ``"probkv"`` from a record's fields, or None if neither fits."""
    if "_id" in record or ("input" in record and "dataset" in record):
        return "longbench"
    if "question" in record or "task" in record or "max_new_tokens" in record:
        return "probkv"
    return None


def example_from_record(record: Mapping[str, Any]) -> Example:
    """Build an :class:`Example` from one record in probkv's format. Errors name the field."""
    for name in REQUIRED_FIELDS:
        if name not in record:
            raise ValueError(f"missing field {name!r}")
    task = record["task"]
    fields = {name: record[name] for name in REQUIRED_FIELDS}
    defaults = task_defaults(task) if isinstance(task, str) else {}
    for name in OPTIONAL_FIELDS:
        if record.get(name) is not None:
            fields[name] = record[name]
        elif name in defaults:
            fields[name] = defaults[name]
    extra = {
        k: v for k, v in record.items() if k not in REQUIRED_FIELDS and k not in OPTIONAL_FIELDS
    }
    if extra:
        metadata = fields.get("metadata", {})
        if isinstance(metadata, Mapping):
            fields["metadata"] = {**extra, **metadata}
    return Example(**fields)


def load_examples(
    path: str | os.PathLike[str],
    *,
    format: str = "auto",
    templates: str | os.PathLike[str] | Mapping[str, tuple[str, str]] | None = None,
) -> list[Example]:
    """Read all examples of a JSONL file.

    Args:
        path: the JSONL file.
        format: ``"auto"`` (from the first record), ``"probkv"`` or ``"longbench"``.
        templates: LongBench only: a template override file, or its parsed form from
            :func:`probkv.eval.longbench.load_templates`.
    """
    check_choice(format, FORMATS, "format")
    path = Path(path)
    template_map = (
        load_templates(templates) if isinstance(templates, (str, os.PathLike)) else templates
    )
    examples: list[Example] = []
    first_line: dict[str, int] = {}
    chosen = None if format == "auto" else format
    for lineno, record in iter_jsonl(path):
        if chosen is None:
            chosen = detect_format(record)
            if chosen is None:
                raise ValueError(
                    f"{path}:{lineno}: cannot tell the data format from the fields "
                    f"{sorted(record)}; probkv's format needs {', '.join(REQUIRED_FIELDS)}, "
                    f"LongBench's needs {', '.join(_LONGBENCH_MARKERS)}, context, answers "
                    "(or pass format='probkv' / format='longbench')"
                )
        if chosen == "probkv" and template_map is not None:
            raise ValueError(f"{path}: templates= applies to LongBench files only")
        try:
            if chosen == "longbench":
                example = example_from_longbench(record, template_map)
            else:
                example = example_from_record(record)
        except ValueError as err:
            raise ValueError(f"{path}:{lineno}: {err}") from None
        if example.id in first_line:
            raise ValueError(
                f"{path}:{lineno}: field 'id': duplicate id {example.id!r} "
                f"(first seen on line {first_line[example.id]})"
            )
        first_line[example.id] = lineno
        examples.append(example)
    if not examples:
        raise ValueError(f"{path}: no examples (the file is empty)")
    return examples
