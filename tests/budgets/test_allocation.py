"""Budgets and top-k selection (S5, S6): uniform, PyramidKV, Ada-KV, top-k per head."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probkv.budgets import (
    adakv_allocation,
    pyramid_budgets,
    retained_attention_mass,
    topk_per_head,
    uniform_budget,
)
from probkv.estimation.selection import RaggedSelection

torch.set_num_threads(1)
FAST = settings(max_examples=60, deadline=None)


# ---------------------------------------------------------------------------------------------
# Slow, plain references
# ---------------------------------------------------------------------------------------------


def reference_topk(scores: torch.Tensor, budgets: list[int], forced: torch.Tensor) -> torch.Tensor:
    """Per head: forced entries, then the rest by (score desc, later position first)."""
    h, t = scores.shape
    mask = torch.zeros(h, t, dtype=torch.bool)
    for head in range(h):
        chosen = [i for i in range(t) if forced[head, i]]
        rest = [i for i in range(t) if not forced[head, i]]
        rest.sort(key=lambda i: (-float(scores[head, i]), -i))
        chosen += rest[: budgets[head] - len(chosen)]
        mask[head, chosen] = True
    return mask


def reference_ada_star(scores: torch.Tensor, remaining: int, forced: torch.Tensor) -> list[int]:
    """Algorithm 1 literally: concatenate every head's scores normalised over its non-forced
    entries (forced ones are kept outside the competition), take the top ``remaining``, count
    per head. Ties: lower head, then later position."""
    h, t = scores.shape
    free = scores.double().masked_fill(forced, -math.inf)
    normalised = free - torch.logsumexp(free, dim=-1, keepdim=True)
    pool = [
        (float(normalised[head, i]), head, i)
        for head in range(h)
        for i in range(t)
        if not forced[head, i]
    ]
    pool.sort(key=lambda x: (-x[0], x[1], -x[2]))
    counts = [0] * h
    for _, head, _ in pool[:remaining]:
        counts[head] += 1
    return counts


def best_retained_mass(attention: torch.Tensor, budget: int, forced: torch.Tensor) -> float:
    """max over every allocation (B_h) with sum B, f_h <= B_h <= t of the mass kept by
    forced entries plus each head's top non-forced entries (brute force over allocations)."""
    h, t = attention.shape
    f = forced.sum(-1).tolist()
    prefix = []
    for head in range(h):
        free = attention[head][~forced[head]].double().sort(descending=True).values
        forced_mass = float(attention[head][forced[head]].double().sum())
        prefix.append([forced_mass + float(free[:j].sum()) for j in range(t - f[head] + 1)])
    best = -math.inf
    for alloc in itertools.product(*[range(f[head], t + 1) for head in range(h)]):
        if sum(alloc) == budget:
            best = max(best, sum(prefix[head][alloc[head] - f[head]] for head in range(h)))
    return best


def random_attention(h: int, t: int, seed: int) -> torch.Tensor:
    """Rows of different peakedness: softmax of normals with a per-head temperature in [0.2, 5]."""
    g = torch.Generator().manual_seed(seed)
    temps = torch.exp(torch.empty(h, 1, dtype=torch.float64).uniform_(-1.6, 1.6, generator=g))
    return torch.softmax(torch.randn(h, t, generator=g, dtype=torch.float64) / temps, dim=-1)


# ---------------------------------------------------------------------------------------------
# uniform_budget (S1)
# ---------------------------------------------------------------------------------------------


def test_uniform_budget_rounds_half_up_and_clamps():
    assert uniform_budget(10, 0.0) == 10
    assert uniform_budget(10, 0.5) == 5
    assert uniform_budget(5, 0.5) == 3  # 2.5 rounds up (Python's round would give 2)
    assert uniform_budget(7, 0.5) == 4  # 3.5 -> 4
    assert uniform_budget(10, 0.74) == 3  # 2.6 -> 3
    assert uniform_budget(3, 0.99) == 1  # 0.03 would round to 0: at least one entry survives
    assert uniform_budget(1, 0.9) == 1


@FAST
@given(st.integers(1, 100_000), st.floats(0.0, 0.999))
def test_uniform_budget_is_within_half_of_target(t, r):
    k = uniform_budget(t, r)
    assert 1 <= k <= t
    if (1 - r) * t >= 0.5:
        assert abs(k - (1 - r) * t) <= 0.5 + 1e-9


