"""``probkv demo``: how much of the full cache's answers each method keeps as the cache shrinks,
and at what prefill cost, on the default model (S7).

The methods: the full cache (the reference), the best top-k baseline of each setting
(``streaming_llm`` question-agnostic, ``snapkv`` question-aware, docs/evaluation.md), the
trained surrogate scores ``kvzap`` and ``prob:kvzap`` (S11: a plain prefill's cost; left out,
with a note, for a model without a shipped scorer), context reconstruction ``kvzip`` and
``prob:kvzip`` (S10.1: a second pass over "repeat the context"), and the paper's own proposal
``prob:min-h`` (S2, S4), at r = 0.5, 0.75 and 0.9 on three generated needle tasks (a few
examples each, about 1.2k prompt tokens), in the two settings of the paper's evaluation:
question-agnostic (the context is compressed before the question is seen, the paper's and
kvpress's setting) and question-aware (the question is inside the compressed prompt, where
observation-window scores such as SnapKV can see it).

Each setting is an ordinary ``probkv eval`` run (:func:`probkv.eval.runner.run_eval`) into
``demo-out/<setting>/``, with its summary and figures: interrupted, it resumes. The jobs of one
example that observe the same score share one prefill (``kvzap`` / ``prob:kvzap`` at the three
ratios: one prefill, six evictions and decodes; ``kvzip`` / ``prob:kvzip``: one prefill and one
reconstruction pass), and every job's ``prefill_s`` is that shared time plus its own eviction.
:func:`demo_report` then writes the first table and figure over both settings
(:func:`answers_kept_table`, :data:`DEMO_FIGURE`), the per-setting tables, and how to rerun a
part, into ``demo-out/`` (:data:`DEMO_REPORT`).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probkv.eval.plots import Figures, plot_answers_kept, plot_summary
from probkv.eval.runner import FULL, RunConfig, RunReport, format_bytes, run_eval
from probkv.models import DEFAULT_MODEL
from probkv.models.dtypes import DEFAULT_DTYPE

#: The best top-k baseline of each setting, keyed by ``question_aware`` (docs/evaluation.md).
DEMO_BASELINES = {False: "streaming_llm", True: "snapkv"}
#: The methods both settings run after ``full`` and the setting's baseline.
DEMO_METHODS = ("kvzap", "prob:kvzap", "kvzip", "prob:kvzip", "prob:min-h")
#: The methods that need a kvzap scorer trained for the model (``probkv models`` lists them).
KVZAP_METHODS = ("kvzap", "prob:kvzap")
# (folder name, question_aware): the paper's setting first.
DEMO_SETTINGS = (("question_agnostic", False), ("question_aware", True))
DEMO_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1")
DEMO_RATIOS = (0.5, 0.75, 0.9)
DEMO_LENGTH = 1200
DEMO_PER_TASK = 3
DEMO_OUT = "demo-out"
DEMO_WORKERS = 2
#: The first figure (answers kept against the ratio, one panel per setting) and the report
#: (every table printed), both in the output folder.
DEMO_FIGURE = "answers_kept.png"
DEMO_FIGURE_DPI = 110  # about 1,600 x 430 pixels; saved with 128 colours: about 40 KB
DEMO_REPORT = "demo.md"

_SETTING_TITLES = {
    False: "question-agnostic: context compressed before the question",
    True: "question-aware: the question inside the compressed prompt",
}


def demo_methods(question_aware: bool, *, kvzap: bool = True) -> tuple[str, ...]:
    """One setting's methods: ``full``, the setting's baseline (:data:`DEMO_BASELINES`), then
    :data:`DEMO_METHODS` (without :data:`KVZAP_METHODS` when ``kvzap`` is false)."""
    methods = (FULL, DEMO_BASELINES[question_aware], *DEMO_METHODS)
    return methods if kvzap else tuple(m for m in methods if m not in KVZAP_METHODS)


def demo_config(
    model: str | None = None,
    *,
    length: int = DEMO_LENGTH,
    per_task: int = DEMO_PER_TASK,
    question_aware: bool = False,
    dtype: str = DEFAULT_DTYPE,
    kvzap: bool = True,
) -> RunConfig:
    """One setting's run configuration (default model, :func:`demo_methods` at
    :data:`DEMO_RATIOS`, the model in ``dtype``, ``auto`` by default:
    :mod:`probkv.models.dtypes`)."""
    return RunConfig(
        model=model or DEFAULT_MODEL,
        methods=demo_methods(question_aware, kvzap=kvzap),
        ratios=DEMO_RATIOS,
        tasks=DEMO_TASKS,
        lengths=(length,),
        per_task=per_task,
        seed=0,
        question_aware=question_aware,
        dtype=dtype,
    )


def eval_command(config: RunConfig, folder: str | os.PathLike[str], workers: int) -> list[str]:
    """The ``probkv eval`` arguments that run (or resume) ``config`` into ``folder``: the same
    run identity, so it resumes the demo's folder (tests/eval/test_demo.py checks it)."""
    argv = ["probkv", "eval", "--model", config.model, "--methods", ",".join(config.methods)]
    argv += ["--ratios", ",".join(f"{r:g}" for r in config.ratios)]
    argv += ["--tasks", ",".join(config.tasks), "--lengths", ",".join(map(str, config.lengths))]
    argv += ["--per-task", str(config.per_task), "--seed", str(config.seed)]
    argv += ["--dtype", config.dtype, "--workers", str(workers), "--out", str(folder)]
    return argv + (["--question-aware"] if config.question_aware else [])


