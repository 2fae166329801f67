"""LongBench's JSONL format: prompt templates, generation budgets and metrics per dataset (S7).

A LongBench record has the fields ``_id``, ``dataset``, ``input`` (the question or
instruction), ``context``, ``answers``, ``all_classes``, ``length`` and ``language``. Each
dataset has a prompt template; probkv splits it at the end of the context into a ``context``
part (the compressed text, containing ``{context}``) and a ``question`` part (fed after
eviction, containing ``{input}`` where the dataset has one), so eviction stays
question-agnostic.

**Templates differ from LongBench's wording.** The templates below are probkv's own text,
following the structure of each LongBench task (instruction, context, then
question/instruction and the answer cue), not LongBench's sentences. Scores are therefore
comparable between methods run by probkv, but not digit-for-digit to published LongBench
numbers. To use LongBench's exact prompts (or any others), pass a JSON file to
``load_examples(..., templates=PATH)``::

    {"hotpotqa": {"context": "...{context}...", "question": "...{input}..."}}

Placeholders are replaced literally (no other brace processing); the context part must contain
``{context}`` once and no ``{input}``, the question part at most one ``{input}`` and no
``{context}``.

As in LongBench: the few-shot datasets (trec, triviaqa, samsum, lsht) and the code datasets
(lcc, repobench-p) are plain completion without chat template; trec, triviaqa, samsum and lsht
score only the first line of the prediction; metrics and ``max_new_tokens`` per dataset follow
LongBench's ``eval.py`` and ``dataset2maxlen``. LongBench-E files (dataset names ending in
``_e``) use the settings of their base dataset.

Chinese: ``lsht`` (classification) and ``passage_retrieval_zh`` are supported (their metrics
need no word segmentation). ``multifieldqa_zh``, ``dureader`` and ``vcsum`` are refused: their
metrics segment Chinese words with jieba, which probkv does not depend on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from probkv.eval.examples import (
    MAX_LINE_BYTES,
    Example,
    check_str_field,
    check_str_list_field,
    field_error,
    utf8_error,
)

CONTEXT_FIELD = "{context}"
INPUT_FIELD = "{input}"


@dataclass(frozen=True)
class LongBenchDataset:
    """Settings of one LongBench dataset: metric, generation budget, the two template parts,
    whether only the first line is scored and whether the chat template is used."""

    name: str
    metric: str
    max_new_tokens: int
    context_template: str
    question_template: str
    first_line_only: bool = False
    chat_template: bool = True


_QA_PASSAGES = (
    "Below are several passages. Afterwards you will answer a question using them; reply "
    "with the answer only, without any other words.\n\nPassages:\n{context}\n\n",
    "Using the passages above, answer the question. Reply with the answer only, without any "
    "other words.\n\nQuestion: {input}\nAnswer:",
)

_DATASETS = (
    LongBenchDataset(
        "narrativeqa",
        "qa_f1",
        128,
        "Read the story below (part of a novel or a film script). You will then answer a "
        "question about it with a short phrase and no explanation.\n\nStory: {context}\n\n",
        "Using the story above, answer with a short phrase only, without explanation.\n\n"
        "Question: {input}\n\nAnswer:",
    ),
    LongBenchDataset(
        "qasper",
        "qa_f1",
        128,
        "Read the scientific article below. You will then answer a question about it as "
        'briefly as you can. If the article does not say, reply "unanswerable"; for a yes/no '
        'question reply "yes", "no" or "unanswerable". Give no explanation.\n\n'
        "Article: {context}\n\n",
        "Answer from the article above as briefly as you can, in a phrase or one sentence. "
        'If the article does not say, reply "unanswerable"; for a yes/no question reply '
        '"yes", "no" or "unanswerable". Give no explanation.\n\nQuestion: {input}\n\nAnswer:',
    ),
    LongBenchDataset(
        "multifieldqa_en",
        "qa_f1",
        64,
        "Read the text below; afterwards you will answer a question about it briefly.\n\n"
        "{context}\n\n",
        "Answer the question using the text above. Reply with the answer only, without any "
        "other words.\n\nQuestion: {input}\nAnswer:",
    ),
    LongBenchDataset("hotpotqa", "qa_f1", 32, *_QA_PASSAGES),
    LongBenchDataset("2wikimqa", "qa_f1", 32, *_QA_PASSAGES),
    LongBenchDataset("musique", "qa_f1", 32, *_QA_PASSAGES),
    LongBenchDataset(
        "gov_report",
        "rouge_l",
        512,
        "Below is a report written by a government agency.\n\nReport:\n{context}\n\n",
        "Write a summary of the report above, about one page long.\n\nSummary:",
    ),
    LongBenchDataset(
        "qmsum",
        "rouge_l",
        512,
        "Below is the transcript of a meeting. Afterwards you will get a query about it, "
        "either a question or an instruction.\n\nTranscript:\n{context}\n\n",
        "Respond to the query using the transcript above, in one or more sentences.\n\n"
        "Query: {input}\nAnswer:",
    ),
    LongBenchDataset(
        "multi_news",
        "rouge_l",
        512,
        "Below are several news articles.\n\nNews:\n{context}\n\n",
        "Write a summary of all the news articles above, about one page long.\n\nSummary:",
    ),
    LongBenchDataset(
        "trec",
        "classification",
        64,
        "Decide the type of the last question. The examples below show questions together "
        "with their types.\n\n{context}\n",
        "{input}",
        first_line_only=True,
        chat_template=False,
    ),
    LongBenchDataset(
        "triviaqa",
        "qa_f1",
        32,
        "Answer each question from its passage, replying with the answer only. Some solved "
        "examples come first.\n\n{context}\n\n",
        "{input}",
        first_line_only=True,
        chat_template=False,
    ),
    LongBenchDataset(
        "samsum",
        "rouge_l",
        128,
        "Summarise each dialogue in a few short sentences. Some solved examples come first."
        "\n\n{context}\n\n",
        "{input}",
        first_line_only=True,
        chat_template=False,
    ),
    LongBenchDataset(
        "passage_count",
        "count",
        32,
        "Below are paragraphs taken from Wikipedia, some of which may appear more than once. "
        "Read them carefully: you will be asked how many different paragraphs there are once "
        "duplicates are removed.\n\n{context}\n\n",
        "How many distinct paragraphs are there above, counting repeated ones once? Reply "
        "with the number only, for example 1, 2 or 3.\n\nThe final answer is: ",
    ),
    LongBenchDataset(
        "passage_retrieval_en",
        "retrieval",
        32,
        "Below are paragraphs taken from Wikipedia. Afterwards you will be given the abstract "
        "of one of them and asked which paragraph it summarises.\n\n{context}\n\n",
        "Here is the abstract.\n\n{input}\n\nWhich paragraph is the abstract taken from? "
        'Reply in the form "Paragraph 1", "Paragraph 2" and so on.\n\nThe answer is: ',
    ),
    LongBenchDataset(
        "lcc",
        "code_sim",
        64,
        "Complete the code below.\n{context}",
        "Next line of code:\n",
        chat_template=False,
    ),
    LongBenchDataset(
        "repobench-p",
        "code_sim",
        64,
        "Complete the code below.\n{context}",
        "{input}Next line of code:\n",
        chat_template=False,
    ),
    LongBenchDataset(
        "lsht",
        "classification",
        64,
        "请判断最后一条新闻属于哪个类别。下面先给出一些带有类别的新闻示例。\n\n{context}\n",
        "{input}",
        first_line_only=True,
        chat_template=False,
    ),
    LongBenchDataset(
        "passage_retrieval_zh",
        "retrieval_zh",
        32,
        "下面有若干段文字，随后会给出其中某一段的摘要，请找出摘要对应的段落。\n\n{context}\n\n",
        '摘要如下。\n\n{input}\n\n这个摘要出自哪一段？请按"段落1"、"段落2"这样的格式作答。\n\n答案是：',
    ),
)

LONGBENCH_DATASETS: Mapping[str, LongBenchDataset] = MappingProxyType(
    {d.name: d for d in _DATASETS}
)
"""Supported LongBench datasets by name."""

UNSUPPORTED_DATASETS: Mapping[str, str] = MappingProxyType(
    {
        "multifieldqa_zh": "its metric (qa_f1_zh) segments Chinese words with jieba",
        "dureader": "its metric (rouge_zh) segments Chinese words with jieba",
        "vcsum": "its metric (rouge_zh) segments Chinese words with jieba",
    }
)


def base_dataset_name(name: str) -> str:
    """LongBench-E datasets (``<name>_e``) share the settings of ``<name>``."""
    if name.endswith("_e") and name[:-2] in {*LONGBENCH_DATASETS, *UNSUPPORTED_DATASETS}:
        return name[:-2]
    return name


def longbench_dataset(name: str) -> LongBenchDataset:
    """The settings of a LongBench dataset; unsupported or unknown names raise ValueError."""
    base = base_dataset_name(name) if isinstance(name, str) else name
    if base in UNSUPPORTED_DATASETS:
        raise ValueError(
            f"LongBench dataset {name!r} is not supported: {UNSUPPORTED_DATASETS[base]}, "
            "which probkv does not depend on"
        )
    if base not in LONGBENCH_DATASETS:
        raise ValueError(
            f"unknown LongBench dataset {name!r}; supported: {', '.join(LONGBENCH_DATASETS)} "
            "(and their LongBench-E variants ending in '_e')"
        )
    return LONGBENCH_DATASETS[base]


def check_template(context_template: Any, question_template: Any, where: str) -> tuple[str, str]:
    """Validate one template pair (see the module docstring); errors name ``where``."""
    if not isinstance(context_template, str) or not isinstance(question_template, str):
        raise ValueError(f"{where}: 'context' and 'question' must both be strings")
    if context_template.count(CONTEXT_FIELD) != 1:
        raise ValueError(f"{where}: 'context' must contain {CONTEXT_FIELD} exactly once")
    if INPUT_FIELD in context_template:
        raise ValueError(
            f"{where}: 'context' must not contain {INPUT_FIELD}: the input belongs to the "
            "question part, which is read after eviction"
        )
    if CONTEXT_FIELD in question_template:
        raise ValueError(f"{where}: 'question' must not contain {CONTEXT_FIELD}")
    if question_template.count(INPUT_FIELD) > 1:
        raise ValueError(f"{where}: 'question' may contain {INPUT_FIELD} at most once")
    return context_template, question_template


def load_templates(path: str | os.PathLike[str]) -> dict[str, tuple[str, str]]:
    """Read a template override file: ``{dataset: {"context": ..., "question": ...}}``.
    Returns ``{dataset: (context_template, question_template)}``; bad files raise ValueError
    naming the file and the dataset."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = f.read(MAX_LINE_BYTES + 1)  # bounded: a template file is small
    except FileNotFoundError:
        raise ValueError(f"template file {str(p)!r} does not exist") from None
    except OSError as err:
        raise ValueError(f"cannot read template file {str(p)!r}: {err.strerror}") from None
    if len(data) > MAX_LINE_BYTES:
        raise ValueError(
            f"{p}: template file larger than the limit of {MAX_LINE_BYTES} bytes "
            f"({MAX_LINE_BYTES / 2**20:g} MiB)"
        )
    data = data.removeprefix(b"\xef\xbb\xbf")  # tolerate a byte-order mark
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise utf8_error(p, data, err, 1) from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{p}: invalid JSON at line {err.lineno} ({err.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError(
            f"{p}: a template file must be a JSON object mapping dataset names to templates"
        )
    out: dict[str, tuple[str, str]] = {}
    for name, entry in raw.items():
        where = f"{p}: dataset {name!r}"
        longbench_dataset(name)  # refuse unknown or unsupported names up front
        if not isinstance(entry, dict) or set(entry) != {"context", "question"}:
            raise ValueError(
                f"{where}: must be an object with exactly the keys 'context' and 'question'"
            )
        out[name] = check_template(entry["context"], entry["question"], where)
    return out


def example_from_longbench(
    record: Mapping[str, Any],
    templates: Mapping[str, tuple[str, str]] | None = None,
) -> Example:
    """Build an :class:`Example` from one LongBench record. Errors name the field."""
    for name in ("_id", "dataset", "input", "context", "answers"):
        if name not in record:
            raise ValueError(f"missing field {name!r}")
    dataset_name = check_str_field("dataset", record["dataset"], non_empty=True)
    try:
        dataset = longbench_dataset(dataset_name)
    except ValueError as err:
        raise ValueError(f"field 'dataset': {err}") from None
    example_id = check_str_field("_id", record["_id"], non_empty=True)
    question_input = check_str_field("input", record["input"])
    context = check_str_field("context", record["context"])
    answers = check_str_list_field("answers", record["answers"], non_empty=True)
    all_classes = record.get("all_classes")
    if all_classes is not None:
        all_classes = check_str_list_field(
            "all_classes", all_classes, non_empty=dataset.metric == "classification"
        )
    if dataset.metric == "classification" and not all_classes:
        raise field_error(
            "all_classes", f"must list the classes of dataset {dataset_name!r}", all_classes
        )
    length = record.get("length")
    if length is not None and (
        isinstance(length, bool) or not isinstance(length, int) or length < 0
    ):
        raise field_error("length", "must be a non-negative integer", length)
    language = record.get("language")
    if language is not None:
        check_str_field("language", language)

    context_template, question_template = dataset.context_template, dataset.question_template
    if templates is not None:
        for key in (dataset_name, dataset.name):
            if key in templates:
                context_template, question_template = templates[key]
                break
    return Example(
        id=example_id,
        task=dataset_name,
        context=context_template.replace(CONTEXT_FIELD, context),
        question=question_template.replace(INPUT_FIELD, question_input),
        answers=answers,
        max_new_tokens=dataset.max_new_tokens,
        metric=dataset.metric,
        all_classes=all_classes or None,
        first_line_only=dataset.first_line_only,
        chat_template=dataset.chat_template,
        metadata={"source": "longbench", "length": length, "language": language},
    )
