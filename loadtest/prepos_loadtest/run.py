"""Run a headless Locust load test against a running prepos server and check its error rate.

    python -m prepos_loadtest.run --host 127.0.0.1:8001 --users 8 --spawn-rate 2 --run-time 60s \\
        --workload bfcl --out out/loadtest --max-error-rate 0.01

Locust runs as a subprocess on a task file of ``loadtest/locustfiles`` (or the
JSONL trace given with ``--trace``). Into ``--out`` go Locust's CSV statistics
(``loadtest_stats.csv``, ``loadtest_failures.csv``, ...), its HTML report
(``report.html``), its log (``locust.log``) and ``summary.json``; the latency
table by served path is printed. Arguments after ``--`` go to Locust unchanged.

Exit codes: 0 the error rate is within the bound; 1 it is not, no request
completed, or the user code raised; 2 usage, or Locust did not run; 130 the run
was interrupted (SIGINT or SIGTERM): Locust stops its users, ends their
sessions and writes what it measured, and ``summary.json`` says
``"interrupted": true, "passed": false``. A second interrupt stops Locust at once.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from prepos_client import DEFAULT_URL
from prepos_client.channel import check_url

from .options import OPTION_CLASSES, WorkloadOptions, add_arguments, from_namespace, to_argv
from .replay import SERVER_TTFT, TOTAL, TPOT, TTFT, ReplayOptions
from .workloads import TraceFormatError, read_trace

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 128 + signal.SIGINT

LOADTEST_DIR = Path(__file__).resolve().parents[1]
LOCUSTFILES = LOADTEST_DIR / "locustfiles"
TRACE_ENV = "PREPOS_TRACE"
CSV_PREFIX = "loadtest"
REPORT_NAME = "report.html"
LOG_NAME = "locust.log"
RUN_END_SUFFIX = "_run_end.json"
"""Written by the prepos user's hooks beside the CSVs (``<csv prefix>_run_end.json``) as Locust quits:
``{"interrupted": bool}``, whether its users were still running then (the run stopped before the end of its run
time); an interrupt that came while they stopped at the end of it stopped nothing."""

PATH_ORDER = ("exact", "gated", "prepaid", "prefix", "rebuild", "append", "close")
KIND_ORDER = (TTFT, SERVER_TTFT, TOTAL, TPOT)
# Locust's startup, its shutdown and the users' END requests, on top of --run-time and --stop-timeout.
_SHUTDOWN_MARGIN_S = 120.0

_TIMESPAN = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


MAX_RUN_TIME_S = 999_999_999 * 86_400  # the longest Python timedelta, in which Locust reads its run time


def parse_run_time(text: str) -> float:
    """Seconds of a Locust run time: `90`, `90s`, `1m30s`, `1h`, as Locust spells them (lower case, no spaces).

    Raises:
        ValueError: anything else (Locust would refuse it after starting), or zero.
    """
    if text.isascii() and text.isdigit():
        seconds = int(text)
    else:
        match = _TIMESPAN.match(text)
        if not text or match is None:
            raise ValueError(f"--run-time: expected e.g. 60s, 1m30s or 1h, got {text!r}")
        hours, minutes, secs = (int(group or 0) for group in match.groups())
        seconds = hours * 3600 + minutes * 60 + secs
    if seconds <= 0:
        raise ValueError(f"--run-time: must be positive, got {text!r}")
    if seconds > MAX_RUN_TIME_S:  # Locust, once started, failed on it with an OverflowError traceback
        raise ValueError(f"--run-time: at most {MAX_RUN_TIME_S}s (999999999 days), got {text!r}")
    return float(seconds)


@dataclass(frozen=True)
class StatsRow:
    """One row of Locust's stats CSV: a request type (`TTFT`, ...) and a served path."""

    kind: str
    path: str
    num_requests: int
    num_failures: int
    average_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    average_tokens: float


@dataclass(frozen=True)
class LoadTestResult:
    """What a run produced: its stats rows, failures and exceptions, and the request error rate."""

    rows: tuple[StatsRow, ...]
    failures: tuple[dict, ...]  # rows of the failures CSV: Method, Name, Error, Occurrences
    exceptions: tuple[dict, ...]  # rows of the exceptions CSV: unexpected errors in the user code
    num_requests: int  # requests sent (each has exactly one TOTAL measurement)
    num_failed: int

    @property
    def error_rate(self) -> float:
        return self.num_failed / self.num_requests if self.num_requests else math.nan


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:  # Locust writes "N/A" where it has no figure
        return math.nan


