"""Tests of probkv.training.scorer and ``probkv train-scorer`` (S11), on a tiny model.

The training contexts never coincide with an evaluation's: their task seeds start at
``TRAIN_SEED_BASE``, above every seed an evaluation uses by default, and their prose seeds
are strings no integer seed renders to. The trainer is checked end to end (every feature kind
measured, resumable from the saved teacher statistics, the file usable by ``kvzap``).
"""

from __future__ import annotations

import argparse
import inspect

import pytest
import torch

from probkv.cli.main import build_parser, main
from probkv.eval.config import RunConfig
from probkv.eval.tasks import TASK_NAMES
from probkv.eval.tasks.generate import generate_examples
from probkv.experiments import attention_prompts, demo
from probkv.hf import compress, prepare_model
from probkv.models.testing import save_tiny_model_folder, tiny_model, tiny_tokenizer
from probkv.policies import parse_method
from probkv.scores import surrogate as sg
from probkv.training import scorer as ts

LENGTH = 700


def _default(func, name):
    return inspect.signature(func).parameters[name].default


def test_training_seeds_are_disjoint_from_every_evaluation_seed():
    eval_seeds = {
        RunConfig.__dataclass_fields__["seed"].default,
        demo.demo_config().seed,
        _default(attention_prompts.haystack_prompt, "seed"),
    }
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("eval", "task-attention-error"):
        for action in sub.choices[command]._actions:
            if action.dest == "seed":
                eval_seeds.add(action.default)
    assert eval_seeds == {0}
    assert ts.training_seed(0) == ts.TRAIN_SEED_BASE > 10**12
    # the evaluations' seeds are small: every one below a million is far from the range
    assert all(s < ts.TRAIN_SEED_BASE for s in [*eval_seeds, 10**6])
    # prose seeds: "probkv-prose:train-K" never equals "probkv-prose:<int>"
    tok = tiny_tokenizer()
    contexts = list(ts.training_contexts(tok, 5, LENGTH))  # byte tokens: the short tasks
    assert [c.kind for c in contexts] == list(ts.CONTEXT_KINDS[:5])
    assert contexts[0].id == "prose-train-0"
    for index, ctx in enumerate(contexts[1:], start=1):
        assert ctx.id.endswith(f"-{ts.training_seed(index)}-0")
    # and the contexts differ from the evaluation's examples of the same task and length
    for ctx in contexts[1:4]:
        (example,) = generate_examples(ctx.kind, tokenizer=tok, length=LENGTH, num_examples=1)
        assert example.id != ctx.id and tok.encode(example.context) != ctx.ids


def test_training_contexts_are_deterministic_and_fit_the_length():
    tok = tiny_tokenizer()
    a = list(ts.training_contexts(tok, 3, LENGTH))
    b = list(ts.training_contexts(tok, 3, LENGTH))
    assert a == b
    assert all(0 < len(c.ids) <= LENGTH for c in a)
    assert set(ts.CONTEXT_KINDS) == {"prose", *TASK_NAMES}


