"""The figure of an attention-error file (probkv.experiments.attention_error_plot)."""

from __future__ import annotations

import json

import pytest

from probkv.experiments import attention_error_plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def ae_data(steps=(1, "1..4")):
    out = []
    for step in steps:
        for r in (0.25, 0.5, 0.9):
            out.append(
                {
                    "ratio": r,
                    "estimator": "topk",
                    "tau": None,
                    "mae_mean": 0.05 * r,
                    "mae_std": 0.0,
                    "step": step,
                    "proposal": "h2o",
                }
            )
            out.append(
                {
                    "ratio": r,
                    "estimator": "uncorrected",
                    "tau": None,
                    "mae_mean": 0.01 * r,
                    "mae_std": 0.001,
                    "step": step,
                    "proposal": "min-h",
                    "sampler": "with_replacement",
                }
            )
            for tau in (1, 2, 50):
                out.append(
                    {
                        "ratio": r,
                        "estimator": "corrected",
                        "tau": tau,
                        "mae_mean": 0.008 * r,
                        "mae_std": 0.001,
                        "step": step,
                        "proposal": "min-h",
                        "weights": "inclusion",
                        "sampler": "with_replacement",
                        "seeds": 3,
                    }
                )
    return {"header": {"model": "smollm2-135m", "prompt": {"prompt_tokens": 157}}, "rows": out}


def assert_png(path, min_width=600):
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    image = imread(path)
    assert image.shape[1] >= min_width and image.shape[0] >= 300
    # Not blank: a figure with axes, lines and text has many distinct colours.
    assert len({tuple(px) for px in image[::7, ::7].reshape(-1, image.shape[2]).tolist()}) > 5


def test_attention_error_plot(tmp_path):
    path = tmp_path / "ae.json"
    path.write_text(json.dumps(ae_data()))
    out = attention_error_plot.plot_attention_error_file(path)
    assert out == tmp_path / "ae.png"
    assert_png(out, min_width=1200)  # two panels: step 1 and steps 1..4
    # A plain list of rows (no header), one step, works too.
    assert_png(
        attention_error_plot.plot_attention_error(ae_data(steps=(1,))["rows"], tmp_path / "one.png")
    )


def test_attention_error_rejects_bad_input(tmp_path):
    for empty in ([], {"rows": []}, {"header": {}}, "text"):
        with pytest.raises(ValueError, match="no attention-error rows"):
            attention_error_plot.plot_attention_error(empty, tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"row 0 lacks the field\(s\) \['mae_std'\]"):
        attention_error_plot.plot_attention_error(
            [{"ratio": 0.5, "estimator": "topk", "mae_mean": 0.1}], tmp_path / "x.png"
        )
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        attention_error_plot.plot_attention_error_file(bad)
    assert not (tmp_path / "x.png").exists()


def test_estimator_labels():
    label = attention_error_plot.estimator_label
    assert label({"estimator": "topk", "proposal": "h2o"}) == "H2O top-k"
    assert label({"estimator": "topk_proposal", "proposal": "min-h"}) == "top-k of min-h"
    assert label({"estimator": "uncorrected", "proposal": "min-h"}) == "min-h uncorrected"
    assert (
        label({"estimator": "corrected", "proposal": "min-h", "weights": "counts", "tau": 2.0})
        == "min-h counts τ=2"
    )
    assert (
        label(
            {
                "estimator": "corrected",
                "proposal": "min-h",
                "weights": "pps",
                "sampler": "pps",
                "tau": 1,
            }
        )
        == "min-h pps τ=1"
    )
