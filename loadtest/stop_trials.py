"""Stop trials: how long the launcher's stop takes with sessions open, drained or not, client stream held or gone.

Each trial starts the real server on free loopback ports (journals on), opens ``--sessions`` sessions with a
turn each, leaves their client holding its stream (``held``) or gone (``gone``), and times ``TritonServer.stop``;
``--no-drain`` runs the same without the drain (the drain file unset), Triton then waiting its exit timeout.
Prints every stop's seconds and the median per case, and checks that every session kept its journal.

    python loadtest/stop_trials.py [--trials 3] [--sessions 2] [--exit-timeout-s 10] [--no-drain]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("backend", "client", "loadtest"):
    sys.path.insert(0, str(ROOT / sub))

from prepos.launcher import interrupt_on_sigterm  # noqa: E402
from prepos.supervise import DRAIN_ENV  # noqa: E402
from prepos_client import Client  # noqa: E402
from prepos_loadtest.repository import check_out_dir, machine, trial_server  # noqa: E402

ENGINE_DIR = ROOT / "engines" / "smollm2-135m-instruct"


def trial(run_dir: Path, num_sessions: int, held: bool, drain: bool, exit_timeout_s: int) -> float:
    """One stop; its seconds. Raises AssertionError when a session lost its journal."""
    journal = run_dir / "journal"
    shutil.rmtree(journal, ignore_errors=True)  # an earlier run's sessions are not this trial's
    server = trial_server(run_dir, ENGINE_DIR, journal, exit_timeout_s=exit_timeout_s)
    if not drain:
        server.env[DRAIN_ENV] = ""
        server.drain_file = None
    with server:
        client = Client(server.grpc_url)
        sessions = []
        for index in range(num_sessions):
            session = client.session(f"stop-trial-{index}")
            session.append("You are a concise assistant.", role="system")
            session.ask("Name a colour.", max_tokens=3, speculate=False)
            sessions.append(session)
        if not held:
            for session in sessions:
                session.detach()
            client.close()
        began = time.monotonic()
        server.stop()
        took = time.monotonic() - began
        if held:
            for session in sessions:
                session.detach()
            client.close()
    kept = len(list(journal.iterdir()))
    assert kept == num_sessions, f"{kept} of {num_sessions} journals kept"
    return took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3, help="stops per case (default %(default)s)")
    parser.add_argument("--sessions", type=int, default=2, help="sessions open at the stop (default %(default)s)")
    parser.add_argument("--exit-timeout-s", type=int, default=10, help="Triton's exit timeout (make serve's: 10)")
    parser.add_argument("--no-drain", action="store_true", help="also time stops without the drain")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "stop_trials", help="run folders")
    args = parser.parse_args(argv)
    check_out_dir(parser, args.out)  # before any server starts or anything is written
    if args.trials < 1 or args.sessions < 1 or args.exit_timeout_s < 1:
        parser.error("--trials, --sessions and --exit-timeout-s must be at least 1")
    if not (ENGINE_DIR / "prepos_engine.json").is_file():
        parser.error(f"no engine in {ENGINE_DIR} (make engine builds it)")
    interrupt_on_sigterm()  # a SIGTERM stops the running trial's server on the way out
    print(f"{machine()}; {args.sessions} sessions open, exit timeout {args.exit_timeout_s} s", flush=True)
    for drain in (True, False) if args.no_drain else (True,):
        for held in (True, False):
            case = f"{'drained' if drain else 'no drain'}, stream {'held' if held else 'gone'}"
            took = [trial(args.out / f"{'drain' if drain else 'nodrain'}-{'held' if held else 'gone'}-{number}",
                          args.sessions, held, drain, args.exit_timeout_s) for number in range(args.trials)]
            print(f"{case}: stop took {', '.join(f'{t:.2f}' for t in took)} s; median {statistics.median(took):.2f} s",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
