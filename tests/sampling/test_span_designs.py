"""Tests of probkv.sampling.span_designs: span-preserving pps designs (S10.2-S10.4).

References are written here from the definitions: iterative capping with unit sizes (S10.3),
systematic sampling as "unit k is kept iff its interval holds a point u + j", evaluated in exact
rational arithmetic. Exact claims (first-order inclusion, unbiasedness, the kept-count bound) are
checked by enumerating a design's whole distribution: every visiting order it can draw (all
permutations of the full blocks) times every interval of the offset ``u`` on which the kept set
is constant. Statistical claims use fixed seeds and ``Z = 5`` standard errors (two-sided false
alarm probability 5.7e-7 per comparison), the standard error taken from the known binomial
variance or from the estimator's own sample variance.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probkv import sampling
from probkv.sampling import capped_scale, span_designs, systematic_sample_ordered
from probkv.sampling.span_designs import (
    UnitDesign,
    block_design,
    block_design_global,
    blocks,
    core_size,
    global_budget,
    sample_design,
    spans,
    top_entries,
    top_entries_global,
    visit_order,
)

torch.set_num_threads(1)
F64 = torch.float64
Z = 5.0


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def proposal(rows: int, t: int, seed: int, spread: float = 2.0, zeros_at_end=None):
    """A float64 proposal ``[rows, t]``; ``zeros_at_end[r]`` entries of row r zero (always kept)."""
    pi = torch.softmax(spread * torch.randn(rows, t, generator=gen(seed), dtype=F64), -1)
    if zeros_at_end is not None:
        for r, a in enumerate(zeros_at_end):
            pi[r, t - a :] = 0.0
    return pi / pi.sum(-1, keepdim=True)


# --------------------------------------------------------------------------- references


def reference_capping(mass: list[float], sizes: list[int], n: float) -> list[float]:
    """S9's iterative capping with unit sizes, literally: lam = remaining / sum |B| M over the
    uncapped units; units with lam M >= 1 are capped at 1; repeat until none is."""
    K = len(mass)
    capped: set[int] = set()
    while True:
        free = [k for k in range(K) if k not in capped and mass[k] > 0]
        remaining = n - sum(sizes[k] for k in capped)
        if not free or remaining <= 0:
            return [1.0 if k in capped else 0.0 for k in range(K)]
        lam = remaining / sum(sizes[k] * mass[k] for k in free)
        new = {k for k in free if lam * mass[k] >= 1}
        if not new:
            return [1.0 if k in capped else (lam * mass[k] if k in free else 0.0) for k in range(K)]
        capped |= new


def reference_systematic(P: list[Fraction], visit: list[int], u: Fraction) -> set[int]:
    """Units laid end to end in ``visit`` order; unit k kept iff [C_prev, C_k) holds u + j."""
    kept, start = set(), Fraction(0)
    for k in visit:
        end = start + P[k]
        j = math.ceil(start - u) if start > u else 0  # first j with u + j >= start
        if u + j < end:
            kept.add(k)
        start = end
    return kept


def implementation_at(inclusion, visit, u, width):
    """``systematic_sample_ordered`` at the float offset ``u`` as a set of units; None where the
    interval of constant outcome is too narrow (< 1e-9) for a float offset to land inside it
    (float rounding of the sums, and the implementation's snapping, act at that scale)."""
    if width < Fraction(1, 10**9):
        return None
    full = visit + [k for k in range(inclusion.shape[-1]) if k not in visit]  # padding last
    kept = systematic_sample_ordered(
        inclusion, torch.tensor([full]), torch.tensor([float(u)], dtype=F64)
    )[0]
    return set(kept.nonzero().flatten().tolist())


def design_distribution(P: list[float], sizes: list[int], order: str, kind: str = "blocks"):
    """Every outcome of the design with its exact probability:
    ``(prob, visit, u, kept units, width of the offset interval)``.

    Visiting orders: position order, or (random) every permutation of the full-size units,
    equally likely, followed by the shorter last unit (spans: every permutation of all units).
    For each order, the kept set is constant between consecutive fractional parts of the
    cumulative sums; ``u`` is the midpoint.
    """
    K = sum(1 for s in sizes if s > 0)
    full = [k for k in range(K) if sizes[k] == max(sizes) or kind == "spans"]
    short = [k for k in range(K) if k not in full]
    orders = (
        [list(range(K))]
        if order == "position"
        else [[*p, *short] for p in itertools.permutations(full)]
    )
    exact = [Fraction(p) for p in P]  # the float P_k, exactly
    for visit in orders:
        cum = list(itertools.accumulate(exact[k] for k in visit))
        cuts = sorted({Fraction(0), Fraction(1), *(c - math.floor(c) for c in cum)})
        for lo, hi in itertools.pairwise(cuts):
            u = (lo + hi) / 2
            kept = reference_systematic(exact, visit, u)
            yield (hi - lo) / len(orders), visit, u, kept, hi - lo


# ------------------------------------------------------------------ S9 equivalence (core=0)


@pytest.mark.parametrize("seed", range(20))
def test_block_one_in_position_order_is_s9_pps_bit_for_bit(seed):
    """block=1, order=position (and no core) is today's sampler: the same inclusion
    probabilities and the same kept sets for the same generator state, per head and global."""
    t = 5 + 7 * seed
    forced = torch.tensor([0, 3, t // 2])
    pi = proposal(3, t, seed, spread=1 + seed % 4, zeros_at_end=forced.tolist()).float()
    k = torch.full((3,), max(1, round(0.4 * t)), dtype=torch.int64).maximum(forced)
    old = sampling.pps_inclusion_probabilities(pi, k, forced)
    design = block_design(pi, k - forced, 1)
    assert torch.equal(design.entry_inclusion, old)
    for s in range(5):
        old_kept = sampling.systematic_sample(old, gen(100 * seed + s))
        assert torch.equal(sample_design(design, "position", gen(100 * seed + s)), old_kept)
    pis = [pi, proposal(2, t + 9, seed + 1).float()]
    always = [forced, torch.zeros(2, dtype=torch.int64)]
    old_global = sampling.pps_inclusion_probabilities_global(pis, 0.7, always)
    new_global = block_design_global(pis, global_budget(pis, 0.7, always), 1)
    for a, b in zip(old_global, new_global, strict=True):
        assert torch.equal(b.entry_inclusion, a)
    masses = [torch.tensor([0.5, 1.0, 0.2], dtype=torch.float64), torch.tensor([2.0, 0.1])]
    old_global = sampling.pps_inclusion_probabilities_global(pis, 0.7, always, row_mass=masses)
    new_global = block_design_global(pis, global_budget(pis, 0.7, always), 1, row_mass=masses)
    for a, b in zip(old_global, new_global, strict=True):
        assert torch.equal(b.entry_inclusion, a)


# ------------------------------------------------------------------------ capping (S10.3)


@settings(max_examples=60, deadline=None)
@given(
    t=st.integers(1, 40),
    block=st.integers(1, 9),
    spread=st.sampled_from([0.5, 2.0, 6.0]),
    kept_fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 10**6),
)
def test_block_inclusion_matches_iterative_capping(t, block, spread, kept_fraction, seed):
    """S10.3: P_k = min(1, lam M_k) with sum_k |B_k| P_k = n (entries), against the literal
    iterative capping with unit sizes; every entry carries its block's P."""
    pi = proposal(1, t, seed, spread)
    n = math.floor(kept_fraction * t)
    design = block_design(pi, n, block)
    units, sizes = design.units[0], design.sizes[0].tolist()
    mass = [float(pi[0][units == k].sum()) for k in range(len(sizes))]
    expected = reference_capping(mass, sizes, n)
    torch.testing.assert_close(
        design.inclusion[0], torch.tensor(expected, dtype=F64), rtol=1e-10, atol=1e-12
    )
    assert float(design.expected_size[0]) == pytest.approx(n, abs=1e-9)
    assert torch.equal(design.entry_inclusion[0], design.inclusion[0][units])


def test_blocks_are_runs_of_consecutive_eligible_entries():
    """Units are runs of ``block`` eligible entries in position order; only the last is shorter;
    ineligible entries (always kept, at the end here) belong to none."""
    eligible = torch.tensor([[True] * 7 + [False] * 3, [True] * 10, [False] * 10])
    units, sizes = blocks(eligible, 3)
    assert units.tolist() == [
        [0, 0, 0, 1, 1, 1, 2, -1, -1, -1],
        [0, 0, 0, 1, 1, 1, 2, 2, 2, 3],
        [-1] * 10,
    ]
    assert sizes.tolist() == [[3, 3, 1, 0], [3, 3, 3, 1], [0, 0, 0, 0]]
    assert blocks(eligible, 1)[0][0].tolist() == [0, 1, 2, 3, 4, 5, 6, -1, -1, -1]


def test_capped_scale_edge_cases():
    """n = 0: nothing (num = 0); n = total size: every unit P = 1; n above it: den = 0 and
    every unit P = 1 (the documented clamp)."""
    mass = torch.tensor([[0.5, 0.3, 0.2]] * 3, dtype=F64)
    sizes = torch.tensor([[2, 2, 1]] * 3)
    n = torch.tensor([0.0, 5.0, 6.0], dtype=F64)
    num, den = capped_scale(mass, sizes, n)
    assert num[0] == 0 and den[2] == 0
    design = block_design(mass, n, 1)
    assert (design.inclusion[0] == 0).all() and (design.inclusion[1:] == 1).all()


# ------------------------------------------------ exact distribution of the design (S10.3)


CASES = [  # (t, block, n, zeros at the end, spread, seed)
    (7, 3, 3, 0, 1.0, 0),
    (8, 3, 4, 1, 2.0, 1),
    (9, 2, 4, 0, 3.0, 2),
    (6, 4, 2, 0, 0.5, 3),
    (9, 4, 5, 2, 1.5, 4),
    (10, 3, 2, 0, 4.0, 5),
    (5, 1, 2, 0, 1.0, 6),
    (6, 2, 5, 0, 2.0, 7),  # take-all blocks
]


@pytest.mark.parametrize("order", span_designs.ORDERS)
@pytest.mark.parametrize(("t", "block", "n", "zeros", "spread", "seed"), CASES)
def test_block_design_is_exactly_unbiased(order, t, block, n, zeros, spread, seed):
    """Exact enumeration of the design's distribution (all visiting orders x all offsets):

    - the implementation keeps exactly the reference's units at every enumerated point;
    - P(entry i kept) = P_i exactly, so E[sum_{i kept} f_i / P_i] = sum_i f_i for any f
      (checked in exact rationals for a random f);
    - every outcome keeps within block - 1 entries of the expected size (S10.3 bound).
    """
    pi = proposal(1, t, seed, spread, zeros_at_end=[zeros])
    design = block_design(pi, n, block)
    P, sizes = design.inclusion[0].tolist(), design.sizes[0].tolist()
    f = [Fraction(x) for x in torch.rand(t, generator=gen(seed), dtype=F64).tolist()]
    units = design.units[0].tolist()
    kept_prob = [Fraction(0)] * len(P)
    estimate = Fraction(0)
    expected_size = sum(Fraction(s) * Fraction(p) for s, p in zip(sizes, P))
    for prob, visit, u, kept, width in design_distribution(P, sizes, order):
        assert implementation_at(design.inclusion, visit, u, width) in (kept, None)
        for k in kept:
            kept_prob[k] += prob
        estimate += prob * sum(f[i] / Fraction(P[units[i]]) for i in range(t) if units[i] in kept)
        size = sum(sizes[k] for k in kept)
        assert abs(size - expected_size) < block
    assert kept_prob == [Fraction(p) for p in P]
    assert estimate == sum(f[i] for i in range(t) if units[i] >= 0)


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(2, 11),
    block=st.integers(2, 4),
    zeros=st.integers(0, 2),
    kept_fraction=st.floats(0.05, 0.95),
    seed=st.integers(0, 10**6),
)
def test_block_design_exact_inclusion_property(t, block, zeros, kept_fraction, seed):
    """The same exact enumeration over random small designs, random visiting order: every
    unit's probability of being kept is exactly its P_k and the kept size stays within
    block - 1 of its expectation."""
    pi = proposal(1, t, seed, 2.0, zeros_at_end=[min(zeros, t - 1)])
    eligible = int((pi > 0).sum())
    design = block_design(pi, math.floor(kept_fraction * eligible), block)
    P, sizes = design.inclusion[0].tolist(), design.sizes[0].tolist()
    kept_prob = [Fraction(0)] * len(P)
    expected_size = sum(Fraction(s) * Fraction(p) for s, p in zip(sizes, P))
    for prob, _, _, kept, _ in design_distribution(P, sizes, "random"):
        for k in kept:
            kept_prob[k] += prob
        assert abs(sum(sizes[k] for k in kept) - expected_size) < block
    assert kept_prob == [Fraction(p) for p in P]


@pytest.mark.parametrize(
    ("block", "order"), [(3, "random"), (4, "random"), (4, "position"), (1, "random")]
)
def test_block_design_unbiased_monte_carlo(block, order):
    """Seeded Monte Carlo over N independent rows: the Horvitz-Thompson total
    sum_{i kept} f_i / P_i has mean sum_i f_i within Z of its own standard error (sample
    standard deviation / sqrt N); each entry's keep frequency is within Z binomial standard
    errors of P_i; whole blocks are kept or dropped together."""
    t, n, N = 24, 9, 20000  # 22 entries in the design: blocks of 3 and 4 end short
    pi = proposal(1, t, seed=11, spread=1.0, zeros_at_end=[2])
    f = torch.rand(t, generator=gen(12), dtype=F64) * 3
    design = block_design(pi.expand(N, t), n, block)
    kept = sample_design(design, order, gen(13))
    P = design.entry_inclusion[0]
    free = P > 0
    totals = torch.where(kept, f / torch.where(free, P, 1.0), 0.0).sum(-1)
    se = float(totals.std()) / math.sqrt(N)
    assert abs(float(totals.mean()) - float(f[free].sum())) <= Z * se
    freq = kept.double().mean(0)
    inner = free & (P < 1)
    assert ((freq - P).abs()[inner] <= Z * (P * (1 - P) / N).sqrt()[inner]).all()
    assert (freq[P == 1] == 1).all() and (freq[~free] == 0).all()
    per_unit = torch.zeros(N, design.sizes.shape[1], dtype=torch.int64)
    per_unit.scatter_add_(1, design.units.clamp(min=0), (kept & free).long())
    assert ((per_unit == 0) | (per_unit == design.sizes)).all()
    sizes = kept.sum(-1).double()
    assert ((sizes - n).abs() < block).all()


# ------------------------------------------------------------- visiting order (S10.4)


def test_visit_order_position_draws_nothing_random_is_a_permutation_short_last():
    sizes = torch.tensor([[3, 3, 3, 3, 1, 0], [3, 3, 3, 0, 0, 0], [2, 2, 2, 2, 2, 2]])
    g = gen(0)
    state = g.get_state()
    assert visit_order(sizes, "position", g).tolist() == [list(range(6))] * 3
    assert torch.equal(g.get_state(), state)
    for _ in range(20):
        order = visit_order(sizes, "random", g)
        assert torch.equal(order.sort(-1).values, torch.arange(6).expand(3, 6))
        assert order[0, 4:].tolist() == [4, 5]  # short unit, then padding
        assert sorted(order[1, :3].tolist()) == [0, 1, 2]
    firsts = torch.stack([visit_order(sizes, "random", g)[2, 0] for _ in range(3000)])
    counts = torch.bincount(firsts, minlength=6).double()  # uniform: 1/6 each
    assert ((counts / 3000 - 1 / 6).abs() <= Z * math.sqrt(1 / 6 * 5 / 6 / 3000)).all()


def test_short_block_visited_in_the_middle_would_break_the_bound():
    """Why ``visit_order`` puts the short block last: blocks of sizes 4, 1, 4 with
    P = 5/16, 1/2, 5/16 (expected 3 entries) visited short-in-the-middle keep both full blocks
    (8 entries, off by 5 >= 4) when u < 1/8; visited short-last, at most 5 (off by 2 < 4)."""
    P = torch.tensor([[5 / 16, 1 / 2, 5 / 16]], dtype=F64)
    sizes = [4, 1, 4]
    for visit, worst in (([0, 1, 2], 8), ([0, 2, 1], 5)):
        kept_sizes = [
            sum(
                s
                for s, k in zip(
                    sizes,
                    systematic_sample_ordered(
                        P, torch.tensor([visit]), torch.tensor([u], dtype=F64)
                    )[0].tolist(),
                )
                if k
            )
            for u in (i / 64 + 1 / 128 for i in range(64))
        ]
        assert max(kept_sizes) == worst


@pytest.mark.parametrize("seed", range(3))
def test_random_order_keeps_first_order_inclusion_exactly(seed):
    """S10.4: for a fixed permutation, enumerating the offset gives P(i kept) = P_i exactly
    (pps of entries, unequal P, take-all entries included)."""
    pi = proposal(1, 9, seed, spread=2.0, zeros_at_end=[1])
    design = block_design(pi, 4, 1)
    P = design.inclusion[0].tolist()
    perm = torch.randperm(len(P), generator=gen(seed)).tolist()
    exact = [Fraction(p) for p in P]
    cum = list(itertools.accumulate(exact[k] for k in perm))
    cuts = sorted({Fraction(0), Fraction(1), *(c - math.floor(c) for c in cum)})
    kept_prob = [Fraction(0)] * len(P)
    for lo, hi in itertools.pairwise(cuts):
        u = (lo + hi) / 2
        kept = reference_systematic(exact, perm, u)
        assert implementation_at(design.inclusion, perm, u, hi - lo) in (kept, None)
        for k in kept:
            kept_prob[k] += hi - lo
    assert kept_prob == exact


def span_design(n: int) -> UnitDesign:
    """n entries, uniform proposal, budget n / 2: every P_i = 1/2."""
    design = block_design(torch.full((1, n), 1.0 / n, dtype=F64), n // 2, 1)
    assert (design.inclusion[0, :n] == 0.5).all()
    return design


def test_span_of_three_exact_probability():
    """P(entries 2, 3, 4 all kept), every P_i = 1/2, n = 6 entries, by exact enumeration.

    Position order: 0 (neighbours i, i + 1 with P_i + P_(i+1) = 1 share one unit interval, so
    exactly one of them is kept). Random order: systematic sampling with all P = 1/2 keeps every
    other unit of the visiting order (even or odd places, each with probability 1/2), so all
    three are kept iff they sit at places of the chosen parity: for a uniform permutation of n
    (even) units, C(n/2, 3) / C(n, 3) = (n - 4) / (8 (n - 1)), here 1/20 (1/8 for independent
    Bernoulli(1/2) sampling, the limit n -> inf)."""
    design = span_design(6)
    span = {2, 3, 4}
    for order, expected in (("position", Fraction(0)), ("random", Fraction(2, 8 * 5))):
        total = Fraction(0)
        for prob, visit, u, kept, width in design_distribution([0.5] * 6, [1] * 6, order):
            assert implementation_at(design.inclusion, visit, u, width) == kept
            total += prob * (span <= kept)
        assert total == expected


def test_span_of_three_monte_carlo():
    """The same with n = 16 through ``sample_design``: never under position order, and with
    frequency (n - 4) / (8 (n - 1)) = 1/10 under random order (Z binomial standard errors)."""
    n, N = 16, 20000
    design = span_design(n)
    design = UnitDesign(
        design.units.expand(N, n), design.inclusion.expand(N, -1), design.sizes.expand(N, -1)
    )
    position = sample_design(design, "position", gen(1))
    assert not position[:, 7:10].all(-1).any()
    random = sample_design(design, "random", gen(2))
    assert (random.sum(-1) == n // 2).all()
    p = (n - 4) / (8 * (n - 1))
    freq = float(random[:, 7:10].all(-1).double().mean())
    assert abs(freq - p) <= Z * math.sqrt(p * (1 - p) / N)


# ------------------------------------------------------------- spans (S10.3, units="spans")


def reference_spans(p: list[float], block: int) -> list[int]:
    """Slow reference of ``spans``: walk the eligible entries (p > 0) in position order; a high
    entry (p >= the exact mean over eligible entries) joins the current unit when the previous
    eligible entry was high and the unit holds fewer than ``block`` entries; every other
    eligible entry opens a new unit. -1 for ineligible entries."""
    eligible = [x for x in p if x > 0]
    mean = Fraction(math.fsum(eligible)) / len(eligible) if eligible else 0
    high = [Fraction(x) >= mean for x in eligible]
    units, unit, size, previous_high, rank = [], -1, 0, False, 0
    for x in p:
        if x <= 0:
            units.append(-1)
            continue
        if high[rank] and previous_high and size < block:
            size += 1
        else:
            unit, size = unit + 1, 1
        units.append(unit)
        previous_high, rank = high[rank], rank + 1
    return units


def test_spans_cut_where_the_proposal_drops():
    """Runs of above-average entries are units of at most ``block`` entries (consecutive among
    the eligible ones: the zero at position 6 does not cut the run 5, 7); every other entry is
    its own unit."""
    p = torch.tensor([[1, 3, 3, 3, 1, 2, 0, 2, 1, 3, 3, 3, 3, 1]], dtype=F64)  # mean 29/13
    units, sizes = spans(p, 3)
    assert units[0].tolist() == [0, 1, 1, 1, 2, 3, -1, 4, 5, 6, 6, 6, 7, 8]
    assert sizes[0].tolist() == [1, 3, 1, 1, 1, 1, 3, 1, 1]
    p[0, 5] = p[0, 7] = 2.5  # now above the mean (30/13): one span across the zero
    assert spans(p, 3)[0][0].tolist() == [0, 1, 1, 1, 2, 3, -1, 3, 4, 5, 5, 5, 6, 7]
    assert torch.equal(spans(p, 1)[0], blocks(p > 0, 1)[0])  # block 1: the entries


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=30), min_size=1, max_size=4),
    block=st.integers(1, 6),
)
def test_spans_match_the_reference(rows, block):
    """The vectorised ``spans`` against the walk above, row by row (integer proposals: exact
    means, and ties with the mean are frequent); ``sizes`` count each unit's entries."""
    t = max(len(r) for r in rows)
    p = torch.tensor([r + [0] * (t - len(r)) for r in rows], dtype=F64)
    units, sizes = spans(p, block)
    for i, row in enumerate(p.tolist()):
        expected = reference_spans(row, block)
        assert units[i].tolist() == expected
        counts = [expected.count(k) for k in range(sizes.shape[1])]
        assert sizes[i].tolist() == counts
        assert max(counts) <= block


