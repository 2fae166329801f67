"""Exact causal attention in row chunks, with weighted column sums (S1, S2).

Every attention-derived statistic of probkv comes from here. ``p_j(i)`` is the causal softmax
of query row ``j`` over keys ``i <= j`` (S1). The kernel walks the rows in chunks; a chunk of
rows ``[a, b)`` is scored only against columns ``[0, b)`` (the upper triangle beyond the
chunk is skipped), so every row sees its full causal prefix and its log-sum-exp is exact.
From the chunk's probabilities it produces the attention output ``P @ V`` and, for each row
weighting ``w_s``, the column sums ``sum_j w_s[j] p_j(i)`` that the ``h2o``, ``h2o-h`` and
``min-h`` proposals need (S2). The ``t x t`` matrix is never materialised: the working
buffers hold one chunk, ``Hq * chunk * t`` scores.

Tensor conventions (docs/architecture.md): one layer, batch dropped; ``query [Hq, t, d]``,
``key``/``value [Hkv, t, d]``, ``Hq = g * Hkv``, query head ``h`` uses KV head ``h // g``.
Arithmetic is float32 whatever the input dtype (bfloat16/float16 inputs are upcast), or
float64 when an input is float64 (the tests use it to check the logic to 1e-12).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from probkv._checks import check_heads, check_positive_int

# Memory budget of the chunked kernel's default chunk: the scores of one chunk of rows, summed
# over all query heads of the layer, take at most this many bytes.
DEFAULT_CHUNK_BYTES = 64 * 2**20
# On CPU the default chunk is also capped at this many rows: the fastest height measured by
# benchmarks/bench_attention_kernel.py (GEMMs are efficient, the chunk stays near the cache).
CPU_CHUNK_ROWS = 64


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any input is float64, float32 otherwise (bf16/fp16 are upcast)."""
    if any(x is not None and x.dtype == torch.float64 for x in tensors):
        return torch.float64
    return torch.float32


def check_scale(scale: float) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(
            f"scale must be a positive finite number (usually d ** -0.5), got {scale!r}"
        )
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(
            f"scale must be a positive finite number (usually d ** -0.5), got {scale!r}"
        )
    return float(scale)


