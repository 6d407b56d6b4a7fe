"""Batching benchmark: sessions answering at the same time, with and without decode (or prefill) batching, in one run.

Starts one Triton server holding two models that share the engine directory and
differ in one setting. With ``--mode decode`` (the default): ``prepos_batched``
(``scheduler.max_decode_batch`` 32: requests decoding at the same time take
their steps as one batch) and ``prepos_unbatched`` (1: one session's step at a
time). With ``--mode prefill``: ``scheduler.max_prefill_batch`` 16 (requests
arriving together prefill their turns in one forward pass) against 1, and one
token per answer by default, so a request is its prefill and one scan. With
``--mode scan``: ``engine.scan`` ``cpu`` (``prepos_scan_cpu``: the compiled
greedy scan) against ``torch`` (``prepos_scan_torch``), which every decoded token
of every session pays. With ``--mode stream``: ``scheduler.stream_interval`` 8
(``prepos_stream8``: after the first token, one response per 8 tokens) against 1
(``prepos_stream1``: one response per token), decode batching on in both. With
``--mode block``: ``engine.page_tokens`` 64 (``prepos_block64``) against 256
(``prepos_block256``), the step a session's KV grows by on CPU. With
``--mode pieces``: ``scheduler.max_prefill_batch_tokens`` 512 (``prepos_pieces``:
a longer prefill goes in pieces of at most 512 new tokens, the other sessions' decode
steps between them) against 65536 (``prepos_whole``: one step); in each wave
the sessions but one stream answers, and the last one, once they stream, sends
a long turn (``--long-tokens``, about 3,000 tokens by default); reported: the
longest wait between two tokens of each streamed answer, and the long turn's
first token. Pre-positioning is off in both, so every answer is a ``prefix`` prefill
(followed by its decode) and the two differ only in how the one setting's
steps run. A wave opens ``users`` sessions (a system turn each), asks every one
a free-form question at the same moment (``--max-tokens`` greedy tokens at
most) and closes them; waves alternate between the models. Reported per model
and number of users: the answers' tokens per second over the wave's wall time
(median of the waves), and the p50 / p99 of each request's total time, as the
client sees it.

    python loadtest/batch_bench.py [--mode decode|prefill|scan|stream|block|pieces] [--users 1,4,8] [--waves 3]
        [--max-tokens 48] [--long-tokens 3000]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("backend", "client", "loadtest"):
    sys.path.insert(0, str(ROOT / sub))

from prepos.launcher import interrupt_on_sigterm  # noqa: E402
from prepos_client import Client  # noqa: E402
from prepos_loadtest.repository import (  # noqa: E402
    check_engine_dir, check_grpc_port, check_out_dir, machine, variant_server)
from prepos_loadtest.stats import percentile  # noqa: E402

log = logging.getLogger("prepos.batch_bench")

BATCHING = ("prepos_batched", "prepos_unbatched")
MODES = {  # the setting each mode compares, and the two models: the new way first, then the baseline
    "decode": ("scheduler.max_decode_batch", dict(zip(BATCHING, ("32", "1")))),
    "prefill": ("scheduler.max_prefill_batch", dict(zip(BATCHING, ("16", "1")))),
    "scan": ("engine.scan", {"prepos_scan_cpu": "cpu", "prepos_scan_torch": "torch"}),
    "stream": ("scheduler.stream_interval", {"prepos_stream8": "8", "prepos_stream1": "1"}),
    "block": ("engine.page_tokens", {"prepos_block64": "64", "prepos_block256": "256"}),
    "pieces": ("scheduler.max_prefill_batch_tokens", {"prepos_pieces": "512", "prepos_whole": "65536"}),
}
OUTPUTS = {"decode": "batch_bench.md", "prefill": "prefill_batch_bench.md", "scan": "scan_batch_bench.md",
           "stream": "stream_bench.md", "block": "block_bench.md", "pieces": "pieces_bench.md"}
DEFAULT_MAX_TOKENS = {"decode": 48, "prefill": 1, "scan": 48, "stream": 48, "block": 48, "pieces": 64}


def variants(mode: str) -> dict[str, dict[str, str]]:
    """The two models of ``mode``: pre-positioning off, the mode's setting the new way or the baseline's."""
    key, values = MODES[mode]
    return {model: {"scheduler.preposition": "false", key: value} for model, value in values.items()}
SYSTEM = "You are a helpful assistant. Answer in full sentences."
QUESTIONS = (
    "Explain how a thermostat keeps a room warm.",
    "Describe the water cycle to a child.",
    "What should I pack for a weekend hiking trip?",
    "Why do leaves change colour in autumn?",
    "Give me three tips for writing a clear email.",
    "How does a bicycle stay upright while moving?",
    "What is the difference between weather and climate?",
    "Suggest a simple recipe for dinner tonight.",
)


def wave(url: str, model: str, users: int, max_tokens: int) -> dict:
    """All ``users`` sessions ask at once; returns the wave's wall time, tokens and per-request times."""
    barrier = threading.Barrier(users)
    results: list[tuple[float, float, int, float] | BaseException | None] = [None] * users

    def user(i: int) -> None:
        try:
            with Client(url, model=model) as client, client.session() as session:
                session.append(SYSTEM, role="system")
                barrier.wait(timeout=120)
                began = time.perf_counter()
                answer = session.ask(QUESTIONS[i % len(QUESTIONS)], max_tokens=max_tokens)
                results[i] = (began, time.perf_counter(), len(answer.token_ids), answer.total_ms)
        except BaseException as err:  # reported below: a failed request fails the benchmark
            results[i] = err
            barrier.abort()

    threads = [threading.Thread(target=user, args=(i,)) for i in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [r for r in results if not isinstance(r, tuple)]
    if failed:
        raise RuntimeError(f"{model}: {len(failed)} of {users} requests failed: {failed[0]!r}")
    wall_s = max(r[1] for r in results) - min(r[0] for r in results)
    return {"wall_s": wall_s, "tokens": sum(r[2] for r in results), "total_ms": [r[3] for r in results]}


def long_turn(num_tokens: int) -> str:
    """A user turn of about ``num_tokens`` tokens: numbered lines of a log to summarize."""
    lines = [f"{i:05d} sensor {i % 7} read {i * 37 % 1000} at step {i}" for i in range(num_tokens // 19 + 1)]
    return "Summarize this log in one sentence.\n" + "\n".join(lines)


def pieces_wave(url: str, model: str, users: int, max_tokens: int, long_tokens: int) -> dict:
    """``users - 1`` sessions stream answers; once each has its first token, the last session sends a turn of
    about ``long_tokens`` tokens. Returns each streamed answer's longest wait between two tokens, and the long
    turn's first-token time (ms, as the client sees them)."""
    streaming = threading.Barrier(users)
    gaps: list[float] = []
    long_first: list[float] = []
    errors: list[BaseException] = []

    def streamer(i: int) -> None:
        try:
            with Client(url, model=model) as client, client.session() as session:
                session.append(SYSTEM, role="system")
                times: list[float] = []
                for _ in session.generate(QUESTIONS[i % len(QUESTIONS)], max_tokens=max_tokens):
                    if not times:  # the first token: wait for the others, then time from the long turn's start
                        streaming.wait(timeout=120)
                    times.append(time.perf_counter())
                gaps.append(max((b - a for a, b in zip(times, times[1:])), default=0.0) * 1e3)
        except BaseException as err:  # reported below
            errors.append(err)
            streaming.abort()

    def reader() -> None:
        try:
            with Client(url, model=model) as client, client.session() as session:
                session.append(SYSTEM, role="system")
                streaming.wait(timeout=120)
                long_first.append(session.ask(long_turn(long_tokens), max_tokens=1, speculate=False).ttft_ms)
        except BaseException as err:
            errors.append(err)
            streaming.abort()

    threads = [threading.Thread(target=streamer, args=(i,)) for i in range(users - 1)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{model}: {len(errors)} of {users} sessions failed: {errors[0]!r}")
    return {"gap_ms": gaps, "long_first_ms": long_first}


def summarize_pieces(runs: dict, args: argparse.Namespace, machine: str) -> str:
    key, values = MODES[args.mode]
    lines = [f"`{key}` {' / '.join(values.values())} ({machine}; pre-positioning off in both; the other sessions "
             f"stream at most {args.max_tokens} tokens while one sends a turn of about {args.long_tokens} tokens; "
             f"{args.waves} alternating waves per row)", "",
             "| users | model | longest wait between two streamed tokens p50 / max (ms) | long turn's first token "
             "median (ms) |", "| --- | --- | --- | --- |"]
    for users in args.users:
        for model in values:
            waves = runs[users][model]
            gaps = [ms for w in waves for ms in w["gap_ms"]]
            firsts = [ms for w in waves for ms in w["long_first_ms"]]
            lines.append(f"| {users} | {model} | {percentile(gaps, 50):.0f} / {max(gaps):.0f} | "
                         f"{statistics.median(firsts):.0f} |")
    return "\n".join(lines)


def summarize(runs: dict, args: argparse.Namespace, machine: str) -> str:
    key, values = MODES[args.mode]
    new, base = values
    lines = [f"`{key}` {' / '.join(values.values())} ({machine}; pre-positioning off in both; greedy, at most "
             f"{args.max_tokens} tokens per answer; {args.waves} alternating waves per row)", "",
             f"| users | model | tokens/s (median wave) | request total p50 / p99 (ms) | tokens/s {new} / {base} |",
             "| --- | --- | --- | --- | --- |"]
    for users in args.users:
        rates = {}
        for model in values:
            waves = runs[users][model]
            rates[model] = statistics.median(w["tokens"] / w["wall_s"] for w in waves)
            totals = [ms for w in waves for ms in w["total_ms"]]
            ratio = ""
            if model == base:
                ratio = f"{rates[new] / rates[base]:.2f}"
            lines.append(f"| {users} | {model} | {rates[model]:.1f} | {percentile(totals, 50):.0f} / "
                         f"{percentile(totals, 99):.0f} | {ratio} |")
    return "\n".join(lines)


def user_counts(text: str) -> list[int]:
    """``--users``: comma-separated whole numbers of at least 1 (``1,4,8``)."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers of at least 1 (1,4,8), got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=user_counts, default=None,
                        help="comma-separated numbers of sessions asking at once (1,4,8; pieces: 2,4)")
    parser.add_argument("--waves", type=int, default=3, help="waves per model and number of users")
    parser.add_argument("--mode", choices=sorted(MODES), default="decode", help="which setting to compare")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens per answer at most (decode: 48, prefill: 1, pieces: 64)")
    parser.add_argument("--long-tokens", type=int, default=3000, help="pieces: about how many tokens the long turn has")
    parser.add_argument("--engine-dir", type=Path, default=ROOT / "engines" / "smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "batch_bench")
    parser.add_argument("--grpc-port", type=int, default=8121)
    args = parser.parse_args(argv)
    if args.max_tokens is None:
        args.max_tokens = DEFAULT_MAX_TOKENS[args.mode]
    if args.users is None:
        args.users = [2, 4] if args.mode == "pieces" else [1, 4, 8]
    if args.waves < 1 or args.max_tokens < 1 or args.long_tokens < 1:
        parser.error("--waves, --max-tokens and --long-tokens must be at least 1")
    if args.mode == "pieces" and min(args.users) < 2:
        parser.error("--mode pieces needs at least 2 users (one sends the long turn while the others stream)")
    check_engine_dir(parser, args.engine_dir)
    check_out_dir(parser, args.out)
    check_grpc_port(parser, args.grpc_port)

    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = ROOT / ".run" / "batch_bench"
    models = variants(args.mode)
    runs: dict = {users: {model: [] for model in models} for users in args.users}
    interrupt_on_sigterm()  # a SIGTERM stops the server on the way out
    with variant_server(run_dir, "batch_repository", models, args.grpc_port, args.engine_dir) as server:
        for model in models:  # warm-up: first requests pay one-time costs
            wave(server.grpc_url, model, 2, 4)
        for users in args.users:
            for index in range(args.waves):
                order = list(models) if index % 2 == 0 else list(reversed(models))
                for model in order:
                    if args.mode == "pieces":
                        result = pieces_wave(server.grpc_url, model, users, args.max_tokens, args.long_tokens)
                        log.info("%d users, %s: longest waits %s ms, long turn's first token %.0f ms", users, model,
                                 [round(ms) for ms in result["gap_ms"]], result["long_first_ms"][0])
                    else:
                        result = wave(server.grpc_url, model, users, args.max_tokens)
                        log.info("%d users, %s: %d tokens in %.2f s", users, model, result["tokens"], result["wall_s"])
                    runs[users][model].append(result)
    table = (summarize_pieces if args.mode == "pieces" else summarize)(runs, args, machine())
    table_file, runs_file = args.out / OUTPUTS[args.mode], args.out / f"runs_{args.mode}.json"
    table_file.write_text(table + "\n")
    runs_file.write_text(json.dumps(runs, indent=1))
    print(table)
    print(f"\nwritten: {table_file}, {runs_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
