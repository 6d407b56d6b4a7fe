"""The confidence gate: may a request with a delta be answered without reading it?

The gate scores the scan of the speculative distribution (cached at the decision
point before the delta arrived) and fires when the score reaches the threshold.
Scores are one-method strategies chosen by name; all lie in [0, 1]; ``certainty``
is the entropy score (1 - entropy / log of the number of allowed tokens).
A threshold with a certified false-accept rate, and the score to use, come from
``prepos calibrate`` (prepos.calibration, prepos.risk; README: Calibrating the gate).
"""

from __future__ import annotations

from dataclasses import dataclass

from prepos.config import GateConfig
from prepos.scan import ScanResult


class PMaxScore:
    def score(self, scan: ScanResult) -> float:
        return scan.p_max


class MarginScore:
    def score(self, scan: ScanResult) -> float:
        return scan.margin


class CertaintyScore:
    def score(self, scan: ScanResult) -> float:
        return scan.certainty


GATE_SCORES = {"p_max": PMaxScore, "margin": MarginScore, "certainty": CertaintyScore}


@dataclass(frozen=True)
class GateDecision:
    fired: bool
    score: float
    threshold: float
    outcome: str  # "fired", "declined" (score below threshold) or "disabled" (speculation off)


class Gate:
    def __init__(self, config: GateConfig):
        self._score = GATE_SCORES[config.score]()
        self._threshold = config.threshold
        self._speculate = config.speculate

    def score(self, scan: ScanResult) -> float:
        return self._score.score(scan)

    def decide(self, scan: ScanResult, *, speculate: bool | None, threshold: float | None) -> GateDecision:
        """Decide for one request; ``speculate``/``threshold`` are the request's overrides (None = config)."""
        limit = self._threshold if threshold is None else threshold
        score = self.score(scan)
        if not (self._speculate if speculate is None else speculate):
            return GateDecision(False, score, limit, "disabled")
        fired = score >= limit
        return GateDecision(fired, score, limit, "fired" if fired else "declined")