def check_floating(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not torch.is_floating_point(x):
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def default_chunk_size(
    num_query_heads: int,
    t: int,
    *,
    budget_bytes: int = DEFAULT_CHUNK_BYTES,
    max_rows: int | None = None,
    element_size: int = 4,
) -> int:
    """Rows per chunk such that one chunk's scores ``[Hq, rows, t]`` fit in ``budget_bytes``.

    At least 1 and at most ``min(t, max_rows)``. The kernel passes ``max_rows=CPU_CHUNK_ROWS``
    (64) on CPU. Peak extra memory is then ``O(rows * Hq * t)``: linear in ``t``; for SmolLM2
    (Hq = 9) at t = 8k, 64 rows are 18 MiB, and the 64 MiB budget caps rows at 227.
    """
    check_positive_int(num_query_heads, "num_query_heads")
    check_positive_int(t, "t")
    rows = budget_bytes // max(1, num_query_heads * t * element_size)
    cap = t if max_rows is None else min(t, check_positive_int(max_rows, "max_rows"))
    return int(max(1, min(cap, rows)))


def uniform_row_weights(t: int, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[t]`` all ones: column sums over every causal row (the ``h2o`` score, S2)."""
    check_positive_int(t, "t")
    return torch.ones(t, dtype=dtype)


def harmonic_row_weights(t: int, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[t]`` harmonic prior of S2: ``h_j = 1 / ((t - j + 1) H_t)`` for rows ``j = 1..t``.

    ``H_t = sum_{k=1..t} 1/k``, so the weights sum to 1 and the last row (``j = t``) has the
    largest weight ``1 / H_t``. Computed in float64, returned in ``dtype``.
    """
    check_positive_int(t, "t")
    inv = 1.0 / torch.arange(t, 0, -1, dtype=torch.float64)  # 1/(t-j+1) for j = 1..t
    return (inv / inv.sum()).to(dtype)


def _check_row_weights(row_weights: torch.Tensor | None, t: int) -> torch.Tensor | None:
    if row_weights is None:
        return None
    check_floating(row_weights, "row_weights")
    if row_weights.ndim != 2 or row_weights.shape[1] != t:
        raise ValueError(
            f"row_weights must be [S, t] with t = {t} (stack the weightings, e.g. "
            f"uniform_row_weights(t)[None]), got shape {tuple(row_weights.shape)}"
        )
    if not torch.isfinite(row_weights).all():
        raise ValueError("row_weights contains NaN or infinite entries; weights must be finite")
    return row_weights


def _check_inputs(query, key, value, query_name: str) -> None:
    """Floating tensors of matching heads (``value`` may be ``None``)."""
    check_floating(query, query_name)
    check_floating(key, "key")
    if value is not None:
        check_floating(value, "value")
    check_heads(query, key, value)


def causal_attention_with_column_sums(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    *,
    scale: float,
    row_weights: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Exact causal softmax attention in row chunks, with weighted column sums (S1, S2).

    Args:
        query: ``[Hq, t, d]`` post-RoPE queries of one layer.
        key: ``[Hkv, t, d]`` post-RoPE keys; ``Hq`` must be a multiple ``g`` of ``Hkv``.
        value: ``[Hkv, t, d_v]`` values, or ``None`` to skip the attention output.
        scale: logit scale (usually ``d ** -0.5``).
        row_weights: ``[S, t]`` one weight per query row for each of ``S`` weightings
            (e.g. ``torch.stack([uniform_row_weights(t), harmonic_row_weights(t)])``), or
            ``None`` (the default) for ``S = 0``.
        chunk_size: rows per chunk; ``None`` picks ``default_chunk_size`` (64 rows on CPU,
            fewer if one chunk's scores would exceed ``DEFAULT_CHUNK_BYTES`` = 64 MiB; off
            CPU as many as fit that budget). Peak extra memory is ``O(chunk * t)`` per head.

    Returns:
        ``(output, column_sums)``: ``output [Hq, t, d_v]`` in the query's dtype (``None``
        when ``value`` is ``None``), equal to causal softmax attention (what
        ``scaled_dot_product_attention(..., is_causal=True)`` computes); ``column_sums
        [S, Hq, t]`` with ``column_sums[s, h, i] = sum_j row_weights[s, j] * p_j^h(i)``,
        float32 (float64 when an input is float64). With uniform weights each head's
        column sums add up to ``t``.

    GQA is handled without repeating keys: the ``g`` query heads of a group are stacked
    into one ``[g * rows, d]`` matrix per KV head and multiplied in one batched matmul.
    """
    _check_inputs(query, key, value, "query")
    if query.shape[1] != key.shape[1]:
        raise ValueError(
            f"query length {query.shape[1]} must equal key length {key.shape[1]} "
            "(prefill self-attention: row j attends to keys 0..j)"
        )
    return _attention_with_column_sums(query, key, value, scale, row_weights, chunk_size)


def causal_attention_rows_with_column_sums(
    query_rows: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    *,
    scale: float,
    row_weights: torch.Tensor | None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``causal_attention_with_column_sums`` for the *last* ``q`` rows of a causal attention
    over ``t >= q`` keys: a prefill chunk after ``t - q`` earlier entries (S1, S2).

    Row ``r`` of ``query_rows [Hq, q, d]`` sits at position ``t - q + r`` and attends to keys
    ``0 .. t - q + r``, its full causal prefix, exactly as in the one-pass kernel; so the
    column sums of consecutive chunks add up to the one-pass column sums (a chunked prefill
    accumulates them exactly). ``row_weights``: ``[S, q]``, one weight per given row.
    Returns ``output [Hq, q, d_v]`` (or ``None``) and ``column_sums [S, Hq, t]``.
    """
    _check_inputs(query_rows, key, value, "query_rows")
    if query_rows.shape[1] > key.shape[1]:
        raise ValueError(
            f"query_rows has {query_rows.shape[1]} rows but there are only {key.shape[1]} keys "
            "(the rows are the last positions of the keys)"
        )
    return _attention_with_column_sums(query_rows, key, value, scale, row_weights, chunk_size)


def _attention_with_column_sums(query, key, value, scale, row_weights, chunk_size):
    """Both public kernels, inputs checked but for the scale, weights and chunk size: rows
    of ``query [Hq, q, d]`` are the last ``q`` of ``t = key.shape[1]`` positions."""
    g = query.shape[0] // key.shape[0]
    scale = check_scale(scale)
    hq, q, _ = query.shape
    hkv, t = key.shape[:2]
    row_weights = _check_row_weights(row_weights, q)
    if chunk_size is None:
        on_cpu = query.device.type == "cpu"
        chunk = default_chunk_size(hq, t, max_rows=CPU_CHUNK_ROWS if on_cpu else None)
    else:
        chunk = min(check_positive_int(chunk_size, "chunk_size"), q)
    chunk = min(chunk, q)

    cdt = _compute_dtype(query, key, value)
    w = None if row_weights is None else row_weights.to(device=query.device, dtype=cdt)
    # CPU: one KV head at a time keeps a chunk's scores near the cache (measured ~5-10%
    # faster at 4k-8k); elsewhere all heads go in one batched matmul.
    heads_per_block = 1 if query.device.type == "cpu" else key.shape[0]
    out, col_sums = _chunked_attention(
        query,
        key,
        value,
        scale=scale,
        row_weights=w,
        chunk=chunk,
        heads_per_block=heads_per_block,
        dtype=cdt,
    )
    output = None if out is None else out.view(hq, q, -1).to(query.dtype)
    return output, col_sums.view(hkv * g, -1, t).transpose(0, 1).contiguous()


def _chunked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    *,
    scale: float,
    row_weights: torch.Tensor | None,
    chunk: int,
    heads_per_block: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The kernel behind ``causal_attention_with_column_sums`` (inputs already checked).

    Returns ``out [Hkv, g, q, d_v]`` (or ``None``) and ``col_sums [Hkv, g, S, t]`` in
    ``dtype``. The ``q`` query rows are the last of the ``t`` key positions (``q = t``: a whole
    prefill). KV heads are processed ``heads_per_block`` at a time, rows ``chunk`` at a time.
    """
    hq, q, d = query.shape
    hkv, t = key.shape[:2]
    off = t - q  # position of the first query row
    g = hq // hkv
    hb = heads_per_block
    dev = query.device
    k = key.to(dtype).contiguous()
    v = None if value is None else value.to(dtype).contiguous()
    dv = 0 if v is None else v.shape[-1]
    qg = query.reshape(hkv, g, q, d)  # a view: query head h = (h // g, h % g)
    num_w = 0 if row_weights is None else row_weights.shape[0]

    # Working buffers, reused by every chunk (fresh allocations per chunk cost page faults);
    # a chunk of rows [a, b) uses the first hb * g * rows * b elements of the scores buffer.
    scores_buf = torch.empty(hb * g * chunk * t, dtype=dtype, device=dev)
    q_buf = torch.empty(hb * g * chunk * d, dtype=dtype, device=dev)
    o_buf = torch.empty(hb * g * chunk * dv, dtype=dtype, device=dev)
    above_diagonal = torch.ones(chunk, chunk, dtype=torch.bool, device=dev).triu_(1)
    col_sums = torch.zeros(hkv, g, num_w, t, dtype=dtype, device=dev)
    out = None if v is None else torch.empty(hkv, g, q, dv, dtype=dtype, device=dev)
    key_t = k.transpose(1, 2)  # [Hkv, d, t] view

    for h0 in range(0, hkv, hb):
        h1 = min(h0 + hb, hkv)
        nh = h1 - h0
        for a in range(0, q, chunk):
            b = min(a + chunk, q)
            rows = b - a
            end = off + b  # the chunk's rows see the causal columns [0, end)
            # queries of the chunk, pre-scaled, stacked per KV head as [g * rows, d] (GQA)
            qc = q_buf[: nh * g * rows * d].view(nh, g, rows, d)
            torch.mul(qg[h0:h1, :, a:b].to(dtype), scale, out=qc)
            # logits against the causal columns only (S1)
            s = scores_buf[: nh * g * rows * end].view(nh, g * rows, end)
            torch.bmm(qc.view(nh, g * rows, d), key_t[h0:h1, :, :end], out=s)
            s.view(nh, g, rows, end)[..., off + a : end].masked_fill_(
                above_diagonal[:rows, :rows], -math.inf
            )
            # row softmax in place (the kernel reads each element before writing it; the
            # tests compare with a dense reference): each row holds its whole causal
            # prefix, so its normaliser (log-sum-exp) is exact
            torch.softmax(s, -1, out=s)
            if out is not None:
                oc = o_buf[: nh * g * rows * dv].view(nh, g * rows, dv)
                torch.bmm(s, v[h0:h1, :end], out=oc)
                out[h0:h1, :, a:b].copy_(oc.view(nh, g, rows, dv))
            if num_w:
                # weighted column sums (S2): [S, rows] @ [rows, end] for every query head
                wc = row_weights[:, a:b].unsqueeze(0).expand(nh * g, num_w, rows)
                col_sums[h0:h1, :, :, :end].view(nh * g, num_w, end).baddbmm_(
                    wc, s.view(nh * g, rows, end)
                )
    return out, col_sums


def attention_with_log_normalisers(
    query_rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the last ``q`` of ``t`` positions and each row's log-normaliser,
    from torch's fused attention kernel (S1): ``output [Hq, q, d_v]`` in the compute dtype and
    ``lse [Hq, q]`` with ``lse[h, r] = log sum_{i <= t - q + r} exp(scale * q_r . k_i)``.

    CPU: the flash kernel behind ``scaled_dot_product_attention``; CUDA: the memory-efficient
    kernel (not yet run on a GPU). Keys/values are repeated per query head (these kernels take
    no GQA). Other devices: ``ValueError``. Together with ``column_sums_from_log_normalisers``
    it is the alternative to ``causal_attention_with_column_sums`` that
    benchmarks/bench_attention_kernel.py compares (slower on CPU: the logits are computed twice).
    """
    check_floating(query_rows, "query_rows")
    check_floating(key, "key")
    check_floating(value, "value")
    g = check_heads(query_rows, key, value)
    scale = check_scale(scale)
    q_len, t = query_rows.shape[1], key.shape[1]
    if q_len > t:
        raise ValueError(f"query_rows has {q_len} rows but there are only {t} keys")
    cdt = _compute_dtype(query_rows, key, value)
    q4 = query_rows.to(cdt)[None]
    k4 = key.to(cdt).repeat_interleave(g, 0)[None]
    v4 = value.to(cdt).repeat_interleave(g, 0)[None]
    d, dv = q4.shape[-1], v4.shape[-1]
    if d != dv:  # the fused kernels need one head size: zero columns change no dot product
        width = max(d, dv)
        q4, k4 = (torch.nn.functional.pad(x, (0, width - d)) for x in (q4, k4))
        v4 = torch.nn.functional.pad(v4, (0, width - dv))
    causal = q_len == t
    mask = None
    if not causal:  # rows at an offset: row r sees keys 0 .. t - q + r
        rows = torch.arange(q_len, device=key.device)[:, None] + (t - q_len)
        beyond = torch.arange(t, device=key.device)[None, :] > rows
        mask = torch.zeros(q_len, t, dtype=cdt, device=key.device).masked_fill_(beyond, -math.inf)
    if key.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k4, v4, 0.0, causal, attn_mask=mask, scale=scale
        )
    elif key.device.type == "cuda":
        bias = None if mask is None else mask[None, None].expand(1, q4.shape[1], q_len, t)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q4, k4, v4, bias, True, 0.0, causal, scale=scale
        )[:2]
    else:
        raise ValueError(
            f"attention_with_log_normalisers supports cpu and cuda tensors, got {key.device}"
        )
    return out[0, ..., :dv], lse[0, :, :q_len].to(cdt)


