"""scheduler.cost_model against hand-computed values: tau, cost curves, speedup, the best draft length
and the concurrency at which speculation stops paying."""

from __future__ import annotations

import pytest

from tandem.scheduler.cost_model import (
    CostCurve,
    best_k,
    break_even_batch,
    expected_tau,
    expected_tau_uniform,
    no_draft_cost,
    speedup,
)


def test_expected_tau_by_hand():
    # 1 (the bonus/recovered token) + P(d1 passes) + P(d1 and d2 pass) + ...
    assert expected_tau([0.8, 0.5], 0) == 1.0
    assert expected_tau([0.8, 0.5], 1) == pytest.approx(1.8)
    assert expected_tau([0.8, 0.5], 2) == pytest.approx(1 + 0.8 + 0.4)
    assert expected_tau([0.8, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)  # past the profile: its last value
    assert expected_tau([], 5) == 1.0
    assert expected_tau([1.0, 1.0, 0.0, 1.0], 4) == 3.0  # nothing passes after a certain rejection
    with pytest.raises(ValueError, match="k must be >= 0"):
        expected_tau([0.5], -1)


@pytest.mark.parametrize("alpha, k, tau", [
    (0.7, 3, 2.533), (0.7, 10, 3.267), (0.4, 3, 1.624), (0.4, 7, 1.666),  # docs/algorithms.md section 0
    (0.5, 1, 1.5), (0.5, 2, 1.75), (0.0, 4, 1.0), (1.0, 4, 5.0),
])
def test_expected_tau_uniform_by_hand(alpha, k, tau):
    assert expected_tau_uniform(alpha, k) == pytest.approx(tau, abs=5e-3)
    assert expected_tau([alpha], k) == pytest.approx(expected_tau_uniform(alpha, k))


def test_expected_tau_uniform_rejects_bad_alpha():
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="alpha must be in"):
            expected_tau_uniform(bad, 3)


def test_cost_curve_interpolates_and_extrapolates():
    curve = CostCurve.from_points({4: 2.5, 1: 1.0, 2: 1.5})
    assert curve.sizes == (1, 2, 4)
    assert curve(1) == 1.0 and curve(2) == 1.5 and curve(4) == 2.5
    assert curve(3) == pytest.approx(2.0)  # linear between measured sizes
    assert curve(6) == pytest.approx(2.5 + 0.5 * 2)  # slope of the last two points beyond them
    assert curve.as_points() == {1: 1.0, 2: 1.5, 4: 2.5}
    assert CostCurve((2,), (0.4,))(1) == 0.4 and CostCurve((2,), (0.4,))(6) == pytest.approx(1.2)
    with pytest.raises(ValueError, match=">= 1 token"):
        curve(0)


@pytest.mark.parametrize("sizes, seconds, match", [
    ((1, 2), (1.0,), "one time per size"),
    ((2, 1), (1.0, 1.0), "increasing"),
    ((0, 1), (1.0, 1.0), ">= 1"),
    ((1, 2), (1.0, -1.0), "positive"),
    ((1,), (float("nan"),), "positive"),
])
def test_cost_curve_validation(sizes, seconds, match):
    with pytest.raises(ValueError, match=match):
        CostCurve(sizes, seconds)


def gentle() -> CostCurve:
    """c(n) = 1 + 0.2 (n - 1): each extra verified token costs a fifth of a forward."""
    return CostCurve.from_points({n: 1 + 0.2 * (n - 1) for n in (1, 2, 4, 8, 16)})


def test_speedup_by_hand():
    curve = CostCurve.from_points({1: 1.0, 3: 2.0})
    assert speedup(2.2, 2, 1, curve) == pytest.approx(2.2 / 2.0)
    assert speedup(2.2, 2, 1, curve, lambda k, b: 0.1 * k * b) == pytest.approx(2.2 / 2.2)
    assert speedup(1.5, 0, 1, curve) == 1.0  # k = 0 is plain decoding
    # At batch 2 the plain step costs c(2) and the speculative one c(2 * 3) = c(6) (extrapolated: 3.5).
    assert speedup(2.2, 2, 2, curve) == pytest.approx(2.2 * 1.5 / 3.5)
    assert no_draft_cost(5, 3) == 0.0


