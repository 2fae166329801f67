"""Calibrated weights (S9, ``probkv.estimation.calibration``) against slow, obviously correct references.

- The quadratic form equals the objective written as a loop over the reference rows.
- The solver against brute force over every set of entries at the bound (tiny problems), and
  its optimality conditions on larger ones.
- The limits the docs claim: nothing evicted keeps every weight at 1; a huge ridge gives the
  design weights back; the fit of the reference rows is never worse than the design's.
- What it is for: on held-out queries from the reference queries' distribution, calibrated
  pps weights give a lower attention error than the Horvitz-Thompson weights in most draws
  (a sign test against "no difference").
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probkv.estimation import calibration as cal
from probkv.estimation.calibration import (
    W_MIN,
    calibrate_head,
    calibrated_selection,
    calibration_system,
    reference_stride,
    solve_calibration,
)
from probkv.estimation.selection import RaggedSelection
from probkv.sampling import pps_inclusion_probabilities, systematic_sample

torch.set_num_threads(1)


def problem(seed: int, t: int = 40, d: int = 8, rows: int = 12, n: int = 15, spread: float = 1.5):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(t, d, generator=g, dtype=torch.float64)
    value = torch.randn(t, d, generator=g, dtype=torch.float64)
    queries = spread * torch.randn(rows, d, generator=g, dtype=torch.float64)
    probs = torch.softmax(queries @ key.T / math.sqrt(d), -1)
    kept = torch.randperm(t, generator=g)[:n].sort().values
    design = 1.0 + 4.0 * torch.rand(n, generator=g, dtype=torch.float64)
    return key, value, queries, probs, kept, design


def data_term_by_rows(probs, values, kept, w) -> float:
    """The module docstring's data term, one reference row at a time."""
    rows, t = probs.shape
    total, spread = 0.0, 0.0
    outputs = []
    for u in range(rows):
        o = sum(probs[u, i] * values[i] for i in range(t))
        outputs.append(o)
        spread += sum(float(probs[u, i] * (values[i] - o).pow(2).sum()) for i in range(t))
    spread /= rows
    for u in range(rows):
        mass = sum(float(w[j] * probs[u, i]) for j, i in enumerate(kept.tolist()))
        err = sum(
            w[j] * probs[u, i] * (values[i] - outputs[u]) for j, i in enumerate(kept.tolist())
        )
        total += (mass - 1.0) ** 2 + float(err.pow(2).sum()) / spread
    return total / rows


def objective(Q, q, design, rho, t, w) -> float:
    return float(w @ Q @ w - 2 * q @ w + 1 + (rho / t) * ((w - design) ** 2 / design).sum())


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 12))
def test_quadratic_form_equals_the_objective_row_by_row(seed, n):
    _, value, _, probs, kept, _ = problem(seed, t=16, rows=5, n=n)
    Q, q = calibration_system(probs, value, kept)
    torch.testing.assert_close(Q, Q.T, rtol=0, atol=1e-15)
    w = torch.rand(kept.numel(), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    w = 3 * w
    got = float(w @ Q @ w - 2 * q @ w + 1)
    assert got == pytest.approx(data_term_by_rows(probs, value, kept, w), rel=1e-9, abs=1e-12)


def brute_force(Q, q, design, rho, t) -> torch.Tensor:
    """Every subset B of entries held at W_MIN: solve the rest exactly, keep the feasible
    solution of least objective (the minimiser of a strictly convex quadratic over a box is
    one of them)."""
    n = design.numel()
    lam = rho / t
    hessian = 2 * Q + torch.diag(2 * lam / design)
    linear = 2 * q + 2 * lam
    best, best_value = None, math.inf
    for size in range(n + 1):
        for bound in itertools.combinations(range(n), size):
            w = torch.full((n,), W_MIN, dtype=torch.float64)
            free = [i for i in range(n) if i not in bound]
            if free:
                f = torch.tensor(free)
                b = torch.tensor(bound, dtype=torch.int64)
                rhs = linear[f] - hessian[f][:, b] @ w[b]
                w[f] = torch.linalg.solve(hessian[f][:, f], rhs)
            if (w < W_MIN - 1e-15).any():
                continue
            value = objective(Q, q, design, rho, t, w)
            if value < best_value:
                best, best_value = w, value
    return best


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 6),
    rho=st.sampled_from([1e-4, 1e-2, 1.0, 100.0]),
)
def test_solver_equals_brute_force_over_the_active_sets(seed, n, rho):
    _, value, _, probs, kept, design = problem(seed, t=20, rows=6, n=n, spread=3.0)
    design = design * 10  # large design weights push the fit onto the bound
    Q, q = calibration_system(probs, value, kept)
    got = solve_calibration(Q, q, design, rho, 20)
    want = brute_force(Q, q, design, rho, 20)
    assert objective(Q, q, design, rho, 20, got) <= objective(Q, q, design, rho, 20, want) + 1e-12
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)