def column_sums_from_log_normalisers(
    query_rows: torch.Tensor,
    key: torch.Tensor,
    log_normalisers: torch.Tensor,
    *,
    scale: float,
    row_weights: torch.Tensor,
    block_rows: int = 256,
    block_keys: int = 512,
) -> torch.Tensor:
    """Weighted column sums (S2) when every row's log-normaliser is already known (from
    ``attention_with_log_normalisers``): ``p_j(i) = exp(scale * q_j . k_i - lse_j)``.

    With the normalisers known, no tile needs its row's other tiles: the rows x keys plane is
    cut into ``block_rows x block_keys`` tiles (``[Hq, 256, 512]`` float32 is 4.5 MiB for 9
    heads; per KV head on CPU it stays in cache), each computed once (logits with ``-lse``
    folded into the matmul, ``exp``, then ``w @ P``); tiles above the diagonal are skipped.
    ``query_rows [Hq, q, d]`` are the last ``q`` of ``t = key.shape[1]`` positions;
    ``log_normalisers [Hq, q]``; ``row_weights [S, q]``. Returns ``[S, Hq, t]`` in the compute
    dtype (float32, float64 for float64 inputs).
    """
    check_floating(query_rows, "query_rows")
    check_floating(key, "key")
    check_floating(log_normalisers, "log_normalisers")
    g = check_heads(query_rows, key)
    scale = check_scale(scale)
    hq, q_len, d = query_rows.shape
    hkv, t = key.shape[:2]
    if q_len > t:
        raise ValueError(f"query_rows has {q_len} rows but there are only {t} keys")
    if log_normalisers.shape != (hq, q_len):
        raise ValueError(
            f"log_normalisers must be [Hq, q] = [{hq}, {q_len}], got {tuple(log_normalisers.shape)}"
        )
    if row_weights is None:
        raise ValueError("row_weights must be an [S, q] tensor, got None")
    row_weights = _check_row_weights(row_weights, q_len)
    block_rows = check_positive_int(block_rows, "block_rows")
    block_keys = check_positive_int(block_keys, "block_keys")
    cdt = _compute_dtype(query_rows, key)
    dev = key.device
    off = t - q_len
    num_w = row_weights.shape[0]
    w = row_weights.to(device=dev, dtype=cdt)
    qg = (query_rows.to(cdt) * scale).view(hkv, g, q_len, d)
    neg_lse = log_normalisers.to(device=dev, dtype=cdt).neg().view(hkv, g, q_len, 1)
    key_t = key.to(cdt).transpose(1, 2)  # [Hkv, d, t]
    col_sums = torch.zeros(hkv, g, num_w, t, dtype=cdt, device=dev)
    hb = 1 if dev.type == "cpu" else hkv  # as in the chunked kernel
    for h0 in range(0, hkv, hb):
        h1 = min(h0 + hb, hkv)
        nh = h1 - h0
        for a in range(0, q_len, block_rows):
            b = min(a + block_rows, q_len)
            rows = b - a
            positions = torch.arange(off + a, off + b, device=dev)
            qc = qg[h0:h1, :, a:b].reshape(nh, g * rows, d)
            bias = neg_lse[h0:h1, :, a:b].reshape(nh, g * rows, 1)
            wc = w[:, a:b].unsqueeze(0).expand(nh * g, num_w, rows)
            for c0 in range(0, off + b, block_keys):  # key blocks left of the chunk's end
                c1 = min(c0 + block_keys, off + b)
                s = torch.baddbmm(bias, qc, key_t[h0:h1, :, c0:c1])  # logits - lse
                if c1 > off + a + 1:  # the block crosses the diagonal: causal mask (S1)
                    beyond = torch.arange(c0, c1, device=dev)[None, :] > positions[:, None]
                    s.view(nh, g, rows, c1 - c0).masked_fill_(beyond, -math.inf)
                s.exp_()
                col_sums[h0:h1, :, :, c0:c1].view(nh * g, num_w, c1 - c0).baddbmm_(
                    wc, s.view(nh * g, rows, c1 - c0)
                )
    return col_sums.view(hq, num_w, t).transpose(0, 1).contiguous()