SPAN_CASES = [  # (proposal, block, n): at most 6 units, so every order is enumerated
    ([1, 4, 4, 4, 1, 1, 3, 3, 1], 3, 3),
    ([1, 4, 4, 4, 1, 1, 3, 3, 1], 2, 4),
    ([2, 5, 5, 1, 5, 5, 5, 0], 3, 2),
    ([1, 1, 9, 9, 9, 9, 1], 2, 3),  # the span of four is cut in two
    ([3, 3, 3, 3, 3, 3], 4, 2),  # all equal: all high, spans of 4 and 2
    ([1, 6, 6, 1, 6, 6], 2, 5),  # take-all units
]


@pytest.mark.parametrize("order", span_designs.ORDERS)
@pytest.mark.parametrize(("p", "block", "n"), SPAN_CASES)
def test_span_design_is_exactly_unbiased(order, p, block, n):
    """Exact enumeration as for blocks (every permutation of the units x every offset): the
    implementation keeps the reference's units, each unit is kept with probability exactly
    P_k, every entry of a kept span is kept (one unit), the Horvitz-Thompson total is exactly
    unbiased, and the expected kept count is the budget."""
    pi = torch.tensor([p], dtype=F64)
    design = block_design(pi, n, block, units="spans")
    assert design.kind == "spans"
    assert design.units[0].tolist() == reference_spans(p, block)
    P, sizes = design.inclusion[0].tolist(), design.sizes[0].tolist()
    units = design.units[0].tolist()
    f = [Fraction(x) for x in torch.rand(len(p), generator=gen(block), dtype=F64).tolist()]
    kept_prob = [Fraction(0)] * len(P)
    estimate, expected_size = Fraction(0), Fraction(0)
    for prob, visit, u, kept, width in design_distribution(P, sizes, order, "spans"):
        assert implementation_at(design.inclusion, visit, u, width) in (kept, None)
        for k in kept:
            kept_prob[k] += prob
        estimate += prob * sum(
            f[i] / Fraction(P[units[i]]) for i in range(len(p)) if units[i] in kept
        )
        expected_size += prob * sum(sizes[k] for k in kept)
    assert kept_prob == [Fraction(x) for x in P]
    assert estimate == sum(f[i] for i in range(len(p)) if units[i] >= 0)
    assert abs(expected_size - n) < 1e-9


