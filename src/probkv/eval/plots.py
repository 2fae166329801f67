"""Figures of an evaluation run and of the attention-error experiment (S7), as PNG files.

From a run's summary (:func:`probkv.eval.summary.summarize`):

- :func:`plot_scores`: average total score vs target compression ratio, one line per method,
  ``full`` as a dashed reference line; :func:`plot_scores_by_task`: the same per task.
- :func:`plot_win_scores`: win score vs ratio (S7; eviction methods only).
- :func:`plot_answers_kept`: the share of the full cache's answers kept vs ratio, one panel per
  run (``probkv demo``'s first figure, one panel per setting).
- :func:`plot_layer_ratios`: per-layer effective compression ratio of methods whose layers
  get different budgets (global scope, S3; PyramidKV, S5): x = layer, y = effective ratio, one
  line per target ratio with a band of +- 1 std over examples (the paper's Figure 9).
- :func:`plot_compression_table`: target vs effective compression ratio, mean +- std over
  examples (the paper's Appendix F.2, Table 1), as a table image.

The figure of an attention-error file is :mod:`probkv.experiments.attention_error_plot`'s, that of
a long-decode file :mod:`probkv.experiments.long_decode_plot`'s; both draw with this module's
helpers.

:func:`plot_run` is what ``probkv plot`` calls on a run folder. Figures
are drawn with matplotlib's object API on the Agg canvas (no pyplot, no global state).
Every function refuses empty input with a ValueError that says what is missing.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter

from probkv.eval.config import FULL
from probkv.eval.store import load_run
from probkv.eval.summary import format_bytes, summarize
from probkv.policies import parse_method

DPI = 150
FONT = {"title": 12, "label": 11, "tick": 10, "legend": 9}
_REFERENCE_STYLE = {"color": "black", "linestyle": "--", "linewidth": 1.3}


def new_figure(width: float, height: float):
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig, path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", bbox_inches="tight")
    return path


def style_axes(ax, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel, fontsize=FONT["label"])
    ax.set_ylabel(ylabel, fontsize=FONT["label"])
    ax.tick_params(labelsize=FONT["tick"])
    ax.grid(True, alpha=0.3)


def add_legend(ax, handles_count: int) -> None:
    if handles_count > 6:  # many entries: outside, to the right
        ax.legend(fontsize=FONT["legend"], loc="upper left", bbox_to_anchor=(1.02, 1.0))
    else:
        ax.legend(fontsize=FONT["legend"], loc="best")


def palette(n: int) -> list:
    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def run_title(summary: Mapping[str, Any], what: str) -> str:
    """``"<what> — <model>, <T> tasks, <N> examples"`` (+ question-aware)."""
    tasks = summary.get("tasks") or {}
    mode = ", question-aware" if summary.get("question_aware") else ""
    model = Path(str(summary.get("model") or "model")).name
    return (
        f"{what}\n{model}: {len(tasks)} task{'s' * (len(tasks) != 1)}, "
        f"{summary.get('num_examples', 0)} examples{mode}"
    )


def _check_summary(summary: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    if not isinstance(summary, Mapping) or not summary.get("entries"):
        raise ValueError(
            "the summary has no entries (no finished jobs); run probkv eval first "
            "(summary = probkv.eval.summary.summarize(rows))"
        )
    return list(summary["entries"])


def _eviction_methods(summary: Mapping[str, Any]) -> list[str]:
    return [m for m in summary.get("methods", []) if m != FULL]


def _method_colors(summary: Mapping[str, Any]) -> dict[str, Any]:
    methods = _eviction_methods(summary)
    return dict(zip(methods, palette(len(methods))))


def _full_entry(entries: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    return next((e for e in entries if e["method"] == FULL), None)


def ratio_axis(ax, ratios: Sequence[float]) -> None:
    ax.set_xticks(list(ratios))
    ax.set_xticklabels([f"{r:g}" for r in ratios])
    lo, hi = min(ratios), max(ratios)
    pad = 0.05 if hi == lo else (hi - lo) * 0.08
    ax.set_xlim(lo - pad, hi + pad)


def _bars(ax, groups: Sequence[str], series: Sequence[tuple[str, Any, Sequence[float | None]]]):
    """Grouped bars: one group per ``groups`` entry, one bar per series ``(label, color,
    values)``, each bar labelled with its value (used when a run has a single ratio, where
    lines would be single points on top of each other)."""
    n = max(len(series), 1)
    width = 0.8 / n
    for k, (label, color, values) in enumerate(series):
        xs = [i - 0.4 + width * (k + 0.5) for i in range(len(groups))]
        kept = [(x, v) for x, v in zip(xs, values) if v is not None]
        if not kept:
            continue
        bars = ax.bar(
            [x for x, _ in kept], [v for _, v in kept], width=width * 0.92, color=color, label=label
        )
        if len(kept) * n <= 24:  # value labels while they fit
            ax.bar_label(bars, fmt="%.2f", fontsize=8, padding=1)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=FONT["tick"])
    ax.set_ylim(0, 1.12)


def _series(summary: Mapping[str, Any], values) -> list[tuple[str, Any, list[float | None]]]:
    """Bar series of every method (``full`` first, in grey) for :func:`_bars`; ``values(method)``
    gives the method's bar heights, one per group."""
    entries = _check_summary(summary)
    out = []
    if _full_entry(entries) is not None:
        out.append(("full (no eviction)", "0.45", FULL))
    out += [(m, c, m) for m, c in _method_colors(summary).items()]
    return [(label, color, values(method)) for label, color, method in out]


