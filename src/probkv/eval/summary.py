"""A run's summary (S7): ``summary.json`` (:func:`summarize`) and ``summary.md``
(:func:`summary_markdown`), computed from the results rows alone, so a partial run and a
rerun summarise alike.

The win score (S7) ranks the *eviction* methods of one ratio on the examples all of them
have finished; ``full`` is not ranked (it is the upper reference, as in the paper) and is
shown next to every ratio, since it does not depend on the ratio.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from probkv.eval.config import FULL, RunConfig
from probkv.eval.store import SUMMARY_JSON, SUMMARY_MD, check_row, write_atomic
from probkv.eval.winscore import (
    average_total_score,
    head_to_head,
    kept_of_full,
    score_table,
    win_scores,
)
from probkv.policies import top_k_versions

_SUMMARY_KEYS = ("effective_ratio", "cache_bytes", "prefill_s", "decode_s")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _std(values: Sequence[float]) -> float:
    """Sample standard deviation (n - 1 denominator); 0 for a single value."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(
    rows: Sequence[Mapping[str, Any]],
    *,
    config: RunConfig | Mapping[str, Any] | None = None,
    jobs_total: int | None = None,
    row_labels: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Aggregate results rows (S7; Appendix F.2 for the compression ratios).

    A row without the fields a summary needs is a ValueError naming it by its label in
    ``row_labels`` (one per row: ``"line N of FILE"`` for rows read from a results file,
    ``probkv.eval.store.line_label``), or else as ``"row i"`` (its 0-based index in ``rows``).

    Returns a JSON-ready dict:

    - ``model``, ``dtype`` (the model's; float32 for rows of an older probkv),
      ``question_aware``, ``tasks`` (examples per task), ``num_examples``,
      ``methods`` (run order), ``ratios``, ``jobs_done``, ``jobs_total``, ``complete``;
    - ``entries``: one per (method, ratio) with rows (``full`` at ratio 0): ``num_examples``,
      ``task_scores`` (mean score per task), ``average_total`` (S7: split means weighted by
      each split's share of the examples), ``effective_ratio_mean``/``_std`` (over examples,
      n - 1 denominator), ``effective_ratio_by_split`` (its mean per task and prompt length,
      ``"vt @ 4k"``: a threshold's ratio adapts to both, S11), ``cache_bytes_mean``, ``prefill_s_mean``, ``decode_s_mean``, and,
      for eviction methods of a run with ``full`` rows, ``kept_of_full``
      (``winscore.kept_of_full``: the share of the full cache's answers kept, and the examples
      scored below / above it);
    - ``win_scores``: per ratio, the win score (S7) of each eviction method on the examples
      every eviction method finished at that ratio (``full`` excluded; needs 2 methods);
    - ``head_to_head``: per ratio, each ``prob:`` method against each of its top-k versions
      that ran at that ratio (``probkv.policies.top_k_versions``), on the examples both
      finished (``winscore.head_to_head``: won / lost / tied, sign test, the pair's win
      scores);
    - ``layers``: per (method, ratio) the mean and std over examples of each evicting layer's
      effective ratio (the paper's Figure 9).
    """
    if not rows:
        raise ValueError("no results rows to summarize (the run has not finished any job)")
    cfg = config.to_json() if isinstance(config, RunConfig) else dict(config or {})
    _check_rows(rows, row_labels)
    order = list(cfg.get("methods") or [])
    order += [m for m in dict.fromkeys(r["method"] for r in rows) if m not in order]
    methods = [m for m in order if any(r["method"] == m for r in rows)]
    groups: dict[tuple[str, float], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["method"], float(r["ratio"])), []).append(r)
    tasks: dict[str, set[str]] = {}
    for r in rows:
        tasks.setdefault(r["task"], set()).add(r["id"])
    ratios = cfg.get("ratios") or sorted({k[1] for k in groups if k[0] != FULL})
    total = jobs_total if jobs_total is not None else len(rows)
    return {
        "model": cfg.get("model") or rows[0].get("model"),
        "dtype": cfg.get("dtype") or rows[0].get("dtype") or "float32",
        "question_aware": cfg.get("question_aware", rows[0].get("question_aware", False)),
        "tasks": {t: len(ids) for t, ids in sorted(tasks.items())},
        "num_examples": len({r["id"] for r in rows}),
        "methods": methods,
        "ratios": [float(r) for r in ratios],
        "jobs_done": len(rows),
        "jobs_total": total,
        "complete": len(rows) >= total,
        "entries": _entries(methods, groups),
        "win_scores": _win_scores(methods, groups),
        "head_to_head": _head_to_head(methods, groups),
        "layers": _layers(groups),
    }


Groups = Mapping[tuple[str, float], Sequence[Mapping[str, Any]]]


def _check_rows(rows: Sequence[Mapping[str, Any]], row_labels: Sequence[str] | None) -> None:
    """Every row has the fields a summary reads, finite numbers (errors name the row)."""
    if row_labels is not None and len(row_labels) != len(rows):
        raise ValueError(f"row_labels has {len(row_labels)} labels for {len(rows)} rows")
    for i, r in enumerate(rows):
        where = f"row {i}" if row_labels is None else row_labels[i]
        check_row(r, where)
        missing = [k for k in _SUMMARY_KEYS if k not in r]
        if missing:
            raise ValueError(f"{where}: results row lacks the field(s) {missing}")
        for key in ("score", *_SUMMARY_KEYS):
            value = r[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where}: field {key!r} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{where}: field {key!r} must be finite, got {value!r}")


def _entries(methods: Sequence[str], groups: Groups) -> list[dict[str, Any]]:
    """``summary["entries"]``: one per (method, ratio) with rows (:func:`summarize`)."""
    full_scores = {r["id"]: r["score"] for r in groups.get((FULL, 0.0), ())}
    entries = []
    for method in methods:
        for ratio in sorted({k[1] for k in groups if k[0] == method}):
            group = groups[(method, ratio)]
            table = score_table(group)
            split_scores = {t: [s[method] for s in ex.values()] for t, ex in table.items()}
            entries.append(
                {
                    "method": method,
                    "ratio": ratio,
                    "num_examples": len(group),
                    "task_scores": {t: _mean(v) for t, v in sorted(split_scores.items())},
                    "average_total": average_total_score(split_scores),
                    "effective_ratio_mean": _mean([r["effective_ratio"] for r in group]),
                    "effective_ratio_std": _std([r["effective_ratio"] for r in group]),
                    "effective_ratio_by_split": _ratio_by_split(group),
                    "cache_bytes_mean": _mean([r["cache_bytes"] for r in group]),
                    "prefill_s_mean": _mean([r["prefill_s"] for r in group]),
                    "decode_s_mean": _mean([r["decode_s"] for r in group]),
                }
            )
            if full_scores and method != FULL:
                scores = {r["id"]: r["score"] for r in group}
                entries[-1]["kept_of_full"] = kept_of_full(scores, full_scores)
    return entries


def length_label(row: Mapping[str, Any]) -> str | None:
    """The prompt's length rounded to a power of two (``"2k"``, ``"512"``), from its context
    and question tokens; None for a row without them (an older probkv's)."""
    n = row.get("context_tokens", 0) + row.get("question_tokens", 0)
    if not n:
        return None
    p = 2 ** round(math.log2(n))
    return f"{p // 1024}k" if p >= 1024 else str(p)


def _ratio_by_split(group: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Mean effective ratio per task and prompt length (``"niah_single_1 @ 4k"``): where a
    threshold sets the ratio (S11) it differs between tasks and lengths."""
    splits: dict[str, list[float]] = {}
    for r in group:
        label = length_label(r)
        key = r["task"] if label is None else f"{r['task']} @ {label}"
        splits.setdefault(key, []).append(r["effective_ratio"])
    return {k: _mean(v) for k, v in sorted(splits.items())}


def _win_scores(methods: Sequence[str], groups: Groups) -> list[dict[str, Any]]:
    """``summary["win_scores"]``: per ratio, on the examples every eviction method finished."""
    win = []
    for ratio in sorted({k[1] for k in groups if k[0] != FULL}):
        ranked = [m for m in methods if m != FULL and (m, ratio) in groups]
        if len(ranked) < 2:
            continue
        common = set.intersection(*({r["id"] for r in groups[(m, ratio)]} for m in ranked))
        if not common:
            continue
        table = score_table(r for m in ranked for r in groups[(m, ratio)] if r["id"] in common)
        win.append({"ratio": ratio, "num_examples": len(common), "scores": win_scores(table)})
    return win


def _head_to_head(methods: Sequence[str], groups: Groups) -> list[dict[str, Any]]:
    """``summary["head_to_head"]``: each ``prob:`` method against its top-k versions."""
    pairs = []
    for method in methods:
        for reference in _top_k_versions(method):
            for ratio in sorted({k[1] for k in groups if k[0] == method}):
                if (reference, ratio) not in groups:
                    continue
                mine = {r["id"]: r for r in groups[(method, ratio)]}
                common = [r for r in groups[(reference, ratio)] if r["id"] in mine]
                if not common:
                    continue
                table = score_table([*common, *(mine[r["id"]] for r in common)])
                pairs.append(
                    {
                        "method": method,
                        "reference": reference,
                        "ratio": ratio,
                        **head_to_head(table, method, reference),
                    }
                )
    return pairs


def _layers(groups: Groups) -> list[dict[str, Any]]:
    """``summary["layers"]``: per (method, ratio), each evicting layer's effective ratio."""
    layers = []
    for (method, ratio), group in groups.items():
        per_layer: dict[int, list[float]] = {}
        for r in group:
            for item in r.get("layers") or ():
                per_layer.setdefault(int(item["layer"]), []).append(item["effective_ratio"])
        if per_layer:
            idx = sorted(per_layer)
            layers.append(
                {
                    "method": method,
                    "ratio": ratio,
                    "layer": idx,
                    "effective_ratio_mean": [_mean(per_layer[i]) for i in idx],
                    "effective_ratio_std": [_std(per_layer[i]) for i in idx],
                }
            )
    return layers


def _top_k_versions(method: str) -> list[str]:
    """``probkv.policies.top_k_versions``, or none for a name this probkv cannot parse (a
    results file of another version must still summarise)."""
    try:
        return top_k_versions(method)
    except ValueError:
        return []


def _fmt(value: float | None, digits: int = 3) -> str:
    return (
        "—"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else f"{value:.{digits}f}"
    )


def format_bytes(n: float) -> str:
    """``"25.5 MiB"``, ``"96.0 KiB"``, ``"512 B"``: cache sizes at a readable scale."""
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    if n >= 2**10:
        return f"{n / 2**10:.1f} KiB"
    return f"{n:.0f} B"


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return lines


def _entry(summary: Mapping[str, Any], method: str, ratio: float) -> Mapping[str, Any] | None:
    for e in summary["entries"]:
        if e["method"] == method and (method == FULL or e["ratio"] == ratio):
            return e
    return None


def _name(method: str) -> str:
    return "full (no eviction)" if method == FULL else method


def _ratio_header(ratios: Sequence[float]) -> list[str]:
    return ["method", *(f"r = {r:g}" for r in ratios)]


def summary_markdown(summary: Mapping[str, Any]) -> str:
    """The summary as Markdown tables: average total score, win score, answers kept of the
    full cache's (runs with ``full``), score per task for each ratio, target vs effective
    compression ratio (Appendix F.2) and timings."""
    lines = _overview_lines(summary)
    if summary["win_scores"]:
        lines += _win_score_lines(summary)
    if summary.get("head_to_head"):
        lines += _head_to_head_lines(summary)
    if any("kept_of_full" in e for e in summary["entries"]):  # runs with `full`
        lines += _kept_lines(summary)
    lines += _task_lines(summary)
    lines += _ratio_lines(summary)
    lines += _split_ratio_lines(summary)
    return "\n".join(lines) + "\n"


def _overview_lines(summary: Mapping[str, Any]) -> list[str]:
    """The title, what ran, and the average total score table."""
    ratios, tasks = summary["ratios"], summary["tasks"]
    mode = "question-aware" if summary.get("question_aware") else "question-agnostic"
    lines = [
        f"# probkv eval: {summary['model']}",
        "",
        f"{summary['num_examples']} examples in {len(tasks)} tasks "
        f"({', '.join(f'{t}: {n}' for t, n in tasks.items())}); {mode} eviction; "
        f"{summary.get('dtype', 'float32')} model; "
        f"{summary['jobs_done']}/{summary['jobs_total']} jobs done"
        + ("" if summary["complete"] else " (incomplete: rerun the same command to resume)")
        + ".",
        "",
        "## Average total score (S7)",
        "",
        "Task means weighted by each task's share of the examples. `full` does not depend on "
        "the ratio: its one value is repeated as the reference.",
        "",
    ]
    body = []
    for m in summary["methods"]:
        cells = [_fmt(e["average_total"]) if (e := _entry(summary, m, r)) else "—" for r in ratios]
        body.append([_name(m), *cells])
    return lines + _table(_ratio_header(ratios), body)


def _win_score_lines(summary: Mapping[str, Any]) -> list[str]:
    ratios = summary["ratios"]
    ranked = [m for m in summary["methods"] if m != FULL]
    lines = ["", "## Win score (S7)", ""]
    lines += [
        "Mean rank of each eviction method per example (ties count as wins), averaged per "
        "task, tasks weighted equally, normalised to [0, 1]; `full` is not ranked.",
        "",
    ]
    by_ratio = {w["ratio"]: w for w in summary["win_scores"]}
    body = []
    for m in ranked:
        body.append(
            [m, *(_fmt(by_ratio[r]["scores"].get(m)) if r in by_ratio else "—" for r in ratios)]
        )
    body.append(
        [
            "(examples)",
            *(str(by_ratio[r]["num_examples"]) if r in by_ratio else "—" for r in ratios),
        ]
    )
    return lines + _table(_ratio_header(ratios), body)


def _head_to_head_lines(summary: Mapping[str, Any]) -> list[str]:
    ratios = summary["ratios"]
    lines = ["", "## `prob:` methods against their top-k", ""]
    lines += [
        "Examples won-lost (ties left out) against the top-k version of the same score, on "
        "the examples both finished; p: exact two-sided sign test of a tie; then the win "
        "scores of the two ranked alone (method / top-k).",
        "",
    ]
    cells: dict[tuple[str, str], dict[float, str]] = {}
    for h in summary["head_to_head"]:
        cells.setdefault((h["method"], h["reference"]), {})[h["ratio"]] = (
            f"+{h['won']}-{h['lost']} (p = {h['p']:.2g}; "
            f"{_fmt(h['win_score'])} / {_fmt(h['reference_win_score'])})"
        )
    body = [[m, ref, *(c.get(r, "—") for r in ratios)] for (m, ref), c in cells.items()]
    return lines + _table(["method", "top-k", *(f"r = {r:g}" for r in ratios)], body)


def _kept_lines(summary: Mapping[str, Any]) -> list[str]:
    ratios = summary["ratios"]
    lines = ["", "## Answers kept of the full cache's", ""]
    lines += [
        "Sum over examples of min(score, full's score) / sum of full's scores; in brackets "
        "the examples scored below / above `full` (above: the evicted prompt got right what "
        "the whole one got wrong; not counted as kept).",
        "",
    ]
    body = []
    for m in (m for m in summary["methods"] if m != FULL):
        cells = []
        for r in ratios:
            e = _entry(summary, m, r)
            k = None if e is None else e.get("kept_of_full")
            cells.append("—" if k is None else f"{_fmt(k['kept'])} (-{k['below']} / +{k['above']})")
        body.append([m, *cells])
    return lines + _table(_ratio_header(ratios), body)


def _task_lines(summary: Mapping[str, Any]) -> list[str]:
    tasks = summary["tasks"]
    lines: list[str] = []
    for r in summary["ratios"]:
        lines += ["", f"## Score per task, r = {r:g}", ""]
        body = []
        for m in summary["methods"]:
            e = _entry(summary, m, r)
            if e is None:
                continue
            body.append(
                [
                    _name(m),
                    *(_fmt(e["task_scores"].get(t)) for t in tasks),
                    _fmt(e["average_total"]),
                ]
            )
        lines += _table(["method", *tasks, "average total"], body)
    return lines


#: An entry whose effective ratio differs from its target by more than this on some split
#: (a threshold's, S11, or a short prompt's) gets a row in "Effective ratio per task and length".
ADAPTS = 0.02


def _split_ratio_lines(summary: Mapping[str, Any]) -> list[str]:
    adapting = [
        e
        for e in summary["entries"]
        if e["method"] != FULL
        and any(abs(v - e["ratio"]) > ADAPTS for v in e["effective_ratio_by_split"].values())
    ]
    if not adapting:
        return []
    splits = sorted({k for e in adapting for k in e["effective_ratio_by_split"]})
    lines = ["", "## Effective ratio per task and length", ""]
    lines += [
        f"Methods whose effective ratio is more than {ADAPTS:g} from the target on some split "
        "(a threshold sets it per prompt, S11): mean over examples; lengths rounded to a power "
        "of two.",
        "",
    ]
    body = [
        [
            _name(e["method"]),
            f"{e['ratio']:g}",
            *(
                f"{e['effective_ratio_by_split'][k]:.3f}"
                if k in e["effective_ratio_by_split"]
                else ""
                for k in splits
            ),
        ]
        for e in adapting
    ]
    return lines + _table(["method", "target r", *splits], body)


def _ratio_lines(summary: Mapping[str, Any]) -> list[str]:
    lines = ["", "## Target vs effective compression ratio (Appendix F.2)", ""]
    lines += [
        "Effective ratio: fraction of the prompt's cache entries evicted, mean over layers and "
        "KV heads; mean ± std over examples. Cache: bytes held right after eviction.",
        "",
    ]
    body = []
    for e in summary["entries"]:
        body.append(
            [
                _name(e["method"]),
                f"{e['ratio']:g}",
                f"{e['effective_ratio_mean']:.3f} ± {e['effective_ratio_std']:.3f}",
                format_bytes(e["cache_bytes_mean"]),
                f"{e['prefill_s_mean']:.2f}",
                f"{e['decode_s_mean']:.2f}",
                str(e["num_examples"]),
            ]
        )
    header = ["method", "target r", "effective r", "cache", "prefill + evict s", "decode s"]
    return lines + _table([*header, "examples"], body)


def write_summary(
    out_dir: str | os.PathLike[str],
    rows: Sequence[Mapping[str, Any]],
    *,
    config: RunConfig | Mapping[str, Any] | None = None,
    jobs_total: int | None = None,
    row_labels: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Write ``summary.json`` and ``summary.md`` into ``out_dir``; returns the summary
    (``row_labels``: as :func:`summarize`)."""
    out = Path(out_dir)
    summary = summarize(rows, config=config, jobs_total=jobs_total, row_labels=row_labels)
    write_atomic(out / SUMMARY_JSON, json.dumps(summary, indent=2) + "\n")
    write_atomic(out / SUMMARY_MD, summary_markdown(summary))
    return summary
