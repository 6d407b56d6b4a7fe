"""The soak's verdict and plot, read back from its sample CSV."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SoakSummary:
    """What a soak found.

    RSS is the tritonserver process plus its descendants; `rss_start_mib` is
    the first sample after warm-up, `rss_end_mib` the last one (for a run that
    ended within its warm-up, `ended_in_warmup`: the first and last samples of
    the run, and the peaks over all of it), and
    `rss_slope_mib_per_h` the least-squares slope over the samples after
    warm-up (None with fewer than 3 of them, spanning less than
    `MIN_TREND_SPAN_S`, or no memory samples: a few seconds' slope, scaled to
    an hour, reads as a leak). `sessions_at_start` were open at the first
    sample (on a server given with --server, some may be other clients').
    A soak with no sample (its metrics endpoint unreadable) measured nothing
    of the server and does not pass; `num_missed` samples could not be taken
    (the endpoint unreadable then), and the report says so.
    """

    users: int
    workload: str
    duration_s: float
    warmup_s: float
    num_samples: int
    num_requests: int  # requests Locust measured (each once)
    num_failed: int  # requests that failed on the client side (rejections, timeouts)
    num_exceptions: int  # errors raised in the load-test user code
    server_errors: int  # prepos_request_errors_total over the run
    locust_status: int
    rss_start_mib: float | None
    rss_end_mib: float | None
    rss_peak_mib: float | None
    rss_slope_mib_per_h: float | None
    kv_start_mib: float | None
    kv_end_mib: float | None
    kv_peak_mib: float | None
    sessions_peak: int
    sessions_at_start: int = 0
    interrupted: bool = False  # stopped by SIGINT or SIGTERM: duration_s is the time it ran (its last sample)
    ended_in_warmup: bool = False  # no sample after the warm-up: the figures are over the whole run
    num_missed: int = 0

    @property
    def num_errors(self) -> int:
        return self.num_failed + self.num_exceptions

    @property
    def passed(self) -> bool:
        return self.locust_status == 0 and self.num_requests > 0 and self.num_errors == 0 and self.num_samples > 0

    def line(self) -> str:
        def mib(value):
            return "-" if value is None else f"{value:.0f} MiB"

        slope = "-" if self.rss_slope_mib_per_h is None else f"{self.rss_slope_mib_per_h:+.0f} MiB/h"
        stopped = " (interrupted)" if self.interrupted else ""
        if self.num_samples == 0:
            stopped += " (no sample: the metrics endpoint was never read)"
        elif self.num_missed:
            stopped += f" ({self.num_missed} samples missed: the metrics endpoint was unreadable then)"
        return (f"soak {'ok' if self.passed else 'FAIL'}: {self.users} users ({self.workload}) for "
                f"{self.duration_s / 60:.1f} min{stopped}: {self.num_requests} requests, {self.num_errors} errors "
                f"(server-side rejections {self.server_errors}); server RSS {self._since()} {mib(self.rss_start_mib)}"
                f" -> end {mib(self.rss_end_mib)} (peak {mib(self.rss_peak_mib)}, trend {slope}); "
                f"KV {mib(self.kv_start_mib)} -> {mib(self.kv_end_mib)} (peak {mib(self.kv_peak_mib)})")

    def _since(self) -> str:
        """Where the start figures were taken."""
        return "at the first sample (the run ended within its warm-up)" if self.ended_in_warmup else "after warm-up"

    def markdown(self) -> str:
        def fmt(value, unit=""):
            if value is None:
                return "-"
            return f"{value:.1f}{unit}" if isinstance(value, float) else f"{value}{unit}"

        rows = [
            ("concurrent sessions (Locust users)", self.users),
            ("workload", self.workload),
            ("duration", f"{self.duration_s / 60:.1f} min{', interrupted' if self.interrupted else ''} "
                         f"(warm-up {self.warmup_s:.0f} s)"),
            ("requests", self.num_requests),
            ("errors (failed requests + user-code exceptions)", self.num_errors),
            ("server-side rejections (prepos_request_errors_total)", self.server_errors),
            (f"server RSS {self._since()} / at end / peak (MiB)",
             f"{fmt(self.rss_start_mib)} / {fmt(self.rss_end_mib)} / {fmt(self.rss_peak_mib)}"),
            ("server RSS trend after warm-up (MiB/h, least squares)", fmt(self.rss_slope_mib_per_h)),
            (f"KV {self._since()} / at end / peak (MiB)",
             f"{fmt(self.kv_start_mib)} / {fmt(self.kv_end_mib)} / {fmt(self.kv_peak_mib)}"),
            ("open sessions, at the first sample / peak", f"{self.sessions_at_start} / {self.sessions_peak}"),
            ("samples", f"{self.num_samples}" + (f" ({self.num_missed} missed: the metrics endpoint was unreadable "
                                                  "then)" if self.num_missed else "")),
        ]
        return "\n".join(["| soak | value |", "|---|---|", *[f"| {name} | {value} |" for name, value in rows]])


def read_samples(path: Path) -> list[dict[str, float | None]]:
    """The sample rows of a soak CSV, numbers parsed; empty cells become None."""
    with path.open(newline="") as handle:
        return [{key: (float(value) if value not in ("", None) else None) for key, value in row.items()}
                for row in csv.DictReader(handle)]


MIN_TREND_SPAN_S = 120.0
"""The least time after warm-up the RSS trend is drawn over."""


def _slope_per_h(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 3 or points[-1][0] - points[0][0] < MIN_TREND_SPAN_S:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in points)
    if var_t == 0:
        return None
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / var_t * 3600


def summarize(csv_path: Path, warmup_s: float, locust: dict[str, Any], locust_status: int, options,
              num_missed: int = 0) -> SoakSummary:
    """Combine the sample CSV and Locust's summary.json (an empty dict when Locust wrote none). A run that ended
    within its warm-up (interrupted, say) is summed up over all its samples, and says so: its last sample alone,
    taken after every session closed, was reported as after warm-up, at end and peak."""
    samples = read_samples(csv_path)
    after = [s for s in samples if s["elapsed_s"] >= warmup_s]
    ended_in_warmup = bool(samples) and not after
    after = after or samples
    rss = [(s["elapsed_s"], s["rss_mib"]) for s in after if s["rss_mib"] is not None]
    kv = [s["kv_mib"] for s in after if s["kv_mib"] is not None]
    errors = [s["request_errors_total"] for s in samples if s["request_errors_total"] is not None]
    interrupted = bool(locust.get("interrupted"))
    return SoakSummary(
        users=options.users,
        workload=options.workload,
        duration_s=samples[-1]["elapsed_s"] if interrupted and samples else options.duration_s,
        warmup_s=warmup_s,
        num_samples=len(samples),
        num_requests=int(locust.get("num_requests", 0)),
        num_failed=int(locust.get("num_failed", 0)),
        num_exceptions=len(locust.get("exceptions", ())),
        server_errors=int(errors[-1] - errors[0]) if errors else 0,
        locust_status=locust_status,
        rss_start_mib=rss[0][1] if rss else None,
        rss_end_mib=rss[-1][1] if rss else None,
        rss_peak_mib=max(v for _, v in rss) if rss else None,
        rss_slope_mib_per_h=None if ended_in_warmup else _slope_per_h(rss),  # a warm-up is no trend
        kv_start_mib=kv[0] if kv else None,
        kv_end_mib=kv[-1] if kv else None,
        kv_peak_mib=max(kv) if kv else None,
        sessions_peak=int(max((s["sessions_open"] or 0 for s in samples), default=0)),
        sessions_at_start=int(samples[0]["sessions_open"] or 0) if samples else 0,
        interrupted=interrupted,
        ended_in_warmup=ended_in_warmup,
        num_missed=num_missed,
    )


def write_plot(csv_path: Path, png_path: Path, warmup_s: float, summary: SoakSummary) -> None:
    """Server RSS, KV bytes and open sessions over the run, warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = read_samples(csv_path)
    minutes = [s["elapsed_s"] / 60 for s in samples]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    rss = [s["rss_mib"] if s["rss_mib"] is not None else math.nan for s in samples]
    top.plot(minutes, rss, color="tab:blue")
    top.set_ylabel("server RSS (MiB)\ntritonserver + backend stubs")
    top.set_title(f"Soak: {summary.users} concurrent sessions ({summary.workload}), "
                  f"{summary.num_requests} requests, {summary.num_errors} errors")
    bottom.plot(minutes, [s["kv_mib"] for s in samples], color="tab:orange", label="KV held (MiB)")
    bottom.set_ylabel("KV held (MiB)")
    bottom.set_xlabel("time since start (min)")
    sessions_axis = bottom.twinx()
    sessions_axis.plot(minutes, [s["sessions_open"] for s in samples], color="tab:green", alpha=0.6)
    sessions_axis.set_ylabel("open sessions", color="tab:green")
    for axis in (top, bottom):
        axis.axvspan(0, warmup_s / 60, color="0.9", label="warm-up")
        axis.grid(alpha=0.3)
    top.legend(["RSS", "warm-up"], loc="lower right")
    figure.tight_layout()
    figure.savefig(png_path, dpi=110)
    plt.close(figure)
