"""load_examples: probkv's and LongBench's JSONL formats, defaults, malformed files (S7)."""

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


# -- encodings and limits (issue 11) -------------------------------------------------------------


def test_non_utf8_file_names_file_line_and_byte(tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = json.dumps(GOOD).encode()
    bad = json.dumps({**GOOD, "id": "b", "context": "caf\u00e9"}, ensure_ascii=False).encode(
        "latin-1"
    )
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n\n" + bad + b"\n")
    with pytest.raises(ValueError) as err:
        load_examples(path)
    column = bad.index(b"\xe9") + 1
    assert str(err.value) == (
        f"{path}:3: not valid UTF-8 (byte 0xe9 at byte {column} of the line); "
        "data files must be UTF-8 text"
    )


def test_binary_file_is_refused_on_its_first_line(tmp_path):
    path = tmp_path / "data.jsonl.gz"
    path.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)))
    with pytest.raises(ValueError, match=rf"^{path}:1: not valid UTF-8 \(byte 0x8b at byte 2"):
        load_examples(path)


def test_huge_max_new_tokens_names_example_value_and_bound(tmp_path):
    path, message = _message(tmp_path, [GOOD, {**GOOD, "id": "big", "max_new_tokens": 10**9}])
    assert message == (
        f"{path}:2: example 'big': field 'max_new_tokens' must be <= 4096 (the bound on an "
        "example's generation budget), got 1000000000"
    )
    assert load_examples(_write(tmp_path, [{**GOOD, "max_new_tokens": 4096}]))[0].max_new_tokens


def test_line_over_the_size_limit_is_refused_before_parsing(tmp_path):
    """A line of 16 MiB + 1 byte is refused from a bounded read (never parsed or read whole);
    one of exactly 16 MiB is accepted."""
    limit = 16 * 2**20
    record = {**GOOD, "context": ""}
    pad = limit - len(json.dumps(record))
    at_limit = {**record, "context": "x" * pad}
    over = {**record, "id": "over", "context": "x" * (pad + 1)}
    path = _write(tmp_path, [at_limit])
    assert len(path.read_bytes()) == limit + 1  # the line and its newline
    assert len(load_examples(path)[0].context) == pad
    path, message = _message(tmp_path, [at_limit, over])
    assert message == (
        f"{path}:2: line longer than the limit of {limit} bytes (16 MiB); split the example "
        "or shorten its context"
    )
