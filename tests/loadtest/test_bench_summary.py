"""The benchmark's paired comparison of the gated path with the transport floor."""

from __future__ import annotations

import math

import bench


def sample(model: str, path: str, ttft_ms: float, pair: int) -> bench.Sample:
    return bench.Sample(model, "gate-floor-pairs", "s", pair, path, 10, ttft_ms, 0.2, ttft_ms, "", None, pair=pair)


def test_gated_over_floor_uses_only_pairs_whose_question_was_gated():
    samples = [
        sample("prepos", "gated", 2.4, 0), sample("floor", "floor", 2.0, 0),
        sample("prepos", "gated", 1.8, 1), sample("floor", "floor", 1.5, 1),
        sample("prepos", "gated", 3.0, 2), sample("floor", "floor", 2.0, 2),
        sample("prepos", "prefix", 90.0, 3), sample("floor", "floor", 1.0, 3),  # not gated: left out
        sample("floor", "floor", 0.5, 4),  # its prepos request failed: no pair
    ]
    p50_ratio, median_ratio, num_pairs = bench.paired_floor_ratios(samples)
    assert num_pairs == 3
    assert math.isclose(p50_ratio, 2.4 / 2.0)
    assert math.isclose(median_ratio, 1.2)  # of 1.2, 1.2 and 1.5


def test_no_pairs_give_nan_not_an_error():
    p50_ratio, median_ratio, num_pairs = bench.paired_floor_ratios([sample("floor", "floor", 1.0, 0)])
    assert num_pairs == 0 and math.isnan(p50_ratio) and math.isnan(median_ratio)
