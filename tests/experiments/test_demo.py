"""``probkv demo`` (issues 6 and 43): its plan (methods x ratios x settings), its tables, the
``probkv eval`` command it prints, and its whole plan run on a tiny model."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from probkv.cli.main import build_parser
from probkv.eval import Example, runner
from probkv.eval.config import RunConfig, config_identity
from probkv.eval.plan import plan_units
from probkv.eval.store import RESULTS_FILE, SUMMARY_MD, read_results
from probkv.eval.summary import summarize
from probkv.experiments import demo
from probkv.models import DEFAULT_MODEL, load_model_config
from probkv.models.testing import save_tiny_model_folder, tiny_scorer
from probkv.scores import scorer_lookup

torch.set_num_threads(1)

EVICTING = ("kvzap", "prob:kvzap", "kvzip", "prob:kvzip", "prob:min-h")


def test_demo_plan():
    """Issue 43: full, the setting's best top-k, kvzap / prob:kvzap, kvzip / prob:kvzip and
    prob:min-h once, at r = 0.5, 0.75 and 0.9, in both settings."""
    agnostic, aware = (demo.demo_config(question_aware=qa) for qa in (False, True))
    assert agnostic.model == aware.model == DEFAULT_MODEL
    assert agnostic.methods == ("full", "streaming_llm", *EVICTING)
    assert aware.methods == ("full", "snapkv", *EVICTING)
    assert not agnostic.question_aware and aware.question_aware
    for cfg in (agnostic, aware):
        assert cfg.ratios == (0.5, 0.75, 0.9)
        assert cfg.tasks == ("niah_single_1", "niah_single_2", "niah_multikey_1")
        assert 1000 <= cfg.lengths[0] <= 2000 and cfg.per_task * len(cfg.tasks) >= 9
        assert len(cfg.jobs_per_example()) == 1 + 6 * 3  # full once, then 6 methods x 3 ratios
    # Jobs of one score share a prefill: full | the baseline's 3 ratios | kvzap and prob:kvzap
    # (6) | kvzip and prob:kvzip (6: one reconstruction pass, S10.1) | prob:min-h (3).
    units = plan_units([Example("x", "t", "c", "q", ("a",), 4)], agnostic.jobs_per_example())
    assert sorted(len(u.jobs) for u in units) == [1, 3, 3, 6, 6]
    # A model without a kvzap scorer runs the rest.
    assert demo.demo_config(kvzap=False).methods == (
        "full",
        "streaming_llm",
        "kvzip",
        "prob:kvzip",
        "prob:min-h",
    )


@pytest.mark.parametrize("question_aware", [False, True])
def test_the_printed_eval_command_resumes_the_demo_folder(question_aware):
    config = demo.demo_config("some/folder", question_aware=question_aware, dtype="float32")
    argv = demo.eval_command(config, "demo-out/x", workers=2)
    assert argv[:2] == ["probkv", "eval"]
    args = build_parser().parse_args(argv[1:])
    again = RunConfig(
        model=args.model,
        methods=tuple(args.methods),
        ratios=tuple(args.ratios),
        tasks=tuple(args.tasks),
        lengths=tuple(args.lengths),
        per_task=args.per_task,
        seed=args.seed,
        question_aware=args.question_aware,
        dtype=args.dtype,
    )
    assert config_identity(again) == config_identity(config)
    assert (args.out, args.workers) == ("demo-out/x", 2)


def _row(method, ratio, score, example="e", task="niah_single_1", prefill=2.0, aware=False):
    return {
        "id": example,
        "task": task,
        "method": method,
        "ratio": ratio,
        "score": score,
        "effective_ratio": ratio,
        "cache_bytes": 2**20 * (1 - ratio),
        "prefill_s": prefill,
        "decode_s": 1.0,
        "question_aware": aware,
    }


def test_demo_table():
    rows = [_row("full", 0.0, 1.0), _row("snapkv", 0.5, 0.0), _row("prob:min-h", 0.5, 0.5)]
    rows.append(_row("prob:snapkv", 0.5, 1.0))
    rows[2]["effective_ratio"] = 0.49
    rows[2]["cache_bytes"] = 2**20 * 0.51
    table = demo.demo_table(summarize(rows))
    lines = table.splitlines()
    assert lines[0].startswith(
        "| method | r | niah_single_1 | average | kept of full | vs top-k | effective r | cache |"
    )
    assert lines[2] == (
        "| full (no eviction) | — | 1.00 | 1.000 | — | — | 0.000 ± 0.000 | 1.0 MiB | 2.0 | 1.0 |"
    )
    assert lines[3].startswith("| snapkv | 0.5 | 0.00 | 0.000 | 0% | — |")
    assert lines[4] == (
        "| prob:min-h | 0.5 | 0.50 | 0.500 | 50% | — | 0.490 ± 0.000 | 522.2 KiB | 2.0 | 1.0 |"
    )  # its top-k did not run
    assert lines[5].startswith("| prob:snapkv | 0.5 | 1.00 | 1.000 | 100% | +1-0 snapkv |")


def _fake_run(setting, aware, methods, scores, prefill):
    """A DemoRun from rows: ``scores[method]`` per ratio (0.5, 0.75), two examples."""
    rows = [_row("full", 0.0, 1.0, ex, prefill=1.0, aware=aware) for ex in ("a", "b")]
    for m in methods:
        for ratio, kept in zip((0.5, 0.75), scores[m]):
            rows += [_row(m, ratio, 1.0, "a", prefill=prefill[m], aware=aware)]
            rows += [_row(m, ratio, kept, "b", prefill=prefill[m], aware=aware)]
    config = RunConfig(
        model="m",
        methods=("full", *methods),
        ratios=(0.5, 0.75),
        tasks=("niah_single_1",),
        lengths=(100,),
        question_aware=aware,
    )
    report = demo.RunReport(None, len(rows), 0, len(rows), summarize(rows))
    return demo.DemoRun(setting, aware, config, report, demo.Figures())


def test_answers_kept_table_reads_both_settings_and_the_prefill_cost():
    prefill = {"streaming_llm": 1.0, "snapkv": 1.5, "kvzip": 3.0}
    runs = [
        _fake_run("question_agnostic", False, ["streaming_llm", "kvzip"], {
            "streaming_llm": [0.0, 0.0], "kvzip": [1.0, 0.0]}, prefill),
        _fake_run("question_aware", True, ["snapkv", "kvzip"], {
            "snapkv": [1.0, 0.0], "kvzip": [1.0, 1.0]}, prefill),
    ]  # fmt: skip
    lines = demo.answers_kept_table(runs).splitlines()
    assert lines[0] == (
        "| method | kept, question-agnostic (r = 0.5 / 0.75) | kept, question-aware "
        "(r = 0.5 / 0.75) | prefill + evict s | prefill vs full |"
    )
    assert lines[2:] == [
        "| full (no eviction) | reference: score 1.00 | reference: score 1.00 | 1.00 | 1.00x |",
        "| streaming_llm | 50% / 50% | — | 1.00 | 1.00x |",
        "| snapkv | — | 100% / 50% | 1.50 | 1.50x |",
        "| kvzip | 100% / 50% | 100% / 100% | 3.00 | 3.00x |",
    ]


def test_demo_report_draws_the_answers_kept_figure(tmp_path):
    prefill = {"streaming_llm": 1.0, "snapkv": 1.5, "kvzip": 3.0, "prob:kvzip": 3.1}
    runs = [
        _fake_run("question_agnostic", False, ["streaming_llm", "kvzip", "prob:kvzip"], {
            "streaming_llm": [0.0, 0.0], "kvzip": [1.0, 0.0], "prob:kvzip": [1.0, 1.0]}, prefill),
        _fake_run("question_aware", True, ["snapkv", "kvzip", "prob:kvzip"], {
            "snapkv": [1.0, 0.0], "kvzip": [1.0, 1.0], "prob:kvzip": [1.0, 1.0]}, prefill),
    ]  # fmt: skip
    text, figure = demo.demo_report(runs, tmp_path / "out")
    assert figure.paths == [tmp_path / "out" / demo.DEMO_FIGURE]
    assert 10_000 < figure.paths[0].stat().st_size < 150_000  # small enough for the README
    assert text.startswith("probkv demo: m (float32), 2 generated needle prompts of about 100")
    assert f"Figure: {figure.paths[0]}." in text
    assert "kvzap and prob:kvzap left out: no kvzap scorer ships for this model" in text


@pytest.fixture
def tiny_folder_with_scorer(tmp_path, monkeypatch):
    """A tiny Llama folder, with a (random) kvzap scorer "shipped" for it."""
    folder = save_tiny_model_folder(tmp_path / "tiny", "llama", max_position_embeddings=4096)
    config = load_model_config(str(folder))
    head_dim = config.hidden_size // config.num_attention_heads
    scorer = tiny_scorer(
        config.num_key_value_heads, head_dim, layers=tuple(range(config.num_hidden_layers))
    )
    scorer = dataclasses.replace(scorer, model=scorer_lookup.model_identity(config, "tiny"))
    monkeypatch.setattr(scorer_lookup, "shipped_scorers", lambda: (scorer,))
    return folder


def test_run_demo_on_a_tiny_model(tiny_folder_with_scorer, tmp_path):
    """The demo's whole plan: every method x ratio x setting has a row per example, ``full``
    once per example and setting; the first table and figure cover both settings; a rerun
    resumes (no job runs twice)."""
    folder, out = tiny_folder_with_scorer, tmp_path / "demo-out"
    runs = demo.run_demo(out, model=str(folder), workers=1, length=500, per_task=1, progress=False)
    assert [(r.setting, r.question_aware) for r in runs] == list(demo.DEMO_SETTINGS)
    for run in runs:
        rows = read_results(out / run.setting / RESULTS_FILE)
        examples = {r["id"] for r in rows}
        assert len(examples) == 3  # one per task
        keys = [(r["id"], r["method"], r["ratio"]) for r in rows]
        assert len(keys) == len(set(keys)) == run.report.jobs_total == run.report.jobs_run
        expected = {(ex, "full", 0.0) for ex in examples} | {
            (ex, m, r)
            for ex in examples
            for m in (demo.DEMO_BASELINES[run.question_aware], *EVICTING)
            for r in (0.5, 0.75, 0.9)
        }
        assert set(keys) == expected
        assert {r["question_aware"] for r in rows} == {run.question_aware}
        kept = [e for e in run.report.summary["entries"] if e["method"] != "full"]
        assert len(kept) == 6 * 3 and all("kept_of_full" in e for e in kept)
        assert (out / run.setting / SUMMARY_MD).is_file()
        names = sorted(p.name for p in run.figures.paths)
        assert "score_vs_ratio.png" in names and "win_score_vs_ratio.png" in names
        assert all(p.parent == out / run.setting for p in run.figures.paths)
    text, figure = demo.demo_report(runs, out, workers=1)
    # A random model answers nothing: no share of the full cache's answers to draw (drawn in
    # test_demo_report_draws_the_answers_kept_figure).
    assert not figure.paths and figure.skipped[0].startswith(demo.DEMO_FIGURE)
    assert (out / demo.DEMO_REPORT).read_text(encoding="utf-8") == text
    table = text.split("## How much", 1)[1].split("\n\n")[1].splitlines()
    assert table[0].startswith(
        "| method | kept, question-agnostic (r = 0.5 / 0.75 / 0.9) | kept, question-aware "
    )
    methods = [line.split(" | ")[0][2:] for line in table[2:]]
    assert methods == ["full (no eviction)", "streaming_llm", "snapkv", *EVICTING]
    for run in runs:
        assert demo.shlex.join(demo.eval_command(run.config, out / run.setting, 1)) in text
    assert f"probkv plot {out / 'question_aware'}" in text and "left out" not in text
    # Rerun: everything is resumed, nothing runs again, the report is redrawn.
    again = demo.run_demo(out, model=str(folder), workers=1, length=500, per_task=1, progress=False)
    for first, second in zip(runs, again):
        assert second.report.jobs_run == 0
        assert second.report.jobs_skipped == first.report.jobs_total
        assert second.report.summary["entries"] == first.report.summary["entries"]


def test_run_demo_interrupted_resumes_and_another_plan_moves_the_old_run_aside(
    tiny_folder_with_scorer, tmp_path, monkeypatch
):
    folder, out = tiny_folder_with_scorer, tmp_path / "demo-out"
    kwargs = {"model": str(folder), "workers": 1, "length": 500, "per_task": 1, "progress": False}
    real_append = runner.append_row

    def stop_after(n):  # Ctrl-C once n more rows are saved
        count = {"rows": 0}

        def append(f, row):
            real_append(f, row)
            count["rows"] += 1
            if count["rows"] == n:
                raise KeyboardInterrupt

        monkeypatch.setattr(runner, "append_row", append)

    stop_after(25)
    with pytest.raises(KeyboardInterrupt):
        demo.run_demo(out, **kwargs)
    first = out / "question_agnostic"
    assert len(read_results(first / RESULTS_FILE)) == 25
    monkeypatch.setattr(runner, "append_row", real_append)
    runs = demo.run_demo(out, **kwargs)
    assert (runs[0].report.jobs_skipped, runs[0].report.jobs_run) == (25, 3 * 19 - 25)
    assert (runs[1].report.jobs_skipped, runs[1].report.jobs_run) == (0, 3 * 19)
    # Another plan (here, another length) moves the old run aside instead of mixing it in.
    stop_after(1)
    with pytest.raises(KeyboardInterrupt):
        demo.run_demo(out, **{**kwargs, "length": 550})
    assert len(read_results(first / "previous-1" / RESULTS_FILE)) == 3 * 19
    assert json.loads((first / "previous-1" / "config.json").read_text())["lengths"] == [500]
    assert len(read_results(first / RESULTS_FILE)) == 1
