"""KVEviction hardness (S8): exact solvers agree, the Partition reduction decides Partition."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probkv.budgets.hardness import (
    decide_partition,
    kept_count,
    partition_brute_force,
    partition_instance,
    solve_kv_eviction_brute_force,
    solve_kv_eviction_meet_in_the_middle,
)

torch.set_num_threads(1)


def random_instance(n: int, d: int, d_v: int, seed: int, spread: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(d, generator=g, dtype=torch.float64) * spread
    k = torch.randn(n, d, generator=g, dtype=torch.float64)
    v = torch.randn(n, d_v, generator=g, dtype=torch.float64)
    return q, k, v


def plain_error(q, k, v, subset, scale=1.0, ord=math.inf) -> float:
    """Equation 4 of the paper for one subset, one softmax at a time."""
    idx = list(subset)
    full = torch.softmax(scale * (k @ q), 0) @ v
    part = torch.softmax(scale * (k[idx] @ q), 0) @ v[idx]
    return float(torch.linalg.vector_norm(part - full, ord=ord))


# ---------------------------------------------------------------------------------------------
# Exact solvers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ord", [math.inf, 1, 2])
def test_brute_force_is_the_minimum_over_a_plain_loop(ord):
    for seed in range(8):
        n, d, d_v = 6, 3, 4
        q, k, v = random_instance(n, d, d_v, seed)
        for kept in range(1, n + 1):
            sol = solve_kv_eviction_brute_force(q, k, v, kept, scale=0.7, ord=ord)
            errors = {
                c: plain_error(q, k, v, c, scale=0.7, ord=ord)
                for c in itertools.combinations(range(n), kept)
            }
            assert len(sol.kept_indices) == kept
            assert sol.error == pytest.approx(min(errors.values()), rel=1e-12, abs=1e-15)
            assert errors[sol.kept_indices] == pytest.approx(sol.error, rel=1e-12, abs=1e-15)


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 12),
    d=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
    kept_frac=st.floats(0.01, 1.0),
    spread=st.sampled_from([0.1, 1.0, 4.0]),
)
def test_meet_in_the_middle_agrees_with_brute_force(n, d, seed, kept_frac, spread):
    q, k, v = random_instance(n, d, 1, seed, spread)
    kept = max(1, math.ceil(kept_frac * n))
    bf = solve_kv_eviction_brute_force(q, k, v, kept)
    mitm = solve_kv_eviction_meet_in_the_middle(q, k, v, kept)
    assert len(mitm.kept_indices) == kept == len(set(mitm.kept_indices))
    # Same optimum (float64 round-off of a few softmaxes: far below 1e-9 relative).
    assert mitm.error == pytest.approx(bf.error, rel=1e-9, abs=1e-13)
    # The reported error is the true error of the returned set.
    assert plain_error(q, k, v, mitm.kept_indices) == pytest.approx(
        mitm.error, rel=1e-12, abs=1e-15
    )


def test_optimal_error_is_no_worse_than_top_k_attention():
    # The solver is a ground truth for policies: top-k by attention weight is one feasible set.
    for seed in range(10):
        q, k, v = random_instance(10, 4, 1, seed, spread=2.0)
        attention = torch.softmax(k @ q, 0)
        for kept in (2, 5, 8):
            top = sorted(torch.topk(attention, kept).indices.tolist())
            sol = solve_kv_eviction_meet_in_the_middle(q, k, v, kept)
            assert sol.error <= plain_error(q, k, v, top) + 1e-15


def test_keeping_everything_is_exact():
    q, k, v = random_instance(7, 2, 3, 0)
    sol = solve_kv_eviction_brute_force(q, k, v, 7)
    assert sol.kept_indices == tuple(range(7)) and sol.error < 1e-15
    q1, k1, v1 = random_instance(7, 2, 1, 0)
    assert solve_kv_eviction_meet_in_the_middle(q1, k1, v1, 7).error < 1e-15


def test_meet_in_the_middle_reaches_sizes_brute_force_refuses():
    # A yes-instance of size 28 (C(28, 14) = 4e7 subsets): the first 14 values and the last 14
    # have equal sums by construction, so the optimal error is exactly 0.
    g = torch.Generator().manual_seed(7)
    side_a = torch.randint(1, 1000, (14,), generator=g).tolist()
    side_b = torch.randint(1, 1000, (13,), generator=g).tolist()
    side_b.append(sum(side_a) - sum(side_b))
    values = side_a + side_b
    inst = partition_instance(values)
    with pytest.raises(ValueError, match="brute-force limit"):
        solve_kv_eviction_brute_force(inst.query, inst.key, inst.value, inst.kept)
    sol = solve_kv_eviction_meet_in_the_middle(inst.query, inst.key, inst.value, inst.kept)
    assert sol.error < 1 / (2 * 28)
    assert 2 * sum(values[i] for i in sol.kept_indices) == sum(values)
    assert decide_partition(values)


# ---------------------------------------------------------------------------------------------
# The Partition reduction (Appendix B)
# ---------------------------------------------------------------------------------------------


def test_partition_instance_is_the_papers_construction():
    inst = partition_instance([3, 1, 1, 2, 2, 1])
    assert inst.query.tolist() == [1.0]  # d = 1, Q = 1
    assert inst.key.tolist() == [[1.0]] * 6  # K = 1
    assert inst.value.flatten().tolist() == [3.0, 1.0, 1.0, 2.0, 2.0, 1.0]
    assert inst.kept == kept_count(6, 0.5) == 3  # |I| = floor(n r), r = 1/2
    odd = partition_instance([1, 2, 3])
    assert odd.value.flatten().tolist() == [1.0, 2.0, 3.0, 0.0] and odd.kept == 2


YES = [[1, 1, 2, 2], [3, 1, 1, 2, 2, 1], [1, 2, 3], [0], [5, 5], [-2, 1, 3, 0], [7, 7, 7, 7]]
NO = [[1, 2, 4, 8], [1, 1, 1, 2], [2, 2, 2, 1, 1, 1, 2], [1, 1, 1, 3], [5], [1, 2]]


@pytest.mark.parametrize("method", ["brute_force", "meet_in_the_middle"])
@pytest.mark.parametrize("values", YES)
def test_yes_instances_map_to_yes(values, method):
    assert partition_brute_force(values)
    assert decide_partition(values, method=method)


@pytest.mark.parametrize("method", ["brute_force", "meet_in_the_middle"])
@pytest.mark.parametrize("values", NO)
def test_no_instances_map_to_no(values, method):
    # [1, 1, 1, 2] and [2, 2, 2, 1, 1, 1, 2] have odd sums; [1, 1, 1, 3] splits into equal sums
    # only with unequal sizes ({3} vs {1, 1, 1}), which the paper's Partition does not allow.
    assert not partition_brute_force(values)
    assert not decide_partition(values, method=method)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(-20, 40), min_size=1, max_size=11))
def test_reduction_decides_partition_on_random_instances(values):
    truth = partition_brute_force(values)
    assert decide_partition(values, method="meet_in_the_middle") == truth
    assert decide_partition(values, method="brute_force") == truth


def test_decision_survives_large_values():
    # Values near the 2^31 limit: the 1 / (2n) threshold still separates yes from no.
    big = 2**31
    assert decide_partition([big, big - 1, 1, 0])  # {big, 0} vs {big - 1, 1}
    assert not decide_partition([big, big - 1, 2, 0])  # sums differ by 1 at best


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ([1, 2.5], r"values\[1\] must be an integer"),
        ([True, 1], r"values\[0\] must be an integer"),
        ("12", "sequence of integers"),
        ([], "empty"),
        ([2**31 + 1, 1], "2\\^31"),
    ],
)
def test_partition_bad_input(values, match):
    with pytest.raises(ValueError, match=match):
        decide_partition(values)


def test_decide_partition_unknown_method():
    with pytest.raises(ValueError, match="method must be 'brute_force' or 'meet_in_the_middle'"):
        decide_partition([1, 1], method="greedy")


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (
            (torch.ones(2), torch.ones(4, 2), torch.ones(4, 1), 0),
            {},
            r"kept must be .* \[1, n = 4\]",
        ),
        ((torch.ones(2), torch.ones(4, 2), torch.ones(4, 1), 5), {}, r"kept must be"),
        ((torch.ones(3), torch.ones(4, 2), torch.ones(4, 1), 2), {}, "query has d = 3"),
        ((torch.ones(2), torch.ones(4, 2), torch.ones(3, 1), 2), {}, "value has 3 rows"),
        (
            (torch.ones(2, 1), torch.ones(4, 2), torch.ones(4, 1), 2),
            {},
            r"query must be a tensor \[d\]",
        ),
        ((torch.ones(2), torch.ones(0, 2), torch.ones(0, 1), 1), {}, "n = 0"),
        (
            (torch.ones(2), torch.full((4, 2), math.nan), torch.ones(4, 1), 2),
            {},
            "key must be finite",
        ),
        ((torch.ones(2), torch.ones(4, 2), torch.ones(4, 1), 2), {"ord": 3}, "ord must be"),
    ],
)
def test_brute_force_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        solve_kv_eviction_brute_force(*args, **kwargs)


def test_meet_in_the_middle_bad_input():
    with pytest.raises(ValueError, match="d_v = 2"):
        solve_kv_eviction_meet_in_the_middle(torch.ones(2), torch.ones(4, 2), torch.ones(4, 2), 2)
    with pytest.raises(ValueError, match="n = 33 exceeds"):
        solve_kv_eviction_meet_in_the_middle(torch.ones(1), torch.ones(33, 1), torch.ones(33, 1), 3)


@pytest.mark.parametrize(("n", "r"), [(0, 0.5), (4, 0.0), (4, 1.5), (4, math.nan), (2.0, 0.5)])
def test_kept_count_bad_input(n, r):
    with pytest.raises(ValueError, match="must be"):
        kept_count(n, r)
