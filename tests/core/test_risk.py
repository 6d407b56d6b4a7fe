"""Clopper–Pearson bounds, risk-controlled thresholds and the agreement monitor (prepos.risk)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from prepos.risk import (
    DEFAULT_GRID,
    AgreementMonitor,
    binomial_cdf,
    clopper_pearson_interval,
    clopper_pearson_upper,
    select_threshold,
)


def exact_cdf(k: int, n: int, p: Fraction) -> Fraction:
    return sum(Fraction(math.comb(n, i)) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


@pytest.mark.parametrize(("k", "n", "alpha", "expected"), [
    # One-sided upper limits from standard binomial tables (Clopper–Pearson, exact).
    (0, 10, 0.05, 0.2589),
    (0, 100, 0.05, 0.0295),
    (5, 100, 0.05, 0.1023),
    (1, 20, 0.05, 0.2161),
    (0, 30, 0.10, 0.0739),
    # Two-sided 95% interval 5/100 has upper 0.1128 = one-sided at alpha 0.025.
    (5, 100, 0.025, 0.1128),
])
def test_upper_bound_matches_tables(k, n, alpha, expected):
    assert clopper_pearson_upper(k, n, alpha) == pytest.approx(expected, abs=5e-5)


@pytest.mark.parametrize(("k", "n", "alpha"), [(0, 7, 0.1), (3, 40, 0.05), (12, 150, 0.01), (19, 20, 0.2)])
def test_upper_bound_solves_the_exact_binomial_tail(k, n, alpha):
    bound = clopper_pearson_upper(k, n, alpha)
    # Independent check in exact rational arithmetic: the tail at the bound is alpha, and it crosses there.
    at = exact_cdf(k, n, Fraction(bound))
    assert float(at) == pytest.approx(alpha, rel=1e-6)
    assert exact_cdf(k, n, Fraction(bound) - Fraction(1, 10**6)) > alpha > exact_cdf(k, n, Fraction(bound) + Fraction(1, 10**6))


def test_binomial_cdf_matches_exact_sum_for_large_n():
    assert binomial_cdf(30, 2000, 0.02) == pytest.approx(float(exact_cdf(30, 2000, Fraction(1, 50))), rel=1e-9)


def test_edge_cases_and_bad_input():
    assert clopper_pearson_upper(4, 4, 0.05) == 1.0
    assert clopper_pearson_interval(0, 10, 0.05)[0] == 0.0
    low, high = clopper_pearson_interval(5, 100, 0.05)
    assert low == pytest.approx(0.0164, abs=5e-5) and high == pytest.approx(0.1128, abs=5e-5)
    with pytest.raises(ValueError, match="num_errors"):
        clopper_pearson_upper(5, 4, 0.05)
    with pytest.raises(ValueError, match="alpha"):
        clopper_pearson_upper(1, 4, 1.5)
    with pytest.raises(ValueError, match="agreed"):
        select_threshold([0.9, 0.8], [True], epsilon=0.1, delta=0.1)
    with pytest.raises(ValueError, match="epsilon"):
        select_threshold([0.9], [True], epsilon=0.0, delta=0.1)
    with pytest.raises(ValueError, match="method"):
        select_threshold([0.9], [True], epsilon=0.1, delta=0.1, method="best")


def test_grid_is_fixed_sorted_and_in_unit_interval():
    assert list(DEFAULT_GRID) == sorted(set(DEFAULT_GRID))
    assert DEFAULT_GRID[0] == 0.0 and DEFAULT_GRID[-1] < 1.0


def test_chooses_lowest_certified_threshold_on_a_known_sample():
    # 200 answers at score 0.95 all agree; 100 at 0.6 with 40 disagreeing.
    scores = [0.95] * 200 + [0.6] * 100
    agreed = [True] * 200 + [True] * 60 + [False] * 40
    result = select_threshold(scores, agreed, epsilon=0.05, delta=0.1)
    assert not result.gate_off
    # Every grid point in (0.6, 0.95] accepts exactly the 200 clean answers; the lowest of them wins.
    expected = min(t for t in DEFAULT_GRID if 0.6 < t <= 0.95)
    assert result.threshold == expected
    assert (result.num_accepted, result.num_errors) == (200, 0)
    assert result.coverage == pytest.approx(200 / 300)
    assert result.bound == pytest.approx(clopper_pearson_upper(0, 200, 0.1 / len(DEFAULT_GRID)))


def test_gate_off_when_nothing_qualifies():
    rng = np.random.default_rng(0)
    scores = rng.uniform(0, 1, 500)
    agreed = rng.uniform(0, 1, 500) > 0.3  # 30% disagreement at every score
    for method in ("bonferroni", "fixed_sequence"):
        result = select_threshold(scores, agreed, epsilon=0.05, delta=0.1, method=method)
        assert result.gate_off and result.threshold is None and result.coverage == 0.0
        assert "gate off" in result.summary()
    # Too few answers to certify anything even when all agree.
    assert select_threshold([0.99] * 5, [True] * 5, epsilon=0.05, delta=0.1).gate_off


GRID = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 .. 0.95


def test_fixed_sequence_stops_at_first_failure():
    # Clean high scores, then a bad band, then clean again: the sequence may not jump over the bad band.
    scores = [0.97] * 300 + [0.9] * 100 + [0.6] * 3000
    agreed = [True] * 300 + [False] * 100 + [True] * 3000
    fst = select_threshold(scores, agreed, epsilon=0.05, delta=0.1, method="fixed_sequence", grid=GRID)
    assert fst.threshold == 0.95 and (fst.num_accepted, fst.num_errors) == (300, 0)
    assert [p.certified for p in fst.curve][:2] == [True, False] and not any(p.certified for p in fst.curve[1:])
    bonf = select_threshold(scores, agreed, epsilon=0.05, delta=0.1, method="bonferroni", grid=GRID)
    assert bonf.threshold == 0.05  # 100 errors in 3400 is 2.9%: certified with Bonferroni, which may skip


def _synthetic(rng, n):
    # Score uniform on [0, 1]; P(disagree | s) = 0.5 * (1 - s)**2, so R(t) = E[...| S >= t] = (1 - t)**2 / 6.
    s = rng.uniform(0, 1, n)
    agreed = rng.uniform(0, 1, n) >= 0.5 * (1 - s) ** 2
    return s, agreed


def true_risk(t: float) -> float:
    return (1 - t) ** 2 / 6


@pytest.mark.parametrize("method", ["bonferroni", "fixed_sequence"])
def test_chosen_threshold_risk_within_epsilon_in_1_minus_delta_of_trials(method):
    epsilon, delta, trials = 0.05, 0.1, 200
    rng = np.random.default_rng(12345)
    violations = opened = 0
    for _ in range(trials):
        result = select_threshold(*_synthetic(rng, 2000), epsilon=epsilon, delta=delta, method=method, grid=GRID)
        if not result.gate_off:
            opened += 1
            violations += true_risk(result.threshold) > epsilon
    assert opened >= trials * 0.9  # the procedure answers, so the check below has something to check
    assert violations <= delta * trials


def test_naive_empirical_threshold_violates_far_more_often():
    # The same stream with the observed rate in place of the bound: the guarantee is what the bound adds.
    epsilon, trials = 0.05, 200
    rng = np.random.default_rng(12345)
    violations = 0
    for _ in range(trials):
        s, agreed = _synthetic(rng, 2000)
        ok = [t for t in GRID if (s >= t).any() and (~agreed[s >= t]).mean() <= epsilon]
        violations += true_risk(min(ok)) > epsilon
    assert violations > 3 * 0.1 * trials


def test_monitor_reports_rate_bounds_and_breach():
    monitor = AgreementMonitor(epsilon=0.05, delta=0.05, min_samples=20)
    assert monitor.report().num_samples == 0 and not monitor.report().breached
    for _ in range(19):
        monitor.record(False)
    assert not monitor.report().breached  # below min_samples
    monitor.record(False)
    report = monitor.report()
    assert report.breached and not report.certified and report.observed_rate == 1.0
    clean = AgreementMonitor(epsilon=0.05, delta=0.05, min_samples=20)
    for i in range(200):
        clean.record(i % 100 != 0)  # 2 disagreements in 200
    report = clean.report()
    assert (report.num_samples, report.num_disagreed) == (200, 2)
    assert report.upper_bound == pytest.approx(clopper_pearson_upper(2, 200, 0.05))
    assert report.certified and not report.breached


def test_monitor_window_forgets_old_samples():
    monitor = AgreementMonitor(epsilon=0.1, window=10, min_samples=5)
    for _ in range(10):
        monitor.record(False)
    for _ in range(10):
        monitor.record(True)
    report = monitor.report()
    assert (report.num_samples, report.num_disagreed) == (10, 0)
    with pytest.raises(ValueError, match="window"):
        AgreementMonitor(epsilon=0.1, window=-1)
