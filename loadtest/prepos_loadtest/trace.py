"""Trace files from the command line: export a built-in workload as JSONL, or summarize a trace file.

    python -m prepos_loadtest.trace export --workload chat --sessions 50 --out chat.jsonl
    python -m prepos_loadtest.trace summary chat.jsonl

Exit codes: 0 ok, 1 the trace file is invalid or unreadable, 2 usage.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .workloads import WORKLOADS, SessionTrace, ThinkTime, TraceFormatError, build_workload, read_trace, write_trace

EXIT_OK = 0
EXIT_INVALID = 1


@dataclass(frozen=True)
class TraceSummary:
    """Counts and think-time figures of a list of session traces."""

    num_sessions: int
    num_steps: int
    num_updates: int  # steps with max_tokens 0
    num_generates: int
    num_closed_choice: int  # generate steps with a choice set
    think_median_s: float  # over steps with a non-zero delay; 0 when there are none
    think_total_s: float

    @classmethod
    def of(cls, traces: Sequence[SessionTrace]) -> TraceSummary:
        steps = [step for trace in traces for step in trace.steps]
        delays = [step.delay_s for step in steps if step.delay_s > 0]
        generates = [step for step in steps if step.max_tokens != 0]
        return cls(
            num_sessions=len(traces),
            num_steps=len(steps),
            num_updates=len(steps) - len(generates),
            num_generates=len(generates),
            num_closed_choice=sum(1 for step in generates if step.choices),
            think_median_s=statistics.median(delays) if delays else 0.0,
            think_total_s=sum(step.delay_s for step in steps),
        )

    def lines(self) -> list[str]:
        return [
            f"sessions        {self.num_sessions}",
            f"steps           {self.num_steps} ({self.num_generates} generate, {self.num_updates} update)",
            f"closed choice   {self.num_closed_choice} of the generate steps",
            f"think time      median {self.think_median_s:.2f} s, total {self.think_total_s:.1f} s",
        ]


def _export(args: argparse.Namespace) -> int:
    think_time = None
    if args.think_median is not None:
        think_time = ThinkTime(args.think_median, args.think_sigma)
    traces = build_workload(args.workload, args.sessions, seed=args.seed, think_time=think_time)
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        num_lines = write_trace(args.out, traces)
    except OSError as error:
        raise ValueError(f"--out {args.out}: cannot write the trace ({error.strerror or error})") from None
    print(f"wrote {len(traces)} sessions, {num_lines} steps to {args.out}")
    return EXIT_OK


def _summary(args: argparse.Namespace) -> int:
    try:
        traces = read_trace(args.trace)
    except (OSError, TraceFormatError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_INVALID
    print("\n".join(TraceSummary.of(traces).lines()))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m prepos_loadtest.trace", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    export = commands.add_parser("export", help="write a built-in workload as a JSONL trace")
    export.add_argument("--workload", required=True, choices=sorted(WORKLOADS), help="built-in workload")
    export.add_argument("--sessions", type=int, required=True, help="number of sessions")
    export.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    export.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    export.add_argument("--think-median", type=float,
                        help="median think time in seconds (default: the workload's own think time)")
    export.add_argument("--think-sigma", type=float, default=0.0,
                        help="lognormal shape of the think time, with --think-median (default %(default)s: constant)")
    export.set_defaults(run=_export)

    summary = commands.add_parser("summary", help="check a JSONL trace and print its counts")
    summary.add_argument("trace", type=Path, help="JSONL trace file")
    summary.set_defaults(run=_summary)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the trace command line; return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "sessions", 1) < 1:
        parser.error("--sessions: must be >= 1")
    try:
        return args.run(args)
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    sys.exit(main())
