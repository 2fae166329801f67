"""Calibrated importance weights: the kept entries' weights fitted to reference queries (S9).

S4 writes the error of the corrected attention of a query ``q`` as a sum over the entries,
``sum_i (W_i - 1) g_i`` with ``g_i = p_q(i) (v_i - o_q)`` (output) and ``p_q(i)`` (mass), and
Horvitz-Thompson weights ``W_i = 1 / P_i`` make it zero on average over the draws. When some
queries are known at eviction time, the weights can make it small *for those queries* in this
draw: survey sampling's calibration estimator (Deville and Saerndal 1992), which moves the
design weights ``d_i`` as little as possible while matching totals known for the whole
population. Here the known totals are, for each reference query ``u`` (a sample of the
reconstruction queries, S10.1), its attention mass over the context (1 after normalisation)
and its context output ``o_u``; the fit is a ridge calibration:

    minimise over w >= w_min (kept entries only)
        (1/R) sum_u [ (sum_i w_i p_u(i) - 1)^2 + || sum_i w_i p_u(i) (v_i - o_u) ||^2 / s^2 ]
      + (rho / t) sum_i (w_i - d_i)^2 / d_i

``p_u`` is the softmax of ``u`` over the ``t`` context entries, ``s^2 = (1/R) sum_u sum_i
p_u(i) ||v_i - o_u||^2`` puts the output residual on the mass residual's scale, and
``rho / t`` makes the penalty of a uniform relative change of all weights comparable to the
same relative error of the mass (``sum_i d_i`` estimates ``t``). ``rho -> inf`` gives back the
design weights; with nothing evicted ``w = 1`` is the exact minimum. The same fit is the bias
("beta") step of attention matching (Zweiger et al. 2026), seen as an estimator. It is not
design-unbiased for a fixed ``rho``; its point is a lower error for queries like the
reference ones (measured in docs/evaluation.md).

Contents (pure tensor functions, float64 arithmetic):

- ``reference_stride``: which reconstruction rows to keep as reference queries;
- ``calibration_system``: the quadratic form of the data term for one KV head;
- ``solve_calibration``: the bound-constrained minimiser (exact solve, projected accelerated
  gradient when a bound is active);
- ``calibrate_head``, ``calibrated_selection``: one head, one layer's ``RaggedSelection``.
"""

from __future__ import annotations

import math

import torch

from probkv._checks import check_positive_int
from probkv.estimation.selection import RaggedSelection

DEFAULT_REFERENCE_ROWS = 128
"""Reference queries kept per query head and layer (rows of the reconstruction pass)."""

W_MIN = 1e-6
"""Smallest calibrated weight: an entry at the bound is kept but carries almost no weight."""

MAX_ITERATIONS = 3000
TOLERANCE = 1e-7  # largest violation of the optimality conditions, relative to the linear term


def check_strength(strength: float, name: str = "calibrate") -> float:
    """The ridge ``rho > 0`` pulling calibrated weights towards the design weights; ``inf``
    means no calibration."""
    if (
        isinstance(strength, bool)
        or not isinstance(strength, (int, float))
        or math.isnan(strength)
        or strength <= 0
    ):
        raise ValueError(
            f"{name} must be a number > 0 (the ridge towards the design weights; inf = no "
            f"calibration), got {strength!r}"
        )
    return float(strength)