def _single_ratio(entries: Sequence[Mapping[str, Any]]) -> float | None:
    ratios = {e["ratio"] for e in entries if e["method"] != FULL}
    return next(iter(ratios)) if len(ratios) == 1 else None


def _ratio_bars(summary, path, group: str, series, ylabel: str, what: str) -> Path:
    """One group of bars (a run with a single ratio), ``series`` as :func:`_bars` takes it."""
    fig = new_figure(7.5, 4.6)
    ax = fig.add_subplot()
    _bars(ax, [group], series)
    style_axes(ax, "target compression ratio (fraction evicted)", ylabel)
    ax.set_title(run_title(summary, what), fontsize=FONT["title"])
    add_legend(ax, 99)  # outside: bars fill the axes
    return save_figure(fig, path)


def _ratio_lines(
    summary, path, points, ratios, ylabel: str, what: str, reference: float | None = None
) -> Path:
    """One line per eviction method through ``points(method)`` (``(ratio, value)`` pairs),
    ``reference`` dashed as ``full``."""
    fig = new_figure(7.5, 4.6)
    ax = fig.add_subplot()
    count = 0
    if reference is not None:
        ax.axhline(reference, label="full (no eviction)", **_REFERENCE_STYLE)
        count += 1
    for method, color in _method_colors(summary).items():
        pts = sorted(points(method))
        if pts:
            ax.plot(*zip(*pts), marker="o", color=color, label=method, linewidth=1.8)
            count += 1
    ratio_axis(ax, ratios)
    ax.set_ylim(-0.03, 1.03)
    style_axes(ax, "target compression ratio r (fraction evicted)", ylabel)
    ax.set_title(run_title(summary, f"{what} vs compression"), fontsize=FONT["title"])
    add_legend(ax, count)
    return save_figure(fig, path)


def plot_scores(summary: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Average total score (S7) vs target compression ratio, one line per method; ``full`` is
    a dashed horizontal reference. With a single ratio: one bar per method. Returns the path."""
    entries = _check_summary(summary)
    ylabel = "average total score"
    single = _single_ratio(entries)
    if single is not None:
        by_method = {e["method"]: e["average_total"] for e in entries}
        series = _series(summary, lambda m: [by_method.get(m)])
        return _ratio_bars(summary, path, f"r = {single:g}", series, ylabel, "Task score")
    full = _full_entry(entries)
    return _ratio_lines(
        summary,
        path,
        lambda m: [(e["ratio"], e["average_total"]) for e in entries if e["method"] == m],
        sorted({e["ratio"] for e in entries if e["method"] != FULL}) or [0.0],
        ylabel,
        "Task score",
        reference=None if full is None else full["average_total"],
    )


def plot_scores_by_task(summary: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Mean score per task vs ratio: one panel per task, one line per method. With a single
    ratio: one group of bars per task."""
    entries = _check_summary(summary)
    tasks = list(summary.get("tasks") or {})
    if not tasks:
        raise ValueError("the summary lists no tasks")
    single = _single_ratio(entries)
    if single is not None:
        by_method = {e["method"]: e["task_scores"] for e in entries}
        fig = new_figure(max(7.5, 1.1 * len(tasks) * (len(by_method) ** 0.5) + 3), 4.8)
        ax = fig.add_subplot()
        series = _series(summary, lambda m: [by_method.get(m, {}).get(t) for t in tasks])
        _bars(ax, [f"{t}\n({summary['tasks'][t]} ex.)" for t in tasks], series)
        style_axes(ax, "task", "mean score")
        ax.set_title(run_title(summary, f"Score per task, r = {single:g}"), fontsize=FONT["title"])
        add_legend(ax, 99)
        return save_figure(fig, path)
    colors = _method_colors(summary)
    ratios = sorted({e["ratio"] for e in entries if e["method"] != FULL}) or [0.0]
    ncols = min(3, len(tasks))
    nrows = math.ceil(len(tasks) / ncols)
    fig = new_figure(4.2 * ncols + 1.8, 3.3 * nrows + 0.9)
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(len(tasks))]
    full = _full_entry(entries)
    for ax, task in zip(axes, tasks):
        if full is not None and task in full["task_scores"]:
            ax.axhline(full["task_scores"][task], label="full (no eviction)", **_REFERENCE_STYLE)
        for method, color in colors.items():
            pts = sorted(
                (e["ratio"], e["task_scores"][task])
                for e in entries
                if e["method"] == method and task in e["task_scores"]
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", color=color, label=method, linewidth=1.6)
        ratio_axis(ax, ratios)
        ax.set_ylim(-0.03, 1.03)
        style_axes(ax, "ratio r", "score")
        ax.set_title(f"{task} ({summary['tasks'][task]} ex.)", fontsize=FONT["label"])
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, fontsize=FONT["legend"], loc="upper left", bbox_to_anchor=(1.0, 0.95)
    )
    fig.suptitle(run_title(summary, "Score per task vs compression"), fontsize=FONT["title"])
    fig.tight_layout()
    return save_figure(fig, path)