def test_the_bound_is_reached_and_the_optimality_conditions_hold():
    """Problems with weights at the bound: gradient zero off the bound, non-negative on it;
    the projected-gradient path (the solver's fallback) reaches no lower objective."""
    hits = 0
    for seed in range(40):
        _, value, _, probs, kept, design = problem(seed, t=60, rows=20, n=30, spread=3.0)
        Q, q = calibration_system(probs, value, kept)
        design = design * 20
        w = solve_calibration(Q, q, design, 1e-4, 60)
        lam = 1e-4 / 60
        hessian = 2 * Q + torch.diag(2 * lam / design)
        linear = 2 * q + 2 * lam
        grad = hessian @ w - linear
        at_bound = w <= W_MIN
        hits += int(at_bound.any())
        scale = float(linear.abs().max())
        assert float(grad[~at_bound].abs().max()) <= 1e-6 * scale
        if at_bound.any():
            assert float(grad[at_bound].min()) >= -1e-6 * scale
            slow = cal._projected_gradient(hessian, linear, design.clone())
            assert (slow >= W_MIN).all()
            best = objective(Q, q, design, 1e-4, 60, w)
            assert best <= objective(Q, q, design, 1e-4, 60, slow) + 1e-12
            assert objective(Q, q, design, 1e-4, 60, slow) - best <= 1e-4 * abs(best)
    assert hits >= 5  # the bound is really exercised


def test_nothing_evicted_keeps_every_weight_at_one():
    _, value, _, probs, _, _ = problem(3, t=30, rows=10)
    kept = torch.arange(30)
    Q, q = calibration_system(probs, value, kept)
    w = solve_calibration(Q, q, torch.ones(30, dtype=torch.float64), 0.01, 30)
    torch.testing.assert_close(w, torch.ones(30, dtype=torch.float64), rtol=0, atol=1e-9)


def test_a_huge_ridge_gives_the_design_weights_back():
    _, value, _, probs, kept, design = problem(4)
    Q, q = calibration_system(probs, value, kept)
    w = solve_calibration(Q, q, design, 1e12, 40)
    torch.testing.assert_close(w, design, rtol=1e-6, atol=0)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), rho=st.sampled_from([1e-3, 0.1, 10.0]))
def test_calibration_never_fits_the_reference_rows_worse_than_the_design(seed, rho):
    """J(w*) <= J(d) and the ridge is 0 at d, so the data term at w* is at most the design's."""
    _, value, _, probs, kept, design = problem(seed)
    Q, q = calibration_system(probs, value, kept)
    w = solve_calibration(Q, q, design, rho, 40)
    fit = float(w @ Q @ w - 2 * q @ w + 1)
    assert fit <= float(design @ Q @ design - 2 * q @ design + 1) + 1e-12


def held_out_error(key, value, queries, kept, log_weights) -> float:
    """Mean |error| of the corrected attention (S4: softmax of logits + log w over the kept
    entries) against the full attention, over the queries."""
    logits = queries @ key.T / math.sqrt(key.shape[1])
    exact = torch.softmax(logits, -1) @ value
    est = torch.softmax(logits[:, kept] + log_weights, -1) @ value[kept]
    return float((est - exact).abs().mean())


