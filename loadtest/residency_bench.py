"""Residency benchmark: how many short sessions one KV budget keeps resident, by the torch engine's KV block.

Starts one Triton server holding two models that differ only in ``engine.page_tokens``
(on CPU, the step a session's KV grows by): 64 (``prepos_block64``, the default) and
256 (``prepos_block256``), each with ``memory.kv_budget_bytes`` of ``--budget-mib``.
For each model in turn, ``--sessions`` sessions open (a system turn each) and ask
one short question, ``--users`` at a time, and stay open; after a pause (the
sessions' idle windows), each asks a second question, in the same order. Reported
per model: how many sessions were still resident after the first pass and the
KV bytes each of them held, the second pass's served paths (``rebuild``: the
session's KV had been evicted and its log is prefilled again) and its client TTFT
p50 / p99. Every session is closed at the end.

    python loadtest/residency_bench.py [--sessions 300] [--users 8] [--budget-mib 1024]
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("backend", "client", "loadtest"):
    sys.path.insert(0, str(ROOT / sub))

from prepos.launcher import ServerOptions, TritonServer, interrupt_on_sigterm  # noqa: E402
from prepos_client import Client  # noqa: E402
from prepos_loadtest.repository import variant_repository  # noqa: E402
from prepos_loadtest.stats import percentile  # noqa: E402

log = logging.getLogger("prepos.residency_bench")

BLOCKS = {"prepos_block64": "64", "prepos_block256": "256"}
RESIDENT_STATES = ("resident", "positioned", "serving")
QUESTIONS = ("Name a colour.", "Name a fruit.", "Name a city.", "Name an animal.")
SETTLE_S = 3.0  # the engine loop publishes its gauges when idle and at least every half second


def variants(budget_bytes: int) -> dict[str, dict[str, str]]:
    return {model: {"engine.page_tokens": block, "memory.kv_budget_bytes": str(budget_bytes)}
            for model, block in BLOCKS.items()}


def run_model(server: TritonServer, model: str, sessions: int, users: int, pause_s: float) -> dict:
    """Both passes over ``sessions`` sessions of ``model``; the figures of the module docstring."""
    with Client(server.grpc_url, model=model) as client:
        opened = [client.session() for _ in range(sessions)]

        def first(i: int) -> None:
            opened[i].append(f"You are assistant number {i}. Answer in a few words.", role="system")
            opened[i].ask(QUESTIONS[i % len(QUESTIONS)], max_tokens=8, speculate=False)

        def second(i: int):
            return opened[i].ask("And another one?", max_tokens=8, speculate=False)

        with ThreadPoolExecutor(users) as pool:
            list(pool.map(first, range(sessions)))
            time.sleep(max(pause_s, SETTLE_S))
            kv_bytes = server.metric("prepos_kv_bytes", model=model)
            resident = sum(server.metric("prepos_sessions", model=model, state=s) for s in RESIDENT_STATES)
            began = time.perf_counter()
            answers = list(pool.map(second, range(sessions)))
            wall_s = time.perf_counter() - began
            list(pool.map(lambda s: s.close(), opened))
    ttfts = [a.ttft_ms for a in answers]
    return {"kv_bytes_per_session": kv_bytes / resident if resident else 0.0, "resident": int(resident),
            "paths": dict(collections.Counter(a.path for a in answers)), "wall_s": wall_s,
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99)}


def summarize(results: dict, args: argparse.Namespace, machine: str) -> str:
    lines = [f"{args.sessions} sessions, {args.users} at a time, KV budget {args.budget_mib} MiB per model "
             f"({machine})", "",
             "| model | resident after the first pass | KV per resident session (MiB) | second pass: paths | "
             "second pass wall (s) | second pass TTFT p50 / p99 (ms) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for model, r in results.items():
        paths = ", ".join(f"{path} {n}" for path, n in sorted(r["paths"].items()))
        lines.append(f"| {model} | {r['resident']} of {args.sessions} | {r['kv_bytes_per_session'] / 2**20:.2f} | "
                     f"{paths} | {r['wall_s']:.1f} | {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=300, help="sessions per model")
    parser.add_argument("--users", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--budget-mib", type=int, default=1024, help="memory.kv_budget_bytes of each model, MiB")
    parser.add_argument("--pause", type=float, default=5.0, help="seconds between the two passes")
    parser.add_argument("--engine-dir", type=Path, default=ROOT / "engines" / "smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "residency_bench")
    parser.add_argument("--grpc-port", type=int, default=8131)
    args = parser.parse_args(argv)
    if args.sessions < 1 or args.users < 1 or args.budget_mib < 1:
        parser.error("--sessions, --users and --budget-mib must be at least 1")
    if not args.pause >= 0:
        parser.error("--pause must be >= 0")
    if not (args.engine_dir / "prepos_engine.json").is_file():
        parser.error(f"--engine-dir: no engine in {args.engine_dir} (make engine builds the default)")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out: {args.out} exists and is not a folder")

    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = ROOT / ".run" / "residency_bench"
    repo = variant_repository(run_dir, "residency_repository", variants(args.budget_mib << 20))
    options = ServerOptions(model_repositories=(repo,), grpc_port=args.grpc_port, http_port=args.grpc_port + 1,
                            metrics_port=args.grpc_port + 2, run_dir=run_dir)
    interrupt_on_sigterm()  # a SIGTERM stops the server on the way out
    results = {}
    with TritonServer(options, env={"PREPOS_ENGINE_DIR": str(args.engine_dir.resolve())}) as server:
        for model in BLOCKS:
            results[model] = run_model(server, model, args.sessions, args.users, args.pause)
            log.info("%s: %s", model, results[model])
    table = summarize(results, args, f"{platform.machine()}, {os.cpu_count()} cores")
    table_file = args.out / "residency_bench.md"
    table_file.write_text(table + "\n")
    print(table)
    print(f"\nwritten: {table_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