def test_span_design_monte_carlo_keeps_spans_whole():
    """Seeded Monte Carlo through ``sample_design`` (random order, a core outside the design):
    keep frequencies within Z binomial standard errors of P_i, spans kept or dropped whole,
    the mean kept count within Z standard errors of the budget."""
    N, n = 20000, 6
    pi = torch.tensor([[1, 2, 8, 8, 8, 8, 8, 1, 2, 1, 7, 7, 1, 30, 1, 2]], dtype=F64)
    core = torch.zeros_like(pi, dtype=torch.bool)
    core[0, 13] = True
    design = block_design(pi.expand(N, -1), n, 4, outside=core.expand(N, -1), units="spans")
    kept = sample_design(design, "random", gen(5))
    P = design.entry_inclusion[0]
    inner = (P > 0) & (P < 1)
    freq = kept.double().mean(0)
    assert ((freq - P).abs()[inner] <= Z * (P * (1 - P) / N).sqrt()[inner]).all()
    assert not kept[:, 13].any()  # the core is outside the design
    assert (kept[:, 2:6].all(-1) == kept[:, 2]).all() and (kept[:, 10] == kept[:, 11]).all()
    sizes = kept.sum(-1).double()
    assert abs(float(sizes.mean()) - n) <= Z * float(sizes.std()) / math.sqrt(N)


