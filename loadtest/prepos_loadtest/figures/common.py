"""What the figures share: their configuration, one measured request, token counts, CSV and plot helpers."""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from prepos.template import EngineManifest, Tokenizer
from prepos_client import Answer
from prepos_loadtest.stats import percentile  # noqa: F401  (the figures import it from here)

log = logging.getLogger("prepos.figures")

YES_NO = ("yes", "no")
QUESTION = "Is the latest reading above 30 degrees? Answer yes or no."


@dataclass(frozen=True)
class FiguresConfig:
    """How much each figure measures. `quick()` is the smoke-test size."""

    entry_lengths: tuple[int, ...] = (64, 128, 256, 512, 1024)
    """Tokens of the session's log before the measured request (figure a)."""
    repetitions: int = 3
    """Measured requests per path and entry length (figures a and b)."""
    anatomy_length: int = 256
    """The representative entry length of figure b (one of `entry_lengths`)."""
    gap_s: float = 0.3
    """Pause before every measured request, after the server's background work went quiet."""
    ratios: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)
    """Queries per update of the streaming monitor (figure c)."""
    monitor_updates: int = 8
    monitor_sessions: int = 2
    monitor_think_s: float = 0.3
    bfcl_sessions: int = 8
    """BFCL sessions of the gate curve (figure d); twin sessions for each."""
    bfcl_turns: int = 4
    throughput_users: int = 8
    throughput_duration_s: float = 60.0
    """Seconds of concurrent load per model for the throughput comparison."""
    throughput_think_scale: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.entry_lengths or min(self.entry_lengths) < 16:
            raise ValueError(f"entry_lengths: give lengths of at least 16 tokens, got {self.entry_lengths}")
        if self.anatomy_length not in self.entry_lengths:
            raise ValueError(f"anatomy_length: must be one of entry_lengths {self.entry_lengths}, "
                             f"got {self.anatomy_length}")
        if self.repetitions < 1:
            raise ValueError(f"repetitions: must be >= 1, got {self.repetitions}")
        if not self.ratios or min(self.ratios) <= 0:
            raise ValueError(f"ratios: must be positive, got {self.ratios}")
        for name in ("monitor_updates", "monitor_sessions", "bfcl_sessions", "bfcl_turns", "throughput_users"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("gap_s", "monitor_think_s", "throughput_think_scale"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not self.throughput_duration_s > 0:
            raise ValueError(f"throughput_duration_s: must be > 0, got {self.throughput_duration_s}")

    @classmethod
    def quick(cls) -> "FiguresConfig":
        return cls(entry_lengths=(64, 256), repetitions=1, anatomy_length=64, ratios=(0.5, 2.0), monitor_updates=3,
                   monitor_sessions=1, bfcl_sessions=1, bfcl_turns=2, throughput_users=2,
                   throughput_duration_s=8.0)


@dataclass(frozen=True)
class Sample:
    """One measured request: what was asked, which path served it, and its timings (ms)."""

    figure: str
    model: str
    nominal_tokens: int  # the entry length asked for (the x of figure a)
    entry_tokens: int  # tokens of the session's log before the request, as framed
    prefill_tokens: int  # tokens prefilled on the critical path (0 for a scan-only answer)
    path: str
    ttft_ms: float  # client: request sent -> first response
    first_token_ms: float | None  # server: arrival in execute -> first response
    queue_ms: float | None
    prefill_ms: float | None
    decode_ms: float | None
    scan_ms: float | None
    total_ms: float
    confidence: float | None
    answer: str

    @classmethod
    def of(cls, figure: str, model: str, nominal_tokens: int, entry_tokens: int, prefill_tokens: int,
           answer: Answer) -> "Sample":
        return cls(figure, model, nominal_tokens, entry_tokens, prefill_tokens, answer.path or "", answer.ttft_ms,
                   answer.first_token_ms, answer.queue_ms, answer.prefill_ms, answer.decode_ms, answer.scan_ms,
                   answer.total_ms, answer.confidence, answer.text)


class TokenCounter:
    """Token counts of framed turns, with the engine's own tokenizer and chat-template framing."""

    def __init__(self, engine_dir: Path):
        self.tokenizer = Tokenizer(engine_dir / "tokenizer.json")
        self.framing = EngineManifest.load(engine_dir).framing

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def update_turn(self, text: str, role: str = "system") -> int:
        """Tokens an update adds to the log: entry + delta + close (the first turn is a system turn here)."""
        return len(self.framing.entry_ids[role]) + self.count(text) + len(self.framing.close_ids)

    def question_turn(self, text: str, role: str = "user") -> int:
        """Tokens of a question's turn up to its decision point: entry + delta + cue."""
        return len(self.framing.entry_ids[role]) + self.count(text) + len(self.framing.cue_ids)

    def delta_and_cue(self, text: str) -> int:
        """What a positioned session prefills for a question (its entry is prepaid): delta + cue."""
        return self.count(text) + len(self.framing.cue_ids)

    def filler(self, num_tokens: int, tag: str = "") -> str:
        """Sensor-feed text whose framed system turn has about `num_tokens` tokens (never more)."""
        budget = num_tokens - len(self.framing.entry_ids["system"]) - len(self.framing.close_ids)
        lines = [f"You watch a sensor feed{tag}. Readings follow."]
        index = 0
        while True:
            line = f"Reading {index}: sensor {index % 7} reported {(index * 37) % 101} degrees."
            if self.count("\n".join([*lines, line])) > budget:
                break
            lines.append(line)
            index += 1
        return "\n".join(lines)


def mean(values: Iterable[float | None]) -> float:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(kept) if kept else math.nan


def write_csv(path: Path, rows: Sequence[object]) -> None:
    """Dataclass rows (or dicts) as CSV with a header; floats to 4 decimals."""
    dicts = [dataclasses.asdict(row) if dataclasses.is_dataclass(row) else dict(row) for row in rows]
    columns = list(dicts[0]) if dicts else []
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in dicts:
            writer.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in row.items()})


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def progress(message: str, *args) -> None:
    """One progress line on stderr."""
    print("figures: " + (message % args if args else message), file=sys.stderr, flush=True)


@dataclass(frozen=True)
class SummaryRow:
    """One line of summary.md: which figure, what quantity, its value as measured."""

    figure: str
    quantity: str
    value: str


@dataclass(frozen=True)
class FigureOutput:
    """What one figure wrote, and its lines for the summary table."""

    png: Path
    csv: tuple[Path, ...]
    rows: tuple[SummaryRow, ...] = field(default_factory=tuple)
