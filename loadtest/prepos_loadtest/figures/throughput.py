"""Throughput beside the prefix-cache baseline: sessions served per minute under concurrent load.

Not a plot: two rows of the summary and a CSV. `throughput_users` simulated
users (threads) replay streaming-monitor sessions with the trace replayer of
the load test, think time scaled by `throughput_think_scale`, for
`throughput_duration_s` on `prepos`, then as long on `prepos_prefix`, in the
same run. A session counts as served when its last step and its END were
answered; the share of first tokens served without a forward pass is the
share of answers whose path was `exact` or `gated`.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from prepos_client import Client

from ..replay import TOTAL, TTFT, ReplayOptions, TraceReplayer, trace_pool
from ..workloads import monitor_sessions
from .common import SummaryRow, mean, progress, write_csv
from .server import MAIN, PREFIX, FigureServer


@dataclass(frozen=True)
class ThroughputResult:
    model: str
    users: int
    duration_s: float
    sessions_served: int
    sessions_per_minute: float
    num_answers: int
    no_forward_pass_share: float  # exact + gated answers / all answers
    ttft_mean_ms: float
    num_failed: int


class _SharedPool:
    """One trace pool for all user threads (a generator may not be advanced by two threads at once)."""

    def __init__(self, pool):
        self._pool, self._lock = pool, threading.Lock()

    def __iter__(self):
        return self

    def __next__(self):
        with self._lock:
            return next(self._pool)


def run_model(server: FigureServer, model: str, users: int, duration_s: float, think_scale: float,
              num_updates: int, seed: int) -> ThroughputResult:
    pool = _SharedPool(trace_pool(monitor_sessions(max(8, users * 2), num_updates=num_updates, seed=seed)))
    options = ReplayOptions(think_scale=think_scale, think_jitter=0.1, request_timeout_s=120.0)
    deadline = time.monotonic() + duration_s
    lock = threading.Lock()
    paths, ttfts = Counter(), []
    counts = Counter()

    def user(index: int) -> None:
        with Client(server.url, model=model, timeout_s=120.0) as client:
            replayer = TraceReplayer(client.session, pool, options, random.Random(f"{seed}:{index}"))
            while True:
                delay = replayer.next_delay_s()
                if time.monotonic() + delay >= deadline:
                    break
                time.sleep(delay)
                measurements = replayer.run_step()
                with lock:
                    for m in measurements:
                        if m.error is not None:
                            counts["failed"] += 1
                        elif m.kind == TTFT:
                            paths[m.name] += 1
                            ttfts.append(m.elapsed_ms)
                        elif m.kind == TOTAL and m.name == "close":
                            counts["served"] += 1
            replayer.close()  # a session cut off by the deadline is ended, not counted

    threads = [threading.Thread(target=user, args=(i,), name=f"throughput-{i}") for i in range(users)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed_s = max(duration_s, time.monotonic() - started)
    answers = sum(paths.values())
    return ThroughputResult(model, users, elapsed_s, counts["served"], counts["served"] * 60 / elapsed_s, answers,
                            (paths["exact"] + paths["gated"]) / answers if answers else 0.0, mean(ttfts),
                            counts["failed"])


def run(server: FigureServer, config, out: Path) -> tuple[Path, tuple[SummaryRow, ...]]:
    results = []
    for model in (MAIN, PREFIX):
        server.wait_background_idle(model)
        progress("[throughput] %d users on %s for %.0f s ...", config.throughput_users, model,
                 config.throughput_duration_s)
        result = run_model(server, model, config.throughput_users, config.throughput_duration_s,
                           config.throughput_think_scale, config.monitor_updates, config.seed)
        results.append(result)
        progress("[throughput] %s: %d sessions served (%.1f/min), %.0f%% of first tokens without a forward pass",
                 model, result.sessions_served, result.sessions_per_minute, result.no_forward_pass_share * 100)
    csv_path = out / "throughput.csv"
    write_csv(csv_path, results)
    rows = tuple(
        SummaryRow("throughput", f"{r.model} ({'prefix-cache baseline' if r.model == PREFIX else 'pre-positioning'}): "
                   f"{r.users} users x {r.duration_s:.0f} s, streaming monitor",
                   f"{r.sessions_per_minute:.1f} sessions/min ({r.sessions_served} served); "
                   f"{r.no_forward_pass_share:.0%} of {r.num_answers} first tokens exact/gated; mean TTFT "
                   f"{r.ttft_mean_ms:.0f} ms; {r.num_failed} failed")
        for r in results)
    return csv_path, rows

