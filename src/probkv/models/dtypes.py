"""The model's compute dtype: ``float32``, ``bfloat16`` or ``auto`` (``--dtype`` of every
command that loads a model).

``auto`` picks bfloat16 where the hardware computes it natively and float32 otherwise:

- CUDA: bfloat16 when the device supports it (``torch.cuda.is_bf16_supported``, Ampere and
  later);
- CPU: bfloat16 when the CPU has bfloat16 matrix or dot-product units (x86 AMX-BF16 or
  AVX512-BF16, read from the CPU flags; on Linux ``/proc/cpuinfo``), else float32: without
  them torch converts bfloat16 to float32 around every matrix product.

Only the model's weights and activations change dtype: attention logits, scores, proposals
and log-weights stay float32 (``probkv.scores.column_sums`` and ``probkv.hf`` upcast), so eviction
decisions do not round to 8 bits of mantissa. docs/evaluation.md ("bfloat16") measures what
bfloat16 changes in prefill time, task scores and attention error.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

#: Names a user may give; ``auto`` resolves to one of the other two.
DTYPE_CHOICES = ("auto", "float32", "bfloat16")
DEFAULT_DTYPE = "auto"
#: The concrete dtypes a model may run in, by name.
MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# CPU flags (Linux /proc/cpuinfo names) of units that compute bfloat16 products natively.
_CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def check_dtype_name(name: object, what: str = "dtype") -> str:
    """``name`` if it is one of :data:`DTYPE_CHOICES`; else a ValueError naming it."""
    if not isinstance(name, str) or name not in DTYPE_CHOICES:
        raise ValueError(f"{what} must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
    return name


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``), or empty where they are unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_has_native_bfloat16(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU has bfloat16 matrix or dot-product units (AMX-BF16, AVX512-BF16).
    ``flags``: the CPU flags to judge (default: this machine's)."""
    flags = _cpu_flags() if flags is None else flags
    return any(flag in flags for flag in _CPU_BF16_FLAGS)


def native_bfloat16(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` computes bfloat16 natively (module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_has_native_bfloat16()
    return False


def resolve_dtype_name(name: str, device: str | torch.device = "cpu") -> str:
    """The concrete dtype name (``"float32"`` or ``"bfloat16"``) of ``name`` on ``device``:
    ``auto`` is bfloat16 where :func:`native_bfloat16`, else float32."""
    check_dtype_name(name)
    if name == "auto":
        return "bfloat16" if native_bfloat16(device) else "float32"
    return name


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """:func:`resolve_dtype_name` as a ``torch.dtype``."""
    return MODEL_DTYPES[resolve_dtype_name(name, device)]


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` or ``"bfloat16"`` for a model dtype; ValueError for any other."""
    for name, value in MODEL_DTYPES.items():
        if dtype == value:
            return name
    raise ValueError(f"model dtype must be torch.float32 or torch.bfloat16, got {dtype!r}")
