"""``probkv demo``: a small side-by-side evaluation on the default model (S7).

Full cache, two top-k baselines (SnapKV, StreamingLLM), and probabilistic eviction with the
``min-h`` proposal (S2) with and without decode-time correction (S4), the same with the global
budget (S3), probabilistic SnapKV (the best proposal question-aware), and context
reconstruction, KVzip's global top-k (``kvzip``) and its probabilistic version
(``prob:kvzip``): the best methods question-agnostic (S10.1, docs/evaluation.md), all at r = 0.5 on three generated needle tasks (a few examples
each, about 1.2k prompt tokens), in the two settings of the paper's evaluation:
question-agnostic (the context is compressed before the question is seen, the paper's and
kvpress's setting) and question-aware (the question is inside the compressed prompt, where
observation-window scores such as SnapKV can see it). Each setting is an ordinary
``probkv eval`` run (:func:`probkv.eval.runner.run_eval`) into ``demo-out/<setting>/``:
interrupted, it resumes; its figures land beside its results.

The global-budget variant shares its prefill with ``prob:min-h`` and ``prob:snapkv`` with
``snapkv`` (same observation, see the runner), so each costs one extra eviction and decode
per example; the global variant gives the per-layer figure (the paper's Figure 9). ``kvzip``
and ``prob:kvzip`` share one prefill and one reconstruction pass per example.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probkv.eval.plots import Figures, plot_summary
from probkv.eval.runner import FULL, RunConfig, RunReport, format_bytes, run_eval
from probkv.models import DEFAULT_MODEL
from probkv.models.dtypes import DEFAULT_DTYPE

DEMO_METHODS = (
    "full",
    "snapkv",
    "streaming_llm",
    "prob:min-h",
    "prob:min-h/correct=false",
    "prob:min-h/scope=global",
    "prob:snapkv",
    "kvzip",
    "prob:kvzip",
)
# (folder name, question_aware): the paper's setting first.
DEMO_SETTINGS = (("question_agnostic", False), ("question_aware", True))
DEMO_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1")
DEMO_RATIO = 0.5
DEMO_LENGTH = 1200
DEMO_PER_TASK = 3
DEMO_OUT = "demo-out"
DEMO_WORKERS = 2


def demo_config(
    model: str | None = None,
    *,
    length: int = DEMO_LENGTH,
    per_task: int = DEMO_PER_TASK,
    question_aware: bool = False,
    dtype: str = DEFAULT_DTYPE,
) -> RunConfig:
    """One setting's run configuration (default model, :data:`DEMO_METHODS` at r = 0.5, the
    model in ``dtype``, ``auto`` by default: :mod:`probkv.models.dtypes`)."""
    return RunConfig(
        model=model or DEFAULT_MODEL,
        methods=DEMO_METHODS,
        ratios=(DEMO_RATIO,),
        tasks=DEMO_TASKS,
        lengths=(length,),
        per_task=per_task,
        seed=0,
        question_aware=question_aware,
        dtype=dtype,
    )


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
    """One Markdown table: per method, the score per task and in total, the share of the full
    cache's answers kept (``winscore.kept_of_full``), the examples won-lost against its top-k
    version (``prob:`` methods whose top-k ran), the effective ratio (mean +- std over
    examples), cache size and times, at the demo's ratio."""
    tasks = list(summary["tasks"])
    header = [
        "method",
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


@dataclass(frozen=True)
class DemoRun:
    """One setting of the demo: its folder name, whether eviction saw the question, the run
    report and the figures."""

    setting: str
    question_aware: bool
    report: RunReport
    figures: Figures


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
    configuration there is moved to ``previous-N/``) and write their figures there."""
    runs = []
    for setting, question_aware in DEMO_SETTINGS:
        config = demo_config(
            model, length=length, per_task=per_task, question_aware=question_aware, dtype=dtype
        )
        folder = Path(out_dir) / setting
        report = run_eval(
            config, folder, workers=workers, threads=threads, force=True, progress=progress
        )
        runs.append(DemoRun(setting, question_aware, report, plot_summary(report.summary, folder)))
    return runs
