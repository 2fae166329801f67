"""The ragged, weighted prefix an ``EvictingLayer`` holds after eviction (S4, S6).

The kept entries of every KV head, flattened head after head into one ``[N, d]`` key tensor
and one ``[N, d_v]`` value tensor (Ada-KV's layout, no padding to the longest head), and one
float32 log-weight per kept entry (``None``: no correction). A head may keep nothing (S4).
``head_index`` names each entry's KV head, on the keys' device, so that decode can treat all
heads in one batched op (a segment softmax over the flattened layout) without reading
``lengths`` per head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RaggedPrefix:
    """The ragged, weighted prefix of an evicted layer (flattened head after head)."""

    keys: torch.Tensor  # [N, d]
    values: torch.Tensor  # [N, d_v]
    log_weights: torch.Tensor | None  # [N] float32, None = no correction
    lengths: list[int]  # per KV head
    offsets: list[int] = field(init=False)
    head_index: torch.Tensor = field(init=False)  # [N] int64: the KV head of each entry

    def __post_init__(self) -> None:
        self.offsets = [0]
        for n in self.lengths:
            self.offsets.append(self.offsets[-1] + n)
        device = self.keys.device
        counts = torch.tensor(self.lengths, dtype=torch.int64, device=device)
        heads = torch.arange(len(self.lengths), device=device)
        self.head_index = torch.repeat_interleave(heads, counts, output_size=self.offsets[-1])

    @property
    def uniform_length(self) -> bool:
        return len(set(self.lengths)) <= 1

    def head(self, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        a, b = self.offsets[h], self.offsets[h + 1]
        lw = None if self.log_weights is None else self.log_weights[a:b]
        return self.keys[a:b], self.values[a:b], lw

    def nbytes(self) -> int:
        tensors = [self.keys, self.values]
        if self.log_weights is not None:
            tensors.append(self.log_weights)
        return sum(t.numel() * t.element_size() for t in tensors)
