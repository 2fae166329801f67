"""Run configuration (probkv.eval.config): canonical methods, sorted ratios, checked fields."""

from __future__ import annotations

import pytest

from probkv.eval.config import RunConfig


def test_config_canonicalises_and_checks():
    cfg = RunConfig(
        model="m",
        methods=("prob:min-h/tau=1", "snapkv"),
        ratios=(0.5, 0.25),
        tasks=("vt",),
        lengths=(100,),
    )
    assert cfg.methods == ("prob:min-h", "snapkv")  # tau=1 is the default: canonical drops it
    assert cfg.ratios == (0.25, 0.5)
    assert cfg.jobs_per_example() == [
        ("prob:min-h", 0.25),
        ("prob:min-h", 0.5),
        ("snapkv", 0.25),
        ("snapkv", 0.5),
    ]
    full = RunConfig(model="m", methods=("full", "h2o"), ratios=(0.5, 0.75), data="x.jsonl")
    assert full.jobs_per_example() == [("full", 0.0), ("h2o", 0.5), ("h2o", 0.75)]
    bad = [
        ({"methods": ("nope",)}, "unknown method"),
        ({"methods": ("prob:min-h", "prob:min-h/tau=1")}, "twice"),
        ({"methods": ()}, "at least one"),
        ({"ratios": (1.0,)}, "ratio"),
        ({"ratios": (0.5, 0.5)}, "twice"),
        ({"data": "x.jsonl"}, "not both"),
        ({"tasks": ()}, "either data"),
        ({"tasks": ("no_such_task",)}, "task"),
        ({"lengths": ()}, "lengths"),
        ({"max_examples": 0}, "max_examples"),
    ]
    base = {
        "model": "m",
        "methods": ("snapkv",),
        "ratios": (0.5,),
        "tasks": ("vt",),
        "lengths": (100,),
    }
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            RunConfig(**(base | change))


def test_dtype_is_resolved_and_part_of_the_identity(monkeypatch):
    from probkv.eval.config import IDENTITY_KEYS, config_identity, stored_identity
    from probkv.models import dtypes

    base = {"model": "m", "methods": ("snapkv",), "ratios": (0.5,), "tasks": ("vt",)}
    base["lengths"] = (100,)
    assert RunConfig(**base).dtype == "float32"  # the API default
    assert RunConfig(**base, dtype="bfloat16").dtype == "bfloat16"
    for native, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(dtypes, "cpu_has_native_bfloat16", lambda native=native: native)
        cfg = RunConfig(**base, dtype="auto")
        assert cfg.dtype == expected  # stored concrete: the identity names what ran
        assert config_identity(cfg)["dtype"] == expected
    assert "dtype" in IDENTITY_KEYS
    assert stored_identity({"model": "m"})["dtype"] == "float32"  # folders of older probkv
    with pytest.raises(
        ValueError, match=r"dtype must be one of auto, float32, bfloat16, got 'f16'"
    ):
        RunConfig(**base, dtype="f16")