@pytest.mark.parametrize(
    ("t", "ratio", "match"),
    [(0, 0.5, "t must be >= 1"), (10, 1.0, "ratio"), (10, -0.1, "ratio"), (10, math.nan, "ratio")],
)
def test_uniform_budget_bad_input(t, ratio, match):
    with pytest.raises(ValueError, match=match):
        uniform_budget(t, ratio)


# ---------------------------------------------------------------------------------------------
# pyramid_budgets (S5)
# ---------------------------------------------------------------------------------------------


def real_pyramid(num_layers, mean_budget, beta, window, t):
    """The real-valued pyramid of the docstring, in floats, written out independently."""
    base = mean_budget - window
    lo = base / beta
    hi = 2 * base - lo
    if t is not None and hi > t - window:
        hi = t - window
        lo = 2 * base - hi
    return [window + hi - layer * (hi - lo) / (num_layers - 1) for layer in range(num_layers)]


@FAST
@given(
    num_layers=st.integers(2, 40),
    mean_budget=st.integers(1, 3000),
    beta=st.sampled_from([1, 1.5, 2, 5, 20, 100]),
    window_frac=st.floats(0, 1),
    slack=st.one_of(st.none(), st.integers(0, 5000)),
)
def test_pyramid_is_linear_decreasing_exact_and_clamped(
    num_layers, mean_budget, beta, window_frac, slack
):
    window = int(window_frac * mean_budget)
    t = None if slack is None else mean_budget + slack
    b = pyramid_budgets(num_layers, mean_budget, beta=beta, window=window, t=t)
    assert len(b) == num_layers
    assert sum(b) == num_layers * mean_budget  # mean exact
    assert all(x >= y for x, y in itertools.pairwise(b))  # non-increasing in depth
    assert min(b) >= 1 and (t is None or max(b) <= t)
    x = real_pyramid(num_layers, mean_budget, beta, window, t)
    if min(x) >= 1:  # no lower clamp: every layer within one unit of the linear pyramid
        assert all(abs(bi - xi) < 1 for bi, xi in zip(b, x, strict=True))


def test_pyramid_matches_the_formula_with_beta_20():
    # base 100, beta 20: lo = 5, hi = 195, step = 190 / 7 = 27.14...; largest remainder keeps 800.
    b = pyramid_budgets(8, 100, beta=20)
    assert b[0] == 195 and b[-1] == 5  # hi / lo = 2 * beta - 1 = 39
    assert sum(b) == 800
    steps = [x - y for x, y in itertools.pairwise(b)]
    assert all(27 <= s <= 28 for s in steps)  # linear up to rounding


def test_pyramid_window_is_outside_the_pyramid():
    b = pyramid_budgets(4, 40, beta=2, window=32)  # base 8: lo 4, hi 12, x = 12, 9.33, 6.67, 4
    assert b == [32 + 12, 32 + 9, 32 + 7, 32 + 4]


def test_pyramid_clamps_the_bottom_layer_at_t_and_keeps_the_mean():
    # t = 100, mean 60: unclamped hi = 117 > 100, so hi = 100 and lo = 2 * 60 - 100 = 20.
    b = pyramid_budgets(5, 60, beta=20, t=100)
    assert b == [100, 80, 60, 40, 20]


def test_pyramid_lower_clamp_moves_units_and_keeps_total():
    b = pyramid_budgets(30, 3, beta=20)  # x goes down to 0.15: top layers would round to 0
    assert min(b) == 1 and sum(b) == 90
    assert all(x >= y for x, y in itertools.pairwise(b))


def test_pyramid_degenerate_cases():
    assert pyramid_budgets(1, 17, t=20) == [17]
    assert pyramid_budgets(6, 17, beta=1) == [17] * 6  # beta = 1: uniform
    assert pyramid_budgets(3, 20, t=20) == [20, 20, 20]  # mean = t forces every layer to t


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_layers": 0, "mean_budget": 5}, "num_layers"),
        ({"num_layers": 4, "mean_budget": 0}, "mean_budget"),
        ({"num_layers": 4, "mean_budget": 5, "beta": 0.5}, "beta"),
        ({"num_layers": 4, "mean_budget": 5, "beta": math.nan}, "beta"),
        ({"num_layers": 4, "mean_budget": 5, "window": 6}, "window = 6"),
        ({"num_layers": 4, "mean_budget": 5, "window": -1}, "window"),
        ({"num_layers": 4, "mean_budget": 50, "t": 40}, "mean_budget = 50 exceeds t = 40"),
        ({"num_layers": 4, "mean_budget": 5.5}, "mean_budget"),
    ],
)
def test_pyramid_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pyramid_budgets(**kwargs)


