"""Shared-prefix benchmark: BFCL agent sessions that open with the same tool lists, the KV of that opening copied
from another session or computed again.

Starts one Triton server holding two models that differ only in
``engine.share_prefixes``: on (``prepos_shared``, the default) against off
(``prepos_unshared``). In each round, each model in turn (the order alternates
between rounds) runs the same ``--sessions`` BFCL multi-turn sessions,
``--users`` at a time: a session opens with its system turn (the involved
classes' tool list, 300-650 tokens; sessions with the same classes have the
same one, and those whose classes begin alike share its start), waits
``--think`` seconds (0: the agent asks at once, so the system turn is prefilled
on the critical path; more: pre-positioning prefills it in the idle window),
then asks its first question with the tool names as ``choices``. Sessions stay
open until the round ends (agents that run many turns), then close; with
``--close`` each closes right after its answer (one task per session: what
later sessions can copy is then the kept openings of closed ones). Reported
per model, over all rounds: the first question's client TTFT p50 / p99 and its
paths, and per session, from the server's counters, the engine-loop seconds
(foreground and background), the tokens prefilled and the tokens whose KV was
copied from another session; and how many answers are the same on both models.

    python loadtest/share_bench.py [--sessions 40] [--users 4] [--think 0] [--rounds 2] [--close]
"""

from __future__ import annotations

import argparse
import collections
import logging
import math
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("backend", "client", "loadtest"):
    sys.path.insert(0, str(ROOT / sub))

from prepos.launcher import TritonServer, interrupt_on_sigterm  # noqa: E402
from prepos_client import Client  # noqa: E402
from prepos_loadtest.repository import (  # noqa: E402
    check_engine_dir, check_grpc_port, check_out_dir, machine, variant_server, write_table)
from prepos_loadtest.stats import path_counts, percentile  # noqa: E402
from prepos_loadtest.workloads import SessionTrace, bfcl_sessions  # noqa: E402

log = logging.getLogger("prepos.share_bench")

MODELS = {"prepos_shared": {"engine.share_prefixes": "true"}, "prepos_unshared": {"engine.share_prefixes": "false"}}
COUNTERS = ("prepos_engine_seconds_total", "prepos_prefill_tokens_total", "prepos_shared_prefix_tokens_total")
SETTLE_S = 3.0  # the engine loop publishes its counters when idle and at least every half second


def run_round(server: TritonServer, model: str, traces: list[SessionTrace], users: int, think_s: float,
              close_each: bool = False) -> dict:
    """The traces' opening (system turn, ``think_s``, first question) on ``model``, each session closed after its
    answer with ``close_each``, else at the end; answers and counter deltas."""
    before = {name: server.metric(name, model=model) for name in COUNTERS}
    with Client(server.grpc_url, model=model) as client:
        opened = [client.session() for _ in traces]

        def open_and_ask(i: int):
            system, question = traces[i].steps[0], traces[i].steps[1]
            opened[i].append(system.delta, role=system.role)
            if think_s:
                time.sleep(think_s)
            return opened[i].ask(question.delta, role=question.role, choices=list(question.choices), max_tokens=16,
                                 speculate=False, end=close_each)

        with ThreadPoolExecutor(users) as pool:
            answers = list(pool.map(open_and_ask, range(len(traces))))
            time.sleep(SETTLE_S)
            after = {name: server.metric(name, model=model) for name in COUNTERS}
            if not close_each:
                list(pool.map(lambda s: s.close(), opened))
    return {"answers": [(a.text, a.path, a.ttft_ms, a.queue_ms, a.prefill_ms) for a in answers],
            "counters": {name: after[name] - before[name] for name in COUNTERS}}