def read_results(csv_prefix: Path) -> LoadTestResult:
    """Read the CSV files Locust wrote with ``--csv csv_prefix``.

    Raises:
        FileNotFoundError: Locust wrote no stats file.
    """
    with open(f"{csv_prefix}_stats.csv", newline="") as handle:
        raw_rows = [row for row in csv.DictReader(handle) if row["Name"] != "Aggregated"]
    rows = tuple(
        StatsRow(
            kind=row["Type"],
            path=row["Name"],
            num_requests=int(row["Request Count"]),
            num_failures=int(row["Failure Count"]),
            average_ms=_number(row["Average Response Time"]),
            p50_ms=_number(row["50%"]),
            p90_ms=_number(row["90%"]),
            p99_ms=_number(row["99%"]),
            max_ms=_number(row["Max Response Time"]),
            average_tokens=_number(row["Average Content Size"]),
        )
        for row in raw_rows
    )
    rows = tuple(sorted(rows, key=_row_order))
    totals = [row for row in rows if row.kind == TOTAL]
    return LoadTestResult(
        rows=rows,
        failures=tuple(_read_optional_csv(Path(f"{csv_prefix}_failures.csv"))),
        exceptions=tuple(_read_optional_csv(Path(f"{csv_prefix}_exceptions.csv"))),
        num_requests=sum(row.num_requests for row in totals),
        num_failed=sum(row.num_failures for row in totals),
    )


