"""Figure c: amortized first-token latency and pre-positioning energy versus the query-to-update ratio.

The streaming monitor: readings arrive as updates, a registered yes/no
question is asked as an empty-delta query at the given number of queries per
update. The same sessions replay on `prepos` and on `prepos_prefix`, one at a
time. Amortized latency is the mean client TTFT over all queries. Energy is
engine-seconds from the server's own counter
``prepos_engine_seconds_total{where="background"}`` (pre-positioning) over the
replay, per query; the foreground engine-seconds per query are recorded too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from prepos_client import Client

from ..workloads import SessionTrace, monitor_sessions
from .common import FigureOutput, FiguresConfig, SummaryRow, mean, percentile, progress, pyplot, write_csv
from .server import MAIN, PREFIX, FigureServer

MODELS = (MAIN, PREFIX)
LABELS = {MAIN: "prepos (pre-positioning)", PREFIX: "prefix-cache baseline"}


@dataclass(frozen=True)
class RatioPoint:
    model: str
    queries_per_update: float
    num_updates: int
    num_queries: int
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    exact_share: float  # queries served by a scan of the cached distribution
    background_engine_ms_per_query: float
    foreground_engine_ms_per_query: float


def _engine_seconds(server: FigureServer, model: str, where: str) -> float:
    return server.metric("prepos_engine_seconds_total", model=model, where=where)


def replay(server: FigureServer, model: str, traces: list[SessionTrace], ratio: float) -> RatioPoint:
    """Replay `traces` one session at a time on `model`; the engine-second counters bracket the replay."""
    server.wait_background_idle(model)
    background_before = _engine_seconds(server, model, "background")
    foreground_before = _engine_seconds(server, model, "foreground")
    ttfts, paths, num_updates = [], [], 0
    with Client(server.url, model=model) as client:
        for trace in traces:
            with client.session() as session:
                for step in trace.steps:
                    time.sleep(step.delay_s)
                    if step.max_tokens == 0:
                        session.append(step.delta, role=step.role)
                        num_updates += step.role == "user"
                        continue
                    answer = session.ask(step.delta, role=step.role, max_tokens=step.max_tokens,
                                         choices=list(step.choices) if step.choices else None)
                    ttfts.append(answer.ttft_ms)
                    paths.append(answer.path)
    server.wait_background_idle(model)
    num_queries = max(1, len(ttfts))
    background = _engine_seconds(server, model, "background") - background_before
    foreground = _engine_seconds(server, model, "foreground") - foreground_before
    return RatioPoint(model, ratio, num_updates, len(ttfts), mean(ttfts), percentile(ttfts, 50),
                      percentile(ttfts, 90), paths.count("exact") / num_queries, background * 1e3 / num_queries,
                      foreground * 1e3 / num_queries)


def plot(points: list[RatioPoint], png: Path) -> None:
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for model, color in zip(MODELS, ("tab:green", "tab:red")):
        chosen = sorted((p for p in points if p.model == model), key=lambda p: p.queries_per_update)
        ratios = [p.queries_per_update for p in chosen]
        left.plot(ratios, [p.ttft_mean_ms for p in chosen], "o-", color=color, label=LABELS[model])
        right.plot(ratios, [p.background_engine_ms_per_query for p in chosen], "o-", color=color,
                   label=f"{LABELS[model]}: background")
        right.plot(ratios, [p.foreground_engine_ms_per_query for p in chosen], "s--", color=color, alpha=0.6,
                   label=f"{LABELS[model]}: foreground")
    ratios = sorted({p.queries_per_update for p in points})
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(ratios, [f"{r:g}" for r in ratios])
        axis.set_xlabel("queries per update (streaming monitor)")
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=7)
    left.set_yscale("log")
    left.set_ylabel("amortized first-token latency: mean client TTFT (ms, log)")
    left.set_title("Amortized first-token latency")
    right.set_ylabel("engine time per query (ms)")
    right.set_title("Pre-positioning energy per query")
    figure.tight_layout()
    figure.savefig(png, dpi=110)
    plt.close(figure)


def run(server: FigureServer, config: FiguresConfig, out: Path) -> FigureOutput:
    points = []
    for ratio in config.ratios:
        traces = monitor_sessions(config.monitor_sessions, num_updates=config.monitor_updates,
                                  queries_per_update=ratio, think_time_s=config.monitor_think_s, seed=config.seed)
        for model in MODELS:
            point = replay(server, model, traces, ratio)
            points.append(point)
            progress("[c] %g queries/update on %s: %d queries, mean TTFT %.1f ms, background %.1f engine-ms/query",
                     ratio, model, point.num_queries, point.ttft_mean_ms, point.background_engine_ms_per_query)
    png, csv_path = out / "c_amortized.png", out / "c_amortized.csv"
    write_csv(csv_path, points)
    plot(points, png)
    rows = []
    for ratio in config.ratios:
        main = next(p for p in points if p.model == MAIN and p.queries_per_update == ratio)
        base = next(p for p in points if p.model == PREFIX and p.queries_per_update == ratio)
        rows.append(SummaryRow(
            "c", f"{ratio:g} queries/update: mean client TTFT prepos / prefix-cache (ms); background engine-ms/query",
            f"{main.ttft_mean_ms:.1f} / {base.ttft_mean_ms:.1f} ({main.exact_share:.0%} exact, "
            f"n={main.num_queries}); {main.background_engine_ms_per_query:.1f}"))
    return FigureOutput(png, (csv_path,), tuple(rows))