def attention_rows(
    query_rows: torch.Tensor,
    key: torch.Tensor,
    *,
    scale: float,
    row_positions: torch.Tensor | Sequence[int],
) -> torch.Tensor:
    """Causal attention probabilities of a few query rows (S1): last query, SnapKV window.

    Args:
        query_rows: ``[Hq, w, d]`` queries of ``w`` rows.
        key: ``[Hkv, t, d]`` keys; ``Hq`` a multiple of ``Hkv``.
        scale: logit scale.
        row_positions: ``[w]`` position of each row in ``0..t-1``; row ``r`` attends to
            keys ``0..row_positions[r]``.

    Returns:
        ``[Hq, w, t]`` probabilities, zero beyond each row's position; float32 (float64 when
        the inputs are float64).
    """
    check_floating(query_rows, "query_rows")
    check_floating(key, "key")
    g = check_heads(query_rows, key)
    scale = check_scale(scale)
    hq, w, d = query_rows.shape
    hkv, t, _ = key.shape
    pos = torch.as_tensor(row_positions, device=key.device)
    if pos.ndim != 1 or pos.shape[0] != w:
        raise ValueError(
            f"row_positions must be [w] with w = {w} query rows, got shape {tuple(pos.shape)}"
        )
    if pos.dtype.is_floating_point or pos.dtype == torch.bool:
        raise ValueError(f"row_positions must be integers, got dtype {pos.dtype}")
    if w and (int(pos.min()) < 0 or int(pos.max()) >= t):
        raise ValueError(
            f"row_positions must lie in [0, {t - 1}] (t = {t} keys), got min {int(pos.min())}, "
            f"max {int(pos.max())}"
        )
    cdt = _compute_dtype(query_rows, key)
    q = (query_rows.to(cdt) * scale).reshape(hkv, g * w, d)
    logits = torch.bmm(q, key.to(cdt).transpose(1, 2)).view(hkv, g, w, t)
    beyond = torch.arange(t, device=key.device)[None, :] > pos[:, None]  # [w, t], causal mask
    logits.masked_fill_(beyond, -math.inf)
    return torch.softmax(logits, -1).view(hq, w, t)
