"""``probkv demo``: a small side-by-side evaluation on the default model (SPEC S7).

Full cache, two top-k baselines (SnapKV, StreamingLLM), and probabilistic eviction with the
``min-h`` proposal (S2) with and without decode-time correction (S4), plus the same with the
global budget (S3), all at r = 0.5 on three generated needle tasks (a few examples each, about
1.2k prompt tokens). It is an ordinary ``probkv eval`` run (:func:`probkv.eval.runner.run_eval`)
into ``demo-out/``: interrupted, it resumes; its figures land beside the results.

The global-budget variant shares its prefill with ``prob:min-h`` (same observation, see the
runner), so it costs one extra eviction and decode per example and gives the per-layer
figure (the paper's Figure 9).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from probkv.eval.plots import Figures, plot_summary
from probkv.eval.runner import FULL, RunConfig, RunReport, format_bytes, run_eval

DEMO_METHODS = (
    "full",
    "snapkv",
    "streaming_llm",
    "prob:min-h",
    "prob:min-h/correct=false",
    "prob:min-h/scope=global",
)
DEMO_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1")
DEMO_RATIO = 0.5
DEMO_LENGTH = 1200
DEMO_PER_TASK = 3
DEMO_OUT = "demo-out"
DEMO_WORKERS = 2


def demo_config(
    model: str | None = None, *, length: int = DEMO_LENGTH, per_task: int = DEMO_PER_TASK
) -> RunConfig:
    """The demo's run configuration (default model, :data:`DEMO_METHODS` at r = 0.5)."""
    from probkv.models import DEFAULT_MODEL

    return RunConfig(
        model=model or DEFAULT_MODEL,
        methods=DEMO_METHODS,
        ratios=(DEMO_RATIO,),
        tasks=DEMO_TASKS,
        lengths=(length,),
        per_task=per_task,
        seed=0,
    )


def demo_table(summary: dict[str, Any]) -> str:
    """One Markdown table: per method, the score per task and in total, the effective ratio
    (mean +- std over examples), cache size and times, at the demo's ratio."""
    tasks = list(summary["tasks"])
    header = [
        "method",
        *tasks,
        "average",
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
            *(f"{e['task_scores'][t]:.2f}" if t in e["task_scores"] else "—" for t in tasks),
            f"{e['average_total']:.3f}",
            f"{e['effective_ratio_mean']:.3f} ± {e['effective_ratio_std']:.3f}",
            format_bytes(e["cache_bytes_mean"]),
            f"{e['prefill_s_mean']:.1f}",
            f"{e['decode_s_mean']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_demo(
    out_dir: str | os.PathLike[str] = DEMO_OUT,
    *,
    model: str | None = None,
    workers: int = DEMO_WORKERS,
    threads: int = 1,
    length: int = DEMO_LENGTH,
    per_task: int = DEMO_PER_TASK,
    progress: bool = True,
) -> tuple[RunReport, Figures]:
    """Run the demo into ``out_dir`` (resuming; a run with another configuration there is
    moved to ``previous-N/``) and write its figures there. Returns the run report and the
    figures."""
    config = demo_config(model, length=length, per_task=per_task)
    report = run_eval(
        config, out_dir, workers=workers, threads=threads, force=True, progress=progress
    )
    figures = plot_summary(report.summary, Path(out_dir))
    return report, figures
