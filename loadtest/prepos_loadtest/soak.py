"""Soak: many concurrent sessions for a long time; errors, server memory and KV sampled over time.

    python -m prepos_loadtest.soak --users 32 --duration 10m [--workload bfcl] [--out out/soak]
    python -m prepos_loadtest.soak --server 127.0.0.1:8001 --metrics-url http://127.0.0.1:8002/metrics

Starts its own server on free loopback ports (or uses ``--server``), runs the
headless Locust load test of ``prepos_loadtest.run`` against it, and meanwhile
samples every ``--sample-interval-s``: the resident memory of the tritonserver
process and its descendants (the Python backend stubs, where the model lives),
KV bytes, open sessions and the server's request and error counters. Each
sample is appended to ``soak.csv`` and flushed at once, so the driver's own
memory stays flat however long it runs and a killed run keeps what it sampled.
At the end: ``soak.png`` (memory and KV over time), ``soak.md`` and one
summary line with the RSS after warm-up and at the end and the error count.

Exit codes: 0 no request failed; 1 a request failed or Locust failed; 2 usage.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from prepos.launcher import interrupt_on_sigterm
from prepos.metrics import metric_sum

from . import run as loadtest_run
from .repository import check_out_dir, free_loopback_ports
from .soak_probe import pid_listening_on, scrape, tree_memory
from .soak_report import SoakSummary, summarize, write_plot
from .workloads import WORKLOADS

log = logging.getLogger("prepos.soak")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
CSV_NAME = "soak.csv"
COLUMNS = ("elapsed_s", "rss_mib", "num_processes", "kv_mib", "kv_budget_mib", "sessions_open",
           "requests_total", "request_errors_total", "engine_foreground_s", "engine_background_s")
MIB = 1024 * 1024


@dataclass(frozen=True)
class SoakOptions:
    """What a soak runs and how it samples."""

    users: int = field(default=32, metadata={"help": "concurrent sessions (Locust users)"})
    duration: str = field(default="10m", metadata={"help": "how long the load runs, e.g. 10m, 2h"})
    workload: str = field(default="monitor", metadata={
        "help": "task file of loadtest/locustfiles: monitor, bfcl, chat (32 bfcl sessions saturate 2 CPU cores)"})
    spawn_rate: float = field(default=4.0, metadata={"help": "users started per second"})
    think_scale: float = field(default=1.0, metadata={"help": "multiplies the workload's think times"})
    sample_interval_s: float = field(default=5.0, metadata={"help": "seconds between memory/KV samples"})
    warmup_s: float = field(default=120.0, metadata={
        "help": "samples before this are warm-up; 'RSS at start' is the first one after it (at most half the run)"})
    request_timeout_s: float = field(default=120.0, metadata={"help": "seconds one request may take before it fails"})

    def __post_init__(self) -> None:
        if self.users < 1:
            raise ValueError(f"users: must be >= 1, got {self.users}")
        loadtest_run.parse_run_time(self.duration)  # raises naming --run-time; re-raised below with our name
        if self.workload not in WORKLOADS:  # the built-in ones: the soak has no trace file to give
            raise ValueError(f"workload: expected one of {', '.join(sorted(WORKLOADS))}, got {self.workload!r}")
        if not (math.isfinite(self.spawn_rate) and self.spawn_rate > 0):
            raise ValueError(f"spawn_rate: must be a finite number > 0, got {self.spawn_rate}")
        if not self.think_scale >= 0:
            raise ValueError(f"think_scale: must be >= 0, got {self.think_scale}")
        if not (math.isfinite(self.sample_interval_s) and self.sample_interval_s > 0):
            raise ValueError(f"sample_interval_s: must be a finite number > 0, got {self.sample_interval_s}")
        if not self.warmup_s >= 0:
            raise ValueError(f"warmup_s: must be >= 0, got {self.warmup_s}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s: must be > 0, got {self.request_timeout_s}")

    @property
    def duration_s(self) -> float:
        return loadtest_run.parse_run_time(self.duration)

    @property
    def effective_warmup_s(self) -> float:
        return min(self.warmup_s, self.duration_s / 2)


class Sampler(threading.Thread):
    """Appends one CSV row per interval until stopped; holds no history in memory."""

    def __init__(self, path: Path, metrics_url: str, pid: int | None, interval_s: float):
        super().__init__(name="soak-sampler", daemon=True)
        self._path, self._metrics_url, self._pid, self._interval_s = path, metrics_url, pid, interval_s
        self._stop_event = threading.Event()
        self._began = time.monotonic()
        self.num_samples = 0
        self.num_scrape_failures = 0

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def run(self) -> None:
        with self._path.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(COLUMNS)
            handle.flush()
            while True:
                row = self.sample()
                if row is not None:
                    writer.writerow(row)
                    handle.flush()
                    self.num_samples += 1
                if self._stop_event.wait(self._interval_s):
                    break
            row = self.sample()  # the state at the very end
            if row is not None:
                writer.writerow(row)

    def sample(self) -> list | None:
        elapsed_s = time.monotonic() - self._began
        memory = tree_memory(self._pid) if self._pid is not None else None
        try:
            text = scrape(self._metrics_url)
        except OSError as error:
            self.num_scrape_failures += 1
            log.warning("metrics endpoint unreadable at %.0f s: %s", elapsed_s, error)
            return None
        return [
            f"{elapsed_s:.1f}",
            f"{memory.rss_bytes / MIB:.1f}" if memory else "",
            memory.num_processes if memory else "",
            f"{metric_sum(text, 'prepos_kv_bytes') / MIB:.2f}",
            f"{metric_sum(text, 'prepos_kv_budget_bytes') / MIB:.0f}",
            int(metric_sum(text, "prepos_sessions")),
            int(metric_sum(text, "prepos_requests_total")),
            int(metric_sum(text, "prepos_request_errors_total")),
            f"{metric_sum(text, 'prepos_engine_seconds_total', where='foreground'):.2f}",
            f"{metric_sum(text, 'prepos_engine_seconds_total', where='background'):.2f}",
        ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m prepos_loadtest.soak", description=__doc__.splitlines()[0])
    defaults = SoakOptions()
    for option in SoakOptions.__dataclass_fields__.values():
        parser.add_argument("--" + option.name.replace("_", "-"), type=type(getattr(defaults, option.name)),
                            default=getattr(defaults, option.name),
                            help=f"{option.metadata.get('help', '')} (default: %(default)s)")
    parser.add_argument("--server", type=parse_server,
                        help="gRPC host:port of a running server (default: start one on free ports)")
    parser.add_argument("--metrics-url", type=parse_metrics_url,
                        help="its metrics endpoint (default: http://HOST:8002/metrics with --server)")
    parser.add_argument("--server-pid", type=parse_pid,
                        help="tritonserver's pid for the memory samples (default: whoever listens on the gRPC port)")
    parser.add_argument("--out", type=Path, default=Path("out/soak"), help="output folder (default: %(default)s)")
    return parser


def parse_server(text: str) -> str:
    """`host:port` from --server (a grpc:// or http:// prefix and a trailing slash are dropped).

    Raises:
        argparse.ArgumentTypeError: no host, or a port that is not a number in 1-65535.
    """
    address = text.split("://", 1)[-1].rstrip("/")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected host:port with a port in 1-65535, e.g. 127.0.0.1:8001, "
                                         f"got {text!r}")
    return address


def parse_metrics_url(text: str) -> str:
    """--metrics-url: an http:// or https:// address.

    Raises:
        argparse.ArgumentTypeError: another scheme, or none.
    """
    if not text.startswith(("http://", "https://")) or text.endswith("://"):
        raise argparse.ArgumentTypeError(f"expected an http:// address, e.g. http://127.0.0.1:8002/metrics, "
                                         f"got {text!r}")
    return text


def parse_pid(text: str) -> int:
    """--server-pid: the id of a running process.

    Raises:
        argparse.ArgumentTypeError: not a positive integer, or no such process.
    """
    try:
        pid = int(text)
    except ValueError:
        pid = 0
    if pid <= 0:
        raise argparse.ArgumentTypeError(f"expected a process id (a positive integer), got {text!r}")
    if not psutil.pid_exists(pid):
        raise argparse.ArgumentTypeError(f"no process with id {pid}")
    return pid


def _options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> SoakOptions:
    values = {name: getattr(args, name) for name in SoakOptions.__dataclass_fields__}
    try:
        return SoakOptions(**values)
    except ValueError as error:
        parser.error(str(error).replace("--run-time", "--duration"))


def _locust_argv(options: SoakOptions, host: str, out: Path) -> list[str]:
    return [
        "--host", host, "--workload", options.workload, "--users", str(options.users),
        "--spawn-rate", str(options.spawn_rate), "--run-time", options.duration,
        "--think-scale", str(options.think_scale), "--workload-sessions", str(max(32, options.users)),
        "--request-timeout-s", str(options.request_timeout_s), "--max-error-rate", "0",
        "--out", str(out / "locust"),
    ]


def run_soak(options: SoakOptions, host: str, metrics_url: str, pid: int | None, out: Path) -> SoakSummary:
    """Run the load and the sampler side by side; write the CSV, plot and markdown; return the summary."""
    out.mkdir(parents=True, exist_ok=True)
    sampler = Sampler(out / CSV_NAME, metrics_url, pid, options.sample_interval_s)
    sampler.start()
    print(f"soak: {options.users} users, {options.workload}, for {options.duration} against {host}; "
          f"samples every {options.sample_interval_s:g} s into {out / CSV_NAME}", file=sys.stderr, flush=True)
    try:
        locust_status = loadtest_run.main(_locust_argv(options, host, out))
    finally:
        sampler.stop()
    try:
        locust = json.loads((out / "locust" / "summary.json").read_text())
    except (OSError, ValueError):
        locust = {}
    summary = summarize(out / CSV_NAME, options.effective_warmup_s, locust, locust_status, options,
                        num_missed=sampler.num_scrape_failures)
    write_plot(out / CSV_NAME, out / "soak.png", options.effective_warmup_s, summary)
    (out / "soak.md").write_text(summary.markdown() + "\n")
    (out / "summary.json").write_text(json.dumps(asdict(summary), indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    options = _options(args, parser)
    if not args.server and (args.metrics_url or args.server_pid):
        parser.error("--metrics-url and --server-pid describe a running server: give its --server too")
    check_out_dir(parser, args.out)
    interrupt_on_sigterm()  # a SIGTERM stops the load, the sampler and a server started here on the way out
    if args.server:
        host = args.server
        metrics_url = args.metrics_url or f"http://{host.rsplit(':', 1)[0]}:8002/metrics"
        try:  # a metrics address that is wrong, or another server's, would leave the soak without samples
            text = scrape(metrics_url)
        except OSError as error:
            parser.error(f"--metrics-url {metrics_url}: cannot read it ({error}); give the server's metrics "
                         "endpoint (--metrics-port of the launcher)")
        if "prepos_requests_total" not in text:
            parser.error(f"--metrics-url {metrics_url}: no prepos metrics there; is it the metrics endpoint of the "
                         f"server at {host}?")
        pid = args.server_pid or pid_listening_on(int(host.rsplit(":", 1)[1]))
        if pid is None:
            log.warning("no process found for %s: memory is not sampled (give --server-pid)", host)
        summary = run_soak(options, host, metrics_url, pid, args.out)
    else:
        from prepos.launcher import ServerOptions, TritonServer

        http, grpc, metrics = free_loopback_ports(3)
        server_options = ServerOptions(http_port=http, grpc_port=grpc, metrics_port=metrics,
                                       run_dir=(args.out / "run").resolve(), ready_timeout_s=300)
        print(f"soak: starting a server on 127.0.0.1:{grpc} ...", file=sys.stderr, flush=True)
        try:
            with TritonServer(server_options) as server:
                summary = run_soak(options, server.grpc_url, server.metrics_url, server.process.pid, args.out)
        except KeyboardInterrupt:  # before the load began (its own interrupts end in a summary): nothing measured
            print("soak: interrupted before the load began; the server it started is stopped, nothing was measured",
                  file=sys.stderr, flush=True)
            return loadtest_run.EXIT_INTERRUPTED
    print(summary.line(), flush=True)
    print(f"written: {args.out / CSV_NAME}, {args.out / 'soak.png'}, {args.out / 'soak.md'}", flush=True)
    if summary.interrupted:
        return loadtest_run.EXIT_INTERRUPTED
    return EXIT_OK if summary.passed else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