def test_span_units_are_visited_in_any_order():
    """``visit_order`` with spans shuffles every non-empty unit (not only the largest)."""
    sizes = torch.tensor([[1, 3, 1, 2, 0]])
    g = gen(3)
    firsts = torch.stack([visit_order(sizes, "random", g, "spans")[0, 0] for _ in range(4000)])
    counts = torch.bincount(firsts, minlength=5).double()
    assert counts[4] == 0
    assert ((counts[:4] / 4000 - 0.25).abs() <= Z * math.sqrt(0.25 * 0.75 / 4000)).all()


# ------------------------------------------------------------------------- core (S10.2)


def test_core_size_is_the_floor_of_the_decimal_fraction():
    assert core_size(0.29, 100) == 29  # the float product is 28.999...
    assert core_size(0.5, 7) == 3 and core_size(1, 7) == 7 and core_size(0.0, 7) == 0
    assert core_size(0.5, 7.6) == 3  # global scope: a real budget
    assert core_size(0.3, torch.tensor([10, 3, 0])).tolist() == [3, 0, 0]
    with pytest.raises(ValueError, match=r"core must be a number in \[0, 1\], got 1.5"):
        core_size(1.5, 3)
    with pytest.raises(ValueError, match="budget must be a non-negative integer tensor"):
        core_size(0.5, torch.tensor([1.5]))


