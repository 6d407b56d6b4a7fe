"""The serving process's Python heap: startup objects kept out of the cyclic collector, its pauses timed.

CPython's cyclic garbage collector stops every thread while it runs, and a full
(generation 2) collection walks every tracked object. Once the model, the
tokenizer and the libraries behind them have loaded, a prepos backend process
holds about 170,000 of them, and on the project's 2-core CPU machine one full
collection took 69 ms; the request that arrived during it waited that long (a
gated first token of 74 ms in a benchmark whose median is 0.22 ms). Those objects
live as long as the process, so :func:`settle_heap` moves them to the permanent
generation, which collections skip; a full collection then walks only what
serving created since.

:class:`CollectorPauses` times every collection, so the pauses that remain are
visible (``prepos_gc_pause_ms``) rather than hidden in request latency.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeapSettled:
    num_frozen: int  # objects moved to the permanent generation
    collect_ms: float  # the full collection before the freeze


def settle_heap() -> HeapSettled:
    """Collect once, then freeze every object alive into the permanent generation.

    Call it once per process, after the model has loaded: frozen objects are never
    collected, so a reference cycle among them that dies later stays in memory.
    """
    start = time.perf_counter()
    gc.collect()
    collect_ms = (time.perf_counter() - start) * 1e3
    gc.freeze()
    settled = HeapSettled(gc.get_freeze_count(), collect_ms)
    log.info("heap settled: %d startup objects frozen out of the garbage collector (full collection before: %.1f ms)",
             settled.num_frozen, settled.collect_ms)
    return settled


class CollectorPauses:
    """Times the garbage collector's runs through ``gc.callbacks``, from any thread.

    The callback runs inside whatever allocation set the collection off, possibly
    while that thread holds a lock, so it takes none: it appends to a bounded deque
    (atomic under the GIL), and :meth:`drain` hands the pauses to the caller later.
    """

    def __init__(self, max_pending: int = 65536):  # the engine loop drains at least every housekeeping
        self._pending: deque[tuple[int, float]] = deque(maxlen=max_pending)  # (generation, pause ms)
        self._started_s: float | None = None
        self._installed = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started_s = time.perf_counter()
        elif self._started_s is not None:
            self._pending.append((info["generation"], (time.perf_counter() - self._started_s) * 1e3))
            self._started_s = None

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True

    def remove(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

    def drain(self) -> list[tuple[int, float]]:
        """The (generation, pause in ms) of the collections since the last drain, oldest first."""
        drained = []
        while self._pending:
            drained.append(self._pending.popleft())
        return drained
