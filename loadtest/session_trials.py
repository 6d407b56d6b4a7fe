"""Session trials: do sessions driven every way the protocol allows answer exactly as calm twins do?

Each trial starts the real server (journals on) on free loopback ports and runs ``--sessions`` sessions at once, each
a seeded random mix of what clients do: questions (free text, token ids, ``choices``, stop strings, seeded sampling
with top-k and top-p, any role, empty deltas), updates, several requests sent before the first is answered
(pipelined on the stream, a bad one among them at times, a time limit on the first, END on the last), questions
with a short time limit, bad requests (refused naming their input), questions and updates over the HTTP bridge on
the same session, one-turn sessions over the bridge, a client that detaches and another that resumes the session,
a question that carries END followed by a new session under the same id, and pauses long enough for
pre-positioning. Halfway through, the server is restarted on its journals while every session is between
requests; each session goes on where it was (the client resumes it).

Then each session's acknowledged turns are replayed, calmly and in order, in a twin session: every greedy or
seeded answer must have the same tokens. Any request that fails other than by its own time limit counts as an
error. Prints per trial the requests of each kind, errors and answers that differed, then the totals; exits 1 if
any answer differed or any request failed.

    python loadtest/session_trials.py [--trials 3] [--sessions 4] [--actions 16]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("backend", "client", "loadtest"):
    sys.path.insert(0, str(ROOT / sub))

from prepos.launcher import TritonServer, interrupt_on_sigterm  # noqa: E402
from prepos_client import Answer, Client, PreposError, PreposTimeout  # noqa: E402
from prepos_loadtest.repository import check_out_dir, trial_server  # noqa: E402
from prepos_loadtest.twins import accepted_after_all, differing_answers  # noqa: E402

ENGINE_DIR = ROOT / "engines" / "smollm2-135m-instruct"
WORDS = "get weather in Paris now alarm 7am list files ok tell me a story about cats the. yes no".split()
CHOICES = (("yes", "no"), ("get_weather", "get_time", "set_alarm"), ("Paris", "Par", "London"))
SYSTEMS = ("You route tool calls.", "You answer yes or no.", "Be brief.")
STOPS = ((".",), (" the", "\n"), ("es",))
LIMITS_S = (0.05, 0.15, 0.4)


def random_question(rng: random.Random) -> dict:
    """Keyword arguments of one random question (for Session.ask)."""
    kw: dict = {}
    r = rng.random()
    if r < 0.15:
        kw["ids"] = [rng.randrange(300, 20000) for _ in range(rng.randint(1, 5))]
    elif r < 0.9:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 5)))
        kw["text"] = text or None
    if rng.random() < 0.2:
        kw["role"] = rng.choice(("tool", "system"))
    r = rng.random()
    if r < 0.25:
        kw.update(choices=list(rng.choice(CHOICES)), max_tokens=12)
    else:
        kw["max_tokens"] = rng.randint(1, 12)
        if r < 0.45:
            kw.update(temperature=rng.choice((0.7, 1.2)), seed=rng.randrange(1 << 32))
            if rng.random() < 0.5:
                kw["top_k"] = rng.choice((5, 50))
            if rng.random() < 0.5:
                kw["top_p"] = rng.choice((0.5, 0.9))
        elif r < 0.6:
            kw["stop"] = list(rng.choice(STOPS))
    return kw


def bridge_ask(http_url: str, session_id: str | None, text: str, max_tokens: int) -> tuple[int, ...]:
    """One request over the HTTP bridge on the named session (None: a one-turn session): its answer's token ids."""
    body = json.dumps({"text_input": text, "max_tokens": max_tokens}
                      | ({"session_id": session_id} if session_id else {})).encode()
    request = urllib.request.Request(f"{http_url}/v2/models/prepos_http/generate", body,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.loads(response.read())
    except urllib.error.HTTPError as err:
        raise PreposError(f"bridge: HTTP {err.code}: {err.read().decode(errors='replace')[:300]}") from None
    ids = reply.get("output_ids", [])
    return tuple(ids) if isinstance(ids, list) else (ids,)


class SessionRun:
    """One session thread's state: its client session, the logical sessions it went through (each a list of
    acknowledged turns, ("append" | "ask", keyword arguments, answer ids)), and its counts."""

    def __init__(self, server: TritonServer, seed: int):
        self.server = server
        self.rng = random.Random(seed)
        self.session_id = f"trial-{seed}"
        self.logs: list[list] = []
        self.counts: collections.Counter = collections.Counter()
        self.errors: list[str] = []
        self.client: Client | None = None
        self.session = None
        self.bridge_ok = False  # the server holds the session (not right after a restart, before it is resumed)

    def open(self) -> None:
        self.session = self.client.session(self.session_id)
        self.logs.append([])
        system = self.rng.choice(SYSTEMS)
        self.session.append(system, role="system")
        self.logs[-1].append(("append", {"text": system, "role": "system"}, None))
        self.bridge_ok = True

    def run(self, num_actions: int) -> None:
        for _ in range(num_actions):
            try:
                self.step()
            except PreposError as err:
                self.errors.append(f"{self.session_id}: {type(err).__name__}: {err}")
                return

    def step(self) -> None:
        """One random action (weights in ACTIONS)."""
        names, weights = zip(*ACTIONS)
        name = self.rng.choices(names, weights)[0]
        if name in ("bridge", "one-turn") and not self.bridge_ok:
            name = "append"
        getattr(self, "do_" + name.replace("-", "_"))()
        self.counts[name] += 1

    def record(self, kind: str, kw: dict, ids=None) -> None:
        self.logs[-1].append((kind, kw, None if ids is None else tuple(ids)))

    def do_ask(self) -> None:
        kw = random_question(self.rng)
        self.record("ask", kw, self.session.ask(**kw).token_ids)
        self.bridge_ok = True  # a request over gRPC has reopened the session after a restart

    def do_timed(self) -> None:
        kw = random_question(self.rng)
        try:
            answer = self.session.ask(**kw, timeout_s=self.rng.choice(LIMITS_S))
        except PreposTimeout as error:
            self.record_timed_out(kw, error)
            return
        self.record("ask", kw, answer.token_ids)
        self.bridge_ok = True

    def record_timed_out(self, kw: dict, error: PreposTimeout) -> None:
        """A question whose call timed out: settled, then replayed in the twin (answer unknown) if it was accepted
        after all, left out if not."""
        self.counts["timed out"] += 1
        if accepted_after_all(self.session, error):
            self.counts["accepted late"] += 1
            self.record("ask", kw, None)

    def do_pipelined(self) -> None:
        """Two to four requests sent before the first is answered: questions, maybe a bad one among them (refused,
        changing nothing), maybe a time limit on the first, maybe END on the last."""
        rng = self.rng
        plan = [("ask", random_question(rng)) for _ in range(rng.randint(2, 3))]
        if rng.random() < 0.3:
            plan.insert(1, ("bad", dict(text="hi", **rng.choice(BAD))))
        limit = rng.choice(LIMITS_S) if rng.random() < 0.3 else None
        end = rng.random() < 0.15
        streams = [self.session.generate(**kw, **({"timeout_s": limit} if limit and not i else {}),
                                         end=end and i == len(plan) - 1)
                   for i, (_, kw) in enumerate(plan)]
        timed_out = None
        for i, ((kind, kw), stream) in enumerate(zip(plan, streams)):
            try:
                answer = Answer.from_chunks(list(stream))
            except PreposTimeout as error:
                if limit is None or i:
                    raise
                timed_out = error
                continue
            except PreposError as err:
                if kind != "bad":
                    raise
                self.check_refusal(err, kw)
                continue
            if kind == "bad":
                raise PreposError(f"a bad request ({kw}) was answered: {answer.text!r}")
            if timed_out is not None:  # served after it, so its outcome came first
                self.record_timed_out(plan[0][1], timed_out)
                timed_out = None
            self.record("ask", kw, answer.token_ids)
        if timed_out is not None:  # nothing answered after it: every later request was refused
            self.record_timed_out(plan[0][1], timed_out)
        self.bridge_ok = True
        if end:
            self.counts["ended"] += 1
            self.open()

    def do_bad(self) -> None:
        kw = dict(text="hi", **self.rng.choice(BAD))
        try:
            answer = self.session.ask(**kw)
        except PreposError as err:
            self.check_refusal(err, kw)
            return
        raise PreposError(f"a bad request ({kw}) was answered: {answer.text!r}")

    def check_refusal(self, err: PreposError, kw: dict) -> None:
        if err.field not in kw:
            raise PreposError(f"a bad request ({kw}) was refused without naming its input: {err}")

    def do_append(self) -> None:
        text = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 4)))
        role = self.rng.choice(("user", "tool"))
        self.session.append(text, role=role)
        self.record("append", {"text": text, "role": role})
        self.bridge_ok = True

    def do_bridge(self) -> None:
        """A question (or an update) over the HTTP bridge on the same session."""
        text = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 4)))
        max_tokens = self.rng.randint(0, 10)
        ids = bridge_ask(self.server.http_url, self.session_id, text, max_tokens)
        if max_tokens:
            self.record("ask", {"text": text, "max_tokens": max_tokens}, ids)
        else:
            self.record("append", {"text": text})

    def do_one_turn(self) -> None:
        """A one-turn session over the HTTP bridge (no session id): a logical session of its own."""
        text = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 4)))
        max_tokens = self.rng.randint(1, 10)
        ids = bridge_ask(self.server.http_url, None, text, max_tokens)
        self.logs.insert(len(self.logs) - 1, [("ask", {"text": text, "max_tokens": max_tokens}, ids)])

    def do_resumed(self) -> None:
        """Another client takes the session over."""
        self.session.detach()
        self.session = self.client.session(self.session_id, resume=True)

    def do_ended(self) -> None:
        """The last question closes the session; a new one opens under the same id."""
        kw = random_question(self.rng)
        self.record("ask", kw, self.session.ask(**kw, end=True).token_ids)
        self.open()

    def do_idle(self) -> None:
        time.sleep(self.rng.choice((0.3, 1.0, 2.0)))  # time to be positioned