def test_calibrated_weights_beat_horvitz_thompson_on_held_out_queries():
    """Keys in clusters, queries from one distribution: 64 reference queries calibrate the
    weights of a pps sample, 64 other queries from the same distribution measure the error.
    Under "calibration does not help", each draw is a coin flip; 40 draws, at least 32 wins
    has probability 1.1e-4 (binomial), so the test fails only if the claim is false or by a
    one-in-ten-thousand accident."""
    wins = 0
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        t, d = 200, 16
        centres = torch.randn(8, d, generator=g, dtype=torch.float64) * 1.5
        key = centres[torch.randint(0, 8, (t,), generator=g)] + 0.5 * torch.randn(
            t, d, generator=g, dtype=torch.float64
        )
        value = torch.randn(t, d, generator=g, dtype=torch.float64)
        direction = torch.randn(d, generator=g, dtype=torch.float64)
        queries = direction + 1.2 * torch.randn(128, d, generator=g, dtype=torch.float64)
        reference, held_out = queries[:64], queries[64:]
        probs = torch.softmax(reference @ key.T / math.sqrt(d), -1)
        pi = probs.mean(0, keepdim=True)
        inclusion = pps_inclusion_probabilities(pi, torch.tensor([40]))
        kept = systematic_sample(inclusion, g)[0].nonzero().squeeze(-1)
        design = 1.0 / inclusion[0, kept]
        w = calibrate_head(
            reference, key, value, kept, design, scale=1 / math.sqrt(d), strength=0.01
        )
        ht = held_out_error(key, value, held_out, kept, design.log())
        calibrated = held_out_error(key, value, held_out, kept, w.log())
        wins += int(calibrated < ht)
    assert sum(math.comb(40, k) for k in range(32, 41)) / 2**40 < 1.2e-4
    assert wins >= 32


def test_a_selection_is_calibrated_head_by_head_with_its_query_group():
    g = torch.Generator().manual_seed(5)
    hkv, group, t, d = 2, 3, 25, 8
    key = torch.randn(hkv, t, d, generator=g)
    value = torch.randn(hkv, t, d, generator=g)
    queries = torch.randn(hkv * group, 7, d, generator=g)
    kept = [torch.tensor([0, 3, 4, 9, 20]), torch.tensor([], dtype=torch.int64)]
    logw = [torch.log(torch.tensor([1.0, 2.0, 3.0, 1.5, 4.0])), torch.zeros(0)]
    selection = RaggedSelection.from_index_lists(kept, logw)
    out = calibrated_selection(selection, key, value, queries, scale=0.3, strength=0.05)
    assert torch.equal(out.indices, selection.indices)
    assert torch.equal(out.lengths, selection.lengths)
    want = calibrate_head(
        queries[:group].reshape(-1, d),
        key[0],
        value[0],
        kept[0],
        logw[0].double().exp(),
        scale=0.3,
        strength=0.05,
    )
    torch.testing.assert_close(out.head(0)[1], want.log().float())
    assert out.head(1)[1].numel() == 0
    # without weights the design is 1 everywhere (a top-k set)
    plain = RaggedSelection.from_index_lists(kept)
    top = calibrated_selection(plain, key, value, queries, scale=0.3, strength=0.05)
    assert top.log_weights is not None and torch.isfinite(top.log_weights).all()


@pytest.mark.parametrize("strength", [0, -1.0, float("nan"), True, "0.1"])
def test_bad_strengths_are_refused_by_name(strength):
    with pytest.raises(ValueError, match="calibrate must be a number > 0"):
        cal.check_strength(strength)


def test_bad_shapes_are_refused():
    key = torch.randn(2, 10, 4)
    selection = RaggedSelection.from_index_lists([torch.tensor([1, 2]), torch.tensor([3])])
    with pytest.raises(ValueError, match="reference_queries must be"):
        calibrated_selection(
            selection, key, key, torch.randn(3, 5, 4), scale=0.5, strength=0.1
        )  # 3 query heads for 2 KV heads
    with pytest.raises(ValueError, match="key and value must be"):
        calibrated_selection(
            selection, key, key[:, :5], torch.randn(2, 5, 4), scale=0.5, strength=0.1
        )
    far = RaggedSelection.from_index_lists([torch.tensor([1, 12]), torch.tensor([3])])
    with pytest.raises(ValueError, match="beyond the 10 entries"):
        calibrated_selection(far, key, key, torch.randn(2, 5, 4), scale=0.5, strength=0.1)
    with pytest.raises(ValueError, match="design weights must be finite"):
        solve_calibration(torch.eye(2), torch.ones(2), torch.tensor([1.0, 0.0]), 0.1, 4)


def test_reference_stride_keeps_about_the_asked_rows():
    assert reference_stride(2000, 128) == 16  # 125 rows
    assert reference_stride(100, 128) == 1
    assert reference_stride(129, 128) == 2
    with pytest.raises(ValueError, match="total_rows"):
        reference_stride(0)
