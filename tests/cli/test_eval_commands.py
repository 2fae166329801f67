"""The ``eval``, ``plot`` and ``demo`` subcommands: argument checking and wiring (the work
itself is tested in test_runner.py, test_plots.py and test_demo.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from probkv.cli import eval_commands as commands
from probkv.cli import main as cli
from probkv.eval import generate_examples, write_examples
from probkv.eval.store import CONFIG_FILE, RESULTS_FILE, read_results
from probkv.experiments import demo
from probkv.models.testing import tiny_tokenizer

torch.set_num_threads(1)


@pytest.fixture
def data_file(tmp_path):
    examples = generate_examples(
        "niah_single_1", tokenizer=tiny_tokenizer(), length=500, num_examples=2, seed=1
    )
    path = tmp_path / "data.jsonl"
    write_examples(path, [dataclasses.replace(ex, max_new_tokens=3) for ex in examples])
    return path


def parse(argv):
    return cli.build_parser().parse_args(argv)


def test_registered():
    assert commands.add_commands in cli.COMMANDS
    args = parse(["eval", "--data", "d.jsonl", "--out", "o"])
    assert args.handler is commands.run_eval_command
    assert args.methods == ["full", "snapkv", "prob:min-h"] and args.ratios == [0.5]
    assert parse(["plot", "x"]).handler is commands.run_plot_command
    assert parse(["demo"]).handler is commands.run_demo_command


def test_demo_defaults_match_the_demo_module():
    args = parse(["demo"])
    assert (args.out, args.workers, args.per_task, args.length) == (
        demo.DEMO_OUT,
        demo.DEMO_WORKERS,
        demo.DEMO_PER_TASK,
        demo.DEMO_LENGTH,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["eval", "--data", "d", "--tasks", "vt", "--out", "o"], "not allowed with argument"),
        (["eval", "--out", "o"], "one of the arguments --data --tasks is required"),
        (["eval", "--data", "d"], "--out"),
        (["eval", "--data", "d", "--out", "o", "--ratios", "0.5,1.5"], "in [0, 1)"),
        (["eval", "--data", "d", "--out", "o", "--ratios", "0.5,,"], "comma-separated list"),
        (["eval", "--tasks", "vt", "--lengths", "0", "--out", "o"], "integer >= 1"),
        (["eval", "--data", "d", "--out", "o", "--workers", "0"], "integer >= 1"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "vt"], "--tasks needs --lengths"),
        (["--data", "DATA", "--lengths", "100"], "--lengths applies to generated --tasks"),
        (["--tasks", "nope", "--lengths", "100"], "task must be one of"),
        (["--data", "DATA", "--methods", "full,bogus"], "unknown method 'bogus'"),
    ],
)
def test_bad_values_exit_2_before_any_work(argv, message, tmp_path, capsys, data_file):
    argv = [str(data_file) if a == "DATA" else a for a in argv]
    out = tmp_path / "out"
    assert cli.main(["eval", *argv, "--out", str(out), "--model", "m"]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_eval_plot_end_to_end(tiny_dir, data_file, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["eval", "--model", tiny_dir, "--data", str(data_file), "--out", str(out)]
    argv += ["--methods", "full,snapkv,prob:min-h/tau=1,h2o", "--ratios", "0.5,0.25"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "# probkv eval" in printed and "| r = 0.25 | r = 0.5 |" in printed
    assert "14 jobs run, 0 already done, 14 in all" in printed
    rows = read_results(out / RESULTS_FILE)
    assert {r["method"] for r in rows} == {"full", "snapkv", "prob:min-h", "h2o"}
    assert len(rows) == 2 * (1 + 3 * 2)
    assert cli.main(["plot", str(out), "--out", str(tmp_path / "figs")]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("wrote ") == 4  # no method varies by layer: that figure skipped
    assert "layer_effective_ratio.png" in captured.err
    assert (tmp_path / "figs" / "score_vs_ratio.png").is_file()


def test_eval_generated_tasks(tiny_dir, tmp_path, capsys):
    out = tmp_path / "gen"
    argv = ["eval", "--model", tiny_dir, "--tasks", "niah_single_1", "--lengths", "500"]
    argv += ["--per-task", "1", "--methods", "snapkv", "--out", str(out), "--no-progress"]
    argv += ["--question-aware", "--seed", "3"]
    assert cli.main(argv) == 0
    (row,) = read_results(out / RESULTS_FILE)
    assert row["id"] == "niah_single_1-500-3-0" and row["question_aware"] and row["seed"] == 3
    assert json.loads((out / CONFIG_FILE).read_text())["question_aware"] is True


def test_malformed_data_via_cli(tiny_dir, data_file, tmp_path, capsys):
    lines = data_file.read_text().splitlines()
    record = json.loads(lines[1])
    record["answers"] = "not a list"
    data_file.write_text(lines[0] + "\n" + json.dumps(record) + "\n")
    argv = ["eval", "--model", tiny_dir, "--data", str(data_file), "--out", str(tmp_path / "o")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{data_file}:2: field 'answers' must be a list of strings" in err


def test_plot_attention_error_file(tmp_path, capsys):
    rows = [
        {"ratio": r, "estimator": e, "tau": t, "mae_mean": m * r, "mae_std": 0.0, "step": 1}
        for r in (0.25, 0.5)
        for e, t, m in [("topk", None, 0.05), ("corrected", 1.0, 0.01)]
    ]
    path = tmp_path / "ae.json"
    path.write_text(json.dumps({"header": {"model": "m"}, "rows": rows}))
    assert cli.main(["plot", str(path)]) == 0
    assert (tmp_path / "ae.png").is_file()
    assert cli.main(["plot", str(tmp_path / "missing")]) == 2
    assert "neither an eval output folder nor a JSON file" in capsys.readouterr().err


def test_demo_command_on_a_tiny_model(tiny_dir, tmp_path, capsys):
    out = tmp_path / "demo-out"
    argv = ["demo", "--model", tiny_dir, "--out", str(out), "--workers", "1", "--per-task", "1"]
    argv += ["--length", "500", "--no-progress"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.index("## How much of the full cache's answers") < printed.index("| snapkv |")
    assert "| full (no eviction) |" in printed and "| prob:min-h | 0.5 |" in printed
    assert "question-agnostic eviction" in printed and "question-aware eviction" in printed
    assert "kvzap and prob:kvzap left out" in printed  # no scorer ships for the tiny model
    assert f"probkv plot {out / 'question_agnostic'}" in printed
    assert (out / "demo.md").read_text(encoding="utf-8") in printed