# ---------------------------------------------------------------------------------------------
# topk_per_head (S5, S6)
# ---------------------------------------------------------------------------------------------


@st.composite
def scored_layer(draw, max_heads=5, max_t=12):
    h = draw(st.integers(1, max_heads))
    t = draw(st.integers(1, max_t))
    # few distinct values so that ties are common and the tie rule is exercised
    values = draw(st.lists(st.integers(-3, 3), min_size=h * t, max_size=h * t))
    scores = torch.tensor(values, dtype=torch.float32).reshape(h, t) / 2
    forced_bits = draw(st.lists(st.booleans(), min_size=h * t, max_size=h * t))
    use_forced = draw(st.booleans())
    forced = torch.tensor(forced_bits).reshape(h, t) & use_forced
    return scores, forced


@FAST
@given(data=st.data(), layer=scored_layer())
def test_topk_per_head_matches_the_slow_reference(data, layer):
    scores, forced = layer
    h, t = scores.shape
    f = forced.sum(-1).tolist()
    budgets = [data.draw(st.integers(f[head], t)) for head in range(h)]
    sel = topk_per_head(scores, budgets, forced=forced)
    assert sel.log_weights is None
    assert sel.lengths.tolist() == budgets
    assert torch.equal(sel.to_mask(t), reference_topk(scores, budgets, forced))
    for head in range(h):
        idx, _ = sel.head(head)
        assert torch.all(idx[1:] > idx[:-1])  # sorted ascending, no duplicates


def test_topk_per_head_tie_rule_prefers_later_positions():
    scores = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]])
    assert topk_per_head(scores, 2).indices.tolist() == [2, 3]
    forced = torch.tensor([[True, False, False, False, False]])
    assert topk_per_head(scores, 2, forced=forced).indices.tolist() == [0, 3]


def test_topk_per_head_accepts_int_list_and_tensor_budgets():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(3, 9, generator=g)
    a = topk_per_head(scores, 4)
    b = topk_per_head(scores, [4, 4, 4])
    c = topk_per_head(scores, torch.tensor([4, 4, 4]))
    assert torch.equal(a.indices, b.indices) and torch.equal(a.indices, c.indices)
    assert isinstance(a, RaggedSelection) and a.lengths.tolist() == [4, 4, 4]
    full = topk_per_head(scores, 9)
    assert full.indices.tolist() == list(range(9)) * 3


def test_topk_per_head_handles_minus_inf_scores():
    scores = torch.tensor([[0.0, -math.inf, -math.inf, 1.0]])
    assert topk_per_head(scores, 3).indices.tolist() == [0, 2, 3]  # tie at -inf: later first


@pytest.mark.parametrize(
    ("scores", "budgets", "forced", "match"),
    [
        (torch.zeros(2, 4), [1, 5], None, r"budgets\[1\] = 5 exceeds t = 4"),
        (torch.zeros(2, 4), [1, -1], None, r"budgets\[1\] = -1"),
        (torch.zeros(2, 4), [1, 1, 1], None, "3 entries but log_scores has 2 heads"),
        (torch.zeros(2, 4), torch.tensor([1.0, 2.0]), None, "integers"),
        (torch.zeros(2, 4), 2.5, None, "budgets must be an integer"),
        (
            torch.zeros(2, 4),
            [2, 1],
            torch.ones(2, 4, dtype=torch.bool),
            r"budgets\[0\] = 2 is below",
        ),
        (torch.zeros(2, 4), 2, torch.ones(2, 3, dtype=torch.bool), "forced has shape"),
        (torch.zeros(2, 4), 2, torch.ones(2, 4), "forced must be a bool"),
        (torch.zeros(4), 2, None, r"\[H, t\]"),
        (torch.zeros(2, 0), 0, None, r"t >= 1"),
        (torch.tensor([[0.0, math.nan]]), 1, None, "NaN"),
        (torch.tensor([[0.0, math.inf]]), 1, None, r"\+inf"),
        (torch.tensor([[-math.inf, -math.inf]]), 1, None, "all -inf"),
        (torch.zeros(2, 4, dtype=torch.int64), 1, None, "floating-point"),
    ],
)
def test_topk_per_head_bad_input(scores, budgets, forced, match):
    with pytest.raises(ValueError, match=match):
        topk_per_head(scores, budgets, forced=forced)


