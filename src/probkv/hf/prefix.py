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

from probkv.estimation import compose_log_weights


@dataclass
class RaggedPrefix:
    """The ragged, weighted prefix of an evicted layer (flattened head after head)."""

    keys: torch.Tensor  # [N, d]
    values: torch.Tensor  # [N, d_v]
    log_weights: torch.Tensor | None  # [N] float32, None = no correction
    lengths: list[int]  # per KV head
    covers: int = 0  # logical entries (tokens seen) at the eviction that made it
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


def kept_prefix(layer, selection) -> RaggedPrefix:
    """The prefix ``layer`` holds after keeping ``selection`` (``EvictingLayer.evict``, which
    checked its number of heads): each segment's kept entries of its current entries (its
    prefix, then its tail), log-weights composed (S4)."""
    keys, values, logw = [], [], []
    for h in range(layer.num_segments):
        idx, new_lw = selection.head(h)
        k_h, v_h, lw_h = _current_entries(layer, h)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= k_h.shape[0]):
            raise ValueError(
                f"selection for head {h} of layer {layer.layer_idx} has indices outside "
                f"[0, {k_h.shape[0]})"
            )
        idx = idx.to(layer.device)
        keys.append(k_h.index_select(0, idx))
        values.append(v_h.index_select(0, idx))
        combined = None if lw_h is None else lw_h.index_select(0, idx)
        if new_lw is not None:
            new_lw = new_lw.to(device=layer.device, dtype=torch.float32)
            combined = new_lw if combined is None else compose_log_weights(combined, new_lw)
        logw.append(combined)
    log_weights = None
    if any(w is not None for w in logw):
        log_weights = torch.cat(
            [
                w if w is not None else torch.zeros(k.shape[0], device=layer.device)
                for w, k in zip(logw, keys)
            ]
        )
        if not torch.isfinite(log_weights).all():
            raise ValueError(f"layer {layer.layer_idx}: selection has non-finite log-weights")
    return RaggedPrefix(
        keys=torch.cat(keys).contiguous(),
        values=torch.cat(values).contiguous(),
        log_weights=log_weights,
        lengths=[int(k.shape[0]) for k in keys],
        covers=layer.get_seq_length(),
    )


def _current_entries(layer, h: int):
    """Segment ``h``'s entries in selection order: prefix first, then the tail (the prompt
    without its padding before the first eviction)."""
    b, head = divmod(h, layer.num_heads)
    start = layer.pads[b] if layer.prefix is None else 0
    tail_k = layer.tail_keys[b, head, start:]
    tail_v = layer.tail_values[b, head, start:]
    if layer.prefix is None:
        return tail_k, tail_v, None
    k, v, lw = layer.prefix.head(h)
    if lw is not None:
        lw = torch.cat([lw, torch.zeros(layer.tail.length, device=layer.device)])
    return torch.cat([k, tail_k]), torch.cat([v, tail_v]), lw


# Tail buffers grow by this many slots at least (amortised O(1) appends during decoding,
# instead of transformers' copy of the whole cache at every step).
TAIL_GROWTH = 16


class DenseTail:
    """The tokens an ``EvictingLayer`` stores densely: the whole prompt before eviction, the
    tokens added since after it. ``[B, Hkv, capacity, d]`` buffers, of which the first
    ``length`` slots are used; appends grow them geometrically (``append``)."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
        """Empty, or holding ``keys``/``values [B, Hkv, n, d]`` whole (views, not copied)."""
        self._keys = keys
        self._values = values
        self.length = 0 if keys is None else keys.shape[2]

    @property
    def keys(self) -> torch.Tensor:
        return self._keys[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self._values[:, :, : self.length]

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[2]

    def append(self, key: torch.Tensor, value: torch.Tensor, limit=None) -> None:
        """Store ``key``/``value [B, Hkv, n, d]`` after the used slots. A full buffer grows to
        exactly what is needed when empty, else by ``max(TAIL_GROWTH, capacity / 8)``;
        ``limit(need, planned) -> capacity`` may change that (the caller's bound)."""
        need = self.length + key.shape[2]
        if need > self.capacity:
            planned = need if self.length == 0 else need + max(TAIL_GROWTH, self.capacity // 8)
            capacity = planned if limit is None else limit(need, planned)
            self._keys = self._grow(self._keys, key, capacity)
            self._values = self._grow(self._values, value, capacity)
        self._keys[:, :, self.length : need] = key
        self._values[:, :, self.length : need] = value
        self.length = need

    def _grow(self, old: torch.Tensor | None, like: torch.Tensor, capacity: int) -> torch.Tensor:
        new = like.new_empty((like.shape[0], like.shape[1], capacity, like.shape[3]))
        if old is not None and self.length:
            new[:, :, : self.length] = old[:, :, : self.length]
        return new

    def sequence(self, b: int, start: int = 0) -> DenseTail:
        """A tail holding sequence ``b``'s used slots from ``start`` on (``[1, Hkv, length -
        start, d]``): views of this one's buffers, no copy (a batch's sequence held to a decode
        budget, ``probkv.hf.decode_budget.split_batch``)."""
        return DenseTail(
            self._keys[b : b + 1, :, start : self.length],
            self._values[b : b + 1, :, start : self.length],
        )

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (``0 <= length <= self.length``)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"a tail of {self.length} tokens cannot keep {length}")
        self.length = length

    def clear(self) -> None:
        """Drop every token and free the buffers (the next append allocates a small one)."""
        self._keys = self._keys[:, :, :0].clone()
        self._values = self._values[:, :, :0].clone()
        self.length = 0

    def nbytes(self) -> int:
        """Bytes allocated (capacity, not just length)."""
        return sum(
            t.numel() * t.element_size() for t in (self._keys, self._values) if t is not None
        )
