"""What one layer's prefill shows an eviction policy, from its real tensors (S2, S6).

``observe_layer`` is the one place where a layer's post-RoPE prefill ``query``, ``key`` and
``value`` become its attention output and a ``LayerObservation``: the policy's log-scores
and forced entries (``probkv.scores``) and the last query's attention (for diagnostics).
The integration calls it inside its attention function during prefill; the attention-error
experiment calls it on captured tensors; so both observe exactly the same numbers, and the
policies (``probkv.policies.select_layers``) turn them into the same kept sets.

A prompt prefilled in several forwards (chunked prefill) is observed by
``PrefillStatistics``: each chunk's rows attend to every earlier entry, exactly as in the
one-pass kernel, so the column sums add up across chunks; only the last rows a score reads
(``probkv.scores.last_query_rows``) are kept. Its observation equals ``observe_layer``'s on
the whole prompt. The harmonic row weights of S2 depend on the prompt's final length, so
``h2o-h`` and ``min-h`` accumulate exactly only when that length is given up front.

Tensors follow docs/architecture.md: one layer, batch dropped; ``query [Hq, t, d]``,
``key``/``value [Hkv, t, d]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from probkv import scores
from probkv.scores import column_sums as kernels


@dataclass(frozen=True)
class LayerObservation:
    """What the prefill of one evicting layer showed the policy."""

    layer_idx: int  # index in the model
    rank: int  # position among the evicting layers (0 = lowest), for layer budgets (PyramidKV)
    log_scores: torch.Tensor  # [Hkv, t] float32 (probkv.scores)
    forced: torch.Tensor | None  # [Hkv, t] bool: always kept, counted in the budget (SnapKV window)
    last_query_attention: torch.Tensor  # [Hkv, t] group-averaged p_t, for diagnostics (S6)
    # A sample of plausible future queries (the reconstruction rows, S10.1) and the logit
    # scale, for calibrated weights (S9, probkv.estimation.calibration); None when not observed.
    reference_queries: torch.Tensor | None = None  # [Hq, m, d] post-RoPE
    scale: float | None = None

    @property
    def num_heads(self) -> int:
        return self.log_scores.shape[0]

    @property
    def length(self) -> int:
        return self.log_scores.shape[1]


def dense_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of the last ``q`` positions over ``n`` dense entries (no eviction),
    torch's SDPA. query ``[Hq, q, d]``, key/value ``[Hkv, n, d]`` -> ``[Hq, q, d_v]``."""
    q_len, n = query.shape[1], key.shape[1]
    mask = None
    is_causal = False
    if q_len == n:
        is_causal = q_len > 1
    elif q_len > 1:
        mask = causal_offset_mask(q_len, n, query.device)
    return F.scaled_dot_product_attention(
        query.unsqueeze(0),
        key.unsqueeze(0),
        value.unsqueeze(0),
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=query.shape[0] != key.shape[0],
    )[0]


def causal_offset_mask(q_len: int, n: int, device) -> torch.Tensor:
    """Bool ``[q, n]``: query ``i`` (at position ``n - q + i``) sees entries ``j <= n - q + i``."""
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (n - q_len)
    return torch.arange(n, device=device).unsqueeze(0) <= rows


def observe_layer(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    score: str,
    score_params: dict | None = None,
    layer_idx: int = 0,
    rank: int = 0,
) -> tuple[torch.Tensor, LayerObservation]:
    """A layer's prefill: its causal attention output ``[Hq, t, d_v]`` and the observation of
    ``score`` with ``score_params`` (S2). Scores built on all-rows column sums get them from
    the same chunked pass that computes the output (``chunk_size`` rows at a time if given);
    the others read the tensors directly and the output is torch's SDPA."""
    params = dict(score_params or {})
    t = key.shape[1]
    weighting = scores.column_sums_needed(score)
    column_sums = None
    if weighting is not None:
        weights = (
            kernels.uniform_row_weights if weighting == "uniform" else kernels.harmonic_row_weights
        )
        out, sums = kernels.causal_attention_with_column_sums(
            query,
            key,
            value,
            scale=scale,
            row_weights=weights(t).unsqueeze(0).to(query.device),
            chunk_size=params.get("chunk_size"),
        )
        column_sums = sums[0]
    else:
        out = dense_causal_attention(query, key, value, scale)
    observation = score_observation(
        query, key, value, scale, score, params, column_sums, layer_idx=layer_idx, rank=rank
    )
    return out, observation


def score_observation(
    query, key, value, scale, score, params, column_sums, *, layer_idx, rank, last_attention=None
) -> LayerObservation:
    """The scores of ``score`` and the last query's attention (S2, S6): ``query [Hq, t, d]``
    needs real values only in the rows the score reads besides ``column_sums``;
    ``last_attention [Hkv, t]``, if known (a decode stage keeps it), else computed."""
    result = scores.compute_scores(
        score,
        query,
        key,
        value,
        scale=scale,
        column_sums=column_sums,
        layer_idx=layer_idx,
        **params,
    )
    return LayerObservation(
        layer_idx=layer_idx,
        rank=rank,
        log_scores=result.log_scores,
        forced=result.forced,
        last_query_attention=(
            last_query_attention(query, key, scale) if last_attention is None else last_attention
        ),
    )


