"""The figure of a ``probkv long-decode`` file: NLL gap to the full cache vs the budget.

One line per method (mean over seeds), the budget ``B`` on a log2 axis; a file with one
budget gives one point per method. Written as PNG beside the file (``probkv plot FILE``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from probkv.eval.plots import add_legend, new_figure, palette, save_figure, style_axes
from probkv.experiments.long_decode import summarise


def is_long_decode(data: Any) -> bool:
    """A ``probkv long-decode`` result (its header names the experiment)."""
    return isinstance(data, dict) and (data.get("header") or {}).get("experiment") == "long-decode"


def plot_long_decode(data: dict, path: str | os.PathLike[str]) -> Path:
    """NLL gap vs budget, one line per method (module docstring)."""
    rows = [r for r in data.get("rows", []) if r.get("budget") is not None]
    if not rows:
        raise ValueError("no long-decode rows with a budget to plot")
    table = summarise(rows)
    methods = list(dict.fromkeys(r["method"] for r in table))
    fig = new_figure(7.0, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    for method, color in zip(methods, palette(len(methods)), strict=True):
        points = sorted((r["budget"], r["nll_gap"]) for r in table if r["method"] == method)
        style = "-" if method.startswith("prob:") else "--"
        ax.plot(*zip(*points, strict=True), style, marker="o", color=color, label=method)
    ax.set_xscale("log", base=2)
    ax.axhline(0.0, color="black", linewidth=1.0)
    header = data.get("header") or {}
    ax.set_title(
        f"{Path(str(header.get('model', ''))).name}: P={header.get('prompt_tokens')}, "
        f"N={header.get('tokens')}, K={header.get('every')}",
        fontsize=12,
    )
    style_axes(ax, "budget B (entries per KV head)", "NLL gap to the full cache (nats/token)")
    add_legend(ax, len(methods))
    return save_figure(fig, path)


def plot_long_decode_file(
    path: str | os.PathLike[str], out: str | os.PathLike[str] | None = None
) -> Path:
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    return plot_long_decode(data, path.with_suffix(".png") if out is None else out)