def plot_win_scores(summary: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Win score (S7) vs ratio, one line per eviction method (one bar each with one ratio)."""
    _check_summary(summary)
    win = summary.get("win_scores") or []
    if not win:
        raise ValueError(
            "the summary has no win scores: they need at least 2 eviction methods (besides "
            "full) that finished the same examples at a ratio"
        )
    ylabel = "win score (0 worst, 1 best)"
    if len(win) == 1:
        (only,) = win
        series = [(m, c, [only["scores"].get(m)]) for m, c in _method_colors(summary).items()]
        group = f"r = {only['ratio']:g} ({only['num_examples']} examples)"
        return _ratio_bars(summary, path, group, series, ylabel, "Win score")
    return _ratio_lines(
        summary,
        path,
        lambda m: [(w["ratio"], w["scores"][m]) for w in win if m in w["scores"]],
        [w["ratio"] for w in win],
        ylabel,
        "Win score",
    )


def plot_kept_of_full(summary: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Share of the full cache's answers kept (``winscore.kept_of_full``: per example the
    smaller of the method's and ``full``'s score, summed, over ``full``'s total) vs ratio, one
    line per eviction method, 100% dashed; one bar per method with a single ratio. Luck (an
    evicted cache answering what the full one misses) does not count, unlike the average."""
    entries = _check_summary(summary)
    kept = {
        (e["method"], e["ratio"]): e["kept_of_full"]["kept"]
        for e in entries
        if (e.get("kept_of_full") or {}).get("kept") is not None
    }
    if not kept:
        raise ValueError(
            "the summary has no answers-kept shares: they need `full` rows with a nonzero "
            "total score on the same examples (run `full` with the other methods)"
        )
    ylabel = "share of the full cache's answers kept"
    ratios = sorted({r for _, r in kept})
    if len(ratios) == 1:
        series = [(m, c, [kept.get((m, ratios[0]))]) for m, c in _method_colors(summary).items()]
        return _ratio_bars(summary, path, f"r = {ratios[0]:g}", series, ylabel, "Answers kept")
    return _ratio_lines(
        summary,
        path,
        lambda m: [(r, v) for (method, r), v in kept.items() if method == m],
        ratios,
        ylabel,
        "Answers kept",
        reference=1.0,
    )


def plot_answers_kept(
    panels: Sequence[tuple[str, Mapping[str, Any]]],
    path: str | os.PathLike[str],
    *,
    labels: Mapping[str, str] | None = None,
    methods: Sequence[str] | None = None,
    title: str | None = None,
    dpi: int = DPI,
) -> Path:
    """The share of the full cache's answers kept (as in :func:`plot_kept_of_full`) against
    the target ratio, one panel per ``(panel title, summary)`` (``probkv demo``: one per
    setting), one line per eviction method: one color per score across the panels, ``prob:``
    methods solid and the others dashed, 100% dashed black. Points are shifted a little left or
    right per method so that equal values stay visible. ``labels`` renames methods in the
    shared legend (``probkv demo`` adds each method's prefill cost); ``methods`` orders it (by
    default, the panels' methods in order of appearance). Refused (ValueError) when no panel has
    a share (``full`` scored 0 on every example)."""
    if not panels:
        raise ValueError("no panels to plot: give (title, summary) pairs")
    found: list[str] = []
    for _, summary in panels:
        _check_summary(summary)
        found += [m for m in _eviction_methods(summary) if m not in found]
    order = list(methods or ())
    methods = [m for m in order if m in found] + [m for m in found if m not in order]
    if not any(
        (e.get("kept_of_full") or {}).get("kept") is not None
        for _, summary in panels
        for e in summary["entries"]
    ):
        raise ValueError(
            "no panel has answers-kept shares: they need `full` rows with a nonzero total "
            "score on the same examples (run `full` with the other methods)"
        )
    scores = list(dict.fromkeys(parse_method(m, 0.5).score for m in methods))
    score_color = dict(zip(scores, palette(len(scores))))
    shift = {m: 0.009 * (i - (len(methods) - 1) / 2) for i, m in enumerate(methods)}
    fig = Figure(figsize=(4.6 * len(panels) + 2.6, 3.9), dpi=dpi)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, len(panels), i + 1) for i in range(len(panels))]
    handles: dict[str, Any] = {}  # legend entries by method, in the order of ``methods``
    for ax, (panel_title, summary) in zip(axes, panels):
        kept = {
            (e["method"], e["ratio"]): e["kept_of_full"]["kept"]
            for e in summary["entries"]
            if (e.get("kept_of_full") or {}).get("kept") is not None
        }
        ratios = sorted({r for _, r in kept}) or [0.0]
        ref = ax.axhline(1.0, **_REFERENCE_STYLE)
        handles.setdefault(FULL, ref)
        for m in methods:
            pts = sorted((r, v) for (method, r), v in kept.items() if method == m)
            if not pts:
                continue
            (line,) = ax.plot(
                [r + shift[m] for r, _ in pts],
                [v for _, v in pts],
                marker="o" if m.startswith("prob:") else "s",
                markersize=5,
                color=score_color[parse_method(m, 0.5).score],
                linestyle="-" if m.startswith("prob:") else "--",
                linewidth=1.8,
            )
            handles.setdefault(m, line)
        ratio_axis(ax, ratios)
        ax.set_ylim(-0.03, 1.05)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        style_axes(ax, "target compression ratio r (fraction evicted)", "")
        ax.set_title(panel_title, fontsize=FONT["label"])
    axes[0].set_ylabel("share of the full cache's answers kept", fontsize=FONT["label"])
    fig.legend(
        [handles[m] for m in [FULL, *methods] if m in handles],
        [
            "full (no eviction)" if m == FULL else (labels or {}).get(m, m)
            for m in [FULL, *methods]
            if m in handles
        ],
        fontsize=FONT["legend"],
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
    )
    if title:
        fig.suptitle(title, fontsize=FONT["title"])
    fig.tight_layout()
    return save_figure(fig, path)


