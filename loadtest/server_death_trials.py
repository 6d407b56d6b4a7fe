"""Server death trials: does a killed tritonserver take its backend stubs with it?

Each trial starts the real server on free loopback ports, has ``--sessions`` sessions
decode long answers, SIGKILLs tritonserver alone after ``--decode-s`` seconds and
counts the backend stubs still running ``--wait-s`` seconds later (python_backend's
stub leaves by itself unless a call to the server was in flight at the kill; see
``prepos.stub``). The launcher's ``stop`` then kills any that stayed, so no trial
leaves a process behind. Prints one line per trial and the total.

    python loadtest/server_death_trials.py [--trials 8] [--sessions 4] [--decode-s 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
for sub in ("backend", "client", "loadtest"):
    sys.path.insert(0, str(ROOT / sub))

from prepos.launcher import interrupt_on_sigterm  # noqa: E402
from prepos_client import Client, PreposError  # noqa: E402
from prepos_loadtest.repository import check_out_dir, trial_server  # noqa: E402

ENGINE_DIR = ROOT / "engines" / "smollm2-135m-instruct"


def decode_until(url: str, index: int, stop: threading.Event) -> None:
    """Ask for long answers until ``stop`` or the server goes away (at most 500 questions)."""
    try:
        with Client(url, timeout_s=30) as client:
            session = client.session(f"death-trial-{index}")
            for _ in range(500):
                if stop.is_set():
                    return
                session.ask("Tell me a long story about the sea.", max_tokens=48)
    except (PreposError, OSError):
        pass  # the server was killed


def trial(run_dir: Path, num_sessions: int, decode_s: float, wait_s: float) -> int:
    """One kill mid-decode; the number of stubs that outlived the server by ``wait_s``."""
    stop = threading.Event()
    with trial_server(run_dir, ENGINE_DIR) as server:
        threads = [threading.Thread(target=decode_until, args=(server.grpc_url, i, stop))
                   for i in range(num_sessions)]
        try:
            for thread in threads:
                thread.start()
            time.sleep(decode_s)
            stubs = psutil.Process(server.process.pid).children(recursive=True)
            os.kill(server.process.pid, signal.SIGKILL)
            server.process.wait()
            _, alive = psutil.wait_procs(stubs, timeout=wait_s)
            return len(alive)
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8, help="kills (default %(default)s)")
    parser.add_argument("--sessions", type=int, default=4, help="sessions decoding at the kill (default %(default)s)")
    parser.add_argument("--decode-s", type=float, default=3.0, help="seconds of decoding before the kill")
    parser.add_argument("--wait-s", type=float, default=20.0, help="seconds the stubs get to leave by themselves")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "server_death", help="run folders")
    args = parser.parse_args(argv)
    check_out_dir(parser, args.out)  # before any server starts or anything is written
    if args.trials < 1 or args.sessions < 1 or not args.decode_s > 0 or not args.wait_s > 0:
        parser.error("--trials and --sessions must be at least 1, --decode-s and --wait-s > 0")
    if not (ENGINE_DIR / "prepos_engine.json").is_file():
        parser.error(f"no engine in {ENGINE_DIR} (make engine builds it)")
    interrupt_on_sigterm()  # a SIGTERM stops the running trial's server on the way out
    stayed = []
    for number in range(args.trials):
        stayed.append(trial(args.out / f"trial-{number}", args.sessions, args.decode_s + number % 3, args.wait_s))
        print(f"trial {number + 1}: {stayed[-1]} backend stub(s) outlived the server by {args.wait_s:g} s",
              flush=True)
    clean = sum(1 for count in stayed if count == 0)
    print(f"{clean} of {args.trials} kills mid-decode left no backend stub behind (the launcher reaped the rest)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
