"""Residency benchmark: short sessions under one KV budget, asking again and again, by KV block or eviction policy.

Starts one Triton server holding two models that differ in one setting, each with
``memory.kv_budget_bytes`` of ``--budget-mib``. With ``--mode block`` (the
default): ``engine.page_tokens`` (on CPU, the step a session's KV grows by) 64
(``prepos_block64``, the default) against 256 (``prepos_block256``). With
``--mode eviction``: ``memory.eviction_policy`` ``next_use`` (``prepos_next_use``)
against ``lru`` (``prepos_lru``), both with 64-token blocks. For each model in
turn, ``--sessions`` sessions open (a system turn each) and ask one short
question, ``--users`` at a time, and stay open; then, after a pause (the
sessions' idle windows), each asks again, in the same order, ``--passes`` passes
in all. Reported per model: how many sessions were resident after the first pass
and the KV bytes each held, and over the later passes the served paths
(``rebuild``: the session's KV had been evicted and its log is prefilled again;
also counted per pass), the wall time per pass and the client TTFT p50 / p99.
Every session is closed at the end.

    python loadtest/residency_bench.py [--mode block|eviction] [--sessions 300] [--users 8] [--budget-mib N] [--passes N]
"""

from __future__ import annotations

import argparse
import collections
import logging
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

log = logging.getLogger("prepos.residency_bench")

MODES = {  # the setting each mode compares, its two models (the new way first), the budget and passes by default
    "block": ("engine.page_tokens", {"prepos_block64": "64", "prepos_block256": "256"}, 1024, 2),
    "eviction": ("memory.eviction_policy", {"prepos_next_use": "next_use", "prepos_lru": "lru"}, 512, 4),
}
RESIDENT_STATES = ("resident", "positioned", "serving")
QUESTIONS = ("Name a colour.", "Name a fruit.", "Name a city.", "Name an animal.")
SETTLE_S = 3.0  # the engine loop publishes its gauges when idle and at least every half second


def variants(mode: str, budget_bytes: int) -> dict[str, dict[str, str]]:
    key, values, _, _ = MODES[mode]
    return {model: {key: value, "memory.kv_budget_bytes": str(budget_bytes)} for model, value in values.items()}


def run_model(server: TritonServer, model: str, sessions: int, users: int, pause_s: float, passes: int) -> dict:
    """``passes`` passes over ``sessions`` sessions of ``model``; the figures of the module docstring."""
    with Client(server.grpc_url, model=model) as client:
        opened = [client.session() for _ in range(sessions)]

        def first(i: int) -> None:
            opened[i].append(f"You are assistant number {i}. Answer in a few words.", role="system")
            opened[i].ask(QUESTIONS[i % len(QUESTIONS)], max_tokens=8, speculate=False)

        def again(i: int):
            return opened[i].ask("And another one?", max_tokens=8, speculate=False)

        answers, walls = [], []
        with ThreadPoolExecutor(users) as pool:
            list(pool.map(first, range(sessions)))
            time.sleep(max(pause_s, SETTLE_S))
            kv_bytes = server.metric("prepos_kv_bytes", model=model)
            resident = sum(server.metric("prepos_sessions", model=model, state=s) for s in RESIDENT_STATES)
            for index in range(1, passes):
                if index > 1:
                    time.sleep(pause_s)
                began = time.perf_counter()
                answers.append(list(pool.map(again, range(sessions))))
                walls.append(time.perf_counter() - began)
            list(pool.map(lambda s: s.close(), opened))
    ttfts = [a.ttft_ms for each_pass in answers for a in each_pass]
    return {"kv_bytes_per_session": kv_bytes / resident if resident else 0.0, "resident": int(resident),
            "paths": dict(collections.Counter(a.path for each_pass in answers for a in each_pass)),
            "rebuilds": [sum(a.path == "rebuild" for a in each_pass) for each_pass in answers],
            "wall_s": statistics.median(walls),
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99)}


def summarize(results: dict, args: argparse.Namespace, machine: str) -> str:
    key = MODES[args.mode][0]
    lines = [f"`{key}`: {args.sessions} sessions, {args.users} at a time, KV budget {args.budget_mib} MiB per model, "
             f"{args.passes} passes ({machine})", "",
             "| model | resident after the first pass | KV per resident session (MiB) | later passes: paths | "
             "`rebuild` per later pass | wall per later pass (s, median) | later passes TTFT p50 / p99 (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for model, r in results.items():
        lines.append(f"| {model} | {r['resident']} of {args.sessions} | {r['kv_bytes_per_session'] / 2**20:.2f} | "
                     f"{path_counts(r['paths'])} | {', '.join(map(str, r['rebuilds']))} | {r['wall_s']:.1f} | "
                     f"{r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="block", help="which setting to compare")
    parser.add_argument("--sessions", type=int, default=300, help="sessions per model")
    parser.add_argument("--users", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--budget-mib", type=int, default=None,
                        help="memory.kv_budget_bytes of each model, MiB (block: 1024, eviction: 512)")
    parser.add_argument("--passes", type=int, default=None, help="passes over the sessions (block: 2, eviction: 4)")
    parser.add_argument("--pause", type=float, default=5.0, help="seconds between two passes")
    parser.add_argument("--engine-dir", type=Path, default=ROOT / "engines" / "smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "residency_bench")
    parser.add_argument("--grpc-port", type=int, default=8131)
    args = parser.parse_args(argv)
    _, _, budget_mib, passes = MODES[args.mode]
    args.budget_mib = budget_mib if args.budget_mib is None else args.budget_mib
    args.passes = passes if args.passes is None else args.passes
    if args.sessions < 1 or args.users < 1 or args.budget_mib < 1:
        parser.error("--sessions, --users and --budget-mib must be at least 1")
    if args.passes < 2:
        parser.error("--passes must be at least 2")
    if not args.pause >= 0:
        parser.error("--pause must be >= 0")
    check_engine_dir(parser, args.engine_dir)
    check_out_dir(parser, args.out)
    check_grpc_port(parser, args.grpc_port)

    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = ROOT / ".run" / "residency_bench"
    models = variants(args.mode, args.budget_mib << 20)
    interrupt_on_sigterm()  # a SIGTERM stops the server on the way out
    results = {}
    with variant_server(run_dir, "residency_repository", models, args.grpc_port, args.engine_dir) as server:
        for model in models:
            results[model] = run_model(server, model, args.sessions, args.users, args.pause, args.passes)
            log.info("%s: %s", model, results[model])
    write_table(args.out / f"{args.mode}_bench.md", summarize(results, args, machine()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
