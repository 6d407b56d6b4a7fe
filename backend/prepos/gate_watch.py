"""Watching the gate in production: audit a sample of gated answers against the full path.

Every ``round(1 / gate.watch_fraction)``-th gated answer is audited: off the
critical path, as background work of the engine loop, the full path (log +
entry + the real delta + cue) is prefilled in the session's own KV (a prefix
of its new log, so the work is not wasted) and its first decided token is
compared with the gated one. Agreement is exported as metrics. An audit whose
session is served, closed or evicted before it runs or finishes is void
(``prepos_gate_audits_void_total``): it needs the session's KV as the answer
left it. When the
threshold was calibrated (``gate.epsilon`` > 0), the gate is suspended for
the model once enough audits were made and the Clopper-Pearson upper bound on
the false-accept rate passes ``epsilon``; only a reload with a new
calibration turns it back on.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from prepos.config import GateConfig
from prepos.metrics import Metrics
from prepos.risk import AgreementMonitor
from prepos.session import Session
from prepos.template import ChoiceTrie

log = logging.getLogger("prepos.gate_watch")


@dataclass(frozen=True)
class Audit:
    """One gated answer to check: the full-path prompt and the token the gate answered with."""

    session: Session
    log_length: int  # the session's log length right after the answer was accepted; later turns void the audit
    prompt_ids: tuple[int, ...]  # log before the turn + opening + entry + delta + cue + forced choice tokens
    trie: ChoiceTrie | None
    forced_ids: tuple[int, ...]
    gated_token_id: int


def min_audits(epsilon: float, delta: float) -> int:
    """Fewest audits whose Clopper-Pearson upper bound can lie within ``epsilon`` (all agreeing)."""
    return max(1, math.ceil(math.log(delta) / math.log(1.0 - epsilon)))


class GateWatch:
    """Samples gated answers for audit, records the outcomes, and suspends the gate when the bound is passed."""

    def __init__(self, config: GateConfig, metrics: Metrics):
        self._every = round(1.0 / config.watch_fraction) if config.watch_fraction > 0 else 0
        self._num_gated = 0
        self._metrics = metrics
        self.epsilon = config.epsilon
        delta = 1.0 - config.confidence if config.confidence > 0 else 0.05
        self._monitor = AgreementMonitor(
            epsilon=config.epsilon if config.epsilon > 0 else 0.5, delta=delta,
            min_samples=min_audits(config.epsilon, delta) if config.epsilon > 0 else 1,
        )
        self.suspended = False

    def sample(self) -> bool:
        """Called once per gated answer: should this one be audited?"""
        if not self._every or self.suspended:
            return False
        self._num_gated += 1
        return self._num_gated % self._every == 0

    def record(self, audit: Audit, full_token_id: int) -> None:
        """The full path's first decided token for ``audit``; may suspend the gate."""
        agreed = full_token_id == audit.gated_token_id
        self._monitor.record(agreed)
        report = self._monitor.report()
        self._metrics.gate_audited("agreed" if agreed else "disagreed", report.upper_bound)
        if not agreed:
            log.info("gate audit: session %r was answered %d where the full path gives %d",
                     audit.session.session_id, audit.gated_token_id, full_token_id)
        if self.epsilon > 0 and report.num_samples >= self._monitor.min_samples \
                and report.upper_bound > self.epsilon and not self.suspended:
            self.suspended = True
            self._metrics.gate_suspended()
            log.warning(
                "gate suspended: %d of %d audited gated answers disagreed with the full path; the false-accept "
                "rate's upper bound %.3f (confidence %.2f) passes gate.epsilon=%.3f. Recalibrate (prepos calibrate) "
                "and reload the model to turn it back on.",
                report.num_disagreed, report.num_samples, report.upper_bound, 1 - self._monitor.delta, self.epsilon)
