"""LongBench datasets: settings per dataset, templates and overrides (S7)."""

from __future__ import annotations

import json

import pytest

from probkv.eval import longbench
from probkv.eval.data import load_examples
from probkv.eval.examples import score_example
from probkv.eval.longbench import (
    LONGBENCH_DATASETS,
    UNSUPPORTED_DATASETS,
    check_template,
    example_from_longbench,
    load_templates,
    longbench_dataset,
)

# LongBench's eval.py (dataset2metric) and pred.py (dataset2maxlen), written out by hand.
LONGBENCH = {
    "narrativeqa": ("qa_f1", 128),
    "qasper": ("qa_f1", 128),
    "multifieldqa_en": ("qa_f1", 64),
    "multifieldqa_zh": ("qa_f1_zh", 64),
    "hotpotqa": ("qa_f1", 32),
    "2wikimqa": ("qa_f1", 32),
    "musique": ("qa_f1", 32),
    "dureader": ("rouge_zh", 128),
    "gov_report": ("rouge_l", 512),
    "qmsum": ("rouge_l", 512),
    "multi_news": ("rouge_l", 512),
    "vcsum": ("rouge_zh", 512),
    "trec": ("classification", 64),
    "triviaqa": ("qa_f1", 32),
    "samsum": ("rouge_l", 128),
    "lsht": ("classification", 64),
    "passage_count": ("count", 32),
    "passage_retrieval_en": ("retrieval", 32),
    "passage_retrieval_zh": ("retrieval_zh", 32),
    "lcc": ("code_sim", 64),
    "repobench-p": ("code_sim", 64),
}
FIRST_LINE = {"trec", "triviaqa", "samsum", "lsht"}
NO_CHAT = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}


def test_every_longbench_dataset_is_supported_or_refused_by_name():
    assert set(LONGBENCH_DATASETS) | set(UNSUPPORTED_DATASETS) == set(LONGBENCH)
    assert not set(LONGBENCH_DATASETS) & set(UNSUPPORTED_DATASETS)
    for name in UNSUPPORTED_DATASETS:
        with pytest.raises(ValueError, match=f"{name}.*jieba"):
            longbench_dataset(name)
        with pytest.raises(ValueError, match="jieba"):
            longbench_dataset(name + "_e")


@pytest.mark.parametrize("name", sorted(LONGBENCH_DATASETS))
def test_dataset_settings_follow_longbench(name):
    dataset = longbench_dataset(name)
    assert (dataset.metric, dataset.max_new_tokens) == LONGBENCH[name]
    assert dataset.first_line_only == (name in FIRST_LINE)
    assert dataset.chat_template == (name not in NO_CHAT)
    check_template(dataset.context_template, dataset.question_template, name)
    assert longbench_dataset(name + "_e") is dataset


def test_record_becomes_context_then_question():
    record = {
        "_id": "x1",
        "dataset": "passage_retrieval_en",
        "input": "An abstract about rivers.",
        "context": "Paragraph 1: Mountains. Paragraph 2: Rivers.",
        "answers": ["Paragraph 2"],
        "all_classes": None,
    }
    ex = example_from_longbench(record)
    assert ex.context.count(record["context"]) == 1 and record["input"] not in ex.context
    assert ex.question.count(record["input"]) == 1
    assert ex.context.endswith("\n\n")  # the question part follows verbatim
    assert (ex.metric, ex.max_new_tokens, ex.chat_template) == ("retrieval", 32, True)
    assert score_example(ex, "Paragraph 2") == 1.0
    assert ex.metadata["source"] == "longbench"


def test_code_and_classification_records():
    code = {
        "_id": "c",
        "dataset": "lcc",
        "input": "",
        "context": "def f():\n",
        "answers": ["    return 1"],
    }
    ex = example_from_longbench(code)
    assert ex.context.endswith("def f():\n") and ex.question == "Next line of code:\n"
    assert not ex.chat_template
    assert score_example(ex, "```\n    return 1\n```") == 1.0
    trec = {
        "_id": "t",
        "dataset": "trec",
        "input": "Question: Where is Rome?\nType:",
        "context": "Question: Who is he?\nType: Human",
        "answers": ["Location"],
        "all_classes": ["Human", "Location"],
    }
    ex = example_from_longbench(trec)
    assert ex.all_classes == ("Human", "Location") and ex.first_line_only
    assert score_example(ex, " Location\nQuestion: Who? Type: Human") == 1.0


def test_template_override_file(tmp_path):
    templates = {"hotpotqa": {"context": "CTX {context} END\n", "question": "Q: {input}\nA:"}}
    tpath = tmp_path / "templates.json"
    tpath.write_text(json.dumps(templates), encoding="utf-8")
    record = {
        "_id": "h",
        "dataset": "hotpotqa",
        "input": "who?",
        "context": "text",
        "answers": ["a"],
    }
    data = tmp_path / "lb.jsonl"
    data.write_text(
        json.dumps(record) + "\n" + json.dumps({**record, "_id": "m", "dataset": "musique"}) + "\n"
    )
    hotpot, musique = load_examples(data, templates=tpath)
    assert (hotpot.context, hotpot.question) == ("CTX text END\n", "Q: who?\nA:")
    # Datasets not in the file keep probkv's templates.
    assert musique.context == example_from_longbench({**record, "dataset": "musique"}).context
    # Braces in the data are not template syntax.
    braces = example_from_longbench({**record, "context": "{x} {input}"}, load_templates(tpath))
    assert braces.context == "CTX {x} {input} END\n"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"context": "no field", "question": "{input}"}, "exactly once"),
        ({"context": "{context} {context}", "question": "{input}"}, "exactly once"),
        ({"context": "{context} {input}", "question": ""}, "must not contain {input}"),
        ({"context": "{context}", "question": "{context}"}, "must not contain {context}"),
        ({"context": "{context}", "question": "{input}{input}"}, "at most once"),
        ({"context": "{context}"}, "exactly the keys"),
        ({"context": "{context}", "question": 3}, "strings"),
    ],
)
def test_bad_template_files_name_file_and_dataset(tmp_path, entry, message):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"qasper": entry}), encoding="utf-8")
    with pytest.raises(ValueError, match=message) as err:
        load_templates(path)
    assert str(path) in str(err.value) and "qasper" in str(err.value)


def test_template_file_errors(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"qasper": ', encoding="utf-8")
    with pytest.raises(ValueError, match="invalid JSON"):
        load_templates(path)
    path.write_text(
        json.dumps({"vcsum": {"context": "{context}", "question": ""}}), encoding="utf-8"
    )
    with pytest.raises(ValueError, match="jieba"):
        load_templates(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_templates(tmp_path / "missing.json")


def test_template_file_encoding_and_size_errors(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    path.write_bytes(b'{"qasper": {\n  "context": "caf\xe9 {context}",\n  "question": ""}}')
    with pytest.raises(ValueError) as err:
        load_templates(path)
    assert str(err.value) == (
        f"{path}:2: not valid UTF-8 (byte 0xe9 at byte 18 of the line); "
        "data files must be UTF-8 text"
    )
    path.write_bytes(
        b"\xef\xbb\xbf" + json.dumps({"qasper": {"context": "{context}", "question": ""}}).encode()
    )
    assert load_templates(path) == {"qasper": ("{context}", "")}
    monkeypatch.setattr(longbench, "MAX_LINE_BYTES", 16)
    with pytest.raises(ValueError, match=rf"^{path}: template file larger than the limit of 16"):
        load_templates(path)