@dataclass
class PrefillStatistics:
    """One layer's prefill seen in chunks (module docstring): what ``observe_layer`` needs,
    accumulated chunk by chunk so that :meth:`observe` equals ``observe_layer`` on the whole
    prompt.

    ``prompt_length``: the prompt's final length when known; the harmonic row weights (S2,
    ``h2o-h``, ``min-h``) need it to weigh an early chunk's rows. Unknown, the first chunk
    is taken as the whole prompt for them and a second chunk is refused (``ValueError``).
    """

    score: str
    score_params: dict
    scale: float
    prompt_length: int | None = None
    length: int = 0  # prompt rows seen so far
    column_sums: torch.Tensor | None = None  # [Hq, length], the score's weighting (S2)
    last_queries: torch.Tensor | None = None  # [Hq, <= rows kept, d], the last rows
    rows_kept: int = field(init=False)

    def __post_init__(self) -> None:
        self.score_params = dict(self.score_params)
        self.rows_kept = scores.last_query_rows(self.score, self.score_params)

    def check_next_chunk(self) -> None:
        """Refuse a further chunk the statistics cannot take exactly (class docstring)."""
        weighting = scores.column_sums_needed(self.score)
        if self.length and weighting == "harmonic" and self.prompt_length is None:
            raise ValueError(
                f"chunked prefill with score {self.score!r}: its harmonic row weights (S2) "
                "depend on the prompt's final length, unknown while the first chunk was "
                "observed; give it to the cache, ProbKVCache(config, policy, "
                "prompt_length=N), or prefill the prompt in one forward (no "
                "prefill_chunk_size)"
            )

    def add_chunk(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """The chunk's attention output ``[Hq, q, d_v]``: ``query [Hq, q, d]`` are the last
        ``q`` positions of ``key``/``value [Hkv, t, d]`` (every entry so far)."""
        q, t = query.shape[1], key.shape[1]
        if t - q != self.length:
            raise ValueError(
                f"a prefill chunk must continue the {self.length} rows seen, got {q} rows at "
                f"positions {t - q}..{t - 1}"
            )
        self.check_next_chunk()
        if self.prompt_length is not None and t > self.prompt_length:
            raise ValueError(
                f"the prompt has {t} tokens, beyond prompt_length={self.prompt_length}"
            )
        weighting = scores.column_sums_needed(self.score)
        if weighting is None:
            out = dense_causal_attention(query, key, value, self.scale)
        else:
            total = self.prompt_length if weighting == "harmonic" and self.prompt_length else t
            weights = (
                kernels.uniform_row_weights(t)
                if weighting == "uniform"
                else kernels.harmonic_row_weights(total)
            )
            out, sums = kernels.causal_attention_rows_with_column_sums(
                query,
                key,
                value,
                scale=self.scale,
                row_weights=weights[t - q : t].unsqueeze(0).to(query.device),
                chunk_size=self.score_params.get("chunk_size"),
            )
            if self.column_sums is not None:
                sums[0, :, : self.length] += self.column_sums
            self.column_sums = sums[0]
        rows = query if self.last_queries is None else torch.cat([self.last_queries, query], 1)
        self.last_queries = rows[:, -self.rows_kept :].clone()  # not a view of the whole chunk
        self.length = t
        return out

    def add_rows(self, query: torch.Tensor, t: int) -> None:
        """A chunk whose attention output is computed elsewhere (a serving engine's kernel):
        ``query [Hq, q, d]`` are rows ``t - q .. t - 1``. Only for scores without column sums,
        which read nothing of a chunk but its last rows (``last_query_rows``)."""
        if scores.column_sums_needed(self.score) is not None:
            raise ValueError(
                f"score {self.score!r} needs every row's column sums (S2): use add_chunk"
            )
        q = query.shape[1]
        if t - q != self.length:
            raise ValueError(
                f"a prefill chunk must continue the {self.length} rows seen, got {q} rows at "
                f"positions {t - q}..{t - 1}"
            )
        if self.prompt_length is not None and t > self.prompt_length:
            raise ValueError(
                f"the prompt has {t} tokens, beyond prompt_length={self.prompt_length}"
            )
        rows = query if self.last_queries is None else torch.cat([self.last_queries, query], 1)
        self.last_queries = rows[:, -self.rows_kept :].clone()
        self.length = t

    def observe(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        query: torch.Tensor | None = None,
        layer_idx: int = 0,
        rank: int = 0,
    ) -> LayerObservation:
        """The observation of the prompt so far (equal to ``observe_layer``'s on it).
        ``query``: the last chunk's rows, used as they are when they are all the rows."""
        t = key.shape[1]
        if t != self.length or self.last_queries is None:
            raise ValueError(f"observe needs the {self.length} entries of the chunks seen, got {t}")
        kept = self.last_queries
        if query is not None and query.shape[1] == t:
            kept = query
        query = kept
        if kept.shape[1] < t:
            # The score reads only these rows (``last_query_rows``); the others are zeros.
            query = kept.new_zeros(kept.shape[0], t, kept.shape[2])
            query[:, t - kept.shape[1] :] = kept
        return score_observation(
            query,
            key,
            value,
            self.scale,
            self.score,
            self.score_params,
            self.column_sums,
            layer_idx=layer_idx,
            rank=rank,
        )


def last_query_attention(query: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
    """``[Hkv, t]``: the last prefill query's attention ``p_t``, averaged over each GQA group
    (the retained-mass diagnostic of the eviction report, S6)."""
    t = key.shape[1]
    last = kernels.attention_rows(
        query[:, -1:], key, scale=scale, row_positions=torch.tensor([t - 1], device=query.device)
    )[:, 0]  # [Hq, t]
    return last.float().view(key.shape[0], -1, t).mean(1)