def reference_top(keys: list[float], count: int, eligible: list[bool]) -> set[int]:
    """The ``count`` eligible entries of largest key; ties to the later position."""
    ranked = sorted((i for i in range(len(keys)) if eligible[i]), key=lambda i: (-keys[i], -i))
    return set(ranked[:count])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), t=st.integers(1, 30), ties=st.booleans(), seed=st.integers(0, 10**6))
def test_top_entries_matches_reference(data, t, ties, seed):
    keys = torch.randn(2, t, generator=gen(seed), dtype=F64)
    if ties:
        keys = keys.round()
    eligible = torch.rand(2, t, generator=gen(seed + 1)) < 0.7
    count = torch.tensor([data.draw(st.integers(0, int(e.sum()))) for e in eligible])
    chosen = top_entries(keys, count, eligible)
    for r in range(2):
        expected = reference_top(keys[r].tolist(), int(count[r]), eligible[r].tolist())
        assert set(chosen[r].nonzero().flatten().tolist()) == expected
    everything = top_entries_global(
        [keys[:1], keys[1:]], int(count.sum()), [eligible[:1], eligible[1:]]
    )
    flat = reference_top(keys.flatten().tolist(), int(count.sum()), eligible.flatten().tolist())
    assert set(torch.cat([m.flatten() for m in everything]).nonzero().flatten().tolist()) == flat