# ---------------------------------------------------------------------------------------------
# adakv_allocation (S6)
# ---------------------------------------------------------------------------------------------


@st.composite
def ada_case(draw):
    h = draw(st.integers(1, 6))
    t = draw(st.integers(1, 14))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(h, t, generator=g) * draw(st.sampled_from([0.1, 1.0, 10.0]))
    window = draw(st.integers(0, t))  # same window in every head (SnapKV)
    forced = torch.zeros(h, t, dtype=torch.bool)
    if window:
        forced[:, t - window :] = True
    budget = draw(st.integers(h * window, h * t))
    alpha = draw(st.sampled_from([0.0, 0.2, 0.5, 1.0]) | st.floats(0, 1))
    return scores, forced, budget, alpha


@settings(max_examples=100, deadline=None)
@given(ada_case())
def test_adakv_allocation_sums_exactly_with_safeguard_and_caps(case):
    scores, forced, budget, alpha = case
    h, t = scores.shape
    b = adakv_allocation(scores, budget, alpha=alpha, forced=forced)
    assert b.dtype == torch.int64 and b.shape == (h,)
    assert int(b.sum()) == budget
    f = forced.sum(-1)
    assert torch.all(b >= f) and torch.all(b <= t)
    remaining = budget - int(f.sum())
    # S6 safeguard: at least alpha of the uniform share of what is allocated beyond the window.
    floor_share = math.floor(alpha * remaining / h)
    assert torch.all(b - f >= floor_share)
    if not forced.any():
        assert torch.all(b >= math.floor(alpha * budget / h))  # the brief's form of the floor
    # The selection realises the allocation exactly.
    sel = topk_per_head(scores, b, forced=forced)
    assert torch.equal(sel.lengths, b)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 8), st.integers(0, 2**31 - 1), st.data())
def test_adakv_alpha_zero_is_algorithm_1(h, t, seed, data):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(h, t, generator=g, dtype=torch.float64)
    forced = torch.rand(h, t, generator=g) < data.draw(st.sampled_from([0.0, 0.3]))
    f = int(forced.sum())
    budget = data.draw(st.integers(f, h * t))
    b = adakv_allocation(scores, budget, alpha=0.0, forced=forced)
    expected = reference_ada_star(scores, budget - f, forced)
    assert (b - forced.sum(-1)).tolist() == expected


def test_adakv_unequal_forced_counts_respect_caps():
    scores = torch.zeros(3, 5)
    forced = torch.tensor(
        [[True, True, True, True, False], [False] * 5, [False] * 4 + [True]], dtype=torch.bool
    )
    for budget in range(5, 16):
        b = adakv_allocation(scores, budget, alpha=1.0, forced=forced)
        assert int(b.sum()) == budget and torch.all(b <= 5) and torch.all(b >= forced.sum(-1))


def test_adakv_alpha_one_is_uniform_and_safeguard_lifts_peaked_heads():
    t = 50
    peaked = torch.full((t,), -30.0)
    peaked[0] = 0.0  # all attention on one entry
    flat = torch.zeros(t)
    scores = torch.stack([peaked, flat])
    assert adakv_allocation(scores, 40, alpha=1.0).tolist() == [20, 20]
    ada = adakv_allocation(scores, 40, alpha=0.0)
    # After its single heavy entry, the peaked head's entries have mass e^-30 / (1 + 49 e^-30),
    # far below the flat head's 1/50: Algorithm 1 gives it exactly the one entry.
    assert ada.tolist() == [1, 39]
    safe = adakv_allocation(scores, 40, alpha=0.2)  # 0.8 * [1, 39] + 0.2 * 20 = [4.8, 35.2]
    assert safe.tolist() == [5, 35]
    assert int(safe[0]) >= math.floor(0.2 * 40 / 2)


def test_adakv_normalize_is_invariant_to_per_head_shifts():
    g = torch.Generator().manual_seed(11)
    for _ in range(20):
        scores = torch.randn(4, 30, generator=g, dtype=torch.float64)
        shifted = scores + torch.tensor([[0.0], [5.0], [-7.0], [2.0]], dtype=torch.float64)
        a = adakv_allocation(scores, 50)
        assert torch.equal(a, adakv_allocation(shifted, 50))
    # Without normalisation a head shifted up by 5 wins the whole competition.
    raw = adakv_allocation(shifted, 50, alpha=0.0, normalize=False)
    assert int(raw[1]) == 30