def test_best_k_on_a_gentle_curve():
    # a = 0.6: k = 1: 1.6 / 1.2 = 1.333, k = 2: 1.96 / 1.4 = 1.4, k = 3: 2.176 / 1.6 = 1.36 -> k = 2.
    assert best_k([0.6], gentle(), k_max=8) == (2, pytest.approx(1.4))
    # A cliff after two good positions: k = 2 (2.71 / 1.4 = 1.936) beats k = 3 (2.791 / 1.6 = 1.744).
    assert best_k([0.9, 0.9, 0.1], gentle(), k_max=8) == (2, pytest.approx(2.71 / 1.4))
    # Drafting cost pulls k down: 0.3 per token -> k = 1: 1.6 / 1.5 = 1.067, k = 2: 1.96 / 2.0 = 0.98.
    assert best_k([0.6], gentle(), k_max=8, draft_cost=lambda k, b: 0.3 * k * b) == (1, pytest.approx(1.6 / 1.5))
    # k_max caps the search.
    assert best_k([0.99], gentle(), k_max=3)[0] == 3


def test_best_k_extremes():
    flat = CostCurve.from_points({1: 1.0, 64: 1.0})  # memory-bound: verification is free
    assert best_k([0.9], flat, k_max=6) == (6, pytest.approx(expected_tau_uniform(0.9, 6)))
    linear = CostCurve.from_points({1: 1.0, 2: 2.0, 64: 64.0})  # compute-bound: cost grows with tokens
    assert best_k([0.95], linear, k_max=6) == (0, 1.0)  # tau(k) < k + 1 always: never pays
    assert best_k([0.0], flat, k_max=6) == (0, 1.0)  # nothing is ever accepted


def test_break_even_batch_by_hand():
    """c(n) = 1 up to 8 tokens, then n / 8. With a = 0.6 and k = 1 (tau 1.6), batch B pays while
    c(2B) / c(B) < 1.6: B = 6 gives 1.5 (pays), B = 7 gives 1.75 and k = 2 gives 2.625 (neither does)."""
    curve = CostCurve.from_points({1: 1.0, 8: 1.0, 16: 2.0})
    assert best_k([0.6], curve, batch=6, k_max=4)[0] == 1
    assert best_k([0.6], curve, batch=7, k_max=4)[0] == 0
    assert break_even_batch([0.6], curve, k_max=4) == 7
    # Better acceptance keeps speculation paying to larger batches.
    assert break_even_batch([0.9], curve, k_max=4) > 7
    # Compute-bound from the first token: it never pays, even alone.
    assert break_even_batch([0.6], CostCurve.from_points({1: 1.0, 2: 2.0}), k_max=4) == 1
    # Free verification at every size checked: None (it pays up to max_batch).
    assert break_even_batch([0.6], CostCurve.from_points({1: 1.0, 4096: 1.0}), k_max=4, max_batch=16) is None


def test_fastest_of_settles_a_size_after_a_larger_one():
    """A simulated machine whose forwards run slow for a few calls after a long one (as on a
    Xeon whose L3 shares the weights with other tenants): with `size` the small sizes are timed
    settled; without it the smallest size only ever runs right after the largest and reads slow."""
    from tandem.model.cost import SETTLE_RUNS, fastest_of

    now = [0.0]
    state = {"slow_calls": 0}

    def clock():
        return now[0]

    def forward(n):
        now[0] += n * (2.0 if state["slow_calls"] else 1.0)
        state["slow_calls"] = max(0, state["slow_calls"] - 1)
        if n >= 8:
            state["slow_calls"] = SETTLE_RUNS - 1

    sizes = (1, 2, 4, 8)
    unsettled = fastest_of(forward, sizes, repeats=3, clock=clock)
    assert unsettled[1] == 2.0  # always measured in the slow spell after size 8
    settled = fastest_of(forward, sizes, repeats=3, clock=clock, size=int)
    assert settled == {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}