# ------------------------------------------------------------------------------ bad input


def test_bad_input_names_the_value():
    pi = proposal(2, 5, 0)
    with pytest.raises(ValueError, match=r"block must be an integer >= 1 .*got 0"):
        block_design(pi, 2, 0)
    with pytest.raises(ValueError, match="pi must be finite and >= 0"):
        block_design(-pi, 2, 1)
    with pytest.raises(ValueError, match=r"pi must be a tensor \[rows, t\]"):
        block_design(pi[0], 2, 1)
    with pytest.raises(ValueError, match="n must be finite and >= 0"):
        block_design(pi, -1, 1)
    with pytest.raises(ValueError, match="order must be one of 'position', 'random'; got 'lifo'"):
        sample_design(block_design(pi, 2, 1), "lifo", gen(0))
    with pytest.raises(ValueError, match=r"generator must be a torch\.Generator"):
        sample_design(block_design(pi, 2, 1), "random", 0)
    P = torch.full((1, 4), 0.5, dtype=F64)
    with pytest.raises(ValueError, match="order must hold a permutation"):
        systematic_sample_ordered(P, torch.tensor([[0, 0, 1, 2]]), torch.tensor([0.5]))
    with pytest.raises(ValueError, match=r"offset must be a tensor \[1\] in \[0, 1\)"):
        systematic_sample_ordered(P, torch.tensor([[0, 1, 2, 3]]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"inclusion probabilities must lie in \[0, 1\]"):
        systematic_sample_ordered(3 * P, torch.tensor([[0, 1, 2, 3]]), torch.tensor([0.5]))
    with pytest.raises(ValueError, match=r"count must be in \[0, eligible entries\]"):
        top_entries(pi, 3, torch.tensor([[True, True, False, False, False]] * 2))