ACTIONS = (("ask", 22), ("timed", 8), ("pipelined", 10), ("append", 14), ("bridge", 8), ("one-turn", 3), ("bad", 4),
           ("resumed", 7), ("ended", 4), ("idle", 20))
BAD = ({"max_tokens": -1}, {"choices": ["yes", "yes"]}, {"choices": ["a<|im_end|>", "b"]}, {"role": "wizard"},
       {"stop": [""]}, {"temperature": -1.0}, {"top_p": 0.0})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3, help="servers started, one after another (default %(default)s)")
    parser.add_argument("--sessions", type=int, default=4, help="sessions at once (default %(default)s)")
    parser.add_argument("--actions", type=int, default=16,
                        help="random actions per session, half before the restart (default %(default)s)")
    parser.add_argument("--kv-budget-mb", type=float, default=0,
                        help="the server's KV budget (memory.kv_budget_bytes) in MB, small to make it evict and "
                             "rebuild sessions (default: the server's own)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "session_trials", help="run folders")
    args = parser.parse_args(argv)
    check_out_dir(parser, args.out)  # before any server starts or anything is written
    if min(args.trials, args.sessions, args.actions) < 1:
        parser.error("--trials, --sessions and --actions must be at least 1")
    if not args.kv_budget_mb >= 0:
        parser.error(f"--kv-budget-mb: expected MB >= 0, got {args.kv_budget_mb}")
    if not (ENGINE_DIR / "prepos_engine.json").is_file():
        parser.error(f"no engine in {ENGINE_DIR} (make engine builds it)")
    interrupt_on_sigterm()  # a SIGTERM stops the running trial's server on the way out
    totals: collections.Counter = collections.Counter()
    for number in range(args.trials):
        counts = trial(args.out / f"trial-{number}", number, args.sessions, args.actions,
                       kv_budget_bytes=int(args.kv_budget_mb * 1e6))
        totals.update(counts)
        print(f"trial {number + 1}: " + ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())), flush=True)
    print("in all: " + ", ".join(f"{n} {kind}" for kind, n in sorted(totals.items())))
    return 1 if totals["errors"] or totals["differed"] else 0


