"""Figures (S7): every plot writes a valid PNG of a sensible size, and refuses empty input
with an error that says what is missing."""

from __future__ import annotations

import json

import pytest

from probkv.eval import plots
from probkv.eval.store import CONFIG_FILE, RESULTS_FILE
from probkv.eval.summary import summarize

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def rows():
    """Results rows of 2 tasks x 3 examples: full, snapkv and a global-scope method at two
    ratios, with per-layer ratios for the evicting methods."""
    out = []
    for i, (task, base) in enumerate([("A", 1.0), ("A", 0.5), ("B", 0.0)]):
        out.append(
            {
                "id": f"e{i}",
                "task": task,
                "method": "full",
                "ratio": 0.0,
                "score": base,
                "effective_ratio": 0.0,
                "cache_bytes": 1000,
                "prefill_s": 1.0,
                "decode_s": 1.0,
                "model": "tiny",
            }
        )
        for method in ("snapkv", "prob:min-h/scope=global"):
            for r in (0.25, 0.5, 0.75):
                layers = [
                    {
                        "layer": k,
                        "effective_ratio": r + (0.1 if method != "snapkv" else 0) * (1 - k),
                    }
                    for k in range(3)
                ]
                out.append(
                    {
                        "id": f"e{i}",
                        "task": task,
                        "method": method,
                        "ratio": r,
                        "score": base * (1 - r) if method == "snapkv" else base * (1 - r / 2),
                        "effective_ratio": sum(x["effective_ratio"] for x in layers) / 3,
                        "cache_bytes": 1000 * (1 - r),
                        "prefill_s": 1.0,
                        "decode_s": 1.0,
                        "model": "tiny",
                        "layers": layers,
                    }
                )
    return out


@pytest.fixture
def summary():
    return summarize(
        rows(), config={"model": "tiny", "methods": ["full", "snapkv", "prob:min-h/scope=global"]}
    )


def assert_png(path, min_width=600):
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    image = imread(path)
    assert image.shape[1] >= min_width and image.shape[0] >= 300
    # Not blank: a figure with axes, lines and text has many distinct colours.
    assert len({tuple(px) for px in image[::7, ::7].reshape(-1, image.shape[2]).tolist()}) > 5


@pytest.mark.parametrize(
    "maker",
    [
        plots.plot_scores,
        plots.plot_scores_by_task,
        plots.plot_win_scores,
        plots.plot_kept_of_full,
        plots.plot_layer_ratios,
        plots.plot_compression_table,
    ],
)
def test_run_figures_are_pngs(summary, tmp_path, maker):
    path = maker(summary, tmp_path / "sub" / "fig.png")
    assert path == tmp_path / "sub" / "fig.png"
    assert_png(path)


@pytest.mark.parametrize(
    "maker",
    [
        plots.plot_scores,
        plots.plot_scores_by_task,
        plots.plot_win_scores,
        plots.plot_kept_of_full,
        plots.plot_layer_ratios,
        plots.plot_compression_table,
    ],
)
def test_run_figures_reject_empty(tmp_path, maker):
    for empty in ({}, {"entries": []}, None):
        with pytest.raises(ValueError, match="no entries"):
            maker(empty, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_figures_that_do_not_apply_say_why(summary, tmp_path):
    only_full_and_one = summarize([r for r in rows() if r["method"] in ("full", "snapkv")])
    with pytest.raises(ValueError, match="at least 2 eviction methods"):
        plots.plot_win_scores(only_full_and_one, tmp_path / "w.png")
    with pytest.raises(ValueError, match=r"scope=global or pyramidkv .*'snapkv'"):
        plots.plot_layer_ratios(only_full_and_one, tmp_path / "l.png")
    # Explicit methods override the default choice.
    assert_png(plots.plot_layer_ratios(only_full_and_one, tmp_path / "l.png", methods=["snapkv"]))
    figures = plots.plot_summary(only_full_and_one, tmp_path / "all")
    assert sorted(p.name for p in figures.paths) == [
        "compression_ratio_table.png",
        "kept_of_full_vs_ratio.png",
        "score_vs_ratio.png",
        "score_vs_ratio_by_task.png",
    ]
    assert len(figures.skipped) == 2


def test_answers_kept_needs_full_rows(tmp_path):
    without_full = summarize([r for r in rows() if r["method"] != "full"])
    with pytest.raises(ValueError, match=r"no answers-kept shares.*run `full`"):
        plots.plot_kept_of_full(without_full, tmp_path / "k.png")
    assert "kept_of_full_vs_ratio.png" in "".join(
        plots.plot_summary(without_full, tmp_path / "all").skipped
    )
    # One ratio: bars, one per method.
    one_ratio = summarize([r for r in rows() if r["ratio"] in (0.0, 0.5)])
    assert_png(plots.plot_kept_of_full(one_ratio, tmp_path / "one.png"))


def test_varies_by_layer():
    assert plots.varies_by_layer("prob:min-h/scope=global")
    assert plots.varies_by_layer("pyramidkv") and plots.varies_by_layer("ada_pyramidkv")
    assert not plots.varies_by_layer("snapkv")
    assert not plots.varies_by_layer("prob:min-h")
    assert not plots.varies_by_layer("no-such-method")


def test_plot_run_reads_a_results_folder(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows()))
    # The run's configuration (without it the rows are not plotted: test_bad_inputs.py).
    methods = list(dict.fromkeys(r["method"] for r in rows()))
    (folder / CONFIG_FILE).write_text(json.dumps({"methods": methods}))
    figures = plots.plot_run(folder)
    assert len(figures.paths) == 6 and not figures.skipped
    for p in figures.paths:
        assert p.parent == folder
        assert_png(p)
    with pytest.raises(ValueError, match=r"no results\.jsonl"):
        plots.plot_run(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / RESULTS_FILE).write_text("")
    with pytest.raises(ValueError, match="no finished jobs"):
        plots.plot_run(tmp_path / "empty")
