"""Every report's percentile is one measured sample, at the same rank, with gaps left out."""

from __future__ import annotations

import math

import pytest

from prepos_loadtest.stats import percentile


def test_rank_on_the_sorted_samples():
    samples = [float(v) for v in range(100, 0, -1)]  # 100..1, unsorted on purpose
    assert percentile(samples, 0) == 1.0
    assert percentile(samples, 50) == 51.0  # round(0.5 * 99) = 50 -> the 51st smallest
    assert percentile(samples, 99) == 99.0  # round(0.99 * 99) = 98
    assert percentile(samples, 100) == 100.0


def test_a_single_slow_sample_is_the_p99_of_a_short_run():
    assert percentile([1.0] * 20 + [9.0], 99) == 9.0
    assert percentile([1.0] * 20 + [9.0], 50) == 1.0


def test_none_and_nan_are_left_out_and_nothing_left_is_nan():
    assert percentile([None, 3.0, math.nan, 1.0, 2.0], 50) == 2.0
    assert math.isnan(percentile([], 50))
    assert math.isnan(percentile([None, math.nan], 99))


@pytest.mark.parametrize("q", [-1, 100.5])
def test_a_rank_outside_0_100_is_refused_by_name(q):
    with pytest.raises(ValueError, match="q must be within 0..100"):
        percentile([1.0], q)