def varies_by_layer(method: str) -> bool:
    """Whether ``method`` gives layers different budgets: the global scope (S3) or PyramidKV
    layer budgets (S5). Names that no longer parse count as False."""
    try:
        policy = parse_method(method, 0.5)
    except ValueError:
        return False
    return getattr(policy, "scope", None) == "global" or (
        getattr(policy, "layer_budgets", None) == "pyramid"
    )


def plot_layer_ratios(
    summary: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    methods: Sequence[str] | None = None,
) -> Path:
    """Per-layer effective compression ratio (the paper's Figure 9): one panel per method
    (default: those whose layer budgets differ, :func:`varies_by_layer`), x = layer, one line
    per target ratio (band: +- 1 std over examples; dotted: the target)."""
    _check_summary(summary)
    layers = summary.get("layers") or []
    if methods is None:
        methods = [m for m in _eviction_methods(summary) if varies_by_layer(m)]
    chosen = [m for m in methods if any(item["method"] == m for item in layers)]
    if not chosen:
        raise ValueError(
            "no per-layer ratios to plot: run a method whose layers get different budgets, "
            "e.g. prob:min-h/scope=global or pyramidkv (summary 'layers' has "
            f"{sorted({item['method'] for item in layers})})"
        )
    ncols = min(2, len(chosen))
    nrows = math.ceil(len(chosen) / ncols)
    fig = new_figure(6.2 * ncols + 1.6, 3.8 * nrows + 0.9)
    ratios = sorted({item["ratio"] for item in layers if item["method"] in chosen})
    colors = dict(zip(ratios, palette(len(ratios))))
    for k, method in enumerate(chosen):
        ax = fig.add_subplot(nrows, ncols, k + 1)
        for item in sorted((i for i in layers if i["method"] == method), key=lambda i: i["ratio"]):
            x = item["layer"]
            mean = item["effective_ratio_mean"]
            std = item["effective_ratio_std"]
            color = colors[item["ratio"]]
            ax.plot(x, mean, marker=".", color=color, label=f"r = {item['ratio']:g}")
            ax.fill_between(
                x,
                [m - s for m, s in zip(mean, std)],
                [m + s for m, s in zip(mean, std)],
                color=color,
                alpha=0.2,
                linewidth=0,
            )
            ax.axhline(item["ratio"], color=color, linestyle=":", linewidth=1)
        ax.set_ylim(-0.03, 1.03)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        style_axes(ax, "layer", "effective compression ratio")
        ax.set_title(method, fontsize=FONT["label"])
        ax.legend(fontsize=FONT["legend"], loc="best", title="target", title_fontsize=9)
    fig.suptitle(
        run_title(summary, "Per-layer effective compression (dotted: target r)"),
        fontsize=FONT["title"],
    )
    fig.tight_layout()
    return save_figure(fig, path)


