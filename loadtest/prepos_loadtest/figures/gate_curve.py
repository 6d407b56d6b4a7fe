"""Figure d: the gate's selective-prediction curve on BFCL sessions: coverage and precision versus threshold.

Measured through the server. Each BFCL session is replayed on two twin
sessions of `prepos` with the same updates. At every decision point, once
both are positioned, the speculative twin asks with ``gate_threshold = 0``
(the gate always fires: the speculative answer and its gate score) and the
full twin asks with ``speculate = false`` (the full path, reading the delta).
A threshold t then covers the decision points whose score is >= t; precision
is the share of covered points where the speculative answer equals the full
path's. The twins' logs hold their own answers, so after a disagreement the
next decision points see logs that differ in that one answer. Decision points
the speculative twin could not answer from a positioned state (path not
`gated`) are counted and left out.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from prepos_client import Client

from ..workloads import bfcl_sessions
from .common import FigureOutput, FiguresConfig, SummaryRow, progress, pyplot, write_csv
from .server import MAIN, FigureServer

THRESHOLDS = tuple(round(i * 0.05, 2) for i in range(21))


@dataclass(frozen=True)
class DecisionPoint:
    session: str
    turn: int
    num_choices: int
    speculative_path: str
    confidence: float  # the gate score of the speculative answer
    speculative_answer: str
    full_path: str
    full_answer: str
    expected: str | None  # BFCL's ground-truth next tool
    agreed: bool


@dataclass(frozen=True)
class CurvePoint:
    threshold: float
    coverage: float  # share of decision points the gate would answer
    precision: float  # agreement with the full path among those (nan when none)
    accuracy_vs_expected: float  # gated answers equal to BFCL's ground truth among those (nan when none)
    num_covered: int
    num_points: int


def measure(server: FigureServer, config: FiguresConfig) -> tuple[list[DecisionPoint], int]:
    """The decision points answered from a positioned state, and how many were not."""
    traces = bfcl_sessions(config.bfcl_sessions, think_time_s=0.0, max_turns=config.bfcl_turns, seed=config.seed)
    points, skipped = [], 0
    with Client(server.url, model=MAIN, timeout_s=120) as client:
        for number, trace in enumerate(traces, start=1):
            with client.session() as speculative, client.session() as full:
                for turn, step in enumerate(trace.steps):
                    if step.max_tokens == 0:
                        speculative.append(step.delta, role=step.role)
                        full.append(step.delta, role=step.role)
                        continue
                    server.wait_positioned(MAIN, num_sessions=2)
                    time.sleep(config.gap_s)
                    choices = list(step.choices) if step.choices else None
                    guess = speculative.ask(step.delta, role=step.role, max_tokens=step.max_tokens, choices=choices,
                                            gate_threshold=0.0, speculate=True)
                    truth = full.ask(step.delta, role=step.role, max_tokens=step.max_tokens, choices=choices,
                                     speculate=False)
                    if guess.path != "gated" or guess.confidence is None:
                        skipped += 1
                        continue
                    points.append(DecisionPoint(trace.name, turn, len(choices or ()), guess.path, guess.confidence,
                                                guess.text, truth.path or "", truth.text, step.expected,
                                                guess.text == truth.text))
            progress("[d] BFCL session %d/%d (%s): %d decision points so far, %d not positioned", number,
                     len(traces), trace.name, len(points), skipped)
    return points, skipped


def curve(points: list[DecisionPoint]) -> list[CurvePoint]:
    result = []
    for threshold in THRESHOLDS:
        covered = [p for p in points if p.confidence >= threshold]
        judged = [p for p in covered if p.expected is not None]
        result.append(CurvePoint(
            threshold,
            len(covered) / len(points) if points else math.nan,
            sum(p.agreed for p in covered) / len(covered) if covered else math.nan,
            sum(p.speculative_answer == p.expected for p in judged) / len(judged) if judged else math.nan,
            len(covered), len(points)))
    return result


def plot(points: list[CurvePoint], num_points: int, png: Path) -> None:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.5))
    xs = [p.threshold for p in points]
    axis.plot(xs, [p.coverage for p in points], "o-", color="tab:blue", label="coverage (gate fires)")
    axis.plot(xs, [p.precision for p in points], "s-", color="tab:green", label="precision (= full path's answer)")
    axis.plot(xs, [p.accuracy_vs_expected for p in points], "^:", color="tab:orange",
              label="gated answer = BFCL ground truth")
    axis.set_xlabel("gate threshold on the score (p_max over the allowed choices)")
    axis.set_ylabel("share of decision points")
    axis.set_ylim(-0.03, 1.03)
    axis.set_title(f"Gate selective prediction on BFCL tool routing ({num_points} decision points)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(png, dpi=110)
    plt.close(figure)


def run(server: FigureServer, config: FiguresConfig, out: Path) -> FigureOutput:
    points, skipped = measure(server, config)
    curve_points = curve(points)
    png, csv_path, points_csv = out / "d_gate_curve.png", out / "d_gate_curve.csv", out / "d_decision_points.csv"
    write_csv(csv_path, curve_points)
    write_csv(points_csv, points)
    plot(curve_points, len(points), png)
    return FigureOutput(png, (csv_path, points_csv), summary_rows(curve_points, len(points), skipped))


def summary_rows(curve_points: list[CurvePoint], num_points: int, skipped: int) -> tuple[SummaryRow, ...]:
    """The summary's rows: the decision points, and coverage and precision at three thresholds (a threshold
    that covered none has no precision, and with no decision point no coverage either: "-", not nan)."""
    rows = [SummaryRow("d", "decision points (answered from a positioned state / not)", f"{num_points} / {skipped}")]
    for threshold in (0.0, 0.5, 0.9):
        p = next(c for c in curve_points if c.threshold == threshold)
        coverage, precision = ("-" if math.isnan(v) else f"{v:.2f}" for v in (p.coverage, p.precision))
        rows.append(SummaryRow("d", f"threshold {threshold:g}: coverage, precision vs full path",
                               f"{coverage}, {precision} ({p.num_covered} covered)"))
    return tuple(rows)
