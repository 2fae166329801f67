"""load_examples: probkv's and LongBench's JSONL formats, defaults, malformed files (SPEC S7)."""

from __future__ import annotations

import json

import pytest

from probkv.eval.data import load_examples

GOOD = {
    "id": "a",
    "task": "niah_single_1",
    "context": "The grass is green. A special magic number for x is 1234567.",
    "question": "\n\nWhat is the special magic number for x?",
    "answers": ["1234567"],
    "max_new_tokens": 16,
}

LONGBENCH_GOOD = {
    "input": "Who wrote it?",
    "context": "Passage 1: It was written by Ann.",
    "answers": ["Ann"],
    "length": 7,
    "dataset": "hotpotqa",
    "language": "en",
    "all_classes": None,
    "_id": "lb1",
}


def _write(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text(
        "".join(
            (line if isinstance(line, str) else json.dumps(line, ensure_ascii=False)) + "\n"
            for line in lines
        ),
        encoding="utf-8",
    )
    return path


def test_probkv_format_with_defaults_per_task(tmp_path):
    lines = [
        GOOD,
        {**GOOD, "id": "b", "task": "qa"},
        {**GOOD, "id": "c", "task": "hotpotqa"},
        {**GOOD, "id": "d", "task": "trec", "all_classes": ["Human", "Location"]},
        {**GOOD, "id": "e", "task": "my_own_task", "source": "web", "difficulty": 3},
        {**GOOD, "id": "f", "task": "my_own_task", "metric": "qa_f1", "metric_note": None},
        "",  # blank lines are skipped
    ]
    examples = load_examples(_write(tmp_path, lines))
    assert [e.metric for e in examples] == [
        "string_match_all",
        "string_match_part",
        "qa_f1",
        "classification",
        "string_match_all",
        "qa_f1",
    ]
    trec = examples[3]
    assert trec.first_line_only and not trec.chat_template
    assert examples[4].metadata == {"source": "web", "difficulty": 3}
    assert examples[0].answer_prefix == "" and examples[0].chat_template


def test_longbench_format_is_detected_and_templated(tmp_path):
    path = _write(
        tmp_path, [LONGBENCH_GOOD, {**LONGBENCH_GOOD, "_id": "lb2", "dataset": "hotpotqa_e"}]
    )
    examples = load_examples(path)
    ex = examples[0]
    assert (ex.id, ex.task, ex.metric, ex.max_new_tokens) == ("lb1", "hotpotqa", "qa_f1", 32)
    # The context part holds the passages, the question part the input (question-agnostic).
    assert LONGBENCH_GOOD["context"] in ex.context and "Who wrote it?" not in ex.context
    assert "Who wrote it?" in ex.question
    assert examples[1].task == "hotpotqa_e" and examples[1].metric == "qa_f1"
    assert load_examples(path, format="longbench") == examples


def _message(tmp_path, lines, **kw):
    path = _write(tmp_path, lines)
    with pytest.raises(ValueError) as err:
        load_examples(path, **kw)
    return str(path), str(err.value)


@pytest.mark.parametrize(
    ("bad", "field", "detail"),
    [
        ({k: v for k, v in GOOD.items() if k != "answers"}, "answers", "missing field"),
        ({**GOOD, "max_new_tokens": "16"}, "max_new_tokens", "integer"),
        ({**GOOD, "answers": []}, "answers", "non-empty"),
        ({**GOOD, "answers": ["ok", 5]}, "answers", "only strings"),
        ({**GOOD, "max_new_tokens": 0}, "max_new_tokens", ">= 1"),
        ({**GOOD, "max_new_tokens": -3}, "max_new_tokens", ">= 1"),
        ({**GOOD, "metric": "bleu"}, "metric", "must be one of"),
        ({**GOOD, "context": 12}, "context", "string"),
        ({**GOOD, "task": "trec"}, "all_classes", "required"),
        ({**GOOD, "id": "first"}, "id", "duplicate"),
    ],
)
def test_malformed_probkv_lines_name_file_line_and_field(tmp_path, bad, field, detail):
    path, message = _message(tmp_path, [{**GOOD, "id": "first"}, bad])
    assert message.startswith(f"{path}:2: ")
    assert f"'{field}'" in message and detail in message


def test_invalid_json_names_file_and_line(tmp_path):
    path, message = _message(tmp_path, [GOOD, '{"id": "b", "task": '])
    assert message.startswith(f"{path}:2: invalid JSON")
    path, message = _message(tmp_path, [GOOD, '{"id": NaN}'])
    assert message.startswith(f"{path}:2: invalid JSON")
    path, message = _message(tmp_path, ["[1, 2]"])
    assert message.startswith(f"{path}:1: ") and "JSON object" in message


@pytest.mark.parametrize(
    ("bad", "field", "detail"),
    [
        ({k: v for k, v in LONGBENCH_GOOD.items() if k != "input"}, "input", "missing field"),
        ({**LONGBENCH_GOOD, "answers": []}, "answers", "non-empty"),
        ({**LONGBENCH_GOOD, "context": ["x"]}, "context", "string"),
        ({**LONGBENCH_GOOD, "dataset": "not_a_dataset"}, "dataset", "unknown LongBench dataset"),
        ({**LONGBENCH_GOOD, "dataset": "dureader"}, "dataset", "jieba"),
        ({**LONGBENCH_GOOD, "dataset": "trec"}, "all_classes", "must list the classes"),
        ({**LONGBENCH_GOOD, "length": "long"}, "length", "non-negative integer"),
    ],
)
def test_malformed_longbench_lines_name_file_line_and_field(tmp_path, bad, field, detail):
    path, message = _message(tmp_path, [LONGBENCH_GOOD, bad])
    assert message.startswith(f"{path}:2: ")
    assert f"'{field}'" in message and detail in message


def test_format_detection_and_explicit_format(tmp_path):
    path, message = _message(tmp_path, [{"text": "hello"}])
    assert message.startswith(f"{path}:1: cannot tell the data format")
    # A probkv file read as LongBench: the first line lacks LongBench's fields.
    path, message = _message(tmp_path, [GOOD], format="longbench")
    assert message.startswith(f"{path}:1: ") and "'_id'" in message
    with pytest.raises(ValueError, match="format"):
        load_examples(_write(tmp_path, [GOOD]), format="csv")
    path, message = _message(tmp_path, [GOOD], templates={})
    assert "LongBench files only" in message


def test_byte_order_mark_is_tolerated(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_text("\ufeff" + json.dumps(GOOD) + "\n", encoding="utf-8")
    assert load_examples(path)[0].id == "a"


def test_empty_or_missing_file(tmp_path):
    path, message = _message(tmp_path, ["", "   "])
    assert message == f"{path}: no examples (the file is empty)"
    with pytest.raises(ValueError, match="does not exist"):
        load_examples(tmp_path / "nope.jsonl")
