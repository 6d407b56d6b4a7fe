"""Certified false-accept rates: binomial upper bounds, risk-controlled gate thresholds, a live monitor.

Pure ``math`` and ``numpy``; nothing here knows about engines or servers.

The quantity controlled is the gate's *selective risk* at threshold ``t``:
``R(t) = P(false accept | score >= t)``, the rate of answers that differ from
the full path among the answers the gate gives. A calibration sample is a list
of ``(score, agreed)`` pairs drawn i.i.d. from the traffic.

Why the bound is valid for one fixed ``t``: given that ``n`` of the calibration
pairs have ``score >= t``, those ``n`` pairs are i.i.d. draws from the traffic
conditioned on ``score >= t``, so their number of false accepts is exactly
Binomial(n, R(t)). The one-sided Clopper–Pearson bound
:func:`clopper_pearson_upper` then exceeds ``R(t)`` with probability at least
``1 - alpha``, whatever ``n`` turned out to be.

Why it stays valid for the chosen ``t`` (many thresholds are tried):
:func:`select_threshold` tests the null ``R(t) > epsilon`` on a grid fixed
before the data are seen (:data:`DEFAULT_GRID`, never derived from the
sample) and chooses the lowest threshold whose null is rejected. Two
family-wise procedures are offered, each keeping the probability of rejecting
*any* true null (certifying any threshold whose risk exceeds ``epsilon``) at
most ``delta``, so the chosen threshold's risk is at most ``epsilon`` with
probability at least ``1 - delta``:

- ``bonferroni`` (default): each grid point is tested at level ``delta / m``
  (``m`` = grid size); the union bound gives the family-wise level. No
  assumption on how risk varies with the threshold.
- ``fixed_sequence``: grid points are tested in the fixed order highest
  threshold first, each at the full level ``delta``, stopping at the first
  that fails (Learn-then-Test, Angelopoulos et al. 2021). Valid for any fixed
  order, because the first true null in that order must be rejected for any
  error to happen. Tighter than Bonferroni when risk falls with the
  threshold, but it stops early when the highest thresholds accept too few
  answers to certify anything.

Where no grid point is certified the result says ``gate_off``. References: El-Yaniv
and Wiener (2010) and Geifman and El-Yaniv (2017) on selective
classification with guaranteed risk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

# Fixed in advance for every score in [0, 1]: 0, 0.1 .. 0.4, then 1 - 10**-x for x = 0.3, 0.5, .., 4.9
# (0.499 .. 0.9999874), denser where confident scores crowd; 29 points keep the Bonferroni split small.
DEFAULT_GRID: tuple[float, ...] = tuple(sorted(
    {0.0, 0.1, 0.2, 0.3, 0.4, *(round(1.0 - 10.0 ** (-x / 10.0), 10) for x in range(3, 50, 2))}))


def _check_counts(num_errors: int, num: int) -> None:
    if num < 0 or num_errors < 0 or num_errors > num:
        raise ValueError(f"num_errors: need 0 <= num_errors <= num, got {num_errors} of {num}")


def _check_level(alpha: float, name: str = "alpha") -> None:
    if not (0.0 < alpha < 1.0):
        raise ValueError(f"{name}: must lie in (0, 1), got {alpha}")


def binomial_cdf(num_errors: int, num: int, p: float) -> float:
    """P(X <= num_errors) for X ~ Binomial(num, p), summed in log space (stable for large ``num``)."""
    _check_counts(num_errors, num)
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if num_errors >= num else 0.0
    i = np.arange(num_errors, dtype=np.float64)
    # log pmf(j) = num*log(1-p) + sum_{i<j} log((num - i) / (i + 1)) + j*log(p / (1-p))
    steps = np.log((num - i) / (i + 1)) + (math.log(p) - math.log1p(-p))
    log_pmf = num * math.log1p(-p) + np.concatenate(([0.0], np.cumsum(steps)))
    top = log_pmf.max()
    return float(min(1.0, math.exp(top) * np.exp(log_pmf - top).sum()))


def clopper_pearson_upper(num_errors: int, num: int, alpha: float) -> float:
    """One-sided Clopper–Pearson upper bound at confidence ``1 - alpha`` on a binomial rate.

    The largest ``p`` with ``P(X <= num_errors | num, p) >= alpha`` (the
    ``1 - alpha`` quantile of Beta(num_errors + 1, num - num_errors)), found by
    bisection on the binomial CDF to 1e-12. ``num == 0`` or
    ``num_errors == num`` gives 1.
    """
    _check_counts(num_errors, num)
    _check_level(alpha)
    if num_errors >= num:
        return 1.0
    if num_errors == 0:  # closed form: (1 - p)**num = alpha
        return -math.expm1(math.log(alpha) / num)
    low, high = num_errors / num, 1.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if binomial_cdf(num_errors, num, mid) >= alpha:
            low = mid
        else:
            high = mid
        if high - low < 1e-12:
            break
    return high


def clopper_pearson_interval(num_errors: int, num: int, alpha: float) -> tuple[float, float]:
    """Two-sided Clopper–Pearson interval at confidence ``1 - alpha`` (``alpha / 2`` each side)."""
    _check_counts(num_errors, num)
    upper = clopper_pearson_upper(num_errors, num, alpha / 2)
    if num_errors == 0:
        return 0.0, upper
    # The lower bound on the error rate is one minus the upper bound on the agreement rate.
    lower = 1.0 - clopper_pearson_upper(num - num_errors, num, alpha / 2)
    return max(0.0, lower), upper


@dataclass(frozen=True)
class ThresholdPoint:
    """One grid threshold on the calibration sample."""

    threshold: float
    num_accepted: int
    num_errors: int  # false accepts among the accepted
    coverage: float  # accepted / all decision points
    risk: float  # observed false-accept rate among accepted (0 when none accepted)
    bound: float  # upper confidence bound on that rate at the procedure's per-test level
    certified: bool


@dataclass(frozen=True)
class RiskControlResult:
    """The chosen threshold, or ``gate_off`` when no grid point meets the bound.

    ``threshold`` is None when the gate is off; ``coverage``, ``num_accepted``,
    ``num_errors`` and ``bound`` then describe nothing accepted (0, 0, 0, 1).
    ``curve`` holds every grid point, highest threshold first.
    """

    threshold: float | None
    coverage: float
    num_accepted: int
    num_errors: int
    bound: float
    epsilon: float
    delta: float
    method: str
    num_points: int
    curve: tuple[ThresholdPoint, ...]

    @property
    def gate_off(self) -> bool:
        return self.threshold is None

    def summary(self) -> str:
        if self.gate_off:
            return (f"gate off: no threshold certifies a false-accept rate <= {self.epsilon:g} "
                    f"with confidence {1 - self.delta:g} on {self.num_points} decision points")
        return (f"threshold {self.threshold:.6g}: coverage {self.coverage:.3f} ({self.num_accepted} of "
                f"{self.num_points}), {self.num_errors} false accepts, upper bound {self.bound:.4f} <= "
                f"epsilon {self.epsilon:g} at confidence {1 - self.delta:g} ({self.method})")


def _curve(scores: np.ndarray, errors: np.ndarray, grid: Sequence[float], alpha: float) -> list[ThresholdPoint]:
    points = []
    for t in sorted(grid, reverse=True):
        accepted = scores >= t
        n = int(accepted.sum())
        k = int(errors[accepted].sum())
        bound = clopper_pearson_upper(k, n, alpha) if n else 1.0
        points.append(ThresholdPoint(t, n, k, n / len(scores), k / n if n else 0.0, bound, False))
    return points


def _bonferroni(points: list[ThresholdPoint], epsilon: float) -> list[ThresholdPoint]:
    return [_certify(p, p.num_accepted > 0 and p.bound <= epsilon) for p in points]


def _fixed_sequence(points: list[ThresholdPoint], epsilon: float) -> list[ThresholdPoint]:
    out, going = [], True
    for p in points:  # highest threshold first
        going = going and p.num_accepted > 0 and p.bound <= epsilon
        out.append(_certify(p, going))
    return out


def _certify(point: ThresholdPoint, certified: bool) -> ThresholdPoint:
    return ThresholdPoint(point.threshold, point.num_accepted, point.num_errors, point.coverage, point.risk,
                          point.bound, certified)


# method -> (per-test level from (delta, grid size), certification rule over the curve)
METHODS: dict[str, tuple[Callable[[float, int], float], Callable[[list[ThresholdPoint], float], list[ThresholdPoint]]]] = {
    "bonferroni": (lambda delta, m: delta / m, _bonferroni),
    "fixed_sequence": (lambda delta, m: delta, _fixed_sequence),
}


def select_threshold(
    scores: Sequence[float],
    agreed: Sequence[bool],
    *,
    epsilon: float,
    delta: float,
    method: str = "bonferroni",
    grid: Sequence[float] = DEFAULT_GRID,
) -> RiskControlResult:
    """The lowest grid threshold (largest coverage) whose false-accept rate is certified ``<= epsilon``.

    With probability at least ``1 - delta`` over the calibration sample, the
    returned threshold's selective risk is at most ``epsilon`` (see the module
    docstring). ``grid`` must be fixed independently of the sample. Returns a
    gate-off result when no grid point qualifies. Raises ``ValueError`` naming
    the argument for empty or mismatched inputs and out-of-range levels.
    """
    _check_level(epsilon, "epsilon")
    _check_level(delta, "delta")
    if method not in METHODS:
        raise ValueError(f"method: unknown {method!r}; known: {', '.join(METHODS)}")
    s = np.asarray(scores, dtype=np.float64)
    errors = ~np.asarray(agreed, dtype=bool)
    if s.ndim != 1 or len(s) == 0:
        raise ValueError("scores: need a non-empty 1-D sequence")
    if errors.shape != s.shape:
        raise ValueError(f"agreed: length {len(errors)} differs from scores' {len(s)}")
    if not np.isfinite(s).all():
        raise ValueError("scores: every score must be finite")
    if not grid:
        raise ValueError("grid: need at least one threshold")
    level_of, rule = METHODS[method]
    points = rule(_curve(s, errors, grid, level_of(delta, len(grid))), epsilon)
    certified = [p for p in points if p.certified]
    if not certified:
        return RiskControlResult(None, 0.0, 0, 0, 1.0, epsilon, delta, method, len(s), tuple(points))
    best = min(certified, key=lambda p: p.threshold)
    return RiskControlResult(best.threshold, best.coverage, best.num_accepted, best.num_errors, best.bound,
                             epsilon, delta, method, len(s), tuple(points))


@dataclass(frozen=True)
class MonitorReport:
    """What :class:`AgreementMonitor` says now."""

    num_samples: int
    num_disagreed: int
    observed_rate: float  # disagreements / samples (0 with no samples)
    upper_bound: float  # one-sided Clopper–Pearson at the monitor's confidence (1 with no samples)
    lower_bound: float  # one-sided lower bound at the same confidence (0 with no samples)
    certified: bool  # enough samples and the upper bound lies at or below epsilon
    breached: bool  # enough samples and the lower bound lies above epsilon


class AgreementMonitor:
    """Watches the gate in production: did sampled gated answers agree with the full path?

    ``record(agreed)`` adds one audited answer (the server samples a few gated
    answers, also runs the full path, and compares). ``report()`` gives the
    observed false-accept rate with one-sided bounds at confidence
    ``1 - delta``; ``certified`` is true while at least ``min_samples`` were
    recorded and the upper bound is at most ``epsilon``; ``breached`` is true once at least ``min_samples`` were
    recorded and even the *lower* bound exceeds ``epsilon`` — evidence, at
    that confidence, that the certified rate no longer holds (the operator
    should recalibrate; the server may turn the gate off). ``window`` keeps
    only the latest samples (0 = all). Not thread-safe: one owner calls it.
    """

    def __init__(self, epsilon: float, delta: float = 0.05, *, min_samples: int = 30, window: int = 0):
        _check_level(epsilon, "epsilon")
        _check_level(delta, "delta")
        if min_samples < 1:
            raise ValueError(f"min_samples: must be >= 1, got {min_samples}")
        if window < 0:
            raise ValueError(f"window: must be >= 0 (0 = keep all), got {window}")
        self.epsilon, self.delta, self.min_samples, self.window = epsilon, delta, min_samples, window
        self._samples: list[bool] = []
        self._num_disagreed = 0

    def record(self, agreed: bool) -> None:
        """Add one audited answer."""
        self._samples.append(bool(agreed))
        self._num_disagreed += not agreed
        if self.window and len(self._samples) > self.window:
            self._num_disagreed -= not self._samples.pop(0)

    def report(self) -> MonitorReport:
        """The observed rate and its bounds over the samples kept."""
        n, k = len(self._samples), self._num_disagreed
        if n == 0:
            return MonitorReport(0, 0, 0.0, 1.0, 0.0, False, False)
        upper = clopper_pearson_upper(k, n, self.delta)
        lower = 0.0 if k == 0 else 1.0 - clopper_pearson_upper(n - k, n, self.delta)
        enough = n >= self.min_samples
        return MonitorReport(n, k, k / n, upper, lower, enough and upper <= self.epsilon, enough and lower > self.epsilon)
