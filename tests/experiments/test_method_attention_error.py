"""Attention error of whole methods on task examples (probkv.experiments.method_attention_error, S7)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from probkv.experiments import attention_error as ae
from probkv.experiments import method_attention_error as mae
from probkv.hf import RepeatPrompt, capture_attention, compress, prepare_model
from probkv.models.testing import save_tiny_model_folder, tiny_model
from probkv.policies import parse_method

torch.set_num_threads(1)

T = 40  # prompt length of the tiny-model tests
# a reconstruction prompt in the tiny vocabulary (S10.1), as tests/hf/test_reconstruct.py
REPEAT = RepeatPrompt(first=(7, 8, 9), later=(10, 11), suffix=(12, 13))


@pytest.fixture(scope="module")
def llama():
    return prepare_model(tiny_model("llama"))


def token_ids(n: int, seed: int) -> list[int]:
    return torch.randint(6, 262, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CONTEXT = token_ids(T, 0)
DECODE = token_ids(6, 1)  # 4 "question" tokens, then 2 "answer" tokens
NUM_FED = 4


def reference_outputs(model, layers):
    captures = capture_attention(model, CONTEXT + DECODE, keep_tensors=False)
    return [captures[i].output[:, T:] for i in layers]


def one_token_at_a_time(model, policy, layers, reference) -> torch.Tensor:
    """Slow reference: compress, then feed the decode tokens one forward each (what
    ``attention_error._compounded_error`` does), error per token as Eq. 11 per head."""
    cache = compress(model, torch.tensor([CONTEXT]), policy, repeat_prompt=REPEAT)
    out = []
    for n, token in enumerate(DECODE):
        captures = capture_attention(model, [token], cache=cache, keep_tensors=False)
        errors = [
            ae.head_errors(ref[:, n], captures[i].output[:, 0]) for ref, i in zip(reference, layers)
        ]
        out.append(torch.cat(errors).mean())
    return torch.stack(out)


@pytest.mark.parametrize("method", ["snapkv", "prob:h2o", "prob:kvzip/core=0.75", "kvzip"])
def test_one_forward_equals_one_token_at_a_time(llama, method):
    """The fast path (all decode tokens in one causal forward through the evicted cache)
    gives the per-token errors of feeding them one by one, for prefill and reconstruction
    scores."""
    layers = ae.evicting_layers(llama)
    reference = reference_outputs(llama, layers)
    policy = parse_method(method, ratio=0.5)
    cache = compress(llama, torch.tensor([CONTEXT]), policy, repeat_prompt=REPEAT)
    fast = mae.token_errors(llama, cache, torch.tensor(DECODE), reference, layers)
    slow = one_token_at_a_time(llama, policy, layers, reference)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-4)
    assert (fast > 0).all()


def test_rows_match_the_integration_seed_by_seed(llama):
    """A sampled method's row is the mean and population std over seeds of what compress
    with that seed gives; a deterministic one runs once; the parts average the right tokens
    (``all`` is the token-weighted mean of ``question`` and ``answer``)."""
    rows = mae.measure_method_errors(
        llama,
        CONTEXT,
        DECODE,
        num_fed=NUM_FED,
        methods=["prob:h2o", "tova"],
        ratios=[0.5],
        seeds=3,
        repeat_prompt=REPEAT,
        example="ex",
    )
    assert [tuple(r) for r in rows] == [mae.METHOD_ROW_FIELDS] * 6
    by = {(r["method"], r["part"]): r for r in rows}
    layers = ae.evicting_layers(llama)
    reference = reference_outputs(llama, layers)
    per_seed = [
        one_token_at_a_time(
            llama, dataclasses.replace(parse_method("prob:h2o", 0.5), seed=s), layers, reference
        )
        for s in range(3)
    ]
    question = torch.stack([e[:NUM_FED].mean() for e in per_seed]).double()
    answer = torch.stack([e[NUM_FED:].mean() for e in per_seed]).double()
    assert by["prob:h2o", "question"]["mae_mean"] == pytest.approx(float(question.mean()), rel=1e-4)
    assert by["prob:h2o", "question"]["mae_std"] == pytest.approx(
        float(question.std(unbiased=False)), rel=1e-3, abs=1e-7
    )
    assert by["prob:h2o", "answer"]["mae_mean"] == pytest.approx(float(answer.mean()), rel=1e-4)
    assert by["prob:h2o", "question"]["seeds"] == 3 and by["tova", "all"]["seeds"] == 1
    assert by["tova", "all"]["mae_std"] == 0.0
    for method in ("prob:h2o", "tova"):
        q, a, both = (by[method, p] for p in ("question", "answer", "all"))
        assert (q["tokens"], a["tokens"], both["tokens"]) == (NUM_FED, 2, 6)
        expected = (NUM_FED * q["mae_mean"] + 2 * a["mae_mean"]) / 6
        assert both["mae_mean"] == pytest.approx(expected, rel=1e-6)
        assert both["effective_ratio"] == pytest.approx(0.5, abs=0.05)
        assert both["num_heads"] == 8  # 2 evicted layers x 4 query heads


def test_rows_carry_canonical_method_names(llama):
    rows = mae.measure_method_errors(
        llama,
        CONTEXT,
        DECODE,
        num_fed=NUM_FED,
        methods=["prob:h2o/core=0.5/block=8", "topk:snapkv/window=32"],
        ratios=[0.5],
        seeds=1,
    )
    assert {r["method"] for r in rows} == {"prob:h2o", "snapkv"}


def test_no_answer_tokens_gives_no_answer_row(llama):
    rows = mae.measure_method_errors(
        llama, CONTEXT, DECODE[:NUM_FED], num_fed=NUM_FED, methods=["snapkv"], ratios=[0.5]
    )
    assert [r["part"] for r in rows] == ["question", "all"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"methods": ["full"]}, "full cache, the reference"),
        ({"methods": ["snapkv", "snapkv"]}, "snapkv twice"),
        ({"methods": ["prob:kvzip", "prob:kvzip/block=32/units=spans"]}, "prob:kvzip twice"),
        ({"methods": ["nosuch"]}, "nosuch"),
        ({"methods": []}, "at least one method"),
        ({"ratios": [0.0]}, r"\(0, 1\)"),
        ({"ratios": [1.5]}, "ratios"),
        ({"seeds": 0}, "seeds"),
        ({"num_fed": 7}, r"num_fed must be in \[0, 6\]"),
    ],
)
def test_bad_arguments_are_refused_by_name(llama, kwargs, match):
    args = {"num_fed": NUM_FED, "methods": ["snapkv"], "ratios": [0.5], "seeds": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        mae.measure_method_errors(llama, CONTEXT, DECODE, **args)


def test_mean_over_examples_counts_wins_against_the_top_k_version():
    def row(example, method, error):
        return {
            "example": example,
            "method": method,
            "ratio": 0.5,
            "part": "all",
            "mae_mean": error,
        }

    rows = [
        row("a", "kvzip", 0.3), row("b", "kvzip", 0.2), row("c", "kvzip", 0.1),
        row("a", "prob:kvzip/core=0.75", 0.1), row("b", "prob:kvzip/core=0.75", 0.1),
        row("c", "prob:kvzip/core=0.75", 0.2),
        row("a", "topk:tova", 0.5), row("a", "prob:tova", 0.4), row("a", "prob:knorm", 0.4),
    ]  # fmt: skip
    summary = {s["method"]: s for s in mae.mean_over_examples(rows)}
    z = summary["prob:kvzip/core=0.75"]
    assert (z["reference"], z["lower"], z["higher"], z["examples"]) == ("kvzip", 2, 1, 3)
    assert z["p"] == 1.0  # 2 against 1 is no evidence
    assert summary["kvzip"]["p"] is None
    assert z["mae_mean"] == pytest.approx(0.4 / 3)
    assert (summary["prob:tova"]["reference"], summary["prob:tova"]["lower"]) == ("topk:tova", 1)
    assert summary["prob:knorm"]["reference"] is None  # its top-k version did not run
    assert summary["kvzip"]["reference"] is None


def test_cli_end_to_end_on_a_tiny_model_folder(tmp_path, capsys):
    """The command on a saved tiny model and a probkv-format data file: the question is fed
    after eviction, the header records the examples, the summary compares prob with top-k."""
    from probkv.cli import main as cli

    folder = save_tiny_model_folder(tmp_path / "tiny", "llama")
    data = tmp_path / "data.jsonl"
    records = [
        {"id": f"ex{i}", "task": "t", "context": "The river is wide. " * 4 + f"Code {i}7{i}.",
         "question": "\nWhat is the code?", "answers": [f"{i}7{i}"], "max_new_tokens": 4}
        for i in range(2)
    ]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    out = tmp_path / "res.json"
    status = cli.main(
        ["task-attention-error", "--model", str(folder), "--data", str(data), "--methods",
         "snapkv,prob:snapkv", "--ratios", "0.5,0.75", "--seeds", "2", "--answer-tokens", "3",
         "--out", str(out)]
    )  # fmt: skip
    assert status == 0
    result = json.loads(out.read_text())
    header, rows, summary = result["header"], result["rows"], result["summary"]
    assert [e["example"] for e in header["examples"]] == ["ex0", "ex1"]
    assert all(e["fed_tokens"] > 0 for e in header["examples"])
    assert len(rows) == 2 * 2 * 2 * 3  # examples x methods x ratios x parts
    answer = [r for r in rows if r["part"] == "answer"]
    assert {r["tokens"] for r in answer} == {3}
    versus = [s for s in summary if s["method"] == "prob:snapkv"]
    assert {s["reference"] for s in versus} == {"snapkv"}
    assert all(s["lower"] + s["higher"] <= 2 for s in versus)
    assert "wrote 24 rows (2 examples)" in capsys.readouterr().out
    # a bad method is refused before any model is loaded
    bad = cli.main(
        ["task-attention-error", "--model", str(tmp_path / "missing"), "--data", str(data),
         "--methods", "full", "--out", str(out)]
    )  # fmt: skip
    assert bad == 2 and "full cache, the reference" in capsys.readouterr().err