def reference_stride(total_rows: int, rows: int = DEFAULT_REFERENCE_ROWS) -> int:
    """Keep every ``stride``-th of ``total_rows`` reconstruction rows, so about ``rows`` are
    kept, evenly spread over the pass (deterministic: no draw)."""
    check_positive_int(total_rows, "total_rows")
    check_positive_int(rows, "rows")
    return max(1, -(-total_rows // rows))


def calibration_system(
    probs: torch.Tensor, values: torch.Tensor, kept: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, q)`` with data term ``w^T Q w - 2 q^T w + 1`` (module docstring) for one KV head.

    Args:
        probs: ``[R, t]`` attention of the reference rows over the context, rows summing to 1.
        values: ``[t, d_v]``.
        kept: ``[n]`` int64 indices of the kept entries.

    Returns float64 ``Q [n, n]`` (symmetric, positive semi-definite) and ``q [n]``. The two
    ``[n, n]`` products over the rows run in ``probs``' dtype (float32 is enough for them and
    twice as fast), the rest in float64.
    """
    p = probs
    v = values.to(p.dtype)
    r = p.shape[0]
    outputs = p @ v  # [R, d_v]
    spread = float((p @ (v * v).sum(-1) - (outputs * outputs).sum(-1)).double().mean())
    pk = p[:, kept]  # [R, n]
    vk = v[kept]  # [n, d_v]
    gram = (pk.T @ pk).double()
    q = pk.double().sum(0) / r
    if spread <= 0:  # every value equal: outputs are exact whatever the weights
        return gram / r, q
    # sum_u p_u(i) p_u(j) (v_i - o_u).(v_j - o_u)
    #   = [gram * (V V^T)]_ij + (P^T X + X^T P)_ij  with  X_ui = p_u(i) (|o_u|^2 / 2 - o_u.v_i)
    x = pk * ((outputs * outputs).sum(-1, keepdim=True) / 2 - outputs @ vk.T)
    cross = (pk.T @ x).double()
    out = gram * (vk @ vk.T).double() + cross + cross.T
    return (gram + out / spread) / r, q


def _kkt_violation(hessian, linear, w) -> float:
    """Largest violation of the bound-constrained optimality conditions, relative to the
    linear term: the gradient must vanish off the bound and be >= 0 on it."""
    grad = hessian @ w - linear
    free = w > W_MIN
    worst = torch.where(free, grad.abs(), (-grad).clamp(min=0))
    return float(worst.max()) / max(float(linear.abs().max()), 1e-300)


def solve_calibration(
    Q: torch.Tensor, q: torch.Tensor, design: torch.Tensor, strength: float, t: int
) -> torch.Tensor:
    """Minimise ``w^T Q w - 2 q^T w + (rho/t) sum (w - d)^2 / d`` over ``w >= W_MIN``.

    A strictly convex quadratic over a box: an active-set method solves the free entries
    exactly (Cholesky) with the others at the bound, moving entries to the bound while the
    solve breaks it and back while their gradient says so; if that has not met the optimality
    conditions within ``TOLERANCE`` after a few rounds, projected gradient with Nesterov
    momentum and restarts finishes from there. Returns float64 ``[n]``.
    """
    rho = check_strength(strength)
    d = design.to(torch.float64)
    if d.numel() == 0:
        return d.clone()
    if not torch.isfinite(d).all() or (d <= 0).any():
        raise ValueError("design weights must be finite and > 0")
    lam = rho / check_positive_int(t, "t")
    hessian = 2.0 * Q.to(torch.float64) + torch.diag(2.0 * lam / d)
    linear = 2.0 * q.to(torch.float64) + 2.0 * lam
    w = _active_set(hessian, linear)
    if w is not None and _kkt_violation(hessian, linear, w) <= TOLERANCE:
        return w
    return _projected_gradient(hessian, linear, d.clamp(min=W_MIN) if w is None else w)


def _active_set(hessian, linear, rounds: int = 20) -> torch.Tensor | None:
    free = torch.ones(linear.shape, dtype=torch.bool, device=linear.device)
    w = None
    for _ in range(rounds):
        w = torch.full_like(linear, W_MIN)
        idx = free.nonzero().squeeze(-1)
        if idx.numel():
            h_ff = hessian[idx][:, idx]
            rhs = linear[idx] - hessian[idx][:, ~free] @ w[~free]
            chol, info = torch.linalg.cholesky_ex(h_ff)
            if int(info) != 0:
                return None
            w[idx] = torch.cholesky_solve(rhs.unsqueeze(-1), chol).squeeze(-1)
        low = w < W_MIN
        if low.any():  # the solve broke the bound: those entries go to it
            free &= ~low
            continue
        grad = hessian @ w - linear
        release = ~free & (grad < 0)  # at the bound, yet the objective falls off it
        if not release.any():
            return w
        free |= release
    return w.clamp(min=W_MIN) if w is not None else None


def _projected_gradient(hessian, linear, w) -> torch.Tensor:
    # a step of 1 / L with L >= the largest eigenvalue (Gershgorin and trace bounds)
    bound = min(float(hessian.abs().sum(-1).max()), float(hessian.diagonal().sum()))
    step = 1.0 / bound
    y, previous, momentum = w.clone(), w.clone(), 1.0

    def value(x):
        return float(0.5 * x @ (hessian @ x) - linear @ x)

    last = value(w)
    for _ in range(MAX_ITERATIONS):
        grad = hessian @ y - linear
        w = (y - step * grad).clamp(min=W_MIN)
        now = value(w)
        if now > last:  # restart the momentum (O'Donoghue and Candes 2015)
            y, momentum = previous.clone(), 1.0
            continue
        if _kkt_violation(hessian, linear, w) <= TOLERANCE:
            break
        nxt = (1.0 + math.sqrt(1.0 + 4.0 * momentum * momentum)) / 2.0
        y = w + ((momentum - 1.0) / nxt) * (w - previous)
        previous, momentum, last = w, nxt, now
    return w


def calibrate_head(
    queries: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kept: torch.Tensor,
    design: torch.Tensor,
    *,
    scale: float,
    strength: float,
) -> torch.Tensor:
    """Calibrated weights ``[n]`` (float64) of one KV head's kept entries.

    ``queries [R, d]``: the reference rows of the head's query group, post-RoPE;
    ``key``, ``value`` ``[t, d]``: the head's context entries before eviction; ``kept [n]``;
    ``design [n]``: the design weights (``1 / P``, 1 for take-all entries)."""
    logits = (queries.to(torch.float32) * scale) @ key.to(torch.float32).T
    probs = torch.softmax(logits.double(), -1).to(torch.float32)
    Q, q = calibration_system(probs, value, kept)
    return solve_calibration(Q, q, design, strength, key.shape[0])


def calibrated_selection(
    selection: RaggedSelection,
    key: torch.Tensor,
    value: torch.Tensor,
    reference_queries: torch.Tensor,
    *,
    scale: float,
    strength: float,
) -> RaggedSelection:
    """``selection`` with its log-weights replaced by calibrated ones (S9), kept entries
    unchanged. ``key``/``value [Hkv, t, d]`` the layer's context entries before eviction;
    ``reference_queries [Hq, m, d]`` (``Hq`` a multiple of ``Hkv``, query head ``h`` in group
    ``h // g``); the design weights are ``exp(selection.log_weights)`` (all 1 without)."""
    check_strength(strength)
    if key.ndim != 3 or value.ndim != 3 or key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"key and value must be [Hkv, t, d] alike, got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    hkv, t, d = key.shape
    if selection.num_heads != hkv:
        raise ValueError(f"selection has {selection.num_heads} heads, key has {hkv}")
    if (
        reference_queries.ndim != 3
        or reference_queries.shape[0] % hkv
        or reference_queries.shape[1] == 0
        or reference_queries.shape[2] != d
    ):
        raise ValueError(
            f"reference_queries must be [Hq, m, {d}] with m >= 1 and Hq a multiple of {hkv}, "
            f"got {tuple(reference_queries.shape)}"
        )
    g = reference_queries.shape[0] // hkv
    weights = []
    for h in range(hkv):
        kept, logw = selection.head(h)
        if kept.numel() == 0:
            weights.append(torch.zeros(0, dtype=torch.float32, device=key.device))
            continue
        if int(kept.max()) >= t:
            raise ValueError(f"head {h} keeps index {int(kept.max())}, beyond the {t} entries")
        design = torch.ones(kept.numel(), dtype=torch.float64, device=key.device)
        if logw is not None:
            design = logw.to(device=key.device, dtype=torch.float64).exp()
        rows = reference_queries[h * g : (h + 1) * g].reshape(-1, d).to(key.device)
        w = calibrate_head(
            rows, key[h], value[h], kept.to(key.device), design, scale=scale, strength=strength
        )
        weights.append(torch.log(w).to(torch.float32))
    log_weights = torch.cat(weights).to(selection.indices.device)
    return RaggedSelection(selection.indices, selection.lengths, log_weights)
