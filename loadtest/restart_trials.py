"""Restart trials: how soon after a restarted server is ready the calls made while it was down are answered.

Each trial starts the real server on free loopback ports (journals on), opens ``--sessions`` sessions of a
`Client(wait_for_ready=True)` with a turn each, stops the server (drained), and has every session ask its next
question at once, while the server is down. After ``--outage-s`` it starts the server again on the same ports and
times, from the moment the launcher found it ready (its HTTP health endpoint, polled every 0.2 s), until each of
those calls had its answer. Each answer must come from the session's journal (path ``rebuild``).

Two cases, alternating trial by trial: the client's gRPC connection as prepos makes it (reconnect attempts at
most half a second apart, ``prepos_client.channel``) and with gRPC's default backoff (tritonclient's own channel
arguments, attempts up to two minutes apart). Prints every call's delay and the median and p99 per case.

    python loadtest/restart_trials.py [--trials 3] [--sessions 4] [--outage-s 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
for sub in ("backend", "client", "loadtest"):
    sys.path.insert(0, str(ROOT / sub))

import tritonclient.grpc as grpcclient  # noqa: E402
from prepos.launcher import TritonServer, interrupt_on_sigterm  # noqa: E402
from prepos_client import Client, PreposError, channel  # noqa: E402
from prepos_loadtest.repository import check_out_dir, machine, trial_server  # noqa: E402
from prepos_loadtest.stats import percentile  # noqa: E402

ENGINE_DIR = ROOT / "engines" / "smollm2-135m-instruct"
CASES = ("prepos channel", "gRPC default backoff")


def default_triton_client(url: str) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(url)  # tritonclient's own channel arguments


def trial(run_dir: Path, num_sessions: int, outage_s: float, case: str) -> list[float]:
    """One restart; each waiting call's seconds from the server's readiness to its answer."""
    journal = run_dir / "journal"
    shutil.rmtree(journal, ignore_errors=True)
    first = trial_server(run_dir / "first", ENGINE_DIR, journal)
    connect = channel.triton_client if case == CASES[0] else default_triton_client
    answered: dict[int, float] = {}
    failed: list[str] = []
    with mock.patch("prepos_client.session.triton_client", connect):
        with first:
            client = Client(first.grpc_url, timeout_s=outage_s + 300, wait_for_ready=True)
            sessions = [client.session(f"restart-trial-{index}") for index in range(num_sessions)]
            for session in sessions:
                session.append("You are a concise assistant.", role="system")
                session.ask("Name a colour.", max_tokens=3, speculate=False)
        # stopped (drained): every session's next call is made now, and waits for the server

        def ask(index: int) -> None:
            try:
                answer = sessions[index].ask("And another?", max_tokens=3, speculate=False)
                if answer.path != "rebuild":
                    failed.append(f"session {index}: path {answer.path}, not rebuild")
                answered[index] = time.monotonic()
            except PreposError as error:
                failed.append(f"session {index}: {error}")

        askers = [threading.Thread(target=ask, args=(index,)) for index in range(num_sessions)]
        for asker in askers:
            asker.start()
        time.sleep(outage_s)
        second = TritonServer(dataclasses.replace(first.options, run_dir=run_dir / "second"), env=first.env)
        with second:  # the same ports and journals
            ready_at = time.monotonic()
            for asker in askers:
                asker.join(outage_s + 300)
            for session in sessions:
                session.close()
            client.close()
    if failed or len(answered) != num_sessions:
        raise AssertionError(f"{case}: {failed or 'a call did not finish'}")
    return [answered[index] - ready_at for index in range(num_sessions)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3, help="restarts per case (default %(default)s)")
    parser.add_argument("--sessions", type=int, default=4, help="sessions waiting (default %(default)s)")
    parser.add_argument("--outage-s", type=float, default=20.0, help="seconds the server stays down")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "restart_trials", help="run folders")
    args = parser.parse_args(argv)
    check_out_dir(parser, args.out)  # before any server starts or anything is written
    if args.trials < 1 or args.sessions < 1 or not (math.isfinite(args.outage_s) and args.outage_s >= 0):
        parser.error("--trials and --sessions must be at least 1, --outage-s a number of seconds >= 0")
    if not (ENGINE_DIR / "prepos_engine.json").is_file():
        parser.error(f"no engine in {ENGINE_DIR} (make engine builds it)")
    interrupt_on_sigterm()
    print(f"{machine()}; {args.sessions} sessions waiting, server down {args.outage_s:g} s", flush=True)
    delays: dict[str, list[float]] = {case: [] for case in CASES}
    for number in range(args.trials):
        for case in CASES:
            took = trial(args.out / f"{'capped' if case == CASES[0] else 'default'}-{number}", args.sessions,
                         args.outage_s, case)
            delays[case] += took
            print(f"{case}, trial {number + 1}: answered {', '.join(f'{t:.2f}' for t in took)} s after ready",
                  flush=True)
    for case in CASES:
        print(f"{case}: median {statistics.median(delays[case]):.2f} s, p99 {percentile(delays[case], 99):.2f} s "
              f"after the server was ready ({len(delays[case])} calls)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
