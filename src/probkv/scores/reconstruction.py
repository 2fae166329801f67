"""Reconstruction rows: attention of a "repeat the context" pass on the cached context (S10.1).

KVzip (Kim et al. 2025) scores a prefilled context ``x_1..x_t`` by running the model once more
over a short instruction to repeat the previous context followed by the context itself. These
*reconstruction queries* attend to the ``t`` cached entries and, causally, to the
reconstruction tokens themselves; the reconstruction tokens are never kept. The statistics
this module accumulates per layer are the raw material of three scores (``probkv.scores``):

- ``kvzip``:   ``max_{u in R, q in G(h)} p_u^q(i)`` (per KV head, max over its GQA group);
- ``h2o-rec``: ``(1/|R|) sum_u p_u(i)`` (mean attention of the reconstruction queries);
- ``min-rec``: the same times ``||v_i||`` (the min-variance form of S2).

``p_u(i)`` is the softmax of query ``u`` over the ``t`` context entries *and* the
reconstruction tokens up to ``u`` (what the model itself computes in that pass); the
statistics read its first ``t`` columns.

Contents (pure tensor and integer functions, no model code, no tokenizer):

- ``reconstruction_chunks``: the token ids of each reconstruction chunk, as KVzip builds them.
- ``reconstruction_attention``: one chunk's attention output and statistics, in row chunks
  (extra memory ``O(rows x (t + n))`` per KV head, never ``n x (t + n)``).
- ``ReconstructionStats``: the statistics of one layer accumulated over the chunks.
- ``kvzip``, ``h2o_reconstruction``, ``min_reconstruction``: the scores made of them
  (``probkv.scores.compute_scores(name, ..., reconstruction=stats)`` dispatches here).

Tensor conventions as ``probkv.scores.column_sums`` (docs/architecture.md): ``query [Hq, n, d]``
(post-RoPE, positions ``t..t+n-1``), ``key``/``value [Hkv, t + n, d]`` = the cached context
followed by the chunk's own entries, ``Hq = g * Hkv``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from probkv._checks import check_heads, check_positive_int
from probkv.scores.column_sums import (
    CPU_CHUNK_ROWS,
    check_floating,
    check_scale,
    default_chunk_size,
)
from probkv.scores.functions import FORCED_LOG_SCORE, Scores, group_log_scores, value_norms
from probkv.scores.proposals import FLOOR

# KVzip's chunk length (tokens of context reconstructed per model pass) and the number of
# tokens of the previous chunk quoted in a later chunk's instruction (its reference code).
DEFAULT_CHUNK_TOKENS = 2000
CHUNK_OVERLAP = 8


@dataclass(frozen=True)
class ReconstructionChunk:
    """One reconstruction pass: it reconstructs context entries ``[start, end)`` and feeds
    ``input_ids`` (instruction, template closing, then those entries' tokens)."""

    start: int
    end: int
    input_ids: tuple[int, ...]


def reconstruction_chunks(
    context_ids: Sequence[int],
    *,
    first: Sequence[int],
    later: Sequence[int],
    suffix: Sequence[int],
    context_start: int = 0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    overlap: int = CHUNK_OVERLAP,
) -> list[ReconstructionChunk]:
    """KVzip's reconstruction inputs for the cached tokens ``context_ids`` (S10.1).

    The entries ``[context_start, t)`` are cut into consecutive chunks of ``chunk_tokens``
    (the last may be shorter). Chunk 0 feeds ``first + suffix + chunk``; chunk ``c > 0`` feeds
    ``later + (last overlap tokens of chunk c-1) + suffix + chunk``: ``first`` and ``later``
    are the tokenized instructions ("repeat the previous context" / "repeat the part ...
    starting with"), ``suffix`` the chat template's end of the user turn and assistant header.
    Entries before ``context_start`` (the template's opening, e.g. a system prompt) are not
    reconstructed. ``context_start`` must leave at least one entry to reconstruct.
    """
    ids = [int(i) for i in context_ids]
    t = len(ids)
    if t == 0:
        raise ValueError("context_ids is empty; there is no context to reconstruct")
    check_positive_int(context_start, "context_start", allow_zero=True)
    if context_start >= t:
        raise ValueError(
            f"context_start must be < {t} (the number of cached tokens), got {context_start}"
        )
    check_positive_int(chunk_tokens, "chunk_tokens")
    check_positive_int(overlap, "overlap", allow_zero=True)
    chunks = []
    for start in range(context_start, t, chunk_tokens):
        end = min(start + chunk_tokens, t)
        if start == context_start:
            instruction = [*first]
        else:
            quoted = ids[start - min(overlap, chunk_tokens) : start]  # end of chunk c - 1
            instruction = [*later, *quoted]
        chunk_ids = (*instruction, *suffix, *ids[start:end])
        chunks.append(ReconstructionChunk(start, end, tuple(int(i) for i in chunk_ids)))
    return chunks


@dataclass
class ReconstructionStats:
    """One layer's reconstruction statistics over every query row seen so far (S10.1).

    ``max_attention [Hkv, t]`` float32: ``max_u max_{q in G(h)} p_u^q(i)``.
    ``sum_attention [Hq, t]`` float64: ``sum_u p_u^q(i)`` per query head.
    ``rows``: ``|R|``, the reconstruction queries counted (per query head).
    ``context_start``: entries before it were not reconstructed (the template's opening).
    ``chunk_tokens``: the chunk length the statistics were computed with.
    ``reference_queries``: ``[Hq, m, d]`` float32, a sample of the reconstruction queries
    themselves (post-RoPE; ``add_reference_queries``), for calibrated weights (S9,
    ``probkv.estimation.calibration``); ``None`` until rows are added.
    """

    max_attention: torch.Tensor
    sum_attention: torch.Tensor
    rows: int = 0
    context_start: int = 0
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    reference_queries: torch.Tensor | None = None
    max_weighted: torch.Tensor | None = None  # [Hkv, t] KVzip+'s max, when weighted (S11)

    @classmethod
    def empty(
        cls,
        num_kv_heads: int,
        num_query_heads: int,
        t: int,
        *,
        context_start: int = 0,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        device: torch.device | str | None = None,
    ) -> ReconstructionStats:
        return cls(
            torch.zeros(num_kv_heads, t, dtype=torch.float32, device=device),
            torch.zeros(num_query_heads, t, dtype=torch.float64, device=device),
            0,
            context_start,
            chunk_tokens,
        )

    @property
    def length(self) -> int:
        return self.max_attention.shape[1]

    def add(
        self,
        max_attention: torch.Tensor,
        sum_attention: torch.Tensor,
        rows: int,
        max_weighted: torch.Tensor | None = None,
    ) -> None:
        """Fold in one chunk's ``reconstruction_attention`` statistics over ``rows`` queries
        (``max_weighted``: KVzip+'s, when the pass is weighted)."""
        if max_weighted is not None:
            if self.max_weighted is None:
                self.max_weighted = torch.zeros_like(self.max_attention)
            torch.maximum(self.max_weighted, max_weighted.float(), out=self.max_weighted)
        if max_attention.shape != self.max_attention.shape:
            raise ValueError(
                f"max_attention must be {tuple(self.max_attention.shape)}, got "
                f"{tuple(max_attention.shape)}"
            )
        if sum_attention.shape != self.sum_attention.shape:
            raise ValueError(
                f"sum_attention must be {tuple(self.sum_attention.shape)}, got "
                f"{tuple(sum_attention.shape)}"
            )
        torch.maximum(self.max_attention, max_attention.float(), out=self.max_attention)
        self.sum_attention += sum_attention.to(torch.float64)
        self.rows += check_positive_int(rows, "rows")

    def add_reference_queries(self, queries: torch.Tensor) -> None:
        """Append reconstruction query rows ``[Hq, k, d]`` to ``reference_queries``."""
        hq = self.sum_attention.shape[0]
        if queries.ndim != 3 or queries.shape[0] != hq:
            raise ValueError(f"queries must be [{hq}, k, d], got {tuple(queries.shape)}")
        rows = queries.detach().to(torch.float32, copy=True)  # never a view of the chunk
        if self.reference_queries is not None:
            rows = torch.cat([self.reference_queries, rows], dim=1)
        self.reference_queries = rows

    def mean_attention(self) -> torch.Tensor:
        """``[Hq, t]`` float64: ``(1/|R|) sum_u p_u^q(i)`` (S10.1)."""
        if self.rows == 0:
            raise ValueError("no reconstruction query has been added yet (rows = 0)")
        return self.sum_attention / self.rows


def reconstruction_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    context_length: int,
    scale: float,
    chunk_size: int | None = None,
    row_weights: torch.Tensor | None = None,
    column_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Attention of ``n`` reconstruction queries after ``t`` cached entries, with statistics.

    Args:
        query: ``[Hq, n, d]`` reconstruction queries; row ``j`` sits at position ``t + j``.
        key: ``[Hkv, t + n, d]``: the ``t = context_length`` cached entries, then the
            reconstruction tokens' own keys. value: ``[Hkv, t + n, d_v]`` likewise.
        context_length: ``t``.
        scale: logit scale.
        chunk_size: query rows per chunk; ``None`` as ``probkv.scores.column_sums`` (64 rows on CPU,
            fewer if one chunk's scores exceed 64 MiB).

        row_weights, column_weights: KVzip+'s weights (S11), ``[n]`` per reconstruction row
            (``1 / ||h_j||``, the row's attention input) and ``[Hq, t]`` per query head and
            entry (``||W_o^q v_i||``); given together or not at all.

    Returns:
        ``(output, max_attention, sum_attention, max_weighted)``: ``output [Hq, n, d_v]``
        (query dtype) is the causal attention the model computes (row ``j`` sees keys
        ``0..t+j``); ``max_attention [Hkv, t]``, ``max_{j, q in G(h)} p_j^q(i)``;
        ``sum_attention [Hq, t]``, ``sum_j p_j^q(i)``; ``max_weighted [Hkv, t]``,
        ``max_{j, q in G(h)} r_j c^q_i p_j^q(i)`` with the weights (``None`` without them); all
        over the first ``t`` columns only, in the arithmetic dtype: float32 (float64 if an
        input is float64).
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_floating(x, name)
    g = check_heads(query, key, value)
    scale = check_scale(scale)
    hq, n, d = query.shape
    hkv, total, _ = key.shape
    t = check_positive_int(context_length, "context_length")
    if n == 0 or total != t + n:
        raise ValueError(
            f"key must hold the {t} cached entries then the {n} reconstruction entries "
            f"(length t + n = {t + n} with n >= 1), got length {total}"
        )
    if chunk_size is None:
        cpu = query.device.type == "cpu"
        chunk = default_chunk_size(hq, total, max_rows=CPU_CHUNK_ROWS if cpu else None)
    else:
        chunk = min(check_positive_int(chunk_size, "chunk_size"), n)
    dtype = (
        torch.float64 if torch.float64 in (query.dtype, key.dtype, value.dtype) else torch.float32
    )
    dev = query.device
    weighted = _check_weights(row_weights, column_weights, n, hq, t)
    if weighted:
        rw = row_weights.to(dev, dtype)
        cw = column_weights.to(dev, dtype).view(hkv, g, 1, t)
        max_weighted = torch.zeros(hkv, t, dtype=dtype, device=dev)
    k_t = key.to(dtype).transpose(1, 2)  # [Hkv, d, t + n]
    v = value.to(dtype)
    qg = query.reshape(hkv, g, n, d)
    dv = v.shape[-1]
    out = torch.empty(hkv, g, n, dv, dtype=dtype, device=dev)
    max_attention = torch.zeros(hkv, t, dtype=dtype, device=dev)
    sum_attention = torch.zeros(hkv, g, t, dtype=dtype, device=dev)
    # Buffers reused by every chunk (one KV head at a time keeps a chunk near the cache on CPU).
    scores_buf = torch.empty(g * chunk * total, dtype=dtype, device=dev)
    q_buf = torch.empty(g * chunk * d, dtype=dtype, device=dev)
    above_diagonal = torch.ones(chunk, chunk, dtype=torch.bool, device=dev).triu_(1)
    for h in range(hkv):
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            rows = b - a
            width = t + b  # row a + r sees keys [0, t + a + r]; later columns are masked
            qc = q_buf[: g * rows * d].view(g, rows, d)
            torch.mul(qg[h, :, a:b].to(dtype), scale, out=qc)
            s = scores_buf[: g * rows * width].view(g * rows, width)
            torch.mm(qc.view(g * rows, d), k_t[h, :, :width], out=s)
            s.view(g, rows, width)[..., t + a :].masked_fill_(
                above_diagonal[:rows, :rows], -math.inf
            )
            torch.softmax(s, -1, out=s)
            out[h, :, a:b] = torch.mm(s, v[h, :width]).view(g, rows, dv)
            context = s.view(g, rows, width)[..., :t]
            torch.maximum(max_attention[h], context.amax((0, 1)), out=max_attention[h])
            sum_attention[h] += context.sum(1)
            if weighted:
                plus = (context * rw[a:b].view(1, rows, 1) * cw[h]).amax((0, 1))
                torch.maximum(max_weighted[h], plus, out=max_weighted[h])
    output = out.view(hq, n, dv).to(query.dtype)
    return output, max_attention, sum_attention.view(hq, t), max_weighted if weighted else None


def _check_weights(row_weights, column_weights, n: int, hq: int, t: int) -> bool:
    """Whether KVzip+'s weights are given (both, of shapes ``[n]`` and ``[Hq, t]``)."""
    if row_weights is None and column_weights is None:
        return False
    if row_weights is None or column_weights is None:
        raise ValueError("row_weights and column_weights (KVzip+) are given together or not at all")
    if tuple(row_weights.shape) != (n,) or tuple(column_weights.shape) != (hq, t):
        raise ValueError(
            f"row_weights must be [{n}] and column_weights [{hq}, {t}], got "
            f"{tuple(row_weights.shape)} and {tuple(column_weights.shape)}"
        )
    return True


# ------------------------------------------------------------------------------ scores (S10.1)


def _forced_prefix(
    stats: ReconstructionStats, sinks: int, chunk_tokens: int
) -> tuple[int, torch.Tensor | None]:
    """Check the statistics fit the score's parameters; return the forced prefix (S10.1): the
    first ``f = max(sinks, context_start)`` entries (attention sinks, the template's opening),
    and its ``[Hkv, t]`` mask (``None`` when ``f = 0``)."""
    if not isinstance(stats, ReconstructionStats):
        raise ValueError(
            "reconstruction must be the ReconstructionStats of the reconstruction pass "
            f"(probkv.hf.compress and observe run it), got {type(stats).__name__}"
        )
    check_positive_int(sinks, "sinks", allow_zero=True)
    if stats.chunk_tokens != chunk_tokens or stats.rows == 0:
        raise ValueError(
            f"the reconstruction statistics were computed with chunk_tokens={stats.chunk_tokens} "
            f"over {stats.rows} rows; this score needs chunk_tokens={chunk_tokens} and >= 1 row"
        )
    hkv, t = stats.max_attention.shape
    f = min(t, max(sinks, stats.context_start))
    if f == 0:
        return 0, None
    forced = torch.zeros(hkv, t, dtype=torch.bool, device=stats.max_attention.device)
    forced[:, :f] = True
    return f, forced


def _prepend_forced(free_log_scores: torch.Tensor, f: int) -> torch.Tensor:
    """``[Hkv, t - f]`` log-scores of the free entries -> ``[Hkv, t]`` float32."""
    hkv = free_log_scores.shape[0]
    forced = torch.full((hkv, f), FORCED_LOG_SCORE, device=free_log_scores.device)
    return torch.cat([forced, free_log_scores.to(torch.float32)], dim=1)


def kvzip(
    reconstruction: ReconstructionStats,
    *,
    sinks: int = 4,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Scores:
    """KVzip (S10.1): ``log max_{u in R, q in G(h)} p_u^q(i)``, the largest attention any
    reconstruction query of the group pays entry ``i``. Raw probabilities, not renormalised
    per head: heads and layers compare on this scale (KVzip's global top-k), floored at
    ``FLOOR / (t - f)``. The first ``f = max(sinks, context_start)`` entries are forced."""
    f, forced = _forced_prefix(reconstruction, sinks, chunk_tokens)
    free = reconstruction.max_attention[:, f:].to(torch.float64)
    floor = FLOOR / max(free.shape[1], 1)
    return Scores(_prepend_forced(torch.log(free.clamp_min(floor)), f), forced)


def kvzip_plus(
    reconstruction: ReconstructionStats,
    *,
    sinks: int = 4,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Scores:
    """KVzip+ (KVzap's teacher, S11): ``log max_{u in R, q in G(h)} p_u^q(i) ||W_o^q v_i|| /
    ||h_u||``, KVzip's attention weighted by what entry ``i`` adds to the output relative to
    the reconstruction row's attention input; otherwise as ``kvzip`` (forced prefix, floor)."""
    if reconstruction.max_weighted is None:
        raise ValueError(
            "score 'kvzip-plus' needs the reconstruction pass weighted by ||W_o v|| / ||h|| "
            "(probkv.hf.reconstruct weighs it for this score)"
        )
    f, forced = _forced_prefix(reconstruction, sinks, chunk_tokens)
    free = reconstruction.max_weighted[:, f:].to(torch.float64)
    floor = FLOOR / max(free.shape[1], 1)
    return Scores(_prepend_forced(torch.log(free.clamp_min(floor)), f), forced)


def h2o_reconstruction(
    reconstruction: ReconstructionStats,
    *,
    sinks: int = 4,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    alpha: torch.Tensor | None = None,
) -> Scores:
    """S10.1 ``h2o-rec``: ``log (1/|R|) sum_u p_u(i)``, the mean attention of the
    reconstruction queries, per query head normalised over the free entries, GQA mixture
    with ``alpha``, floored (S2, as ``h2o``); the first ``max(sinks, context_start)`` forced."""
    return _mean_scores(reconstruction, None, sinks, chunk_tokens, alpha)


def min_reconstruction(
    reconstruction: ReconstructionStats,
    value: torch.Tensor,
    *,
    sinks: int = 4,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    alpha: torch.Tensor | None = None,
) -> Scores:
    """S10.1 ``min-rec``: ``log (1/|R|) sum_u p_u(i) ||v_i||_2`` (the min-variance form of S2
    over the reconstruction queries); ``value [Hkv, t, d_v]``. Otherwise as ``h2o-rec``."""
    if value is None:
        raise ValueError("value is required for the 'min-rec' score (pi ∝ mean_u p_u(i) ||v_i||)")
    return _mean_scores(reconstruction, value, sinks, chunk_tokens, alpha)


def _mean_scores(stats, value, sinks, chunk_tokens, alpha) -> Scores:
    f, forced = _forced_prefix(stats, sinks, chunk_tokens)
    mean = stats.mean_attention()  # [Hq, t]
    hkv, t = stats.max_attention.shape
    if value is not None:
        if not isinstance(value, torch.Tensor) or value.ndim != 3 or value.shape[:2] != (hkv, t):
            raise ValueError(
                f"value must be [Hkv, t, d_v] = [{hkv}, {t}, d_v] for 'min-rec', got "
                f"{tuple(getattr(value, 'shape', ())) or type(value).__name__}"
            )
        mean = mean * value_norms(value, mean.shape[0] // hkv).to(mean.device)
    if f == t:
        return Scores(_prepend_forced(mean.new_zeros(hkv, 0), f), forced)
    return Scores(_prepend_forced(group_log_scores(mean[:, f:], hkv, alpha), f), forced)
