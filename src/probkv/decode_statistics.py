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
  ``x`` in ``1..10^4``.
- ``queries``: the latest decode query rows (SnapKV's window, TOVA's and ``min``'s last row).

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
from probkv.observation import LayerObservation, causal_offset_mask

# Rates s_k = 2^k of the harmonic kernel's exponential sum (module docstring).
HARMONIC_RATES = tuple(2.0**k for k in range(-18, 5))


def harmonic_kernel(distance: torch.Tensor) -> torch.Tensor:
    """``sum_k c_k exp(-s_k x)`` with ``c_k = s_k ln 2``: ``~ 1/x`` for distances ``x >= 1``."""
    rates = torch.tensor(HARMONIC_RATES, dtype=torch.float64)
    x = distance.to(torch.float64).unsqueeze(-1)
    return (rates * math.log(2.0) * torch.exp(-rates * x)).sum(-1)


def decode_probabilities(
    query: torch.Tensor, keys: torch.Tensor, log_weights: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One KV head's decode attention ``[g, q, n]`` (float32): the ``q`` query rows of its
    group ``query [g, q, d]`` over its ``n`` entries ``keys [n, d]``, the newest ``q`` of which
    are the rows themselves (causal among them); prefix logits get ``+ log w`` (S4)."""
    logits = torch.matmul(query, keys.T).float().mul_(scale)
    if log_weights is not None:
        logits[..., : log_weights.shape[0]] += log_weights
    q, n = query.shape[1], keys.shape[0]
    if q > 1:
        logits.masked_fill_(~causal_offset_mask(q, n, query.device), float("-inf"))
    return torch.softmax(logits, dim=-1)


@dataclass
class DecodeStatistics:
    """One layer's statistics over the entries it holds (module docstring).

    ``sums[h]``: ``[S, g, n_h]`` float64 accumulators of head ``h`` (``S = 1`` uniform rows,
    ``len(HARMONIC_RATES)`` harmonic; empty when the score reads no column sums).
    ``last_attention[h]``: ``[n_h]`` the latest row's group-mean attention (diagnostics).
    """

    score: str
    score_params: dict
    sums: list[torch.Tensor]
    last_attention: list[torch.Tensor]
    queries: torch.Tensor | None = None  # [Hq, <= rows_kept, d], the latest decode rows
    group: int = 1  # g, known from the first decode rows (the prompt's sums hold 1 row)
    weighting: str | None = field(init=False)
    rows_kept: int = field(init=False)

    def __post_init__(self) -> None:
        self.weighting = scores.column_sums_needed(self.score)
        self.rows_kept = scores.last_query_rows(self.score, self.score_params)

    @classmethod
    def from_prompt(
        cls,
        score: str,
        score_params: dict,
        *,
        prompt_log_scores: torch.Tensor,
        last_query_attention: torch.Tensor,
        kept: Sequence[torch.Tensor],
        value_norms: torch.Tensor | None = None,
    ) -> DecodeStatistics:
        """Statistics after the prompt's eviction (stage 1): the prompt's ``t`` rows enter the
        column sums through its proposal ``exp(log_scores) [Hkv, t]`` (each of its rows counted
        as that distribution: exact for ``h2o``'s group mean, an approximation of the rows'
        harmonic weights for ``-h``), restricted to the ``kept[h]`` indices. ``value_norms
        [Hkv, t]``: divided out of a ``min-h`` proposal (its column sums do not hold them).
        The sums hold one row per KV head until the first decode rows give the group."""
        t = prompt_log_scores.shape[1]
        weighting = scores.column_sums_needed(score)
        sums = []
        for h, idx in enumerate(kept):
            pi = torch.exp(prompt_log_scores[h].double())
            if value_norms is not None:
                pi = pi / value_norms[h].double().clamp_min(1e-12)
                pi = pi / pi.sum()
            pi = pi[idx.to(pi.device)]
            if weighting is None:
                sums.append(pi.new_zeros(0, 1, pi.shape[0]))
                continue
            if weighting == "uniform":
                mass = torch.tensor([float(t)], dtype=torch.float64)
            else:  # sum_{x=1..t} exp(-s x): every prompt row weighed by its distance
                rates = torch.tensor(HARMONIC_RATES, dtype=torch.float64)
                decay = torch.exp(-rates)
                mass = decay * (1 - decay**t) / (1 - decay)
            mass = mass.to(pi.device)
            sums.append(mass.view(-1, 1, 1) * pi.view(1, 1, -1))
        device = last_query_attention.device
        last = [last_query_attention[h][idx.to(device)] for h, idx in enumerate(kept)]
        return cls(score, dict(score_params), sums, last)

    @property
    def lengths(self) -> list[int]:
        return [int(a.shape[0]) for a in self.last_attention]

    def observe(self, probs: Sequence[torch.Tensor], query: torch.Tensor) -> None:
        """A forward's ``q`` rows: ``probs[h] [g, q, n_h]`` over head ``h``'s entries now (its
        last ``q`` or more are new), ``query [Hq, q, d]``."""
        q = query.shape[1]
        self.group = query.shape[0] // len(probs)
        for h, p in enumerate(probs):
            p = p.double()
            new = p.shape[-1] - self.last_attention[h].shape[0]
            if new < 0:
                raise ValueError(f"head {h}: {p.shape[-1]} entries, fewer than the statistics'")
            self.last_attention[h] = p[:, -1].float().mean(0)
            if self.weighting is None:
                continue
            acc = torch.nn.functional.pad(self.sums[h], (0, new))
            if acc.shape[1] != self.group:  # the prompt's rows, the same for the group
                acc = acc.expand(-1, self.group, -1).clone()
            if self.weighting == "uniform":
                acc[0] += p.sum(1)
            else:  # row r of q is at distance q - r at the end of this forward
                rates = torch.tensor(HARMONIC_RATES, dtype=torch.float64, device=p.device)
                dist = torch.arange(q, 0, -1, dtype=torch.float64, device=p.device)
                row_decay = torch.exp(-rates.view(-1, 1) * dist)  # [S, q]
                acc = acc * torch.exp(-rates * q).view(-1, 1, 1)
                acc += torch.einsum("sr,grn->sgn", row_decay, p)
            self.sums[h] = acc
        rows = query if self.queries is None else torch.cat([self.queries, query], 1)
        self.queries = rows[:, -self.rows_kept :].clone()

    def column_sums(self, h: int) -> torch.Tensor | None:
        """``[g, n_h]`` float32 weighted column sums of head ``h`` (``None``: not needed)."""
        if self.weighting is None:
            return None
        acc = self.sums[h]
        if self.weighting == "harmonic":
            coef = torch.tensor(HARMONIC_RATES, dtype=torch.float64, device=acc.device)
            acc = (coef * math.log(2.0)).view(-1, 1, 1) * acc
        return acc.sum(0).float()

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
        rows seen (SnapKV's window shrinks to them right after the prompt)."""
        n = keys.shape[1]
        g = self.group
        params = dict(self.score_params)
        query = keys.new_zeros(len(heads) * g, n, keys.shape[2])
        if self.queries is not None:
            rows = self.queries.view(-1, g, *self.queries.shape[1:])[list(heads)]
            rows = rows.reshape(-1, *rows.shape[2:])[:, -n:].to(keys.dtype)
            query[:, n - rows.shape[1] :] = rows
            if "window" in params:
                params["window"] = min(params["window"], rows.shape[1])
        sums = None
        if self.weighting is not None:
            sums = torch.cat([self.column_sums(h) for h in heads])
        result = scores.compute_scores(
            self.score, query, keys, values, scale=scale, column_sums=sums, **params
        )
        last = torch.stack([self.last_attention[h] for h in heads])
        return LayerObservation(
            layer_idx=layer_idx,
            rank=rank,
            log_scores=result.log_scores,
            forced=result.forced,
            last_query_attention=last,
        )

    def keep(self, kept: Sequence[torch.Tensor]) -> None:
        """After a stage: ``kept[h]`` indices of head ``h``'s entries survive."""
        for h, idx in enumerate(kept):
            self.last_attention[h] = self.last_attention[h][idx.to(self.last_attention[h].device)]
            if self.weighting is not None:
                self.sums[h] = self.sums[h][..., idx.to(self.sums[h].device)]