def test_adakv_theorem_3_3_beats_every_uniform_allocation():
    # alpha = 0 keeps the layer's global top-B of the attention mass, which no uniform
    # allocation can beat (Ada-KV Theorem 3.3). Exact inequality up to float64 round-off
    # of sums of at most H * t = 256 terms in [0, 1] (< 1e-12).
    for seed in range(30):
        h, t = 4, 64
        attention = random_attention(h, t, seed)
        for per_head in (1, 4, 16, 32, 63):
            budget = per_head * h
            ada = topk_per_head(
                attention.log(), adakv_allocation(attention.log(), budget, alpha=0.0)
            )
            uni = topk_per_head(attention.log(), per_head)
            m_ada = retained_attention_mass(attention, ada).sum()
            m_uni = retained_attention_mass(attention, uni).sum()
            assert m_ada >= m_uni - 1e-12


def test_adakv_alpha_zero_is_optimal_over_all_allocations():
    # Brute force over every allocation (B_h) with sum B: Ada's alpha = 0 allocation retains the
    # maximum mass, with and without a forced window (tiny H, t; tolerance = float64 round-off).
    # With a window, the competition is over each head's attention renormalised to its
    # non-forced entries (the window is kept outside it), so that is the mass measured.
    cases = 0
    for seed in range(12):
        h, t = 3, 5
        attention = random_attention(h, t, 100 + seed)
        for window in (0, 1, 2):
            forced = torch.zeros(h, t, dtype=torch.bool)
            if window:
                forced[:, t - window :] = True
            free = attention.masked_fill(forced, 0.0)
            free = free / free.sum(-1, keepdim=True)
            for budget in range(h * window, h * t + 1):
                alloc = adakv_allocation(attention.log(), budget, alpha=0.0, forced=forced)
                sel = topk_per_head(attention.log(), alloc, forced=forced)
                got = float(retained_attention_mass(free, sel).sum())
                assert got == pytest.approx(best_retained_mass(free, budget, forced), abs=1e-12)
                cases += 1
    assert cases == 12 * (16 + 13 + 10)


@pytest.mark.parametrize(
    ("budget", "kwargs", "match"),
    [
        (13, {}, r"budget = 13 must be in \[0, 12\]"),
        (-1, {}, "budget = -1"),
        (5, {"forced": torch.ones(3, 4, dtype=torch.bool)}, r"budget = 5 must be in \[12, 12\]"),
        (5, {"alpha": 1.5}, "alpha must be in"),
        (5, {"alpha": math.nan}, "alpha"),
        (5.0, {}, "budget must be an integer"),
        (True, {}, "budget must be an integer"),
    ],
)
def test_adakv_bad_input(budget, kwargs, match):
    with pytest.raises(ValueError, match=match):
        adakv_allocation(torch.zeros(3, 4), budget, **kwargs)


# ---------------------------------------------------------------------------------------------
# retained_attention_mass (S6)
# ---------------------------------------------------------------------------------------------


def test_retained_attention_mass_equals_a_plain_sum():
    attention = random_attention(3, 10, 5)
    sel = RaggedSelection.from_index_lists(
        [torch.tensor([0, 4, 9]), torch.tensor([], dtype=torch.int64), torch.arange(10)]
    )
    mass = retained_attention_mass(attention, sel)
    expected = [float(attention[0, [0, 4, 9]].sum()), 0.0, float(attention[2].sum())]
    assert mass.tolist() == pytest.approx(expected, abs=1e-15)
    assert mass.dtype == attention.dtype


def test_retained_attention_mass_bad_input():
    sel = RaggedSelection.from_index_lists([torch.tensor([0, 5])])
    with pytest.raises(ValueError, match=r"indices must be in \[0, 3\]"):
        retained_attention_mass(torch.ones(1, 4) / 4, sel)
    with pytest.raises(ValueError, match="2 rows"):
        retained_attention_mass(torch.ones(2, 8) / 8, sel)
    with pytest.raises(ValueError, match="non-negative"):
        retained_attention_mass(-torch.ones(1, 8), sel)
    with pytest.raises(ValueError, match=r"\[H, t\]"):
        retained_attention_mass(torch.ones(8), sel)
