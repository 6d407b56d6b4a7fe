"""Run every figure on one freshly started server and write PNGs, CSVs and summary.md.

    python -m prepos_loadtest.figures [--out out/figures] [--quick]

`--quick` measures a little of everything (about two minutes; the smoke
test's size). Progress goes to stderr, one line per measurement. Exit codes:
0 every figure was written; 1 the server or a measurement failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import time
from pathlib import Path

from prepos.launcher import interrupt_on_sigterm
from prepos_client import PreposError

from . import amortized, anatomy, entry_length, gate_curve, throughput
from .common import FiguresConfig, SummaryRow, TokenCounter, progress
from .server import ENGINE_DIR, FigureServer

SUMMARY_NAME = "summary.md"


def machine_line() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} cores, {platform.machine()}, {platform.system()} {platform.release()}, no GPU used"


def summary_markdown(rows: list[SummaryRow], config: FiguresConfig, machine: str, elapsed_s: float,
                     quick: bool) -> str:
    lines = [
        "# prepos figures",
        "",
        f"Machine: {machine}. Run: `python -m prepos_loadtest.figures{' --quick' if quick else ''}` "
        f"({elapsed_s / 60:.1f} min), one server, every model side by side. Client TTFT includes gRPC over loopback.",
        f"Entry lengths {list(config.entry_lengths)} tokens, {config.repetitions} repetition(s) per point; "
        f"query-to-update ratios {list(config.ratios)}; {config.bfcl_sessions} BFCL sessions of up to "
        f"{config.bfcl_turns} turns.",
        "",
        "| figure | measurement | value |",
        "|---|---|---|",
        *[f"| {row.figure} | {row.quantity} | {row.value} |" for row in rows],
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m prepos_loadtest.figures", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/figures"), help="output folder (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="a small run of every figure (about two minutes)")
    parser.add_argument("--engine-dir", type=Path, default=ENGINE_DIR, help="engine directory (default: %(default)s)")
    args = parser.parse_args(argv)
    config = FiguresConfig.quick() if args.quick else FiguresConfig()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.png"), *out.glob("*.csv"), out / SUMMARY_NAME]:
        stale.unlink(missing_ok=True)

    started = time.monotonic()
    rows: list[SummaryRow] = []
    counter = TokenCounter(args.engine_dir)
    progress("starting the server (prepos, prepos_prefix, prepos_rebuild, floor) ...")
    interrupt_on_sigterm()  # a SIGTERM stops the server on the way out
    try:
        with FigureServer(run_dir=(out / "run").resolve(), engine_dir=args.engine_dir) as server:
            progress("server ready at %s after %.0f s", server.url, time.monotonic() - started)
            result_a, output_a = entry_length.run(server, counter, config, out)
            rows += output_a.rows
            rows += anatomy.run(server, counter, config, list(result_a.samples), out).rows
            rows += amortized.run(server, config, out).rows
            rows += gate_curve.run(server, config, out).rows
            rows += throughput.run(server, config, out)[1]
    except (RuntimeError, OSError, PreposError) as error:
        print(f"figures failed: {error}", file=sys.stderr)
        return 1
    elapsed_s = time.monotonic() - started
    (out / SUMMARY_NAME).write_text(summary_markdown(rows, config, machine_line(), elapsed_s, args.quick))
    progress("done in %.1f min: %s", elapsed_s / 60, ", ".join(sorted(p.name for p in out.glob("*.png"))))
    print((out / SUMMARY_NAME).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
