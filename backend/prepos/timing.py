"""Per-request server-side timings, as reported in every response."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from prepos.protocol import ResponseChunk


@dataclass
class RequestClock:
    """Per-request timings: queue time, compute time (engine-loop time spent on it), first token.

    Compute splits further into the time spent in engine prefill, engine decode
    and vocabulary scans (:meth:`measure`); the rest of it is framing,
    tokenization and sending.
    """

    now: Callable[[], float]
    arrival_s: float
    picked_s: float = 0.0
    compute_s: float = 0.0
    resumed_s: float = 0.0
    first_token_ms: float | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    scan_s: float = 0.0

    def start(self) -> None:
        self.picked_s = self.resumed_s = self.now()

    def pause(self) -> None:
        self.compute_s += self.now() - self.resumed_s

    def resume(self) -> None:
        self.resumed_s = self.now()

    @contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        """Add the time spent in the block to ``phase``: ``prefill``, ``decode`` or ``scan``."""
        began = self.now()
        try:
            yield
        finally:
            setattr(self, f"{phase}_s", getattr(self, f"{phase}_s") + self.now() - began)

    def add(self, phase: str, seconds: float) -> None:
        """Count engine time spent for this request by the loop while it waited (a batched decode) as
        ``phase`` and as compute: a batch's whole time counts for each request in it."""
        setattr(self, f"{phase}_s", getattr(self, f"{phase}_s") + seconds)
        self.compute_s += seconds

    def chunk(self, text: str, ids: Sequence[int], path: str, confidence: float, finish: str) -> ResponseChunk:
        now = self.now()
        if self.first_token_ms is None:
            self.first_token_ms = (now - self.arrival_s) * 1e3
        return ResponseChunk(
            text=text, token_ids=tuple(ids), path=path, confidence=confidence, finish_reason=finish,
            queue_ms=(self.picked_s - self.arrival_s) * 1e3,
            compute_ms=(self.compute_s + now - self.resumed_s) * 1e3,
            first_token_ms=self.first_token_ms,
            prefill_ms=self.prefill_s * 1e3, decode_ms=self.decode_s * 1e3, scan_ms=self.scan_s * 1e3,
        )
