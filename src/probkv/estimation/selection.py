"""What one layer keeps after eviction: a ragged, flattened selection per KV head (S4, S6).

The layout is the evicted cache layer's storage layout (Ada-KV's flattened heads): the kept
entries of head 0, then of head 1, ..., each head's indices sorted ascending, plus one float32
log-weight per kept entry (``None`` means no correction: top-k methods, ``tau = inf``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RaggedSelection:
    indices: torch.Tensor  # [N] int64, positions in the prefix, sorted within each head
    lengths: torch.Tensor  # [Hkv] int64, kept entries per head; sum == N
    log_weights: torch.Tensor | None = None  # [N] float32 (S4), or None = no correction

    def __post_init__(self) -> None:
        if self.indices.ndim != 1 or self.lengths.ndim != 1:
            raise ValueError(
                f"indices and lengths must be 1-D, got {tuple(self.indices.shape)} and {tuple(self.lengths.shape)}"
            )
        if int(self.lengths.sum()) != self.indices.numel():
            raise ValueError(
                f"lengths sum to {int(self.lengths.sum())} but there are {self.indices.numel()} indices"
            )
        if self.log_weights is not None and self.log_weights.shape != self.indices.shape:
            raise ValueError(
                f"log_weights shape {tuple(self.log_weights.shape)} != indices shape {tuple(self.indices.shape)}"
            )

    @property
    def num_heads(self) -> int:
        return self.lengths.numel()

    @property
    def offsets(self) -> torch.Tensor:
        """``[Hkv + 1]`` start of each head's run in the flattened layout."""
        return torch.cat([self.lengths.new_zeros(1), self.lengths.cumsum(0)])

    def head(self, h: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Kept indices (and log-weights) of KV head ``h``."""
        start, stop = (int(x) for x in self.offsets[h : h + 2])
        lw = None if self.log_weights is None else self.log_weights[start:stop]
        return self.indices[start:stop], lw

    @classmethod
    def from_masks(
        cls, kept: torch.Tensor, log_weights: torch.Tensor | None = None
    ) -> RaggedSelection:
        """From a boolean mask ``[Hkv, t]`` (and optional dense log-weights ``[Hkv, t]``)."""
        if kept.ndim != 2 or kept.dtype != torch.bool:
            raise ValueError(
                f"kept must be a bool mask [Hkv, t], got {kept.dtype} {tuple(kept.shape)}"
            )
        heads, idx = kept.nonzero(as_tuple=True)  # row-major: head by head, indices ascending
        lengths = kept.sum(-1).to(torch.int64)
        lw = None if log_weights is None else log_weights[heads, idx].to(torch.float32)
        return cls(idx.to(torch.int64), lengths, lw)

    @classmethod
    def from_index_lists(
        cls, per_head: list[torch.Tensor], log_weights: list[torch.Tensor] | None = None
    ) -> RaggedSelection:
        order = [torch.sort(ix.to(torch.int64)) for ix in per_head]
        indices = (
            torch.cat([o.values for o in order]) if order else torch.zeros(0, dtype=torch.int64)
        )
        lengths = torch.tensor([ix.numel() for ix in per_head], dtype=torch.int64)
        lw = None
        if log_weights is not None:
            lw = torch.cat([w.to(torch.float32)[o.indices] for w, o in zip(log_weights, order)])
        return cls(indices, lengths, lw)

    @classmethod
    def concat(cls, parts: list[RaggedSelection]) -> RaggedSelection:
        """One selection of several heads' selections, heads in the order given (weights 0,
        i.e. weight 1, for a part without them when another part has some)."""
        log_weights = None
        if any(p.log_weights is not None for p in parts):
            log_weights = torch.cat(
                [
                    p.log_weights
                    if p.log_weights is not None
                    else torch.zeros(p.indices.numel(), device=p.indices.device)
                    for p in parts
                ]
            )
        return cls(
            torch.cat([p.indices for p in parts]),
            torch.cat([p.lengths for p in parts]),
            log_weights,
        )

    def dense_log_weights(self, t: int, *, evicted: float = -math.inf) -> torch.Tensor:
        """``[Hkv, t]`` float32: each kept entry's log-weight (0 without correction), ``evicted``
        elsewhere (``-inf``: excluded from a softmax, S4)."""
        device = self.indices.device
        heads = torch.repeat_interleave(torch.arange(self.num_heads, device=device), self.lengths)
        out = torch.full((self.num_heads, t), evicted, dtype=torch.float32, device=device)
        out[heads, self.indices] = 0.0 if self.log_weights is None else self.log_weights.float()
        return out

    def to_mask(self, t: int) -> torch.Tensor:
        """Boolean ``[Hkv, t]`` mask of kept entries (for tests and diagnostics)."""
        device = self.indices.device
        heads = torch.repeat_interleave(torch.arange(self.num_heads, device=device), self.lengths)
        mask = torch.zeros(self.num_heads, t, dtype=torch.bool, device=device)
        mask[heads, self.indices] = True
        return mask