def trial(run_dir: Path, number: int, num_sessions: int, num_actions: int,
          kv_budget_bytes: int = 0) -> collections.Counter:
    """One trial on a fresh server, restarted halfway: the requests of each kind, errors, answers that differed,
    and sessions evicted (with ``kv_budget_bytes``, 0 for the server's default)."""
    server = trial_server(run_dir, ENGINE_DIR, journal_dir=run_dir / "journal", exit_timeout_s=2)
    if kv_budget_bytes:
        server.env["PREPOS_MEMORY_KV_BUDGET_BYTES"] = str(kv_budget_bytes)
    runs = [SessionRun(server, 1000 * number + i) for i in range(num_sessions)]
    counts: collections.Counter = collections.Counter()
    with server:
        clients = [Client(server.grpc_url) for _ in runs]
        for run, client in zip(runs, clients):
            run.client = client
            run.open()
        for phase in range(2):
            if phase:  # every session is between requests: restart on the journals
                server.stop()
                server.log_file = run_dir / "tritonserver-restarted.log"
                server.start()
                server.wait_ready()
                for run in runs:
                    run.bridge_ok = False
                counts["restarts"] += 1
            todo = num_actions // 2 if not phase else num_actions - num_actions // 2
            threads = [threading.Thread(target=run.run, args=(todo,)) for run in runs if not run.errors]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            time.sleep(1.0)  # the engine loop publishes its counters when idle
            counts["evicted"] += int(server.metric("prepos_kv_evictions_total", what="kv"))
        for run in runs:
            if not run.errors:
                run.session.close()
            counts.update(run.counts)
            counts["errors"] += len(run.errors)
            for error in run.errors:
                print(f"  error: {error}", flush=True)
        with Client(server.grpc_url) as client:
            for run in runs:
                for turns in run.logs:
                    counts["differed"] += differing_answers(client, turns)
                    counts["replayed"] += sum(kind == "ask" and ids is not None for kind, _, ids in turns)
        for client in clients:
            client.close()
    counts.setdefault("errors", 0)
    counts.setdefault("differed", 0)
    return counts


if __name__ == "__main__":
    sys.exit(main())