def compression_rows(summary: Mapping[str, Any]) -> list[list[str]]:
    """Rows of the target vs effective compression table (Appendix F.2): method, target r,
    effective r (mean +- std over examples), cache size (mean), examples."""
    entries = _check_summary(summary)
    return [
        [
            "full (no eviction)" if e["method"] == FULL else e["method"],
            f"{e['ratio']:g}",
            f"{e['effective_ratio_mean']:.3f} ± {e['effective_ratio_std']:.3f}",
            format_bytes(e["cache_bytes_mean"]),
            str(e["num_examples"]),
        ]
        for e in entries
    ]


def plot_compression_table(summary: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """The target vs effective compression table (Appendix F.2) as an image."""
    rows = compression_rows(summary)
    header = ["method", "target r", "effective r (mean ± std)", "cache", "examples"]
    width = max(8.0, 0.09 * max(len(r[0]) for r in rows) + 6.0)
    fig = new_figure(width, 0.3 * (len(rows) + 1) + 0.7)
    ax = fig.add_subplot()
    ax.axis("off")
    table = ax.table(cellText=rows, colLabels=header, loc="center", cellLoc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(10)
    table.auto_set_column_width(list(range(len(header))))
    table.scale(1.0, 1.35)
    for (r, _c), cell in table.get_celld().items():
        if r == 0:
            cell.set_text_props(weight="bold")
            cell.set_facecolor("#e8e8e8")
    ax.set_title(
        run_title(summary, "Target vs effective compression ratio (Appendix F.2)"),
        fontsize=FONT["title"],
    )
    return save_figure(fig, path)


# -- whole runs ------------------------------------------------------------------------------------


@dataclass
class Figures:
    """The PNG files written, and why any figure was skipped."""

    paths: list[Path] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def plot_summary(summary: Mapping[str, Any], out_dir: str | os.PathLike[str]) -> Figures:
    """Every run figure that applies to ``summary``, written into ``out_dir``."""
    _check_summary(summary)
    out = Path(out_dir)
    figures = Figures()
    makers = [
        ("score_vs_ratio.png", plot_scores),
        ("score_vs_ratio_by_task.png", plot_scores_by_task),
        ("win_score_vs_ratio.png", plot_win_scores),
        ("kept_of_full_vs_ratio.png", plot_kept_of_full),
        ("layer_effective_ratio.png", plot_layer_ratios),
        ("compression_ratio_table.png", plot_compression_table),
    ]
    for name, maker in makers:
        try:
            figures.paths.append(maker(summary, out / name))
        except ValueError as err:
            figures.skipped.append(f"{name}: {err}")
    return figures


def plot_run(
    run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None
) -> Figures:
    """The figures of an evaluation run folder (from its results, so a partial run plots
    too), written into ``out_dir`` (default: the run folder)."""
    rows, config, labels = load_run(run_dir)
    if not rows:
        raise ValueError(f"{run_dir} has no finished jobs in its results yet")
    summary = summarize(rows, config=config, row_labels=labels)
    return plot_summary(summary, run_dir if out_dir is None else out_dir)
