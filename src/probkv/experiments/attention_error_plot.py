"""The figure of an attention-error file (``probkv attention-error``,
``{"header": ..., "rows": [...]}``, S7): mean absolute error vs ratio, one line per
estimator (and ``tau`` for the corrected one), error bars = std over seeds, one panel per
``step`` value. :func:`plot_attention_error_file` is what ``probkv plot FILE`` calls; the
drawing helpers are :mod:`probkv.eval.plots`'.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib import colormaps

from probkv.eval.plots import FONT, new_figure, ratio_axis, save_figure, style_axes

_AE_REQUIRED = ("ratio", "estimator", "mae_mean", "mae_std")


def attention_error_rows(data: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(rows, header)`` of an attention-error result: ``{"header": ..., "rows": [...]}`` or a
    plain list of rows. Each row needs ``ratio``, ``estimator``, ``mae_mean``, ``mae_std``
    (``tau``, ``step``, ``proposal``, ``weights``, ``sampler`` optional)."""
    header: dict[str, Any] = {}
    if isinstance(data, Mapping):
        header = dict(data.get("header") or {})
        rows = data.get("rows")
    else:
        rows = data
    if not isinstance(rows, Sequence) or isinstance(rows, (str, bytes)) or not rows:
        raise ValueError(
            "no attention-error rows: expected {'header': ..., 'rows': [...]} or a list of "
            "rows with ratio, estimator, mae_mean, mae_std"
        )
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"attention-error row {i} must be an object, got {row!r}")
        missing = [k for k in _AE_REQUIRED if k not in row]
        if missing:
            raise ValueError(f"attention-error row {i} lacks the field(s) {missing}: {row!r}")
    return [dict(r) for r in rows], header


def estimator_label(row: Mapping[str, Any]) -> str:
    """Legend label of an attention-error row's estimator."""
    est = row["estimator"]
    proposal = row.get("proposal") or "proposal"
    sampler = " pps" if row.get("sampler") == "pps" else ""
    if est == "topk":
        return "H2O top-k"
    if est == "topk_proposal":
        return f"top-k of {proposal}"
    if est == "uncorrected":
        return f"{proposal}{sampler} uncorrected"
    if est == "corrected":
        weights = row.get("weights")
        scheme = "" if not weights or weights == "pps" else f" {weights}"
        return f"{proposal}{sampler}{scheme} τ={row.get('tau'):g}"
    return str(est)


_ESTIMATOR_ORDER = ("topk", "topk_proposal", "uncorrected", "corrected")


def _series_key(row: Mapping[str, Any]) -> tuple:
    """One line per estimator configuration (and tau)."""
    return tuple(row.get(k) for k in ("estimator", "proposal", "weights", "sampler", "tau"))


def _series_order(key: tuple) -> tuple:
    est = _ESTIMATOR_ORDER.index(key[0]) if key[0] in _ESTIMATOR_ORDER else len(_ESTIMATOR_ORDER)
    tau = key[4] if isinstance(key[4], (int, float)) else -1.0
    return (est, str(key[1:4]), tau)


def _step_order(step: Any) -> tuple:
    if step is None:
        return (0, 0, "")
    if isinstance(step, int):
        return (1, step, "")
    return (2, 0, str(step))


def _step_title(step: Any) -> str:
    if step is None:
        return "decode step not given"
    if isinstance(step, int):
        return f"decode step {step} (per layer, not compounded)"
    return f"decode steps {step} (averaged, compounded)"


def plot_attention_error(data: Any, path: str | os.PathLike[str]) -> Path:
    """Attention error (S7, paper Eq. 11 / Figure 2) vs ratio: one line per estimator (and
    tau), error bars = std over seeds, one panel per ``step``; log y axis when the errors
    span more than a factor 20."""
    rows, header = attention_error_rows(data)
    steps = sorted({r.get("step") for r in rows}, key=_step_order)
    series: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault(_series_key(r), []).append(r)
    keys = sorted(series, key=_series_order)
    fixed = {"topk": "black", "topk_proposal": "tab:gray", "uncorrected": "tab:red"}
    corrected = [k for k in keys if k[0] == "corrected"]
    ramp = colormaps["viridis"]
    shades = {k: ramp(0.05 + 0.8 * i / max(len(corrected) - 1, 1)) for i, k in enumerate(corrected)}
    fig = new_figure(6.4 * len(steps) + 2.6, 4.8)
    first_ax = None
    for j, step in enumerate(steps):
        ax = fig.add_subplot(1, len(steps), j + 1, sharey=first_ax)
        first_ax = first_ax or ax
        values = []
        for key in keys:
            pts = sorted(
                (r["ratio"], r["mae_mean"], r["mae_std"])
                for r in series[key]
                if r.get("step") == step
            )
            if not pts:
                continue
            x, y, err = zip(*pts)
            values += [v for v in y if v > 0]
            ax.errorbar(
                x,
                y,
                yerr=err,
                marker="o",
                markersize=4,
                capsize=3,
                linestyle="--" if key[0] in ("topk", "topk_proposal") else "-",
                color=shades.get(key, fixed.get(key[0], "tab:blue")),
                label=estimator_label(series[key][0]),
            )
        if values and max(values) / min(values) > 20:
            ax.set_yscale("log")
        ratio_axis(ax, sorted({r["ratio"] for r in rows}))
        style_axes(ax, "compression ratio r (fraction evicted)", "attention MAE (mean over heads)")
        ax.set_title(_step_title(step), fontsize=FONT["label"])
    handles, labels = first_ax.get_legend_handles_labels()
    fig.legend(
        handles, labels, fontsize=FONT["legend"], loc="upper left", bbox_to_anchor=(1.0, 0.9)
    )
    prompt = header.get("prompt") or {}
    bits = [Path(str(header["model"])).name] if header.get("model") else []
    if prompt.get("prompt_tokens"):
        bits.append(f"{prompt['prompt_tokens']}-token prompt")
    seeds = {r.get("seeds") for r in rows if r.get("seeds")}
    if seeds:
        bits.append(f"{max(seeds)} seeds")
    fig.suptitle(
        "Attention error vs compression (error bars: std over seeds)"
        + (f"\n{', '.join(bits)}" if bits else ""),
        fontsize=FONT["title"],
    )
    fig.tight_layout()
    return save_figure(fig, path)


def plot_attention_error_file(
    path: str | os.PathLike[str], out: str | os.PathLike[str] | None = None
) -> Path:
    """Plot an attention-error JSON file into ``out`` (default: beside it, ``<name>.png``)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError included
        raise ValueError(f"cannot read {path} as JSON ({err})") from None
    except RecursionError:
        raise ValueError(f"cannot read {path} as JSON (nested too deeply)") from None
    return plot_attention_error(data, path.with_suffix(".png") if out is None else out)
