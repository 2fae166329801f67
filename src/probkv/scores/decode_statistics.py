"""Online statistics of decode steps, for eviction during generation (S2, S10.5).

A layer held to a decode budget (``probkv.hf.decode_budget``) is re-evicted every few steps.
Each re-eviction is one more sampling stage (S10.5) and needs the policy's scores over the
entries held *now*: the kept prefix entries, then the tail of tokens added since. This module
keeps, per KV head and aligned with those entries, what the scores of S2 read:

- ``column_sums``: the attention each entry received from every decode row (plus the
  prompt's rows, carried over from the prompt's scores), for ``h2o``, ``h2o-h``, ``min-h``.
  ``h2o-h`` weighs row ``j`` at step ``T`` by ``1 / (T - j + 1)`` (S2's harmonic prior, up to
  its normaliser, which the proposal's normalisation drops). That kernel is not an online sum,
  so it is written as a sum of exponentials ``1/x ~ sum_k c_k exp(-s_k x)`` (a Riemann sum of
  ``1/x = int_0^inf exp(-x s) ds`` on a geometric grid of rates ``s_k``): one decaying
  accumulator per rate, exact online; ``harmonic_kernel`` is within 0.1 % of ``1/x`` for
  ``x`` in ``1..10^4``. The rows are the decode attention's own probabilities (handed over by
  ``probkv.hf.attention``, not recomputed); they wait in a buffer of ``PENDING_ROWS`` rows and
  enter the sums when these are read (a stage) or the buffer is full: ``m`` rows decay every
  accumulator once by ``exp(-s_k m)`` and add ``sum_r exp(-s_k (m - r)) p_r`` in one matrix
  product, the same sum as ``m`` one-row updates in another order.
- ``queries``: the latest decode query rows (SnapKV's window, TOVA's and ``min``'s last row).
- ``last_attention``: the latest row's group-mean attention, for the stage's observation; a
  score without column sums (StreamingLLM, K-norm, TOVA, SnapKV) receives probabilities only
  on the step that starts a stage.
- ``fixed``: for a score whose entries' scores never change once they are in the cache (a
  row's ``fixed``: ``kvzap``, whose scorer reads every KV head's key and value at the entry's
  position), each entry's log-score and forced flag, computed once when the entry enters
  (``from_prompt`` for the prompt's, ``enter`` for the tail's, from every KV head's entries
  of those positions, which the dense tail holds) and carried through the stages: exactly the
  scores the whole sequence would give them.

Entries are indexed as the layer holds them (prefix, then tail): scores that read positions
(StreamingLLM's sinks and recency, SnapKV's window) see the entries in position order, which
they are, since kept entries keep their order.

Tensors: ``query [Hq, q, d]``, a head's ``keys [n, d]``; ``g = Hq / Hkv`` query heads per KV
head, query head ``h`` in group ``h // g`` (S2 GQA).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from probkv import scores
from probkv.scores.observation import LayerObservation, score_observation

# Rates s_k = 2^k of the harmonic kernel's exponential sum (module docstring).
HARMONIC_RATES = tuple(2.0**k for k in range(-24, 5))


_RATES: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

# Room the accumulators grow by when the tail passes their width (amortised appends).
_GROWTH = 16

# Decode rows held before they are added to the column sums (read at a stage, or when full).
PENDING_ROWS = 32


def _rates(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(s_k, exp(-s_k), c_k)`` float64 on ``device``, built once."""
    key = str(device)
    if key not in _RATES:
        rates = torch.tensor(HARMONIC_RATES, dtype=torch.float64, device=device)
        _RATES[key] = (rates, torch.exp(-rates), rates * math.log(2.0))
    return _RATES[key]


def harmonic_kernel(distance: torch.Tensor) -> torch.Tensor:
    """``sum_k c_k exp(-s_k x)`` with ``c_k = s_k ln 2``: ``~ 1/x`` for distances ``x >= 1``."""
    rates, _, coef = _rates(distance.device)
    x = distance.to(torch.float64).unsqueeze(-1)
    return (coef * torch.exp(-rates * x)).sum(-1)