def _train(model, work):
    return ts.train_scorer(
        model,
        tiny_tokenizer(),
        name="tiny",
        work_dir=work,
        contexts=4,
        heldout=2,
        length=LENGTH,
        progress=False,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.set_num_threads(1)
    model = prepare_model(tiny_model("llama", num_hidden_layers=2))
    work = tmp_path_factory.mktemp("work")
    scorer = _train(model, work)
    return model, scorer, work


def test_train_scorer_measures_every_feature_kind(trained):
    model, scorer, work = trained
    assert sorted(scorer.layers) == [0, 1]
    assert set(scorer.metrics["by_features"]) == set(sg.FEATURE_KINDS)
    for row in scorer.metrics["by_features"].values():
        assert -1.0 <= row["spearman_mean"] <= 1.0
        assert set(row["kept_overlap"]) == {"0.5", "0.75", "0.9"}
        assert row["alpha"] in ts.ALPHAS
    assert scorer.features == "kv" and scorer.recipe["teacher"] == "kvzip"
    assert scorer.model["shapes"]["num_key_value_heads"] == model.config.num_key_value_heads
    assert len(list(work.glob("*.pt"))) == 4


def test_train_scorer_resumes_from_saved_teacher_statistics(trained):
    model, scorer, work = trained
    saved = {p.name: p.stat().st_mtime_ns for p in work.glob("*.pt")}
    again = _train(model, work)
    assert {p.name: p.stat().st_mtime_ns for p in work.glob("*.pt")} == saved
    for i in scorer.layers:
        torch.testing.assert_close(again.layers[i].weight, scorer.layers[i].weight)


def test_trained_scorer_evicts_by_name_and_is_refused_without_one(trained, tmp_path):
    model, scorer, _ = trained
    ids = torch.tensor([list(range(6, 206))])
    with pytest.raises(ValueError, match="no scorer for model"):
        compress(model, ids, parse_method("kvzap", 0.5))
    path = tmp_path / "tiny.pt"
    sg.save_scorer(scorer, path)
    loaded = sg.load_scorer(path)
    for method in ("kvzap", "topk:kvzap", "prob:kvzap"):
        policy = parse_method(method, 0.5)
        policy = type(policy)(
            **{**policy.__dict__, "score_params": {**policy.score_params, "surrogate": loaded}}
        )
        cache = compress(model, ids, policy)
        assert 0.4 < cache.effective_ratio() < 0.6
    other = prepare_model(tiny_model("llama", num_hidden_layers=3))
    with pytest.raises(ValueError, match="trained for another model"):
        compress(other, ids, policy)


def test_train_scorer_mlp_form_reports_both_forms_on_the_same_contexts(trained, tmp_path):
    """The MLP form starts from the ridge fit and is measured beside it on the same held-out
    contexts; the file reads back as an MLP scorer that evicts by name."""
    model, linear, work = trained
    mlp = ts.train_scorer(
        model,
        tiny_tokenizer(),
        name="tiny",
        work_dir=work,
        contexts=4,
        heldout=2,
        length=LENGTH,
        progress=False,
        form="mlp",
        hidden=8,
        mlp_rows=64,
        epochs=3,
    )
    assert mlp.form == "mlp" and mlp.recipe["form"] == "mlp" and mlp.recipe["hidden"] == 8
    assert set(mlp.metrics["by_form"]) == {"linear", "mlp"}
    # the linear row is the linear scorer's own held-out measurement
    assert mlp.metrics["by_form"]["linear"]["spearman_mean"] == pytest.approx(
        linear.metrics["spearman_mean"]
    )
    assert mlp.metrics["spearman_mean"] == mlp.metrics["by_form"]["mlp"]["spearman_mean"]
    for i, fit in mlp.layers.items():
        assert fit.w1.shape == (fit.weight.shape[0], 8) and fit.w2.shape == (8, fit.weight.shape[1])
        info = mlp.metrics["by_form"]["mlp"]["per_layer"][str(i)]
        assert info["val_mse"] <= info["val_mse_linear"]  # the best epoch, or the start
    path = tmp_path / "mlp.pt"
    sg.save_scorer(mlp, path)
    loaded = sg.load_scorer(path)
    policy = parse_method("prob:kvzap", 0.5)
    policy = type(policy)(
        **{**policy.__dict__, "score_params": {**policy.score_params, "surrogate": loaded}}
    )
    cache = compress(model, torch.tensor([list(range(6, 206))]), policy)
    assert 0.4 < cache.effective_ratio() < 0.6


def test_train_scorer_bad_input(trained):
    model, _, work = trained
    with pytest.raises(ValueError, match="heldout"):
        ts.train_scorer(model, tiny_tokenizer(), name="t", work_dir=work, contexts=4, heldout=1)
    with pytest.raises(ValueError, match="features"):
        ts.train_scorer(model, tiny_tokenizer(), name="t", work_dir=work, features="hidden")
    with pytest.raises(ValueError, match="teacher must be one of"):
        ts.train_scorer(model, tiny_tokenizer(), name="t", work_dir=work, teacher="h2o")
    with pytest.raises(ValueError, match="form must be one of"):
        ts.train_scorer(model, tiny_tokenizer(), name="t", work_dir=work, form="tree")
    with pytest.raises(ValueError, match="hidden must be"):
        ts.train_scorer(model, tiny_tokenizer(), name="t", work_dir=work, form="mlp", hidden=0)


def test_train_scorer_on_kvzip_plus_refuses_another_teachers_statistics(trained, tmp_path):
    """S11: KVzap's teacher, KVzip+; a work folder saved for KVzip is refused by name (its
    targets are another score), a fresh one trains and records the teacher."""
    model, _, work = trained
    with pytest.raises(ValueError, match="saved for teacher 'kvzip', not 'kvzip-plus'"):
        ts.train_scorer(
            model,
            tiny_tokenizer(),
            name="t",
            work_dir=work,
            contexts=4,
            heldout=2,
            length=LENGTH,
            progress=False,
            teacher="kvzip-plus",
        )
    plus = ts.train_scorer(
        model,
        tiny_tokenizer(),
        name="t",
        work_dir=tmp_path / "plus",
        contexts=4,
        heldout=2,
        length=LENGTH,
        progress=False,
        teacher="kvzip-plus",
    )
    assert plus.recipe["teacher"] == "kvzip-plus" and sorted(plus.layers) == [0, 1]


def test_train_scorer_cli(tmp_path, capsys):
    folder = save_tiny_model_folder(tmp_path / "model", num_hidden_layers=1)
    out = tmp_path / "s.pt"
    argv = [
        "train-scorer",
        "--model",
        str(folder),
        "--out",
        str(out),
        "--contexts",
        "3",
        "--heldout",
        "2",
        "--length",
        str(LENGTH),
        "--dtype",
        "float32",
        "--form",
        "mlp",
        "--hidden",
        "4",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "features kv " in printed and "spearman per layer (mlp)" in printed
    assert "form linear" in printed and "form mlp" in printed
    assert sg.load_scorer(out).model["name"] == str(folder) and sg.load_scorer(out).form == "mlp"
    assert (tmp_path / "s.pt.work").is_dir()
    assert main(["train-scorer", "--out", str(tmp_path)]) == 2  # a folder, refused