def _read_optional_csv(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def _row_order(row: StatsRow) -> tuple:
    path_rank = PATH_ORDER.index(row.path) if row.path in PATH_ORDER else len(PATH_ORDER)
    kind_rank = KIND_ORDER.index(row.kind) if row.kind in KIND_ORDER else len(KIND_ORDER)
    return path_rank, row.path, kind_rank, row.kind


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def summary_lines(result: LoadTestResult, max_error_rate: float) -> list[str]:
    """The printed summary: latency by served path and request type, failures, and the verdict."""
    header = (f"{'path':<9} {'type':<8} {'requests':>8} {'failures':>8} {'avg ms':>8} {'p50 ms':>8} "
              f"{'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} {'tokens':>6}")
    lines = [header, "-" * len(header)]
    for row in result.rows:
        lines.append(f"{row.path:<9} {row.kind:<8} {row.num_requests:>8} {row.num_failures:>8} "
                     f"{_ms(row.average_ms):>8} {_ms(row.p50_ms):>8} {_ms(row.p90_ms):>8} {_ms(row.p99_ms):>8} "
                     f"{_ms(row.max_ms):>8} {row.average_tokens:>6.1f}")
    if result.failures:
        lines += ["", "failures:"]
        lines += [f"  {f['Occurrences']:>5}x {f['Method']} {f['Name']}: {f['Error']}" for f in result.failures]
    if result.exceptions:
        lines += ["", "exceptions in the user code:"]
        lines += [f"  {e.get('Count', '?'):>5}x {e.get('Message', '')}" for e in result.exceptions]
    lines.append("")
    if result.num_requests == 0:
        lines.append("no request completed: FAIL")
    else:
        verdict = "ok" if result.error_rate <= max_error_rate else "FAIL"
        lines.append(f"requests {result.num_requests}, failed {result.num_failed}: error rate "
                     f"{result.error_rate:.2%} (bound {max_error_rate:.2%}): {verdict}")
    return lines


def passed(result: LoadTestResult, max_error_rate: float) -> bool:
    """True when requests completed, none raised in the user code, and the error rate is within the bound."""
    return result.num_requests > 0 and not result.exceptions and result.error_rate <= max_error_rate


def locust_command(args: argparse.Namespace, locustfile: Path, out: Path, extra: Sequence[str]) -> list[str]:
    options = [from_namespace(options_class, args) for options_class in OPTION_CLASSES]
    return [
        sys.executable, "-m", "locust",
        "-f", str(locustfile),
        "--headless", "--only-summary",
        "--host", args.host,
        "--users", str(args.users),
        "--spawn-rate", str(args.spawn_rate),
        "--run-time", args.run_time,
        "--stop-timeout", str(args.stop_timeout),
        "--csv", str(out / CSV_PREFIX),
        "--html", str(out / REPORT_NAME),
        # The error bound decides the exit status, not Locust's any-failure rule.
        "--exit-code-on-error", "0",
        *[argument for option in options for argument in to_argv(option)],
        *extra,
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m prepos_loadtest.run", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=DEFAULT_URL, help="gRPC host:port of the server (default: %(default)s)")
    parser.add_argument("--users", type=int, default=4, help="simulated users (default: %(default)s)")
    parser.add_argument("--spawn-rate", type=float, default=1.0, help="users started per second (default: %(default)s)")
    parser.add_argument("--run-time", default="60s", help="how long to run, e.g. 60s, 5m (default: %(default)s)")
    parser.add_argument("--workload", default="bfcl", choices=sorted(p.stem for p in LOCUSTFILES.glob("*.py")),
                        help="task file in loadtest/locustfiles (default: %(default)s; `trace` needs --trace)")
    parser.add_argument("--trace", type=Path, help="JSONL trace file to replay (implies --workload trace)")
    parser.add_argument("--locustfile", type=Path, help="a task file of your own, instead of --workload")
    parser.add_argument("--out", type=Path, default=Path("out/loadtest"), help="output folder (default: %(default)s)")
    parser.add_argument("--max-error-rate", type=float, default=0.01,
                        help="fail when failed/sent requests exceeds this (default: %(default)s)")
    parser.add_argument("--stop-timeout", type=int, default=30,
                        help="seconds users may take at the end to finish their request in flight "
                             "(default: %(default)s)")
    group = parser.add_argument_group("prepos users")
    for options_class in OPTION_CLASSES:
        add_arguments(group, options_class)
    return parser


def _choose_locustfile(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Path, dict[str, str]]:
    if args.locustfile is not None:
        return args.locustfile, {}
    if args.trace is not None:
        return LOCUSTFILES / "trace.py", {TRACE_ENV: str(args.trace.resolve())}
    if args.workload == "trace":
        if not os.environ.get(TRACE_ENV):
            parser.error(f"--workload trace: give the file with --trace (or {TRACE_ENV})")
        return LOCUSTFILES / "trace.py", {}
    return LOCUSTFILES / f"{args.workload}.py", {}


def _names_a_port(host: str) -> bool:
    """Whether a gRPC target names its port: ``host:port``, ``[v6]:port``, ``dns:///host:port``,
    ``ipv4:a.b.c.d:port``; a ``unix:`` socket has none to name."""
    if host.startswith(("unix:", "unix-abstract:", "vsock:")):
        return True
    address = host.split("///", 1)[1] if "///" in host else host
    for scheme in ("ipv4:", "ipv6:", "dns:"):
        address = address.removeprefix(scheme)
    return "]:" in address if address.startswith("[") else address.count(":") == 1


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        check_url(args.host)
    except ValueError as error:
        parser.error(f"--host: {error}")
    tls = bool(getattr(args, "tls", False) or getattr(args, "tls_ca", ""))
    if not tls and not _names_a_port(args.host):  # gRPC would go to port 443, where TLS is what a server expects
        parser.error(f"--host: {args.host!r} names no port, so gRPC would use 443 (TLS); give the server's gRPC "
                     f"port, {args.host.removeprefix('dns:///')}:8001 say, or --tls for a TLS endpoint on 443")
    if args.users < 1:
        parser.error("--users: must be >= 1")
    if not (math.isfinite(args.spawn_rate) and args.spawn_rate > 0):
        parser.error(f"--spawn-rate: must be a finite number > 0, got {args.spawn_rate}")
    if not 0 <= args.max_error_rate <= 1:
        parser.error("--max-error-rate: must be in [0, 1]")
    if args.stop_timeout < 0:
        parser.error("--stop-timeout: must be >= 0")
    try:
        parse_run_time(args.run_time)
        for options_class in (WorkloadOptions, ReplayOptions):
            from_namespace(options_class, args)
    except ValueError as error:
        parser.error(str(error))
    if args.trace is not None and not args.trace.is_file():
        parser.error(f"--trace: no such file: {args.trace}")
    if args.trace is not None:
        try:  # read here too, so that a malformed file is a usage error before Locust starts
            read_trace(args.trace)
        except (OSError, TraceFormatError) as error:
            parser.error(f"--trace: {error}")


class _Interrupted(Exception):
    """SIGINT or SIGTERM reached the load test."""


@contextmanager
def _interrupts_raised() -> Iterator[None]:
    """Raise `_Interrupted` in the main thread on SIGINT and SIGTERM, instead of their defaults."""
    def interrupt(signum, _frame):
        raise _Interrupted(signal.Signals(signum).name)

    try:
        previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: signals stay as they were
        yield
        return
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@dataclass(frozen=True)
class LocustRun:
    """How the Locust subprocess ended."""

    returncode: int
    interrupted: bool = False  # SIGINT or SIGTERM reached the load test, which passed it on


def _stop(process: subprocess.Popen, wait_s: float) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(wait_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def run_locust(command: list[str], env: dict[str, str], log_path: Path, timeout_s: float,
               stop_s: float = _SHUTDOWN_MARGIN_S) -> LocustRun:
    """Run Locust with its output in `log_path`; stop it (SIGTERM, then SIGKILL) if it outlives `timeout_s`.

    Locust runs in a session of its own, so a terminal's Ctrl-C reaches only this process, whichever
    way the signal comes (the terminal, `kill` of this process or of its group). On SIGINT or SIGTERM
    Locust gets one SIGINT: it stops its users (their sessions are ended) and writes its statistics,
    within `stop_s`; a second interrupt kills it.
    """
    with log_path.open("wb") as log, _interrupts_raised():
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            try:
                return LocustRun(process.wait(timeout_s))
            except subprocess.TimeoutExpired:
                returncode = _stop(process, 30)
                print(f"Locust ran past {timeout_s:.0f} s and was stopped (status {returncode})", file=sys.stderr)
                return LocustRun(EXIT_USAGE)
            except _Interrupted as interrupt:
                print(f"{interrupt}: stopping Locust's users and writing what they measured "
                      f"(interrupt again to stop at once)", file=sys.stderr, flush=True)
                process.send_signal(signal.SIGINT)
                try:
                    return LocustRun(process.wait(stop_s), interrupted=True)
                except subprocess.TimeoutExpired:
                    return LocustRun(_stop(process, 5), interrupted=True)
        except _Interrupted:
            process.kill()
            return LocustRun(process.wait(), interrupted=True)


def stopped_early(run: LocustRun, run_end: Path) -> bool:
    """Whether the run stopped before the end of its run time. An interrupt passed on to Locust while its users
    stopped at the end of it stopped nothing (Locust records which, in ``run_end``); one that killed Locust, or
    that left no record, counts as stopping it."""
    if not run.interrupted:
        return False
    if run.returncode < 0:
        return True
    try:
        return json.loads(run_end.read_text())["interrupted"] is not False
    except (OSError, ValueError, KeyError, TypeError):
        return True


def _log_tail(path: Path, num_lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


def _finite(value):
    # JSON has no NaN: Locust's "N/A" figures become null.
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the load test; return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(args, parser)
    if importlib.util.find_spec("locust") is None:
        print("locust is not installed in this environment (pip install locust)", file=sys.stderr)
        return EXIT_USAGE
    locustfile, extra_env = _choose_locustfile(args, parser)

    out = args.out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"--out {out}: cannot make the output folder ({err.strerror or err})")
    run_end = out / f"{CSV_PREFIX}{RUN_END_SUFFIX}"
    for stale in [*out.glob(f"{CSV_PREFIX}_*.csv"), run_end, out / REPORT_NAME, out / "summary.json"]:
        stale.unlink(missing_ok=True)
    env = {**os.environ, **extra_env}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(LOADTEST_DIR), env.get("PYTHONPATH", "")) if p)
    command = locust_command(args, locustfile, out, extra)
    timeout_s = parse_run_time(args.run_time) + args.stop_timeout + _SHUTDOWN_MARGIN_S
    print(f"prepos load test: {locustfile.stem}, {args.users} users (+{args.spawn_rate:g}/s) for {args.run_time} "
          f"against {args.host}", flush=True)
    run = run_locust(command, env, out / LOG_NAME, timeout_s, stop_s=args.stop_timeout + _SHUTDOWN_MARGIN_S)
    returncode = run.returncode
    interrupted = stopped_early(run, run_end)

    try:
        result = read_results(out / CSV_PREFIX)
    except FileNotFoundError:
        if run.interrupted:
            print("interrupted before Locust wrote any statistics: nothing was measured", file=sys.stderr)
            return EXIT_INTERRUPTED
        print(f"Locust wrote no statistics (exit status {returncode}); its log ({out / LOG_NAME}) ends:\n"
              f"{_log_tail(out / LOG_NAME)}", file=sys.stderr)
        return EXIT_USAGE
    lines = summary_lines(result, args.max_error_rate)
    if interrupted:
        lines.append("interrupted before the end of --run-time: FAIL (the figures cover the part that ran)")
    elif run.interrupted:
        lines.append("(the interrupt came after the end of --run-time, while the users stopped: the run is complete)")
    print("\n".join(lines))
    summary = {"error_rate": None if result.num_requests == 0 else result.error_rate,
               "max_error_rate": args.max_error_rate,
               "passed": passed(result, args.max_error_rate) and not interrupted and returncode == 0,
               "interrupted": interrupted, "locust_exit_status": returncode, **asdict(result)}
    (out / "summary.json").write_text(json.dumps(_finite(summary), indent=1, default=str))
    written = [f"{label}: {path}" for label, path in (("report", out / REPORT_NAME),
                                                      ("csv", out / f"{CSV_PREFIX}_stats.csv"),
                                                      ("log", out / LOG_NAME)) if path.exists()]
    print("  ".join(written))
    if interrupted:
        return EXIT_INTERRUPTED
    if returncode != 0:
        print(f"Locust exited with status {returncode}; its log ({out / LOG_NAME}) ends:\n{_log_tail(out / LOG_NAME)}",
              file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK if passed(result, args.max_error_rate) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