def decode_probabilities(
    query: torch.Tensor,
    keys: torch.Tensor,
    log_weights: torch.Tensor | None,
    lengths: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Decode attention of every KV head ``[Hkv, g, q, n]`` (float32): the ``q`` query rows
    ``query [Hq, q, d]`` over each head's entries ``keys [Hkv, n, d]`` (head ``h``'s first
    ``lengths[h]``, the rest padding, zero probability), the newest ``q`` of which are the
    rows themselves (causal among them); ``log_weights [Hkv, n]`` (zero on the tail) are added
    to the logits (S4)."""
    h, n, d = keys.shape
    hq, q, _ = query.shape
    g = hq // h
    logits = torch.matmul(query.reshape(h, g * q, d), keys.transpose(1, 2)).float().mul_(scale)
    logits = logits.view(h, g, q, n)
    if log_weights is not None:
        logits += log_weights.view(h, 1, 1, n)
    index = torch.arange(n, device=keys.device)
    length = torch.tensor(list(lengths), device=keys.device).view(h, 1, 1, 1)
    row = torch.arange(q, device=keys.device).view(1, 1, q, 1)
    visible = index.view(1, 1, 1, n) < length - (q - 1) + row  # causal rows, no padding
    logits.masked_fill_(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1)


@dataclass
class DecodeStatistics:
    """One layer's statistics over the entries it holds (module docstring), padded to the
    longest head: entries past ``lengths[h]`` are padding (zero).

    ``sums``: ``[S, Hq, n]`` float64 accumulators (``S = 1`` uniform rows,
    ``len(HARMONIC_RATES)`` harmonic, ``0`` when the score reads no column sums); before the
    first decode rows they hold one row per KV head (``[S, Hkv, n]``, the prompt's).
    ``last_attention``: ``[Hkv, n]`` the latest row's group-mean attention (diagnostics).
    """

    score: str
    score_params: dict
    sums: torch.Tensor  # [S, H, capacity >= width]: zero past width
    last_attention: torch.Tensor
    lengths: list[int]
    width: int  # the longest head's entries: the statistics' logical width
    queries: torch.Tensor | None = None  # [Hq, <= rows_kept, d], the latest decode rows
    group: int = 1  # g, known from the first decode rows
    pending: torch.Tensor | None = field(default=None, repr=False)  # [rows, Hq, width]
    pending_rows: int = 0  # rows held in ``pending``, not yet in ``sums``
    fixed: FixedScores | None = None  # a ``fixed`` row's scores of the entries (docstring)
    weighting: str | None = field(init=False)
    rows_kept: int = field(init=False)

    def __post_init__(self) -> None:
        self.weighting = scores.column_sums_needed(self.score)
        self.rows_kept = scores.last_query_rows(self.score, self.score_params)
        if scores.score_spec(self.score).fixed and self.fixed is None:
            raise ValueError(f"score {self.score!r} is fixed per entry: pass its entries' scores")

    @classmethod
    def from_prompt(
        cls,
        score: str,
        score_params: dict,
        *,
        prompt_log_scores: torch.Tensor,
        last_query_attention: torch.Tensor,
        kept: Sequence[torch.Tensor],
        values: torch.Tensor | None = None,
        prompt_forced: torch.Tensor | None = None,
    ) -> DecodeStatistics:
        """Statistics after the prompt's eviction (stage 1): the prompt's ``t`` rows enter the
        column sums through its proposal ``exp(log_scores) [Hkv, t]`` (each of its rows counted
        as that distribution: exact for ``h2o``'s group mean, an approximation of the rows'
        harmonic weights for ``-h``), restricted to the ``kept[h]`` indices. ``value_norms
        [Hkv, t]``: divided out of a ``min-h`` proposal (its column sums do not hold them).
        A ``fixed`` score keeps the kept entries' log-scores and ``prompt_forced [Hkv, t]``
        flags as they are."""
        t = prompt_log_scores.shape[1]
        device = prompt_log_scores.device
        weighting = scores.column_sums_needed(score)
        pi = torch.exp(prompt_log_scores.double())
        if weighting is not None and scores.score_spec(score).value_norm:
            if values is None:
                raise ValueError(f"score {score!r} multiplies by value norms: pass values")
            value_norms = values.float().norm(dim=-1)
            pi = pi / value_norms.to(device).double().clamp_min(1e-12)
            pi = pi / pi.sum(-1, keepdim=True)
        if weighting is None:
            mass = torch.zeros(0, dtype=torch.float64, device=device)
        elif weighting == "uniform":
            mass = torch.tensor([float(t)], dtype=torch.float64, device=device)
        else:  # sum_{x=1..t} exp(-s x): every prompt row weighed by its distance
            decay = _rates(device)[1]
            mass = decay * (1 - decay**t) / (1 - decay)
        lengths = [int(idx.numel()) for idx in kept]
        index, valid = _padded(kept, device)
        sums = mass.view(-1, 1, 1) * (pi.gather(1, index) * valid).unsqueeze(0)
        last = last_query_attention.float().gather(1, index.to(last_query_attention.device))
        fixed = None
        if scores.score_spec(score).fixed:
            fixed = FixedScores.empty(len(kept), device)
            fixed.append(prompt_log_scores, prompt_forced)
            fixed.keep(index, valid.bool(), lengths)
        return cls(
            score,
            dict(score_params),
            sums,
            last * valid.float(),
            lengths,
            max(lengths),
            fixed=fixed,
        )

    def enter(
        self, key: torch.Tensor, value: torch.Tensor, *, first_position: int, layer_idx: int
    ) -> None:
        """A ``fixed`` score: score the entries that entered since the last stage, the dense
        tail's ``key``/``value [Hkv, m, d]`` (every KV head's, positions ``first_position`` on),
        with the score's own function (its ``sinks`` counted from ``first_position``), once."""
        m = key.shape[1]
        if self.fixed is None or m == 0:
            return
        if any(n != f + m for n, f in zip(self.lengths, self.fixed.lengths, strict=True)):
            raise ValueError(
                f"{m} tail entries do not complete the heads' {self.fixed.lengths} scored "
                f"entries to {self.lengths}"
            )
        params = dict(self.score_params)
        if "sinks" in params:  # the first ``sinks`` positions of the sequence are forced
            params["sinks"] = max(0, int(params["sinks"]) - first_position)
        result = scores.compute_scores(
            self.score, None, key, value, scale=1.0, layer_idx=layer_idx, **params
        )
        self.fixed.append(result.log_scores, result.forced)

    def observe(self, probs: torch.Tensor | None, query: torch.Tensor) -> None:
        """A forward's ``q`` rows: ``probs [Hkv, g, q, n]`` over the entries held now (the
        decode attention's own, ``evicted_attention_with_probabilities``, or recomputed by
        ``decode_probabilities``; every head holds ``q`` entries more), ``query [Hq, q, d]``.
        ``probs`` may be ``None`` for a score that reads no column sums, on a step that starts
        no stage: the latest row's attention is then unknown until the next rows come."""
        q = query.shape[1]
        width = self.width
        self.group = query.shape[0] // max(1, len(self.lengths))
        self.lengths = [length + q for length in self.lengths]
        self.width = max(self.lengths, default=0)
        if q >= self.rows_kept:  # the latest rows, no copy of the older ones
            self.queries = query[:, q - self.rows_kept :].clone()
        else:
            rows = query if self.queries is None else torch.cat([self.queries, query], 1)
            self.queries = rows[:, -self.rows_kept :].clone()
        if probs is None:
            if self.weighting is not None:
                raise ValueError(f"score {self.score!r} needs every decode row's probabilities")
            self.last_attention = None
            return
        h, g, _, n = probs.shape
        self.group = g
        if n < width:
            raise ValueError(f"{n} entries, fewer than the statistics' {width}")
        self.width = n
        self.last_attention = probs[:, :, -1].mean(1)
        if self.weighting is not None:
            self._hold(probs.reshape(h * g, q, n))

    def _hold(self, p: torch.Tensor) -> None:
        """Rows ``p [Hq, q, n]`` into the pending rows (added to the sums when read, at the
        latest after ``PENDING_ROWS`` rows): one copy per forward instead of a pass over every
        accumulator."""
        hq, q, n = p.shape
        if self.pending_rows + q > PENDING_ROWS:
            self._flush()
        if q > PENDING_ROWS:
            self._accumulate(p.transpose(0, 1))
            return
        if self.pending is None or self.pending.shape[1] != hq or self.pending.shape[2] < n:
            self._flush()
            self.pending = p.new_zeros(PENDING_ROWS, hq, n + _GROWTH)
        m = self.pending_rows
        self.pending[m : m + q, :, :n] = p.transpose(0, 1)
        self.pending_rows = m + q

    def _flush(self) -> None:
        """Add the pending rows to the sums (they are zero past each row's width)."""
        if self.pending_rows:
            rows = self.pending[: self.pending_rows]
            self._accumulate(rows)
            rows.zero_()
            self.pending_rows = 0

    def _accumulate(self, rows: torch.Tensor) -> None:
        """Add ``rows [m, Hq, n]`` (oldest first) to the column sums, in place (S2 weights,
        module docstring): at the last row, row ``r`` (0 the oldest) is at distance ``m - r``, so
        every accumulator decays by ``exp(-s m)`` and takes ``sum_r exp(-s (m - r)) p_r``,
        one matrix product for every rate."""
        m, hq, n = rows.shape
        if self.sums.shape[1] != hq:  # the prompt's rows, the same for the whole group
            self.sums = self.sums.repeat_interleave(hq // self.sums.shape[1], dim=1)
        if self.sums.shape[2] < n:
            self.sums = torch.nn.functional.pad(self.sums, (0, n + _GROWTH - self.sums.shape[2]))
        acc = self.sums[:, :, :n]  # a view: updated in place
        p = rows.double().reshape(m, hq * n)
        if self.weighting == "uniform":
            acc[0] += p.sum(0).view(hq, n)
        else:
            rates, decay, _ = _rates(p.device)
            acc *= (decay**m).view(-1, 1, 1)
            dist = torch.arange(m, 0, -1, dtype=torch.float64, device=p.device)
            kernel = torch.exp(-rates.view(-1, 1) * dist)  # [S, m]
            acc += torch.matmul(kernel, p).view(-1, hq, n)

    def column_sums(self, heads: Sequence[int], n: int) -> torch.Tensor | None:
        """``[len(heads) g, n]`` float32 weighted column sums of ``heads`` (``None``: not
        needed), their first ``n`` entries."""
        if self.weighting is None:
            return None
        self._flush()
        g = self.group
        if list(heads) == list(range(len(self.lengths))):  # every head: no gather
            acc = self.sums[:, :, :n]
        else:
            rows = torch.cat([torch.arange(h * g, (h + 1) * g) for h in heads])
            acc = self.sums[:, rows.to(self.sums.device), :n]
        if self.weighting == "harmonic":  # sum_k c_k acc_k, one product
            coef = _rates(acc.device)[2].view(1, -1)
            return torch.matmul(coef, acc.reshape(acc.shape[0], -1)).view(-1, n).float()
        return acc[0].float()

    def observation(
        self,
        heads: Sequence[int],
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        scale: float,
        layer_idx: int,
        rank: int,
    ) -> LayerObservation:
        """The policy's observation of ``heads`` (equal lengths ``n``): ``keys``/``values
        [len(heads), n, d]`` their entries now. Scores that read the last query rows get the
        rows seen: a row's ``last_rows`` parameter (SnapKV's window) shrinks to them right
        after the prompt."""
        n = keys.shape[1]
        if self.fixed is not None:  # scored when they entered (``enter``)
            log_scores, forced = self.fixed.read(heads, n)
            return LayerObservation(
                layer_idx, rank, log_scores, forced, self.last_attention[list(heads), :n]
            )
        g = self.group
        params = dict(self.score_params)
        query = keys.new_zeros(len(heads) * g, n, keys.shape[2])
        if self.queries is not None:
            rows = self.queries.view(-1, g, *self.queries.shape[1:])[list(heads)]
            rows = rows.reshape(-1, *rows.shape[2:])[:, -n:].to(keys.dtype)
            query[:, n - rows.shape[1] :] = rows
            rows_param = scores.score_spec(self.score).last_rows
            if isinstance(rows_param, str):  # e.g. SnapKV's window: at most the rows seen
                params[rows_param] = min(scores.last_query_rows(self.score, params), rows.shape[1])
        return score_observation(
            query,
            keys,
            values,
            scale,
            self.score,
            params,
            self.column_sums(heads, n),
            layer_idx=layer_idx,
            rank=rank,
            last_attention=self.last_attention[list(heads), :n],
        )

    def keep(self, kept: Sequence[torch.Tensor]) -> None:
        """After a stage: ``kept[h]`` indices of head ``h``'s entries survive."""
        self._flush()
        device = self.sums.device
        index, valid = _padded(kept, device)
        if self.last_attention is not None:
            self.last_attention = self.last_attention.gather(1, index) * valid.float()
        if self.fixed is not None:
            self.fixed.keep(index, valid.bool(), [int(idx.numel()) for idx in kept])
        if self.weighting is not None:
            g = self.sums.shape[1] // len(kept)
            rows = index.repeat_interleave(g, dim=0)
            valid_rows = valid.repeat_interleave(g, dim=0)
            self.sums = self.sums.gather(2, rows.expand(self.sums.shape[0], -1, -1)) * valid_rows
        self.lengths = [int(idx.numel()) for idx in kept]
        self.width = max(self.lengths, default=0)


def _padded(kept: Sequence[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[Hkv, n_max]`` gather indices (0 on padding) and the float mask of real entries."""
    n = max((int(idx.numel()) for idx in kept), default=0)
    index = torch.zeros(len(kept), n, dtype=torch.int64, device=device)
    valid = torch.zeros(len(kept), n, dtype=torch.float64, device=device)
    for h, idx in enumerate(kept):
        index[h, : idx.numel()] = idx.to(device)
        valid[h, : idx.numel()] = 1.0
    return index, valid


@dataclass
class FixedScores:
    """A ``fixed`` score's log-scores ``[Hkv, capacity]`` (float32) and forced flags (bool) of
    the entries each head holds, in the layer's order (prefix, then tail): head ``h``'s first
    ``lengths[h]``, padding after."""

    log_scores: torch.Tensor
    forced: torch.Tensor
    lengths: list[int]

    @classmethod
    def empty(cls, heads: int, device) -> FixedScores:
        return cls(
            torch.zeros(heads, 0, device=device),
            torch.zeros(heads, 0, dtype=torch.bool, device=device),
            [0] * heads,
        )

    def append(self, log_scores: torch.Tensor, forced: torch.Tensor | None) -> None:
        """Every head's next ``m`` entries: ``log_scores``/``forced [Hkv, m]``."""
        h, m = log_scores.shape
        width = max(self.lengths) + m
        if self.log_scores.shape[1] < width:
            pad = width + _GROWTH - self.log_scores.shape[1]
            self.log_scores = torch.cat([self.log_scores, self.log_scores.new_zeros(h, pad)], 1)
            self.forced = torch.cat([self.forced, self.forced.new_zeros(h, pad)], 1)
        log_scores = log_scores.to(self.log_scores.device, torch.float32)
        for i, n in enumerate(self.lengths):
            self.log_scores[i, n : n + m] = log_scores[i]
            self.forced[i, n : n + m] = (
                False if forced is None else forced[i].to(self.forced.device)
            )
        self.lengths = [n + m for n in self.lengths]

    def keep(self, index: torch.Tensor, valid: torch.Tensor, lengths: list[int]) -> None:
        """After a stage: ``index [Hkv, n]`` (padded, ``valid`` marks real entries)."""
        index = index.to(self.log_scores.device)
        valid = valid.to(self.log_scores.device)
        self.log_scores = self.log_scores.gather(1, index) * valid
        self.forced = self.forced.gather(1, index) & valid
        self.lengths = list(lengths)

    def read(self, heads: Sequence[int], n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``heads``' first ``n`` log-scores ``[len(heads), n]`` and forced flags (``None`` if
        none is forced)."""
        if any(self.lengths[h] != n for h in heads):
            raise ValueError(f"heads {list(heads)} hold {self.lengths}, not {n} scored entries")
        rows = list(heads)
        forced = self.forced[rows, :n].clone()
        return self.log_scores[rows, :n].clone(), forced if bool(forced.any()) else None