@dataclass(frozen=True)
class DemoRun:
    """One setting of the demo: its folder name, whether eviction saw the question, the run
    configuration, the run report and the figures."""

    setting: str
    question_aware: bool
    config: RunConfig
    report: RunReport
    figures: Figures


def _prefill_costs(runs: Sequence[DemoRun]) -> dict[str, tuple[float, float | None]]:
    """Per method: ``(mean prefill + eviction seconds, that over full's)``: the seconds are the
    mean over the method's rows in every setting, the ratio the mean over the settings of the
    method's mean against ``full``'s in the same setting (question-aware prompts are longer)."""
    seconds: dict[str, list[tuple[float, int]]] = {}
    ratios: dict[str, list[float]] = {}
    for run in runs:
        entries = run.report.summary["entries"]
        full = next((e["prefill_s_mean"] for e in entries if e["method"] == FULL), None)
        per_method: dict[str, list[tuple[float, int]]] = {}
        for e in entries:
            per_method.setdefault(e["method"], []).append((e["prefill_s_mean"], e["num_examples"]))
        for method, items in per_method.items():
            seconds.setdefault(method, []).extend(items)
            mean = sum(s * n for s, n in items) / sum(n for _, n in items)
            if full:
                ratios.setdefault(method, []).append(mean / full)
    out = {}
    for method, items in seconds.items():
        mean = sum(s * n for s, n in items) / sum(n for _, n in items)
        r = ratios.get(method)
        out[method] = (mean, sum(r) / len(r) if r else None)
    return out


def _methods_in_order(runs: Sequence[DemoRun]) -> list[str]:
    """``full``, the baselines in the order of the settings, then the other methods."""
    methods: list[str] = []
    for run in runs:
        methods += [m for m in run.report.summary["methods"] if m not in methods]
    baselines = [m for m in methods if m in DEMO_BASELINES.values()]
    rest = [m for m in methods if m != FULL and m not in baselines]
    return [FULL, *baselines, *rest] if FULL in methods else [*baselines, *rest]