def combine(rounds: list[dict], sessions: int) -> dict:
    """One model's rounds as the table's figures."""
    ttfts = [ttft for r in rounds for _, _, ttft, _, _ in r["answers"]]
    per_session = {name: statistics.median(r["counters"][name] for r in rounds) / sessions for name in COUNTERS}
    return {"ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
            "queue_p50_ms": percentile([a[3] for r in rounds for a in r["answers"]], 50),
            "prefill_p50_ms": percentile([a[4] for r in rounds for a in r["answers"]], 50),
            "paths": dict(collections.Counter(a[1] for r in rounds for a in r["answers"])),
            "engine_s": per_session["prepos_engine_seconds_total"],
            "prefilled": per_session["prepos_prefill_tokens_total"],
            "shared": per_session["prepos_shared_prefix_tokens_total"]}


def summarize(results: dict[str, dict], same: int, total: int, args: argparse.Namespace, machine: str) -> str:
    lines = [f"`engine.share_prefixes`: {args.sessions} BFCL sessions per round, {args.users} at a time, "
             f"{args.think:g} s between the system turn and the first question, "
             f"{'each closed after its answer' if args.close else 'open until the round ends'}, {args.rounds} rounds "
             f"({machine})", "",
             "| model | first question TTFT p50 / p99 (ms) | its server queue / prefill p50 (ms) | paths | "
             "engine-loop s per session | tokens prefilled per session | tokens shared per session |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for model, r in results.items():
        lines.append(f"| {model} | {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | "
                     f"{r['queue_p50_ms']:.1f} / {r['prefill_p50_ms']:.1f} | {path_counts(r['paths'])} | {r['engine_s']:.3f} | "
                     f"{r['prefilled']:.0f} | {r['shared']:.0f} |")
    lines += ["", f"Same answer on both models: {same} of {total}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=40, help="BFCL sessions per model and round (at most 200)")
    parser.add_argument("--users", type=int, default=4, help="sessions in flight at once")
    parser.add_argument("--think", type=float, default=0.0, help="seconds between the system turn and the question")
    parser.add_argument("--rounds", type=int, default=2, help="rounds (each runs both models)")
    parser.add_argument("--close", action="store_true", help="close each session right after its answer")
    parser.add_argument("--engine-dir", type=Path, default=ROOT / "engines" / "smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "share_bench")
    parser.add_argument("--grpc-port", type=int, default=8141)
    args = parser.parse_args(argv)
    if not 1 <= args.sessions <= 200:
        parser.error("--sessions must be in [1, 200] (BFCL's multi-turn base set)")
    if args.users < 1 or args.rounds < 1:
        parser.error("--users and --rounds must be at least 1")
    if not (math.isfinite(args.think) and args.think >= 0):
        parser.error("--think must be a number >= 0")
    check_engine_dir(parser, args.engine_dir)
    check_out_dir(parser, args.out)
    check_grpc_port(parser, args.grpc_port)

    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = ROOT / ".run" / "share_bench"
    interrupt_on_sigterm()  # a SIGTERM stops the server on the way out
    rounds: dict[str, list[dict]] = {model: [] for model in MODELS}
    with variant_server(run_dir, "share_repository", MODELS, args.grpc_port, args.engine_dir) as server:
        for index in range(args.rounds):
            traces = bfcl_sessions(args.sessions, seed=index)
            for model in (list(MODELS) if index % 2 == 0 else list(MODELS)[::-1]):
                rounds[model].append(run_round(server, model, traces, args.users, args.think, args.close))
                log.info("round %d, %s: %s", index + 1, model, rounds[model][-1]["counters"])
    shared, unshared = rounds.values()
    pairs = [(a[0], b[0]) for r1, r2 in zip(shared, unshared) for a, b in zip(r1["answers"], r2["answers"])]
    results = {model: combine(model_rounds, args.sessions) for model, model_rounds in rounds.items()}
    table = summarize(results, sum(a == b for a, b in pairs), len(pairs), args, machine())
    write_table(args.out / f"share_bench_think{args.think:g}{'_close' if args.close else ''}.md", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
