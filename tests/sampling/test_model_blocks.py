"""Model-wide blocks (S11) against slow references: block scores and selections by loops, the
block pps's inclusion probabilities and draws against the theory (Monte Carlo, tolerances from
the binomial and the CLT)."""

from __future__ import annotations

import math

import pytest
import torch

from probkv.sampling import model_blocks

torch.set_num_threads(1)


def random_pis(layers: int, heads: int, t: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        x = torch.rand(heads, t, generator=gen, dtype=torch.float64) ** 4
        out.append(x / x.sum(-1, keepdim=True))
    return out


def slow_masses(pis, block, aggregate):
    t = pis[0].shape[-1]
    k = math.ceil(t / block)
    out = []
    for b in range(k):
        per_head = []
        for pi in pis:
            for h in range(pi.shape[0]):
                per_head.append(
                    sum(float(pi[h, i]) for i in range(b * block, min(t, b * block + block)))
                )
        out.append(sum(per_head) if aggregate == "sum" else max(per_head))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("aggregate", ["sum", "max"])
@pytest.mark.parametrize(("t", "block"), [(64, 16), (70, 16), (50, 1), (33, 32), (10, 128)])
def test_block_masses_match_loops(aggregate, t, block):
    pis = random_pis(3, 2, t, seed=t + block)
    got = model_blocks.block_masses(pis, block, aggregate)
    torch.testing.assert_close(got, slow_masses(pis, block, aggregate), rtol=1e-12, atol=1e-12)


def test_forced_blocks_any_layer_or_head():
    f1 = torch.zeros(2, 40, dtype=torch.bool)
    f2 = torch.zeros(2, 40, dtype=torch.bool)
    f1[1, 17] = True  # block 1 of 16
    f2[0, 39] = True  # last, short block
    got = model_blocks.forced_blocks([f1, None, f2], 40, 16)
    assert got.tolist() == [False, True, True]


@pytest.mark.parametrize(
    ("budget", "t", "block", "want"),
    [
        (1024, 2048, 16, 64),
        (1024, 2048, 128, 8),
        (1000, 2000, 128, 8),
        (1023, 2046, 32, 32),
        (8, 100, 16, 1),
        (7, 100, 16, 1),
        (100, 100, 16, 6),
        (104, 100, 16, 7),
        (3, 5, 16, 1),
    ],
)
def test_block_budget_rounds_half_up(budget, t, block, want):
    # floor(budget / block + 1/2), at least one block, at most all
    assert model_blocks.block_budget(budget, t, block) == want


def slow_top(mass, forced, k):
    kept = [bool(f) for f in forced]
    rest = max(0, k - sum(kept))
    # highest mass first, ties to the later block
    order = sorted(
        (i for i in range(len(mass)) if not kept[i]), key=lambda i: (-float(mass[i]), -i)
    )
    for i in order[:rest]:
        kept[i] = True
    return kept


@pytest.mark.parametrize("seed", range(6))
def test_top_blocks_match_sorting(seed):
    gen = torch.Generator().manual_seed(seed)
    k_all = 20
    mass = torch.randint(0, 6, (k_all,), generator=gen).double()  # ties on purpose
    forced = torch.rand(k_all, generator=gen) < 0.15
    for k in (1, 5, 12, 20):
        got = model_blocks.top_blocks(mass, forced, k)
        assert got.tolist() == slow_top(mass, forced, k)
        assert int(got.sum()) == max(k, int(forced.sum()))


def slow_inclusion(mass, n):
    """Iterative capping written out: P = min(1, lam M) with sum P = n."""
    P = [0.0] * len(mass)
    capped: set[int] = set()
    while True:
        free = [i for i in range(len(mass)) if i not in capped and mass[i] > 0]
        lam = (n - len(capped)) / sum(mass[i] for i in free)
        newly = [i for i in free if lam * mass[i] >= 1]
        if not newly:
            for i in free:
                P[i] = lam * mass[i]
            for i in capped:
                P[i] = 1.0
            return P
        capped |= set(newly)


@pytest.mark.parametrize("order", ["random", "position"])
@pytest.mark.parametrize("core", [0.0, 0.5])
def test_pps_blocks_inclusion_and_frequencies(order, core):
    """Each block is kept with its P_b: frequencies within 4.5 binomial SDs; P_b matches
    iterative capping; exactly k blocks every draw; forced and core blocks always kept."""
    mass = torch.tensor([5.0, 0.1, 0.3, 2.0, 0.2, 0.05, 1.0, 0.4, 0.6, 0.02, 3.0, 0.7])
    forced = torch.zeros(12, dtype=torch.bool)
    forced[-1] = True
    k = 6
    gen = torch.Generator().manual_seed(7)
    draws = 4000
    counts = torch.zeros(12, dtype=torch.float64)
    first_P = None
    for _ in range(draws):
        kept, P = model_blocks.pps_blocks(mass, forced, k, core=core, order=order, generator=gen)
        assert int(kept.sum()) == k
        assert bool(kept[forced].all())
        first_P = P if first_P is None else first_P
        torch.testing.assert_close(P, first_P)  # the design does not depend on the draw
        counts += kept.double()
    core_n = math.floor(core * (k - 1))
    sure = forced.clone()
    if core_n:
        sure[torch.argsort(torch.where(forced, -1.0, mass.double()), descending=True)[:core_n]] = (
            True
        )
    free_mass = [0.0 if sure[i] else float(mass[i]) for i in range(12)]
    want = slow_inclusion(free_mass, k - int(sure.sum()))
    want = torch.tensor([1.0 if sure[i] else want[i] for i in range(12)], dtype=torch.float64)
    torch.testing.assert_close(first_P, want, rtol=1e-9, atol=1e-12)
    freq = counts / draws
    sd = (want * (1 - want) / draws).sqrt()
    assert bool(((freq - want).abs() <= 4.5 * sd + 1e-12).all()), (freq, want)


def test_pps_horvitz_thompson_totals_unbiased():
    """sum over kept blocks of x_b / P_b is unbiased for sum x_b (S9): the Monte Carlo mean
    within 4.5 standard errors (the sample SD over sqrt(draws), CLT)."""
    gen = torch.Generator().manual_seed(3)
    mass = torch.rand(30, generator=gen, dtype=torch.float64) ** 3 + 1e-3
    x = torch.rand(30, generator=gen, dtype=torch.float64) * mass.sqrt()  # a head's values
    forced = torch.zeros(30, dtype=torch.bool)
    forced[:2] = True
    totals = []
    for _ in range(3000):
        kept, P = model_blocks.pps_blocks(mass, forced, 10, core=0.0, order="random", generator=gen)
        totals.append(float((torch.where(kept, x / P, 0.0)).sum()))
    t = torch.tensor(totals, dtype=torch.float64)
    se = t.std() / math.sqrt(t.numel())
    assert abs(float(t.mean()) - float(x.sum())) <= 4.5 * float(se)


@pytest.mark.parametrize("bad", [0, -16, 1.5, "16", True, None])
def test_bad_block_sizes_refused(bad):
    with pytest.raises(ValueError, match="block must be an integer >= 1"):
        model_blocks.num_blocks(100, bad)


def test_bad_aggregate_refused():
    with pytest.raises(ValueError, match="aggregate must be one of 'sum', 'max'"):
        model_blocks.block_masses(random_pis(1, 1, 8, 0), 4, "mean")


def slow_protected(t, block, k, sink_blocks, recent_tokens):
    """Loops: the first blocks, then the blocks holding one of the last ``recent_tokens``
    positions, from the end, ``k`` blocks at most."""
    n = math.ceil(t / block)
    chosen = list(range(min(sink_blocks, k, n)))
    for b in reversed(range(n)):
        positions = range(b * block, min(t, (b + 1) * block))
        if any(i >= t - recent_tokens for i in positions) and b not in chosen and len(chosen) < k:
            chosen.append(b)
    return sorted(chosen)


@pytest.mark.parametrize("t", [1, 15, 16, 17, 100, 257])
@pytest.mark.parametrize("block", [1, 16, 32])
@pytest.mark.parametrize("sink_blocks", [0, 1, 3])
@pytest.mark.parametrize("recent_tokens", [0, 1, 16, 40, 1000])
def test_protected_blocks_match_loops(t, block, sink_blocks, recent_tokens):
    n = model_blocks.num_blocks(t, block)
    for k in sorted({1, 2, n // 2 or 1, n}):
        got = model_blocks.protected_blocks(
            t, block, k, sink_blocks=sink_blocks, recent_tokens=recent_tokens
        )
        assert got.shape == (n,)
        assert torch.nonzero(got).flatten().tolist() == slow_protected(
            t, block, k, sink_blocks, recent_tokens
        )
        assert int(got.sum()) <= k  # counted in the budget