def answers_kept_table(runs: Sequence[DemoRun]) -> str:
    """The demo's first table (Markdown): per method, the share of the full cache's answers it
    keeps (``winscore.kept_of_full``) at each ratio in each setting, and its prefill cost
    (prefill plus eviction, seconds per example and over ``full``'s). ``full``'s cells give its
    own average score, what "100%" stands for; a method a setting did not run shows ``—``."""
    ratios = sorted({r for run in runs for r in run.config.ratios})
    rs = " / ".join(f"{r:g}" for r in ratios)
    header = ["method"]
    header += [f"kept, {run.setting.replace('_', '-')} (r = {rs})" for run in runs]
    header += ["prefill + evict s", "prefill vs full"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    costs = _prefill_costs(runs)
    for method in _methods_in_order(runs):
        cells = ["full (no eviction)" if method == FULL else method]
        for run in runs:
            entries = {(e["method"], e["ratio"]): e for e in run.report.summary["entries"]}
            if method == FULL:
                e = entries.get((FULL, 0.0))
                cells.append("—" if e is None else f"reference: score {e['average_total']:.2f}")
                continue
            if method not in run.report.summary["methods"]:
                cells.append("—")
                continue
            kept = [(entries.get((method, r)) or {}).get("kept_of_full") for r in ratios]
            cells.append(" / ".join(_kept_cell(k) for k in kept))
        seconds, versus = costs.get(method, (None, None))
        cells.append("—" if seconds is None else f"{seconds:.2f}")
        cells.append("—" if versus is None else f"{versus:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _kept_cell(kept: dict[str, Any] | None) -> str:
    if kept is None or kept["kept"] is None:
        return "—"
    return f"{kept['kept']:.0%}"


def _versus_cell(summary: dict[str, Any], method: str, ratio: float) -> str:
    """``+w-l topk-name`` for a prob: method against its first top-k version that ran."""
    for h in summary.get("head_to_head", ()):
        if h["method"] == method and h["ratio"] == ratio:
            return f"+{h['won']}-{h['lost']} {h['reference']}"
    return "—"


def demo_table(summary: dict[str, Any]) -> str:
    """One setting's Markdown table: per method and ratio, the score per task and in total,
    the share of the full cache's answers kept (``winscore.kept_of_full``), the examples
    won-lost against its top-k version (``prob:`` methods whose top-k ran), the effective
    ratio (mean +- std over examples), cache size and times."""
    tasks = list(summary["tasks"])
    header = [
        "method",
        "r",
        *tasks,
        "average",
        "kept of full",
        "vs top-k",
        "effective r",
        "cache",
        "prefill+evict s",
        "decode s",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for e in summary["entries"]:
        name = "full (no eviction)" if e["method"] == FULL else e["method"]
        cells = [
            name,
            "—" if e["method"] == FULL else f"{e['ratio']:g}",
            *(f"{e['task_scores'][t]:.2f}" if t in e["task_scores"] else "—" for t in tasks),
            f"{e['average_total']:.3f}",
            _kept_cell(e.get("kept_of_full")),
            _versus_cell(summary, e["method"], e["ratio"]),
            f"{e['effective_ratio_mean']:.3f} ± {e['effective_ratio_std']:.3f}",
            format_bytes(e["cache_bytes_mean"]),
            f"{e['prefill_s_mean']:.1f}",
            f"{e['decode_s_mean']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _kvzap_available(model: str) -> bool:
    """Whether a kvzap scorer ships for ``model`` (``probkv.scores.scorer_lookup``)."""
    from probkv.models import load_model_config
    from probkv.scores.scorer_lookup import has_scorer

    return has_scorer(load_model_config(model))


def run_demo(
    out_dir: str | os.PathLike[str] = DEMO_OUT,
    *,
    model: str | None = None,
    workers: int = DEMO_WORKERS,
    threads: int = 1,
    length: int = DEMO_LENGTH,
    per_task: int = DEMO_PER_TASK,
    dtype: str = DEFAULT_DTYPE,
    progress: bool = True,
) -> list[DemoRun]:
    """Run both settings into ``out_dir/<setting>/`` (resuming; a run with another
    configuration there is moved to ``previous-N/``) and write their figures there; the
    report over both is :func:`demo_report`'s."""
    model = model or DEFAULT_MODEL
    kvzap = _kvzap_available(model)
    runs = []
    for setting, question_aware in DEMO_SETTINGS:
        config = demo_config(
            model,
            length=length,
            per_task=per_task,
            question_aware=question_aware,
            dtype=dtype,
            kvzap=kvzap,
        )
        folder = Path(out_dir) / setting
        report = run_eval(
            config, folder, workers=workers, threads=threads, force=True, progress=progress
        )
        figures = plot_summary(report.summary, folder)
        runs.append(DemoRun(setting, question_aware, config, report, figures))
    return runs


def _palette_png(path: Path, colors: int = 128) -> Path:
    """Rewrite a PNG with a palette of ``colors`` colours: a line figure looks the same at a
    third of the size or less (small enough to show in the README)."""
    from PIL import Image  # matplotlib's own dependency

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)
    return path


def _header(runs: Sequence[DemoRun]) -> str:
    summary = runs[0].report.summary
    config = runs[0].config
    tasks = ", ".join(t for t in config.tasks if t in summary["tasks"])
    return (
        f"probkv demo: {config.model} ({config.dtype}), {summary['num_examples']} "
        f"generated needle prompts of about {config.lengths[0]} tokens per setting ({tasks}; "
        f"{config.per_task} each), r = {' / '.join(f'{r:g}' for r in config.ratios)}, "
        "greedy decoding"
    )


def demo_report(
    runs: Sequence[DemoRun], out_dir: str | os.PathLike[str], *, workers: int = DEMO_WORKERS
) -> tuple[str, Figures]:
    """Draw the first figure (:data:`DEMO_FIGURE`) and write the report (:data:`DEMO_REPORT`)
    into ``out_dir``; return the report's text (what ``probkv demo`` prints) and the figure.
    The report: the first table (:func:`answers_kept_table`), the figure, one detailed table
    per setting (:func:`demo_table`), where everything is and how to rerun one part."""
    out = Path(out_dir)
    costs = _prefill_costs(runs)
    labels = {
        m: f"{m} (prefill {c[1]:.1f}x full)" if c[1] is not None else m for m, c in costs.items()
    }
    figure = Figures()
    panels = [(_SETTING_TITLES[run.question_aware], run.report.summary) for run in runs]
    config = runs[0].config
    title = (
        f"Answers kept as the cache shrinks: {Path(config.model).name} ({config.dtype}), "
        f"{runs[0].report.summary['num_examples']} needle prompts of {config.lengths[0]} "
        "tokens per setting"
    )
    try:
        path = plot_answers_kept(
            panels,
            out / DEMO_FIGURE,
            labels=labels,
            methods=_methods_in_order(runs),
            title=title,
            dpi=DEMO_FIGURE_DPI,
        )
        figure.paths.append(_palette_png(path))
    except ValueError as err:
        figure.skipped.append(f"{DEMO_FIGURE}: {err}")
    parts = [
        _header(runs),
        "",
        "## How much of the full cache's answers each method keeps, and at what prefill cost",
        "",
        answers_kept_table(runs),
        "Kept: per prompt the smaller of the method's and the full cache's score, summed, over "
        "the full cache's sum (an answer the full cache misses does not count). Prefill: the "
        "prompt's prefill plus the method's scoring and eviction, seconds per prompt, and that "
        "over the full cache's prefill (the decode is not counted). Figure: "
        + (str(figure.paths[0]) if figure.paths else "not drawn, " + "; ".join(figure.skipped))
        + ".",
    ]
    if any(m not in run.config.methods for run in runs for m in KVZAP_METHODS):
        parts += [
            "",
            f"{' and '.join(KVZAP_METHODS)} left out: no kvzap scorer ships for this model "
            "(`probkv models` lists those that have one; `probkv train-scorer` trains one).",
        ]
    for run in runs:
        how = (
            "question-aware eviction (the question is inside the compressed prompt)"
            if run.question_aware
            else "question-agnostic eviction (the context is compressed before the question)"
        )
        parts += ["", f"## {run.setting}: {how}", "", demo_table(run.report.summary)]
    parts += [
        "Scores: fraction of the needle values found in the answer (RULER string_match_all). "
        "Effective r: fraction of the prompt's cache entries evicted (mean ± std over "
        "examples). vs top-k: prompts won-lost by a prob: method against its top-k version. "
        "Why the methods differ: docs/evaluation.md.",
        "",
        "## Where everything is, and how to rerun one part",
        "",
        f"- This report: {out / DEMO_REPORT}; the figure above: {out / DEMO_FIGURE}.",
    ]
    for run in runs:
        folder = out / run.setting
        parts.append(
            f"- {run.setting}: results, summary.md and {len(run.figures.paths)} figures in "
            f"{folder}/ ({run.report.jobs_run} jobs run now, {run.report.jobs_skipped} already "
            f"done). Rerun this setting alone (it resumes; add --force to redo it): "
            f"`{shlex.join(eval_command(run.config, folder, workers))}`; redraw its figures: "
            f"`probkv plot {shlex.quote(str(folder))}`."
        )
    parts += [
        "- One method or ratio: the same `probkv eval` command with fewer --methods or "
        "--ratios and another --out folder.",
        "- The whole demo: run it again; finished jobs are skipped and every table and figure "
        f"is redrawn. Delete {out}/ to start over.",
    ]
    text = "\n".join(parts) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_REPORT).write_text(text, encoding="utf-8")
    return text, figure
