"""Decode-time correction: importance log-weights and corrected attention (S4, S9).

A kept prefix entry ``i`` carries a log-weight ``log w_i``; at every decode step its attention
logit becomes ``scale * q . k_i + log w_i`` while entries created after eviction get no weight,
and one softmax over both gives the self-normalised importance-sampling estimate of the
full-cache attention (the paper's Algorithm 1). Three weight schemes (S9), all unbiased for
the eviction-time unnormalised total ``sum_i p~(i) v_i`` at ``tau = 1``:

- ``"counts"`` (Hansen-Hurwitz, the paper's Eq. 10): ``w_i = c_i / (m pi_i)``.
- ``"inclusion"`` (Horvitz-Thompson, same with-replacement sampler): ``w_i = 1 / (1 - (1 - pi_i)^m)``.
- ``"pps"`` (fixed-size pps sampling): ``w_i = 1 / P_i``.

One function per scheme: ``counts_log_weights``, ``inclusion_log_weights``, ``pps_log_weights``.
Temperature: ``log w / tau``; ``tau = inf`` is no correction (``log w = 0``).
"""

from __future__ import annotations

import math

import torch

from probkv._checks import check_heads, check_tau
from probkv.sampling.samplers import Count, checked_probabilities, integer_per_row


def _bool_mask(kept: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if not isinstance(kept, torch.Tensor) or kept.dtype != torch.bool or kept.shape != shape:
        got = f"{kept.dtype} {tuple(kept.shape)}" if isinstance(kept, torch.Tensor) else type(kept)
        raise ValueError(f"kept must be a bool tensor of shape {tuple(shape)}, got {got}")
    return kept


def _log_inclusion_with_replacement(log1m_p: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` with ``x = m log(1 - p)`` <= 0, accurate at both ends (log1mexp).

    ``x > -log 2``: ``log(-expm1(x))``; otherwise ``log1p(-exp(x))``, which is exactly 0 once
    ``exp(x)`` underflows (entry kept almost surely: weight exactly 1) and for ``p = 1``.
    """
    mf = m.to(torch.float64).unsqueeze(-1)
    x = torch.where(mf > 0, mf * log1m_p, 0.0)
    near_zero = x > -math.log(2.0)
    small = torch.log(-torch.expm1(torch.where(near_zero, x, -1.0)))
    large = torch.log1p(-torch.exp(torch.where(near_zero, -1.0, x)))
    return torch.where(near_zero, small, large)


def _prepared(
    proposal: torch.Tensor, kept: torch.Tensor, tau: float
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The proposal as float64 distributions, the kept mask checked against it, ``tau``."""
    tau = check_tau(tau)
    p = checked_probabilities(proposal, "proposal")
    return p, _bool_mask(kept, p.shape), tau


def _tempered(log_w: torch.Tensor, kept: torch.Tensor, tau: float) -> torch.Tensor:
    """``log w / tau`` on kept entries, 0 elsewhere, float32; ``tau = inf``: zeros."""
    if math.isinf(tau):
        return torch.zeros(kept.shape, dtype=torch.float32, device=kept.device)
    return torch.where(kept, log_w / tau, 0.0).to(torch.float32)


def _draws(
    p: torch.Tensor, kept: torch.Tensor, counts: torch.Tensor | None, num_samples: Count | None
) -> torch.Tensor | None:
    """``m`` per row of a with-replacement sample (int64 ``[...]``, or ``None`` if unknown):
    ``counts.sum(-1)`` when counts are given (checked against ``kept`` and ``num_samples``),
    else ``num_samples``. Kept entries must have positive proposal probability."""
    batch = p.shape[:-1]
    m = (
        None
        if num_samples is None
        else integer_per_row(num_samples, batch, "num_samples", device=p.device)
    )
    if counts is not None:
        if not isinstance(counts, torch.Tensor) or counts.shape != p.shape:
            raise ValueError(f"counts must be a tensor of shape {tuple(p.shape)}")
        if counts.dtype.is_floating_point or counts.dtype == torch.bool or (counts < 0).any():
            raise ValueError("counts must be non-negative integers (sampling.sample_counts)")
        if not torch.equal(kept, counts > 0):
            raise ValueError("kept must be exactly the entries with counts > 0")
        drawn = counts.sum(-1).to(torch.int64)
        if m is not None and not torch.equal(m, drawn):
            raise ValueError(
                f"num_samples {m.tolist()} differs from counts.sum(-1) {drawn.tolist()}"
            )
        m = drawn
    if (kept & (p <= 0)).any():
        raise ValueError("kept contains an entry with proposal probability 0")
    return m


def counts_log_weights(
    proposal: torch.Tensor,
    kept: torch.Tensor,
    counts: torch.Tensor,
    *,
    num_samples: Count | None = None,
    tau: float = 1.0,
) -> torch.Tensor:
    """Hansen-Hurwitz log-weights of a with-replacement sample (S4 Eq. 10, the paper):
    ``(log c_i - log m - log pi_i) / tau`` on kept entries, 0 elsewhere.

    Args:
        proposal: ``[..., t]`` the proposal the sample was drawn from.
        kept: bool ``[..., t]``, the sampled kept set: exactly ``counts > 0``.
        counts: int ``[..., t]`` draws per entry (``sampling.sample_counts``); ``m`` is
            ``counts.sum(-1)``.
        num_samples: ``m`` per row, if given checked against ``counts.sum(-1)``.
        tau: temperature ``> 0`` (``inf`` = no correction: zeros).

    Returns:
        float32 ``[..., t]``. Always-kept entries (sampling module docstring) are not kept by
        the sampler and get 0 here: weight 1, a take-all stratum.
    """
    if counts is None:
        raise ValueError("counts_log_weights needs counts (sampling.sample_counts)")
    p, kept, tau = _prepared(proposal, kept, tau)
    m = _draws(p, kept, counts, num_samples)
    safe_p = torch.where(kept, p, 1.0)
    c = torch.where(kept, counts.to(torch.float64), 1.0)
    log_w = torch.log(c) - torch.log(m.to(torch.float64)).unsqueeze(-1) - torch.log(safe_p)
    return _tempered(log_w, kept, tau)


def inclusion_log_weights(
    proposal: torch.Tensor,
    kept: torch.Tensor,
    num_samples: Count | None,
    *,
    counts: torch.Tensor | None = None,
    tau: float = 1.0,
) -> torch.Tensor:
    """Horvitz-Thompson log-weights of a with-replacement sample (S9):
    ``-log(1 - (1 - pi_i)^m) / tau`` on kept entries, computed in log space; 0 elsewhere.

    An entry whose inclusion probability rounds to 1 (``(1 - pi_i)^m`` underflows) gets
    log-weight exactly 0.

    Args:
        proposal: ``[..., t]`` the proposal the sample was drawn from.
        kept: bool ``[..., t]``, the sampled kept set.
        num_samples: ``m`` per row: int or integer tensor broadcastable to ``[...]``
            (``None`` only when ``counts`` are given: then ``counts.sum(-1)``).
        counts: optional int ``[..., t]`` draws, checked against ``kept`` and ``m``.
        tau: temperature ``> 0`` (``inf`` = no correction: zeros).

    Returns:
        float32 ``[..., t]``.
    """
    if num_samples is None and counts is None:
        raise ValueError("inclusion_log_weights needs num_samples (the m that was drawn)")
    p, kept, tau = _prepared(proposal, kept, tau)
    m = _draws(p, kept, counts, num_samples)
    if (kept.any(-1) & (m == 0)).any():
        raise ValueError("kept is non-empty in a row with num_samples = 0")
    safe_p = torch.where(kept, p, 1.0)
    log_w = -_log_inclusion_with_replacement(torch.log1p(-safe_p), m)
    return _tempered(log_w, kept, tau)


def pps_log_weights(
    proposal: torch.Tensor,
    kept: torch.Tensor,
    inclusion: torch.Tensor,
    *,
    tau: float = 1.0,
) -> torch.Tensor:
    """Log-weights of a fixed-size pps sample (S9): ``-log P_i / tau`` on kept entries, 0
    elsewhere; exactly 0 for the take-all stratum (``P_i = 1``).

    Args:
        proposal: ``[..., t]`` the proposal the inclusion probabilities came from.
        kept: bool ``[..., t]``, the sampled kept set (``sampling.systematic_sample``).
        inclusion: ``[..., t]`` the ``P_i`` the sample was drawn with, in ``[0, 1]``.
        tau: temperature ``> 0`` (``inf`` = no correction: zeros).

    Returns:
        float32 ``[..., t]``.
    """
    if inclusion is None:
        raise ValueError("pps_log_weights needs inclusion (the P_i the sample was drawn with)")
    p, kept, tau = _prepared(proposal, kept, tau)
    P = inclusion.to(torch.float64) if isinstance(inclusion, torch.Tensor) else None
    if P is None or P.shape != p.shape or not torch.isfinite(P).all():
        raise ValueError(f"inclusion must be a finite tensor of shape {tuple(p.shape)}")
    if (P < 0).any() or (P > 1).any():
        raise ValueError(f"inclusion must lie in [0, 1], got max {P.max().item():.6g}")
    if (kept & (P <= 0)).any():
        raise ValueError("kept contains an entry with inclusion probability 0")
    return _tempered(-torch.log(torch.where(kept, P, 1.0)), kept, tau)


def compose_log_weights(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Log-weights after a second eviction (S4): ``old + new``.

    The second eviction targets ``p~ * w_old`` (what the cache already estimates), so its weights
    ``w_new`` multiply: ``w = w_old * w_new``. Both tensors index the same entries (the cache
    before the second eviction), ``[..., n]``; the caller then drops what the second eviction
    evicted. Returns float32.
    """
    for name, x in (("old", old), ("new", new)):
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor of log-weights")
        if torch.isnan(x).any() or (x == math.inf).any():
            raise ValueError(f"{name} log-weights must not be NaN or +inf")
    if old.shape != new.shape:
        raise ValueError(f"old {tuple(old.shape)} and new {tuple(new.shape)} shapes differ")
    return (old.to(torch.float64) + new.to(torch.float64)).to(torch.float32)


def corrected_attention_reference(
    query: torch.Tensor,
    kept_keys: torch.Tensor,
    kept_values: torch.Tensor,
    kept_log_weights: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """The paper's Algorithm 1, literally, for ONE query vector of one head, in float64 (S4).

    Two normalisers: ``z_hat_{1:t}`` over the kept prefix entries (weighted) and ``z_{t+1:n}``
    over the entries created after eviction (exact), sharing one division. The weights arrive as
    log-weights (Eq. 10, temperature already applied). A reference for tests: it exponentiates
    logits directly, so it refuses logits above 700 (float64 overflow).

    Shapes: ``query [d]``, ``kept_keys [k, d]``, ``kept_values [k, d_v]``,
    ``kept_log_weights [k]``, ``new_keys [u, d]``, ``new_values [u, d_v]`` (``k + u >= 1``).
    Returns float64 ``[d_v]``.
    """
    d, d_v = query.shape[-1], kept_values.shape[-1]
    shapes_ok = (
        query.ndim == 1
        and kept_keys.ndim == 2
        and kept_values.ndim == 2
        and new_keys.ndim == 2
        and kept_keys.shape[-1] == d == new_keys.shape[-1]
        and kept_values.shape[0] == kept_keys.shape[0]
        and new_values.shape == (new_keys.shape[0], d_v)
        and kept_log_weights.shape == (kept_keys.shape[0],)
    )
    if not shapes_ok or kept_keys.shape[0] + new_keys.shape[0] == 0:
        raise ValueError(
            "expected query [d], kept_keys [k, d], kept_values [k, d_v], kept_log_weights [k], "
            f"new_keys [u, d], new_values [u, d_v] with k + u >= 1; got {tuple(query.shape)}, "
            f"{tuple(kept_keys.shape)}, {tuple(kept_values.shape)}, "
            f"{tuple(kept_log_weights.shape)}, {tuple(new_keys.shape)}, {tuple(new_values.shape)}"
        )
    q, K_I, V_I = query.double(), kept_keys.double(), kept_values.double()
    K_new, V_new, log_w = new_keys.double(), new_values.double(), kept_log_weights.double()
    logits_I, logits_new = scale * (K_I @ q), scale * (K_new @ q)
    if (torch.cat([logits_I, logits_new]) > 700).any():
        raise ValueError(
            "a logit exceeds 700: exp overflows in the literal form; use corrected_attention"
        )
    p_tilde_I = torch.exp(logits_I)  # unnormalised probabilities of the kept prefix entries
    p_tilde_new = torch.exp(logits_new)  # ... and of the entries t+1..n
    w = torch.exp(log_w)  # w_i = c_i / (m pi_i) (or S9 weight), tempered (Eq. 10)
    z_hat_1t = (w * p_tilde_I).sum()  # normaliser estimate for the eviction-time entries
    z_t1n = p_tilde_new.sum()  # exact normaliser for the decode-time entries
    mu_hat_1t = ((w * p_tilde_I)[:, None] * V_I).sum(0)  # estimated unnormalised expectation
    mu_t1n = (p_tilde_new[:, None] * V_new).sum(0)  # exact unnormalised expectation
    return (mu_hat_1t + mu_t1n) / (z_hat_1t + z_t1n)  # corrected attention


def corrected_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_weights: torch.Tensor,
    *,
    scale: float,
    causal_offset: int | None = None,
) -> torch.Tensor:
    """Corrected attention, fast form (S4): ``softmax(scale q . k + log w) . V``, GQA.

    Adding ``log w_i`` to the logit of a kept prefix entry and 0 to entries created after eviction
    is Algorithm 1 with both normalisers in one softmax. With ``log_weights`` all zero it is plain
    attention. A log-weight of ``-inf`` excludes an entry (padding of ragged heads).

    Args:
        query: ``[Hq, q, d]``; query head ``h`` uses KV head ``h // (Hq // Hkv)``.
        key: ``[Hkv, n, d]``; value: ``[Hkv, n, d_v]`` (kept prefix entries and later entries).
        log_weights: ``[Hkv, n]`` (0 for entries created after eviction).
        scale: attention scaling (usually ``d ** -0.5``).
        causal_offset: ``None``: every query row sees all ``n`` entries (decode). Otherwise row
            ``j`` sees entries ``i <= causal_offset + j`` (e.g. ``n - q`` for ``q`` new tokens
            appended at the end).

    Returns:
        ``[Hq, q, d_v]`` in ``query``'s dtype, computed in at least float32.
    """
    group = check_heads(query, key, value)
    if log_weights.shape != key.shape[:2]:
        raise ValueError(
            f"log_weights must be [Hkv, n] = {tuple(key.shape[:2])}, got {tuple(log_weights.shape)}"
        )
    if torch.isnan(log_weights).any() or (log_weights == math.inf).any():
        raise ValueError("log_weights must not be NaN or +inf (-inf excludes an entry)")
    if causal_offset is not None and (
        isinstance(causal_offset, bool) or not isinstance(causal_offset, int) or causal_offset < 0
    ):
        raise ValueError(f"causal_offset must be None or an integer >= 0, got {causal_offset!r}")
    dtype = torch.promote_types(query.dtype, torch.float32)
    h_kv, n = key.shape[:2]
    q = query.to(dtype).unflatten(0, (h_kv, group))  # [Hkv, g, q, d]
    logits = scale * torch.einsum("hgqd,hnd->hgqn", q, key.to(dtype))
    logits = logits + log_weights.to(dtype)[:, None, None, :]
    if causal_offset is not None:
        rows = torch.arange(query.shape[1], device=query.device)[:, None]
        visible = torch.arange(n, device=query.device)[None, :] <= causal_offset + rows
        logits = logits.masked_fill(~visible, -math.inf)
    out = torch.einsum("hgqn,hnd->hgqd", torch.softmax(logits, -1), value.to(dtype))
    return out.flatten(0, 1).to(query.dtype)


def ragged_corrected_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    log_weights: torch.Tensor | None,
    lengths: list[int],
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    *,
    scale: float,
    new_excluded: torch.Tensor | None = None,
) -> torch.Tensor:
    """Corrected attention over a ragged kept prefix, the slow and obvious way: one
    ``corrected_attention`` per head (S4). The reference the fast decode paths are tested
    against (``probkv.hf.attention``'s segment softmax over the same layout; vLLM's kernels
    against ``corrected_attention`` itself).

    The prefix is Ada-KV's flattened layout: head ``s``'s kept entries are rows
    ``sum(lengths[:s]) ..`` of ``keys``/``values``/``log_weights``, head after head (a head may
    keep nothing). After them every head holds ``T`` entries created after eviction, which
    carry no weight; the ``q`` query rows are the newest ``q`` of them, causal among
    themselves (row ``j`` sees new entries ``i <= T - q + j``).

    Args:
        query: ``[S, g, q, d]``: head ``s``'s ``g`` query heads (a GQA group) at ``q`` rows.
        keys: ``[N, d]``; values: ``[N, d_v]``; log_weights: ``[N]`` or ``None`` (all 0).
        lengths: ``S`` kept counts summing to ``N``.
        new_keys: ``[S, T, d]``; new_values: ``[S, T, d_v]`` (``T >= q``).
        scale: attention scaling.
        new_excluded: ``[S, T]`` bool, new slots that are no entry (padding), or ``None``.

    Returns:
        ``[S, g, q, d_v]`` in ``query``'s dtype, computed in at least float32.
    """
    segments, _, rows, _ = query.shape if query.ndim == 4 else (None, None, None, None)
    if segments != len(lengths) or sum(lengths) != keys.shape[0]:
        raise ValueError(
            f"expected query [S, g, q, d] with S = len(lengths) and keys [sum(lengths), d]; got "
            f"query {tuple(query.shape)}, {len(lengths)} lengths summing to {sum(lengths)}, "
            f"keys {tuple(keys.shape)}"
        )
    if new_keys.shape[:1] != (segments,) or new_keys.shape[1] < rows:
        raise ValueError(
            f"new_keys must be [S, T, d] with T >= q = {rows}, got {tuple(new_keys.shape)}"
        )
    dtype = torch.promote_types(query.dtype, torch.float32)
    t = new_keys.shape[1]
    new_log_weights = torch.zeros(segments, t, dtype=dtype, device=query.device)
    if new_excluded is not None:
        new_log_weights = new_log_weights.masked_fill(new_excluded, -math.inf)
    outs, start = [], 0
    for s, n in enumerate(lengths):
        kept = slice(start, start + n)
        start += n
        kept_lw = torch.zeros(n, dtype=dtype, device=query.device)
        if log_weights is not None:
            kept_lw = log_weights[kept].to(dtype)
        outs.append(
            corrected_attention(
                query[s],
                torch.cat([keys[kept], new_keys[s]])[None],
                torch.cat([values[kept], new_values[s]])[None],
                torch.cat([kept_lw, new_log_weights[s]])[None],
                scale=scale,
                causal_offset=n + t - rows,
            )
        )
    return torch.stack(outs)


def kish_effective_sample_size(log_weights: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Kish's effective sample size per row, ``(sum w)^2 / sum w^2`` over kept entries.

    A diagnostic of weight degeneracy (S4): equals the number kept when all weights are equal, 1
    when one weight dominates, 0 for a row with nothing kept. Shapes ``[..., t]`` -> float64
    ``[...]``.
    """
    kept = _bool_mask(kept, log_weights.shape)
    lw = torch.where(kept, log_weights.to(torch.float64), -math.inf)
    ess = torch.exp(2 * torch.logsumexp(lw, -1) - torch.logsumexp(2 * lw, -1))
    return torch.where(kept.any(-1), ess, 0.0)
