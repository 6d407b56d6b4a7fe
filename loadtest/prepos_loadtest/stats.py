"""The one percentile every benchmark and figure quotes, so a p99 means the same thing in each report."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float | None], q: float) -> float:
    """The sample at rank ``q`` percent of the sorted values (nearest rank on the 0..n-1 scale).

    None and NaN entries are left out; with nothing left the answer is NaN. No interpolation: the
    figure is always one of the measured samples.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be within 0..100, got {q}")
    ordered = sorted(v for v in values if v is not None and not math.isnan(v))
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def path_counts(paths: dict[str, int]) -> str:
    """Served paths and how many answers each served, as a report writes them: ``prefix 20, prepaid 280``."""
    return ", ".join(f"{path} {n}" for path, n in sorted(paths.items()))
