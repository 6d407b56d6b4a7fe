"""`prepos calibrate`: certify a gate threshold on a sample of traffic, offline, with the model in process.

    prepos calibrate --workload bfcl --sessions 150 --epsilon 0.05 --epsilon 0.13 --delta 0.1 --out out/calibration/bfcl
    prepos calibrate --trace my_traffic.jsonl --epsilon 0.05 --out out/calibration/mine
    prepos calibrate --workload bigbench:causal_judgment --epsilon 0.13 --out out/calibration/causal_judgment

Replays the trace against the engine (speculative and full path at every
decision point), appending records to ``<out>/records.jsonl`` (a rerun resumes
where it stopped; ``--report-only`` reports on the records there without
replaying; the report covers every record in the file), then writes ``report.md``, ``risk_coverage.csv``/``.png``
and a ``gate_eps<epsilon>.pbtxt`` fragment per epsilon under ``--out``.
Progress goes to stderr. Exit codes: 0 ok, 1 bad input (the message names it), 2 usage, 130 interrupted (the
records written so far stay; a rerun with the same ``--out`` resumes).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from prepos_loadtest.workloads import WORKLOADS

log = logging.getLogger("prepos.calibrate")

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_ENGINE_DIR = "engines/smollm2-135m-instruct"
REPO_ROOT = Path(__file__).resolve().parents[2]  # a source checkout: client/prepos_client/calibrate_cli.py
WORKLOAD_NAMES = f"{', '.join(WORKLOADS)}, or bigbench[:TASK]"


def _placeholder(value: str) -> tuple[str, str]:
    name, sep, text = value.partition("=")
    if not sep or not name or not text:
        raise argparse.ArgumentTypeError(f"--placeholder: expected NAME=TEXT, got {value!r}")
    return name, text


def _fraction(value: str) -> float:
    number = float(value)
    if not 0.0 < number < 1.0:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1), got {value}")
    return number


def build_parser() -> argparse.ArgumentParser:
    from prepos.config import EngineConfig

    engine_defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    parser = argparse.ArgumentParser(prog="prepos calibrate", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=Path, help="JSONL trace (the load tests' format)")
    source.add_argument("--workload", help=f"built-in workload: {WORKLOAD_NAMES} (a BIG-bench yes/no task)")
    source.add_argument("--report-only", action="store_true",
                        help="no replay: report on the records already in the records file")
    parser.add_argument("--sessions", type=int, default=None, help="sessions to build from --workload (default: "
                        "the workload's all for bigbench, 100 for others)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    parser.add_argument("--max-points", type=int, default=None, help="record only the first N decision points "
                        "of the trace, those already recorded among them included (a rerun with the same N records "
                        "none); default all")
    parser.add_argument("--epsilon", type=_fraction, action="append", required=True,
                        help="false-accept rate to certify; repeat for several")
    parser.add_argument("--delta", type=_fraction, default=0.1, help="1 - confidence (default %(default)s)")
    parser.add_argument("--held-out", type=float, default=0.5,
                        help="share of sessions held out for the check (default %(default)s)")
    parser.add_argument("--method", default="bonferroni", help="multiple-threshold correction: bonferroni or "
                        "fixed_sequence (default %(default)s)")
    parser.add_argument("--placeholder", type=_placeholder, action="append", default=None, metavar="NAME=TEXT",
                        help="a placeholder speculative delta compared with the empty one (repeatable; default "
                        "one neutral placeholder)")
    parser.add_argument("--no-placeholder", action="store_true", help="record only the empty delta")
    parser.add_argument("--score", action="append", default=None, help="gate score to certify (repeatable; "
                        "default all: p_max, margin, certainty); fewer candidates, tighter certificate")
    parser.add_argument("--variant", action="append", default=None, help="speculative delta to certify: empty "
                        "or a placeholder's name (repeatable; default all recorded)")
    parser.add_argument("--out", type=Path, required=True, help="report directory")
    parser.add_argument("--records", type=Path, default=None, help="records file (default OUT/records.jsonl)")
    parser.add_argument("--engine-dir", type=Path, default=Path(DEFAULT_ENGINE_DIR), help="engine directory "
                        "(default %(default)s)")
    parser.add_argument("--device", default=engine_defaults["device"], help="torch device (default %(default)s)")
    parser.add_argument("--dtype", default=engine_defaults["dtype"], help="weight dtype (default %(default)s)")
    parser.add_argument("--threads", type=int, default=engine_defaults["num_threads"],
                        help="torch threads, 0 = torch's default (default %(default)s)")
    parser.add_argument("--bigbench-cache", type=Path, default=None, help="BIG-bench task cache directory")
    return parser


DEFAULT_PLACEHOLDERS = {"placeholder": "(message)"}


def load_sessions(args: argparse.Namespace) -> list:
    """The sessions to replay from --trace or --workload (raises ValueError naming the argument)."""
    from prepos_loadtest.workloads import TraceFormatError, build_workload, read_trace

    if args.trace is not None:
        try:
            return read_trace(args.trace)
        except (OSError, TraceFormatError) as error:
            raise ValueError(f"--trace: {error}") from None
    name, _, task = args.workload.partition(":")
    if name == "bigbench":
        from prepos_loadtest import bigbench_tasks

        task = task or bigbench_tasks.YES_NO_TASKS[0]
        cache = args.bigbench_cache or bigbench_tasks.DEFAULT_CACHE_DIR
        try:
            path = bigbench_tasks.fetch_tasks((task,), cache)[task]
            return bigbench_tasks.task_decision_points(bigbench_tasks.load_task(path, task), args.sessions,
                                                       seed=args.seed)
        except (OSError, RuntimeError, ValueError) as error:  # not fetched, not in the sdist, not a yes/no task
            raise ValueError(f"--workload: BIG-bench task {task!r}: {error}") from None
    if name not in WORKLOADS:
        raise ValueError(f"--workload: unknown workload {name!r}; choose one of {WORKLOAD_NAMES}")
    if task:
        raise ValueError(f"--workload: only bigbench takes a task, got {args.workload!r}")
    return build_workload(name, args.sessions or 100, seed=args.seed)


def replay(args: argparse.Namespace, sessions: list, placeholders: dict[str, str], records: Path):
    from prepos.calibration import CalibrationReplay, check_replayable
    from prepos.config import EngineConfig
    from prepos.core import check_device, create_engine
    from prepos.template import EngineManifest, Tokenizer

    config = EngineConfig(device=args.device, dtype=args.dtype, num_threads=args.threads)
    check_device(config.device)
    manifest = EngineManifest.load(args.engine_dir)
    try:  # before the model loads
        check_replayable(sessions, manifest.framing)
    except ValueError as error:
        raise ValueError(f"{'--trace' if args.trace is not None else '--workload'}: {error}") from None
    engine = create_engine(config, args.engine_dir)
    tokenizer = Tokenizer(args.engine_dir / "tokenizer.json")
    runner = CalibrationReplay(engine, tokenizer, manifest.framing, placeholders=placeholders)
    return runner.run(sessions, records, max_points=args.max_points)


def main(argv: list[str] | None = None) -> int:
    """Run `prepos calibrate`; return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(format="prepos calibrate: %(message)s", level=logging.INFO)
    from prepos.calibration import EMPTY, ReplayInterrupted, check_not_in_use, check_resumable, read_records
    from prepos.calibration_report import SCORES, calibrate, recorded_variants, write_report
    from prepos.launch_checks import unusable_folder
    from prepos.risk import METHODS

    if args.method not in METHODS:
        parser.error(f"--method: unknown {args.method!r}; use {' or '.join(METHODS)}")
    if not 0.0 <= args.held_out < 1.0:
        parser.error(f"--held-out: must lie in [0, 1), got {args.held_out}")
    if args.sessions is not None and args.sessions < 1:
        parser.error("--sessions: must be >= 1")
    if args.max_points is not None and args.max_points < 1:
        parser.error("--max-points: must be >= 1")
    if args.threads < 0:
        parser.error("--threads: must be >= 0 (0: torch's default)")
    unknown = sorted(set(args.score or ()) - set(SCORES))
    if unknown:
        parser.error(f"--score: unknown {', '.join(map(repr, unknown))}; use {', '.join(SCORES)}")
    # Before the model loads (seconds) and before anything is written: a replay appends to the records file and
    # the report goes to --out.
    problem = unusable_folder(args.out)
    if problem:
        parser.error(f"--out: {problem}")
    records_path = args.records or args.out / "records.jsonl"
    records_flag = "--records" if args.records else "--out"
    if records_path.is_dir():
        parser.error(f"{records_flag}: {records_path} is a directory, not a records file")
    problem = args.records and not args.report_only and unusable_folder(args.records.parent)
    if problem:
        parser.error(f"--records: {problem}")
    if args.no_placeholder and args.placeholder:
        parser.error("--no-placeholder: records only the empty delta; it cannot go with --placeholder")
    names = [name for name, _ in args.placeholder or ()]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        parser.error(f"--placeholder: {', '.join(map(repr, repeated))} given more than once")
    placeholders = {} if args.no_placeholder else dict(args.placeholder or DEFAULT_PLACEHOLDERS)
    args.epsilon = list(dict.fromkeys(args.epsilon))  # 0.5 and 5e-1 are one epsilon: one section, one fragment
    recorded = (EMPTY, *placeholders)
    unknown = sorted(set(args.variant or ()) - set(recorded))
    if unknown and not args.report_only:
        parser.error(f"--variant: {', '.join(map(repr, unknown))} not recorded by this run; it records "
                     f"{', '.join(recorded)} (--placeholder NAME=TEXT adds one)")
    summary = None
    try:
        if not args.report_only:
            sessions = load_sessions(args)
            if args.engine_dir == Path(DEFAULT_ENGINE_DIR) and not args.engine_dir.is_dir():
                args.engine_dir = REPO_ROOT / DEFAULT_ENGINE_DIR  # the default is the checkout's, wherever run from
            if not args.engine_dir.is_dir():
                raise ValueError(f"--engine-dir: {args.engine_dir} is not a directory (make engine builds the default)")
            check_not_in_use(records_path)  # before the model loads (seconds)
            check_resumable(records_path, sessions, placeholders)
            summary = replay(args, sessions, placeholders, records_path)
            log.info("recorded %d decision points (%d already there) in %.1f s", summary.num_recorded,
                     summary.num_skipped, summary.elapsed_s)
        header, records = read_records(records_path)
        if args.report_only:
            if not records:
                raise ValueError(f"--report-only: no records in {records_path}")
            placeholders = header.get("placeholders", {})
            recorded = recorded_variants(records)
            unknown = sorted(set(args.variant or ()) - set(recorded))
            if unknown:
                parser.error(f"--variant: {', '.join(map(repr, unknown))} not in {records_path}; it records "
                             f"{', '.join(recorded)}")
        results = calibrate(records, epsilons=args.epsilon, delta=args.delta, held_out_fraction=args.held_out,
                            method=args.method, scores=args.score or SCORES, variants=args.variant)
    except ValueError as error:
        print(f"prepos calibrate: error: {error}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt as interrupt:  # records are appended one by one: those written stay, a rerun skips them
        num_recorded = interrupt.summary.num_recorded if isinstance(interrupt, ReplayInterrupted) else \
            summary.num_recorded if summary else 0
        print(f"prepos calibrate: interrupted; {num_recorded} decision points recorded by this run in {records_path}"
              f" (rerun with the same {records_flag} to resume)", file=sys.stderr)
        return EXIT_INTERRUPTED
    title = args.workload or str(args.trace or records_path)
    paths = write_report(args.out, records, results, title=title, placeholders=placeholders,
                         held_out_fraction=args.held_out)
    for res in results:
        chosen = res.chosen
        if chosen is None:
            print(f"epsilon {res.epsilon:g}: gate off — no threshold certifies it at confidence {1 - res.delta:g}")
        else:
            c, h = chosen.calibration, chosen.held_out
            print(f"epsilon {res.epsilon:g}: score {chosen.score}, {chosen.variant} delta, threshold {c.threshold:.6g}: "
                  f"coverage {c.coverage:.3f} ({c.num_accepted}/{c.num_points}), {c.num_errors} false accepts, "
                  f"bound {c.bound:.4f} at confidence {1 - res.delta:g} over {len(res.candidates)} candidates; "
                  + (f"held out {h.num_errors}/{h.num_accepted} false accepts, rate {h.rate:.4f} "
                     f"[{h.interval[0]:.4f}, {h.interval[1]:.4f}]" if h.num_accepted else
                     "held out: none answered, no false-accept rate to observe"))
    print("report: " + ", ".join(str(p) for p in paths))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
