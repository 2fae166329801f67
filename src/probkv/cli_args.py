"""argparse value types shared by the ``probkv`` subcommands (``probkv.cli`` and the command
modules it registers). Each raises ``argparse.ArgumentTypeError`` naming the bad value."""

from __future__ import annotations

import argparse


def positive_int(value: str) -> int:
    """argparse type: an integer >= 1 (error message names the bad value)."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}")
    return n


def comma_list(value: str) -> list[str]:
    """argparse type: a non-empty comma-separated list (``a,b,c``)."""
    items = [v.strip() for v in value.split(",")]
    if not value.strip() or any(not v for v in items):
        raise argparse.ArgumentTypeError(f"must be a comma-separated list, got {value!r}")
    return items


def ratio_list(value: str) -> list[float]:
    """argparse type: comma-separated compression ratios in [0, 1)."""
    out = []
    for item in comma_list(value):
        try:
            r = float(item)
        except ValueError:
            r = -1.0
        if not 0.0 <= r < 1.0:
            raise argparse.ArgumentTypeError(
                f"ratios must be numbers in [0, 1) (fraction evicted), got {item!r}"
            )
        out.append(r)
    return out


def length_list(value: str) -> list[int]:
    """argparse type: comma-separated positive integers (prompt lengths in tokens)."""
    return [positive_int(item) for item in comma_list(value)]


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--dtype float32|bfloat16|auto`` (default auto) on a command that loads a model
    (:mod:`probkv.dtypes`; argparse names a bad value and the allowed ones)."""
    from probkv.dtypes import DEFAULT_DTYPE, DTYPE_CHOICES

    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default=DEFAULT_DTYPE,
        help=f"model dtype (default {DEFAULT_DTYPE}: bfloat16 where the hardware computes it "
        "natively, CPU AMX/AVX512-BF16 or CUDA, else float32); attention scores, proposals "
        "and log-weights stay float32",
    )
