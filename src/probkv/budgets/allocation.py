"""How many entries each layer and each KV head keeps, and which ones (S5, S6).

Budgets are integers that add up exactly: a layer's heads share its budget ``B`` without losing or
inventing a single entry, and PyramidKV's layers share ``num_layers * mean_budget`` exactly.

- ``uniform_budget``: kept entries per head for a compression ratio ``r`` (S1).
- ``pyramid_budgets``: PyramidKV's linearly decreasing layer budgets (S5).
- ``adakv_allocation``: Ada-KV's head-wise split of a layer budget, with the safeguard ``alpha`` (S6).
- ``topk_per_head``: the top-``B_h`` entries of every head under any allocation (S5, S6).
- ``retained_attention_mass``: Ada-KV's diagnostic ``sum_i T_h(i) A_h(i)`` per head (S6).

Conventions shared by every function here (docs/architecture.md):

- ``log_scores`` is ``[H, t]`` (one row per KV head), any float dtype; larger is more important.
  Entries may be ``-inf`` (zero mass) but not NaN or ``+inf``; every head needs a finite entry.
- ``forced`` is an optional bool mask ``[H, t]`` of entries a method always keeps (SnapKV's
  observation window). Forced entries are kept first and count against the budget (S6).
- Ties are broken deterministically: among equal scores of one head the *later* position wins
  (the more recent token; decode queries attend locally more often than not), and in Ada-KV's
  competition across heads the lower head index wins. ``torch.topk`` gives no such guarantee,
  so every selection here goes through one stable sort.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from fractions import Fraction

import torch

from probkv._checks import check_positive_int, check_ratio
from probkv.estimation.selection import RaggedSelection

__all__ = [
    "adakv_allocation",
    "pyramid_budgets",
    "retained_attention_mass",
    "topk_per_head",
    "uniform_budget",
]


# --------------------------------------------------------------------------------------------
# Input checks (same style as probkv._checks: name the argument, the bad value, what is allowed)
# --------------------------------------------------------------------------------------------


def _as_int(value: object, name: str) -> int:
    """An integer-like value (Python int, NumPy integer, 0-d integer tensor); never a bool."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _check_log_scores(log_scores: torch.Tensor, name: str = "log_scores") -> torch.Tensor:
    """``[H, t]`` float log-scores, no NaN or +inf, a finite entry in every head; as float64."""
    if not isinstance(log_scores, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor [H, t], got {type(log_scores).__name__}")
    if log_scores.ndim != 2 or log_scores.shape[0] == 0 or log_scores.shape[1] == 0:
        raise ValueError(
            f"{name} must be [H, t] with H >= 1 heads and t >= 1 entries, "
            f"got shape {tuple(log_scores.shape)}"
        )
    if not torch.is_floating_point(log_scores):
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {log_scores.dtype}")
    scores = log_scores.detach().to(torch.float64)
    if torch.isnan(scores).any():
        raise ValueError(f"{name} contains NaN; log-scores must be numbers (-inf = zero mass)")
    if (scores == math.inf).any():
        raise ValueError(f"{name} contains +inf; log-scores must be finite or -inf")
    dead = torch.isinf(scores).all(-1)
    if dead.any():
        raise ValueError(
            f"{name} has heads {dead.nonzero().flatten().tolist()} whose entries are all -inf; "
            "every head needs at least one finite log-score"
        )
    return scores


def _check_forced(forced: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
    """Optional bool mask of always-kept entries, same ``[H, t]`` shape as the log-scores."""
    shape = scores.shape
    if forced is None:
        return torch.zeros(shape, dtype=torch.bool, device=scores.device)
    if not isinstance(forced, torch.Tensor) or forced.dtype != torch.bool:
        got = forced.dtype if isinstance(forced, torch.Tensor) else type(forced).__name__
        raise ValueError(f"forced must be a bool tensor [H, t] or None, got {got}")
    if forced.shape != shape:
        raise ValueError(
            f"forced has shape {tuple(forced.shape)} but log_scores has shape {tuple(shape)}"
        )
    return forced.detach().to(scores.device)


def _check_alpha(alpha: float) -> float:
    """Ada-KV safeguard: the floor fraction of the uniform share, in [0, 1] (S6)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or math.isnan(alpha):
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(
            f"alpha must be in [0, 1] (floor fraction of the uniform share), got {alpha!r}"
        )
    return float(alpha)


def _check_budgets(
    budgets: int | Sequence[int] | torch.Tensor, num_heads: int, t: int, forced_counts: torch.Tensor
) -> torch.Tensor:
    """Per-head budgets ``[H]`` int64 with ``forced_h <= B_h <= t`` (an int means every head)."""
    if isinstance(budgets, torch.Tensor) and budgets.ndim == 0:
        budgets = _as_int(budgets, "budgets")
    if isinstance(budgets, torch.Tensor):
        if budgets.ndim != 1:
            raise ValueError(
                f"budgets must be an int or a 1-D [H] tensor, got shape {tuple(budgets.shape)}"
            )
        if torch.is_floating_point(budgets) or budgets.dtype == torch.bool:
            raise ValueError(f"budgets must be integers, got dtype {budgets.dtype}")
        b = budgets.detach().to(device=forced_counts.device, dtype=torch.int64)
    elif isinstance(budgets, Sequence) and not isinstance(budgets, (str, bytes)):
        b = torch.tensor([_as_int(x, "budgets[h]") for x in budgets], dtype=torch.int64)
    else:
        b = torch.full((num_heads,), _as_int(budgets, "budgets"), dtype=torch.int64)
    b = b.to(forced_counts.device)
    if b.numel() != num_heads:
        raise ValueError(f"budgets has {b.numel()} entries but log_scores has {num_heads} heads")
    low = b < forced_counts
    if low.any():
        h = int(low.nonzero()[0])
        raise ValueError(
            f"budgets[{h}] = {int(b[h])} is below the {int(forced_counts[h])} forced entries of "
            "that head; each budget must be >= 0 and >= its head's forced entries (they count "
            "against it)"
        )
    high = b > t
    if high.any():
        h = int(high.nonzero()[0])
        raise ValueError(f"budgets[{h}] = {int(b[h])} exceeds t = {t}; each budget must be <= t")
    return b


# --------------------------------------------------------------------------------------------
# Rounding that keeps totals exact
# --------------------------------------------------------------------------------------------


def _largest_remainder(shares: Sequence[Fraction], total: int) -> list[int]:
    """Integers ``b_i`` with ``sum b_i = total`` and ``|b_i - shares_i| < 1`` (Hamilton's method).

    ``shares`` are exact rationals summing to ``total``: each gets its floor, and the ``total -
    sum(floors)`` leftover units go to the largest fractional parts (ties: lower index). An
    integral share never gets a unit, so ``b_i <= c`` whenever ``shares_i <= c`` for an integer c.
    """
    floors = [math.floor(s) for s in shares]
    leftover = total - sum(floors)
    if not 0 <= leftover <= len(shares):
        raise ValueError(f"internal: shares sum to {sum(shares)}, not to the total {total}")
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - floors[i]), i))
    for i in order[:leftover]:
        floors[i] += 1
    return floors


def _capped_uniform_share(total: int, caps: Sequence[int]) -> list[Fraction]:
    """The most even split of ``total`` with ``share_h <= caps_h`` (water-filling, exact).

    Every head gets the same level ``lam``, except heads whose cap is below it, which get their
    cap. With equal caps (no forced entries, or the same window in every head) this is
    ``total / H``, Ada-KV's uniform share. Requires ``total <= sum(caps)``.
    """
    shares: list[Fraction] = [Fraction(0)] * len(caps)
    left, heads_left = Fraction(total), len(caps)
    for h in sorted(range(len(caps)), key=lambda i: caps[i]):
        level = left / heads_left
        share = min(Fraction(caps[h]), level)
        shares[h] = share
        left -= share
        heads_left -= 1
    return shares


# --------------------------------------------------------------------------------------------
# Uniform and PyramidKV budgets (S1, S5)
# --------------------------------------------------------------------------------------------


def uniform_budget(t: int, ratio: float) -> int:
    """Kept entries per head for compression ratio ``r`` (S1: ``r`` = fraction evicted).

    ``k = floor((1 - r) * t + 1/2)`` (round half up, never Python's round-half-to-even), then
    clamped to ``[1, t]``: at least one entry survives, so ``r`` close to 1 keeps one entry.
    ``r = 0`` keeps all ``t``.
    """
    t = check_positive_int(t, "t")
    r = check_ratio(ratio)
    k = math.floor((1.0 - r) * t + 0.5)
    return min(t, max(1, k))


def pyramid_budgets(
    num_layers: int,
    mean_budget: int,
    *,
    beta: float = 20,
    window: int = 0,
    t: int | None = None,
) -> list[int]:
    """PyramidKV's per-layer budgets (S5): linear in depth, decreasing, mean exactly ``mean_budget``.

    ``mean_budget`` is the uniform budget per head (e.g. ``uniform_budget(t, r)``) and includes the
    ``window`` entries that every layer keeps outside the pyramid (SnapKV's observation window,
    S6): only ``base = mean_budget - window`` is shaped. Layer ``l = 0 .. L-1`` (0 = lowest) gets
    ``window + x_l`` with the real-valued pyramid

        lo = base / beta,   hi = 2 * base - lo,   x_l = hi - l * (hi - lo) / (L - 1),

    so the bottom layer gets ``hi``, the top layer ``lo`` (``hi / lo = 2 beta - 1``) and the mean
    is exactly ``base``. If ``t`` is given and ``hi > t - window``, then ``hi = t - window`` and
    ``lo = 2 * base - hi`` (the mean stays ``base``; the slope flattens). The ``x_l`` are rounded
    with the largest-remainder method (exact rationals, ties to the lower layer), so the total is
    exactly ``num_layers * mean_budget``, every layer is within 1 of its real value and the list
    stays non-increasing. Budgets are then clamped to ``[1, t]`` (``[1, inf)`` without ``t``:
    a small ``base`` with ``window = 0`` can round top layers to 0); the units this adds or removes
    are taken from the largest or given to the smallest layers that can absorb them, which keeps
    the total exact (``1 <= mean_budget <= t`` is checked) and the list non-increasing.

    Where implementations differ, probkv follows the reference code's shape with exact totals:

    - The reference code (Zefan-Cai/PyramidKV) and kvpress divide the step by ``L - 1``, so the
      top layer gets exactly ``lo`` and the mean is exactly ``base``; probkv does the same. (The
      paper, arXiv 2406.02069 Sec. 4, states the pyramid from the total budget; as far as we
      recall its text it divides the step by ``L``, which would not keep the mean. The code is
      what the published numbers were measured with, so probkv follows the code.)
    - The reference code floors ``lo`` and the step (integer division), so its layers sum to
      more than ``L * base``; kvpress uses floats and rounds each layer on its own. Neither keeps
      the total exact; probkv rounds jointly so it does.
    - Both clamp ``hi`` at ``t - window`` as above. The reference code additionally falls back to
      the uniform budget whenever ``t < 2 * base``, and kvpress whenever ``lo < window``; probkv
      keeps the (clamped) pyramid instead, which is continuous in ``t``.
    - The reference code keeps the window outside the budget (as ``window`` here); kvpress counts
      its window inside (``window=0`` here).

    ``beta >= 1``; ``beta = 1`` gives the uniform budget in every layer.
    """
    num_layers = check_positive_int(num_layers, "num_layers")
    mean_budget = check_positive_int(_as_int(mean_budget, "mean_budget"), "mean_budget")
    window = check_positive_int(_as_int(window, "window"), "window", allow_zero=True)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta):
        raise ValueError(f"beta must be a finite number >= 1, got {beta!r}")
    if beta < 1:
        raise ValueError(f"beta must be >= 1 (hi / lo = 2 * beta - 1), got {beta!r}")
    if window > mean_budget:
        raise ValueError(
            f"window = {window} exceeds mean_budget = {mean_budget}; the mean budget includes "
            "the window every layer keeps"
        )
    if t is not None:
        t = check_positive_int(_as_int(t, "t"), "t")
        if mean_budget > t:
            raise ValueError(
                f"mean_budget = {mean_budget} exceeds t = {t}; a layer keeps at most t"
            )

    base = mean_budget - window
    if num_layers == 1:
        shaped = [base]
    else:
        lo = Fraction(base) / Fraction(beta)
        hi = 2 * base - lo
        if t is not None and hi > t - window:  # reference clamp: keep the mean, flatten the slope
            hi = Fraction(t - window)
            lo = 2 * base - hi
        step = (hi - lo) / (num_layers - 1)
        shaped = _largest_remainder(
            [hi - layer * step for layer in range(num_layers)], num_layers * base
        )
    # Every layer keeps at least one entry; with t known, at most t (S1).
    return _clamp_keep_total([window + x for x in shaped], 1, t if t is not None else math.inf)


def _clamp_keep_total(budgets: list[int], low: int, high: float) -> list[int]:
    """Clamp a non-increasing list to ``[low, high]`` and move the difference to unclamped layers.

    A deficit (layers raised to ``low``) is taken one unit at a time from the largest layer above
    ``low`` (ties: the deepest such layer); a surplus (layers cut to ``high``) is given to the
    smallest layer below ``high`` (ties: the lowest such layer). Both keep the list
    non-increasing, and the total is kept whenever ``len * low <= total <= len * high``.
    """
    total = sum(budgets)
    out = [min(high, max(low, b)) for b in budgets]
    diff = total - sum(out)
    while diff < 0:
        room = [i for i, b in enumerate(out) if b > low]
        if not room:
            break
        i = max(room, key=lambda j: (out[j], j))
        out[i] -= 1
        diff += 1
    while diff > 0:
        room = [i for i, b in enumerate(out) if b < high]
        if not room:
            break
        i = min(room, key=lambda j: (out[j], j))
        out[i] += 1
        diff -= 1
    return out


# --------------------------------------------------------------------------------------------
# Ada-KV head-wise allocation and top-k selection (S6)
# --------------------------------------------------------------------------------------------


def adakv_allocation(
    log_scores: torch.Tensor,
    budget: int,
    *,
    alpha: float = 0.2,
    forced: torch.Tensor | None = None,
    normalize: bool = True,
) -> torch.Tensor:
    """Ada-KV's split of one layer's budget ``B`` over its ``H`` KV heads (Algorithm 1 + safeguard).

    Args:
        log_scores: ``[H, t]`` log-scores of the layer's KV heads (GQA: already one row per KV
            head, the group average of S2).
        budget: ``B``, the layer's total kept entries over all heads, forced entries included
            (S6: the window counts against the budget). ``F <= B <= H * t``, F = forced entries.
        alpha: safeguard, the floor fraction of the uniform share (S6; the reference code's
            ``floor_alpha``; Algorithm 2 line 8 of the paper writes the mix the other way round).
        forced: optional ``[H, t]`` bool mask of entries every head keeps anyway.
        normalize: what is compared across heads. ``True`` (default): each head's scores as a
            distribution over its *non-forced* entries (``log_softmax`` with forced entries
            masked out), i.e. the attention-mass scale on which Ada-KV's bound is stated
            (Theorem 3.1 uses each head's attention weights ``A_h``, which sum to 1). Forced
            entries are kept outside the competition, so they are left out of the normaliser
            too: their log-scores may be placeholders (``probkv.scores.snapkv`` gives its
            window one), and the competition is over the prefix attention the reference code
            scores (it scores the prefix columns only). ``False``: the log-scores are compared
            as given, for callers whose scores already share one scale (the reference code
            compares max-pooled window attention without renormalising it; pass ``log`` of
            exactly that to reproduce it).

    Returns:
        ``[H]`` int64 budgets ``B_h`` (forced entries included) for ``topk_per_head``.

    Steps (R = B - F entries are allocated, forced entries are kept outside the competition,
    as the reference code subtracts the window before allocating):

    1. ``B_h*`` = how many of the top-``R`` non-forced comparison scores of the whole layer
       belong to head ``h`` (ties: lower head, then later position).
    2. Safeguard: ``x_h = (1 - alpha) * B_h* + alpha * u_h`` with ``u_h`` the uniform share of
       ``R``, ``R / H`` (with unequal forced counts: the most even split with ``u_h <= t - f_h``).
    3. ``B_h = f_h + largest-remainder rounding of x_h`` (exact rationals; ties: lower head).

    Guarantees: ``sum B_h == B``; ``f_h <= B_h <= t``; ``B_h >= f_h + floor(alpha * u_h)``, which
    without forced entries is ``B_h >= floor(alpha * B / H)``. With ``alpha = 0`` and
    ``normalize=True`` the kept sets of ``topk_per_head`` are the layer's global top-``B``, which
    maximises the retained attention mass ``sum_h sum_i T_h(i) A_h(i)`` over all allocations
    (Ada-KV Theorem 3.3), ``A_h`` being each head's attention renormalised to its non-forced
    entries.
    """
    scores = _check_log_scores(log_scores)
    num_heads, t = scores.shape
    forced_mask = _check_forced(forced, scores)
    a = _check_alpha(alpha)
    forced_counts = forced_mask.sum(-1)
    num_forced = int(forced_counts.sum())
    budget = _as_int(budget, "budget")
    if not num_forced <= budget <= num_heads * t:
        raise ValueError(
            f"budget = {budget} must be in [{num_forced}, {num_heads * t}]: at least the "
            f"{num_forced} forced entries and at most all H * t = {num_heads} * {t} entries"
        )
    remaining = budget - num_forced

    # Normalise over the competing (non-forced) entries only: forced entries are kept outside
    # the competition, so their scores (SnapKV gives its window a placeholder) must not shift it.
    keys = (
        torch.log_softmax(scores.masked_fill(forced_mask, -math.inf), dim=-1)
        if normalize
        else scores
    )
    # Step 1 (Algorithm 1): the top-R of all heads' non-forced scores, counted per head. Flip so
    # the row-major flattening runs head ascending, position descending; a stable sort then
    # breaks ties toward the lower head and the later position.
    flipped_free = ~forced_mask.flip(-1)
    heads = torch.arange(num_heads, device=keys.device).unsqueeze(-1).expand(num_heads, t)
    values = keys.flip(-1)[flipped_free]
    owners = heads[flipped_free]
    top = torch.sort(values, descending=True, stable=True).indices[:remaining]
    b_star = torch.bincount(owners[top], minlength=num_heads).tolist()

    # Steps 2-3: safeguard mix with the uniform share, exact rounding to integers.
    caps = (t - forced_counts).tolist()
    share = _capped_uniform_share(remaining, caps)
    fa = Fraction(a)
    mixed = [(1 - fa) * b + fa * u for b, u in zip(b_star, share, strict=True)]
    alloc = _largest_remainder(mixed, remaining)
    return forced_counts.to(torch.int64) + torch.tensor(
        alloc, dtype=torch.int64, device=keys.device
    )


def topk_per_head(
    log_scores: torch.Tensor,
    budgets: int | Sequence[int] | torch.Tensor,
    *,
    forced: torch.Tensor | None = None,
) -> RaggedSelection:
    """Keep each head's forced entries and then its highest log-scores, ``B_h`` entries in all.

    Args:
        log_scores: ``[H, t]`` log-scores (one row per KV head).
        budgets: ``B_h`` per head: an int for every head (uniform, PyramidKV) or ``[H]`` ints
            (Ada-KV). Forced entries count against it: ``forced_h <= B_h <= t``.
        forced: optional ``[H, t]`` bool mask of entries kept whatever their score.

    Returns:
        ``RaggedSelection`` (S6 flattened layout): indices sorted ascending within each head,
        ``lengths == budgets``, ``log_weights=None`` (top-k methods carry no correction, S4).
        Ties between equal scores of a head go to the later position.
    """
    scores = _check_log_scores(log_scores)
    num_heads, t = scores.shape
    forced_mask = _check_forced(forced, scores)
    b = _check_budgets(budgets, num_heads, t, forced_mask.sum(-1))
    keys = scores.masked_fill(forced_mask, math.inf)  # forced first (no score is +inf)
    order = torch.sort(keys.flip(-1), dim=-1, descending=True, stable=True).indices
    positions = (t - 1) - order  # back to original positions; ties ranked later-first
    take = torch.arange(t, device=keys.device).unsqueeze(0) < b.unsqueeze(-1)
    kept = torch.zeros(num_heads, t, dtype=torch.bool, device=keys.device)
    kept.scatter_(1, positions, take)
    return RaggedSelection.from_masks(kept)


def retained_attention_mass(attention: torch.Tensor, selection: RaggedSelection) -> torch.Tensor:
    """Ada-KV's diagnostic per head: ``sum_i T_h(i) A_h(i)`` (S6), the attention mass kept.

    ``attention`` is ``[H, t]`` non-negative (e.g. each KV head's group-averaged last-query
    attention, rows summing to 1); ``selection`` holds the kept entries of the same ``H`` heads.
    Log-weights are ignored: this is the mass of the kept set, not of a corrected estimate.
    Returns ``[H]`` in ``attention``'s dtype. With rows summing to 1, the L1 eviction-loss bound
    of Theorem 3.1 is ``2 C sum_h (1 - mass_h)``.
    """
    if not isinstance(attention, torch.Tensor) or attention.ndim != 2:
        got = (
            tuple(attention.shape)
            if isinstance(attention, torch.Tensor)
            else type(attention).__name__
        )
        raise ValueError(f"attention must be a tensor [H, t], got {got}")
    if not torch.is_floating_point(attention):
        raise ValueError(f"attention must be a floating-point tensor, got dtype {attention.dtype}")
    if not torch.isfinite(attention).all() or (attention < 0).any():
        raise ValueError("attention must be finite and non-negative (attention weights)")
    num_heads, t = attention.shape
    if selection.num_heads != num_heads:
        raise ValueError(
            f"selection has {selection.num_heads} heads but attention has {num_heads} rows"
        )
    if selection.indices.numel() and (
        int(selection.indices.min()) < 0 or int(selection.indices.max()) >= t
    ):
        raise ValueError(
            f"selection indices must be in [0, {t - 1}] for attention of length t = {t}, got "
            f"range [{int(selection.indices.min())}, {int(selection.indices.max())}]"
        )
    lengths = selection.lengths.to(attention.device)
    heads = torch.repeat_interleave(torch.arange(num_heads, device=attention.device), lengths)
    kept = torch.zeros(num_heads, t, dtype=torch.bool, device=attention.device)
    kept[heads, selection.indices.to(attention.device)] = True  # each kept entry counted once
    return (attention * kept).sum(-1)
