"""Timeout trials: does a call that raised PreposTimeout ever change its session without saying so?

Each trial starts the real server on free loopback ports and runs ``--sessions`` sessions at once, each a seeded
random mix of questions (free text or ``choices``, some with a short time limit), updates and pauses. After a call
times out, the session is settled (``Session.settle``): the error's ``accepted`` says whether the server took the
turn after all (a final response that came after the client gave up); such turns go into the session's record.
Then each session's recorded turns are replayed, calmly and without time limits, in a twin session: every greedy
answer must be the same. A timed-out call reported as not accepted whose turn the server had accepted all the same
shows as a twin that answers differently. Prints, per trial, the calls that timed out, those accepted after all,
the requests the server stopped at their deadline (``prepos_requests_abandoned_total{reason="deadline"}``) and the
answers that differed, then the totals.

``--margin-ms`` sets how much earlier than the client the server's deadline comes. A negative one gives the server
more time than the client waits, so that many calls time out on the client and are accepted by the server all the
same: settling then has late acceptances to find, and the twins check that each was reported as it happened.

    python loadtest/timeout_trials.py [--trials 5] [--sessions 4] [--actions 14] [--margin-ms MS]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("backend", "client", "loadtest"):
    sys.path.insert(0, str(ROOT / sub))

from prepos.launcher import interrupt_on_sigterm  # noqa: E402
from prepos_client import Client, PreposTimeout  # noqa: E402
from prepos_client import deadlines  # noqa: E402
from prepos_loadtest.repository import check_out_dir, trial_server  # noqa: E402
from prepos_loadtest.twins import accepted_after_all, differing_answers  # noqa: E402

ENGINE_DIR = ROOT / "engines" / "smollm2-135m-instruct"
WORDS = "get weather in Paris now alarm 7am list files ok tell me a story about cats".split()
CHOICES = (("yes", "no"), ("get_weather", "get_time", "set_alarm"))
SYSTEMS = ("You route tool calls.", "You answer yes or no.", "Be brief.")
LIMITS_S = (None, None, None, 0.05, 0.15, 0.4)  # a call's time limit: none (the client's default) or a short one


def run_session(url: str, seed: int, num_actions: int, out: dict) -> None:
    """One session's random calls; ``out`` gets its accepted turns, the number of calls that timed out and how many
    of those were accepted after all."""
    rng = random.Random(seed)
    turns, timeouts, accepted_late = [], 0, 0  # turns: (kind, keyword arguments, answer ids)
    with Client(url) as client, client.session() as session:
        system = rng.choice(SYSTEMS)
        session.append(system, role="system")
        turns.append(("append", {"text": system, "role": "system"}, None))
        for _ in range(num_actions):
            r = rng.random()
            if r < 0.55:
                text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 4))) or None
                kw = {"choices": list(rng.choice(CHOICES)), "max_tokens": 12} if rng.random() < 0.25 \
                    else {"max_tokens": rng.randint(1, 12)}
                limit = rng.choice(LIMITS_S)
                try:
                    answer = session.ask(text, **kw, **({"timeout_s": limit} if limit else {}))
                except PreposTimeout as error:
                    timeouts += 1
                    if accepted_after_all(session, error):
                        accepted_late += 1
                        turns.append(("ask", {"text": text, **kw}, None))  # replayed, its answer not compared
                    continue
                turns.append(("ask", {"text": text, **kw}, tuple(answer.token_ids)))
            elif r < 0.8:
                text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
                role = rng.choice(("user", "tool"))
                session.append(text, role=role)
                turns.append(("append", {"text": text, "role": role}, None))
            else:
                time.sleep(rng.choice((0.2, 1.0, 2.5)))  # idle: time to be positioned
    out.update(turns=turns, timeouts=timeouts, accepted_late=accepted_late)


def trial(run_dir: Path, number: int, num_sessions: int, num_actions: int) -> tuple[int, int, int, int]:
    """One trial on a fresh server: (calls that timed out, of those accepted after all, requests stopped at their
    deadline, answers differing)."""
    with trial_server(run_dir, ENGINE_DIR) as server:
        results = [{} for _ in range(num_sessions)]
        threads = [threading.Thread(target=run_session, args=(server.grpc_url, 1000 * number + i, num_actions, out))
                   for i, out in enumerate(results)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if any("turns" not in out for out in results):
            raise RuntimeError("a session failed; see the output above")
        with Client(server.grpc_url) as client:
            differed = sum(differing_answers(client, out["turns"]) for out in results)
        time.sleep(1.0)  # the engine loop publishes its counters when idle
        stopped = int(server.metric("prepos_requests_abandoned_total", reason="deadline"))
    return (sum(out["timeouts"] for out in results), sum(out["accepted_late"] for out in results), stopped,
            differed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5,
                        help="servers started, one after another (default %(default)s)")
    parser.add_argument("--sessions", type=int, default=4, help="sessions at once (default %(default)s)")
    parser.add_argument("--actions", type=int, default=14, help="random actions per session (default %(default)s)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "timeout_trials", help="run folders")
    parser.add_argument("--margin-ms", type=float, default=None,
                        help="the most a call's time limit exceeds the deadline it sends the server; negative: the "
                             "server gets more time than the client waits (default: the client's, "
                             f"{deadlines.SERVER_DEADLINE_MARGIN_S * 1e3:g} ms)")
    args = parser.parse_args(argv)
    check_out_dir(parser, args.out)  # before any server starts or anything is written
    if args.trials < 1 or args.sessions < 1 or args.actions < 1:
        parser.error("--trials, --sessions and --actions must be at least 1")
    if args.margin_ms is not None:
        if not math.isfinite(args.margin_ms):
            parser.error(f"--margin-ms must be a finite number of milliseconds, got {args.margin_ms}")
        deadlines.SERVER_DEADLINE_MARGIN_S = args.margin_ms / 1e3
    if not (ENGINE_DIR / "prepos_engine.json").is_file():
        parser.error(f"no engine in {ENGINE_DIR} (make engine builds it)")
    interrupt_on_sigterm()  # a SIGTERM stops the running trial's server on the way out
    totals = [0, 0, 0, 0]
    for number in range(args.trials):
        counts = trial(args.out / f"trial-{number}", number, args.sessions, args.actions)
        totals = [a + b for a, b in zip(totals, counts)]
        print(f"trial {number + 1}: {counts[0]} calls timed out ({counts[1]} accepted after all), {counts[2]} stopped "
              f"by the server at their deadline, {counts[3]} answers differed from the twins'", flush=True)
    print(f"in all: {totals[0]} calls timed out ({totals[1]} accepted after all), {totals[2]} stopped by the server, "
          f"{totals[3]} answers differed")
    return 0 if totals[3] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
