"""Path benchmark: first-token latency per served path against baselines, in one run.

Starts one Triton server holding four models that share the engine directory:
``prepos`` (as configured), ``prepos_prefix`` (pre-positioning off: what a
prefix cache pays), ``prepos_stateless`` (KV dropped after every request: the
whole log is prefilled each time) and ``floor`` (a no-op decoupled model: the
transport floor). The same session traces (BFCL multi-turn tool routing and a
streaming monitor) replay against each, one session at a time, with think time
between turns; then an interference run and the engine's decode-step figures.
Writes a markdown table and the raw samples as JSON.

    python loadtest/bench.py [--sessions 3] [--think-time 2] [--out out/bench]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
for sub in ("backend", "client", "loadtest"):
    sys.path.insert(0, str(ROOT / sub))

from prepos.launcher import TritonServer, interrupt_on_sigterm  # noqa: E402
from prepos_client import Client  # noqa: E402
from prepos_loadtest.repository import check_engine_dir, check_grpc_port, check_out_dir, variant_server  # noqa: E402
from prepos_loadtest.stats import percentile  # noqa: E402
from prepos_loadtest.workloads import SessionTrace, Step, bfcl_sessions, monitor_sessions  # noqa: E402

log = logging.getLogger("prepos.bench")

VARIANTS = {  # model name -> parameters added to prepos's config
    "prepos": {},
    "prepos_prefix": {"scheduler.preposition": "false"},
    # stateless: no KV kept between requests, and none copied from other sessions' requests in flight
    "prepos_stateless": {"scheduler.preposition": "false", "scheduler.retain_kv": "false",
                         "engine.share_prefixes": "false"},
}


@dataclass
class Sample:
    mode: str  # model served
    workload: str
    session: str
    step: int
    path: str
    delta_tokens_hint: int  # characters of the delta, to pair prepaid and prefix at the same delta
    ttft_ms: float  # client-measured
    server_first_token_ms: float
    total_ms: float
    answer: str
    expected: str | None
    queue_ms: float | None = None  # server: arrival to the engine loop picking it up
    compute_ms: float | None = None  # server: engine-loop time spent on it
    pair: int | None = None  # replay_paired_with_floor: the question both models answered


def questions(client: Client, traces: list[SessionTrace],
              label: str) -> Iterator[tuple[SessionTrace, int, Step, Any]]:
    """Replay ``traces`` on ``client``, one session each, appending every update after its think time; yield each
    question, after its think time, with its index and session, for the caller to ask."""
    for trace in traces:
        with client.session() as session:
            for index, step in enumerate(trace.steps):
                time.sleep(step.delay_s)
                if step.max_tokens == 0:
                    session.append(step.delta, role=step.role)
                    continue
                yield trace, index, step, session
        log.info("%s: %s done", label, trace.name)


def replay(url: str, model: str, traces: list[SessionTrace], workload: str,
           gate_threshold: float | None = None) -> list[Sample]:
    samples = []
    with Client(url, model=model) as client:
        for trace, index, step, session in questions(client, traces, f"{model} {workload}"):
            answer = session.ask(step.delta, role=step.role, max_tokens=step.max_tokens,
                                 choices=list(step.choices) if step.choices else None,
                                 gate_threshold=gate_threshold, speculate=True)
            samples.append(Sample(model, workload, trace.name, index, answer.path, len(step.delta),
                                  answer.ttft_ms, answer.first_token_ms, answer.total_ms, answer.text,
                                  step.expected))
    return samples


def measure_floor(url: str, payloads: list[Step], gap_s: float, label: str) -> list[Sample]:
    """The no-op model answering the same request payloads after the same idle gap: the transport floor."""
    samples = []
    with Client(url, model="floor") as client, client.session() as session:
        for index, step in enumerate(payloads):
            time.sleep(gap_s)
            answer = session.ask(step.delta, role=step.role, max_tokens=1,
                                 choices=list(step.choices) if step.choices else None)
            samples.append(Sample("floor", label, "floor", index, "floor", len(step.delta), answer.ttft_ms,
                                  answer.first_token_ms, answer.total_ms, "", None))
    return samples


def replay_paired_with_floor(url: str, traces: list[SessionTrace], gap_s: float) -> list[Sample]:
    """The forced-gate replay again, each question also sent to the floor with the same payload ``gap_s``
    before or after it (the order alternates), so the two meet the same moment of the machine: after the
    session's think time, with whatever pre-positioning its updates started already done or not alike."""
    samples = []
    with Client(url, model="prepos") as client, Client(url, model="floor") as floor_client, \
            floor_client.session() as floor:
        for pair, (trace, index, step, session) in enumerate(questions(client, traces, "prepos and floor, paired")):
            choices = list(step.choices) if step.choices else None
            asks = [lambda: ("prepos", session.ask(step.delta, role=step.role, max_tokens=step.max_tokens,
                                                   choices=choices, gate_threshold=0.0, speculate=True)),
                    lambda: ("floor", floor.ask(step.delta, role=step.role, max_tokens=1, choices=choices))]
            for position, ask in enumerate(asks if pair % 2 else asks[::-1]):
                if position:
                    time.sleep(gap_s)
                model, answer = ask()
                samples.append(Sample(model, "gate-floor-pairs", trace.name, index, answer.path, len(step.delta),
                                      answer.ttft_ms, answer.first_token_ms, answer.total_ms,
                                      answer.text if model == "prepos" else "", None, pair=pair))
    return samples


def paired_floor_ratios(samples: list[Sample]) -> tuple[float, float, int]:
    """From :func:`replay_paired_with_floor`: gated client p50 over the floor's in the same pairs, the median
    of the per-pair ratios, and the number of pairs (those whose prepos answer was ``gated``)."""
    pairs: dict[int, dict[str, Sample]] = {}
    for s in samples:
        if s.workload == "gate-floor-pairs":
            pairs.setdefault(s.pair, {})[s.mode] = s
    kept = [p for p in pairs.values() if "floor" in p and p.get("prepos") and p["prepos"].path == "gated"]
    if not kept:
        return float("nan"), float("nan"), 0
    gated = percentile([p["prepos"].ttft_ms for p in kept], 50)
    floor = percentile([p["floor"].ttft_ms for p in kept], 50)
    return gated / floor, statistics.median(p["prepos"].ttft_ms / p["floor"].ttft_ms for p in kept), len(kept)


def _wait_background_idle(server: TritonServer, model: str, quiet_s: float = 1.0, timeout_s: float = 120) -> None:
    """Wait until the model's background prefill counter stops moving (pre-positioning finished)."""
    def background_tokens() -> float:
        return server.metric("prepos_prefill_tokens_total", model=model, where="background")

    deadline, last, still_since = time.monotonic() + timeout_s, -1.0, time.monotonic()
    while time.monotonic() < deadline:
        now = background_tokens()
        if now != last:
            last, still_since = now, time.monotonic()
        elif time.monotonic() - still_since >= quiet_s:
            return
        time.sleep(0.1)


def measure_interference(server: TritonServer, model: str, num: int, think_s: float) -> list[Sample]:
    """Pairs of the same request of session B: once with nothing in the background, once while another
    session's long update is being pre-positioned.

    The two conditions alternate, so a drift of the machine's speed during the run
    reaches both alike. Before each request the background is idle, so B is
    positioned either way (the request is served ``prepaid``); in the second of a
    pair a fresh session A appends a long document just before B asks, and its
    pre-positioning (seconds of work) runs while B's request arrives and is served.
    """
    def document(tag: str) -> str:
        return " ".join(f"{tag} line {i}: sensor {i % 7} reported value {i * 37 % 101}." for i in range(40))

    samples = []
    with Client(server.grpc_url, model=model) as client, client.session() as b:
        b.append("You answer with one word.", role="system")
        for index in range(num):
            for condition in ("off", "on"):
                _wait_background_idle(server, model)
                a = client.session() if condition == "on" else None
                if a is not None:
                    a.append(document(f"Pair {index}"), role="user")  # its pre-positioning starts now
                time.sleep(think_s)
                answer = b.ask(f"Question {index}: pick a color.", max_tokens=1, speculate=False)
                samples.append(Sample(model, f"interference-{condition}", "b", index, answer.path, 0, answer.ttft_ms,
                                      answer.first_token_ms, answer.total_ms, answer.text, None,
                                      answer.queue_ms, answer.compute_ms))
                if a is not None:
                    a.close()
    return samples


def engine_figures(engine_dir: Path) -> dict:
    """Decode step vs the memory-bandwidth bound, and prefill throughput (same machine, same run)."""
    try:
        import engine_microbench
    except ImportError:
        return {}
    try:
        return engine_microbench.measure(str(engine_dir), steps=40)
    except Exception as err:  # the table says it is missing rather than the run failing
        log.warning("engine figures unavailable: %s", err)
        return {}


def collector_figures(server: TritonServer, model: str = "prepos") -> dict[str, float | int]:
    """The model's full garbage collections over the run (each stops its process) and their summed pause."""
    full = {"generation": "2", "model": model}
    return {"full garbage collections in prepos's process": int(server.metric("prepos_gc_collections_total", **full)),
            "their summed pause (ms)": server.metric("prepos_gc_pause_seconds_total", **full) * 1e3}


def summarize(samples: list[Sample], engine: dict, machine: str,
              collector: dict[str, float | int] | None = None) -> tuple[str, dict]:
    def group(**match):
        return [s for s in samples if all(getattr(s, k) == v for k, v in match.items())]

    rows, figures = [], {}

    def row(label, chosen):
        if not chosen:
            return
        ttft = [s.ttft_ms for s in chosen]
        server = [s.server_first_token_ms for s in chosen if s.server_first_token_ms is not None]
        figures[label] = {"n": len(chosen), "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
                          "server_p50": percentile(server, 50), "server_p99": percentile(server, 99)}
        rows.append((label, chosen))

    workloads = [("bfcl", "BFCL tool routing"), ("monitor", "streaming monitor")]
    for workload, _ in workloads:
        row(f"{workload}: stateless baseline", group(mode="prepos_stateless", workload=workload))
        row(f"{workload}: prefix-cache baseline", group(mode="prepos_prefix", workload=workload))
        for path in ("exact", "gated", "prepaid", "prefix", "rebuild"):
            row(f"{workload}: {path}", group(mode="prepos", workload=workload, path=path))
    row("bfcl, gate forced (threshold 0): gated", group(mode="prepos", workload="bfcl-forced-gate", path="gated"))
    row("transport floor, monitor payloads", group(workload="floor-monitor"))
    row("transport floor, BFCL payloads", group(workload="floor-bfcl"))
    row("interference: another session pre-positioning", group(workload="interference-on"))
    row("interference: nothing in the background", group(workload="interference-off"))

    def fig(label, key):
        return figures.get(label, {}).get(key, float("nan"))

    base = "bfcl: prefix-cache baseline"
    forced = "bfcl, gate forced (threshold 0): gated"
    lines = [
        f"Machine: {machine}. Sessions replayed one at a time; client TTFT includes gRPC; "
        "server first token is arrival in `execute` to the first response.",
        "",
        "| served | n | client TTFT p50 (ms) | p99 | server first token p50 (ms) | p99 | p50 vs prefix-cache baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, chosen in rows:
        f = figures[label]
        workload = label.split(":")[0].split(",")[0]
        baseline = fig(f"{workload}: prefix-cache baseline", "ttft_p50")
        ratio = baseline / f["ttft_p50"] if f["ttft_p50"] and baseline == baseline else float("nan")
        versus = f"{ratio:.1f}x faster" if ratio == ratio else ""
        lines.append(f"| {label} | {f['n']} | {f['ttft_p50']:.2f} | {f['ttft_p99']:.2f} | {f['server_p50']:.3f} | "
                     f"{f['server_p99']:.3f} | {versus} |")

    delta_requests = [s for s in samples if s.mode == "prepos" and s.workload == "bfcl" and s.delta_tokens_hint > 0]
    gated = [s for s in delta_requests if s.path == "gated"]
    positioned = [s for s in delta_requests if s.path in ("gated", "prepaid")]
    agree = [s for s in gated if s.expected is not None and s.answer == s.expected]
    paired_p50, paired_median, num_pairs = paired_floor_ratios(samples)
    derived = {
        "gate coverage (gated / positioned requests with a delta)": f"{len(gated)}/{len(positioned)}",
        "gated answers equal to the workload's expected answer": f"{len(agree)}/{len(gated)}",
        "prefix / gated first-token ratio, BFCL, gate forced (client p50)":
            fig(base, "ttft_p50") / fig(forced, "ttft_p50"),
        "prefix / gated first-token ratio, BFCL, gate forced (server p50)":
            fig(base, "server_p50") / fig(forced, "server_p50"),
        "prefix / exact first-token ratio, monitor (client p50)":
            fig("monitor: prefix-cache baseline", "ttft_p50") / fig("monitor: exact", "ttft_p50"),
        "exact / floor client p50 (same payloads)":
            fig("monitor: exact", "ttft_p50") / fig("transport floor, monitor payloads", "ttft_p50"),
        "gated / floor client p50 (same payloads, gate forced)":
            fig(forced, "ttft_p50") / fig("transport floor, BFCL payloads", "ttft_p50"),
        "gated / floor client p50, paired (each question to both, alternating order, 0.3 s apart)":
            f"{paired_p50:.2f} (median of the {num_pairs} pairs' ratios: {paired_median:.2f})",
        "exact server first token p50 (ms)": fig("monitor: exact", "server_p50"),
        "gated server first token p50 (ms, gate forced)": fig(forced, "server_p50"),
        "prepaid / prefix at the same delta (BFCL, paired p50)": paired_ratio(samples),
        "interference: queue wait p50 / p99 while another session is pre-positioned (ms)":
            "{:.1f} / {:.1f}".format(*_queue_pcts(samples, "interference-on")),
        "interference: queue wait p50 / p99 with nothing in the background (ms)":
            "{:.1f} / {:.1f}".format(*_queue_pcts(samples, "interference-off")),
        "interference p99 ratio (another session pre-positioning / nothing in the background)":
            fig("interference: another session pre-positioning", "ttft_p99")
            / fig("interference: nothing in the background", "ttft_p99"),
    }
    derived.update(collector or {})
    if engine:
        derived.update({
            "torch engine decode step p50, 100-token context (ms)": engine["engine_decode_median_ms"],
            "torch engine decode step p99 (ms)": engine["engine_decode_p99_ms"],
            "memory-bound decode step: weight bytes / read bandwidth (ms)": engine["decode_bound_ms"],
            "decode step / memory bound (median of paired rounds)": engine["engine_decode_ratio_to_bound"],
            "decode step / memory bound at the run's fastest probe": engine["engine_decode_ratio_to_fastest_probe"],
            "read bandwidth (GB/s, median of rounds)": engine["read_bandwidth_gb_s"],
            f"torch engine decode step p50, {engine['long_context']}-token context (ms)":
                engine["long_decode_median_ms"],
            "its bound: weights + KV read / read bandwidth (ms)": engine["long_decode_bound_ms"],
            "Hugging Face eager decode step p50 (ms)": engine["hf_eager_decode_median_ms"],
            "prefill throughput, 40-token extension (tokens/s)": engine["engine_prefill_tok_s"]["40"],
            "prefill throughput, 512-token extension (tokens/s)": engine["engine_prefill_tok_s"]["512"],
        })
    lines += ["", "| figure | value |", "|---|---|"]
    for name, value in derived.items():
        lines.append(f"| {name} | {value:.2f} |" if isinstance(value, float) else f"| {name} | {value} |")
    figures["derived"] = derived
    return "\n".join(lines), figures


def _queue_pcts(samples: list[Sample], workload: str) -> tuple[float, float]:
    waits = [s.queue_ms for s in samples if s.workload == workload and s.queue_ms is not None]
    return percentile(waits, 50), percentile(waits, 99)


def paired_ratio(samples: list[Sample]) -> float:
    """Median over the same (session, step) of prepaid TTFT / prefix-baseline TTFT."""
    prefix = {(s.session, s.step): s.ttft_ms for s in samples if s.mode == "prepos_prefix" and s.workload == "bfcl"}
    ratios = [s.ttft_ms / prefix[(s.session, s.step)] for s in samples
              if s.mode == "prepos" and s.path == "prepaid" and (s.session, s.step) in prefix]
    return statistics.median(ratios) if ratios else float("nan")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=3, help="BFCL sessions replayed per mode")
    parser.add_argument("--turns", type=int, default=4, help="user turns per BFCL session at most")
    parser.add_argument("--monitor-sessions", type=int, default=2)
    parser.add_argument("--think-time", type=float, default=2.0, help="seconds between a session's requests")
    parser.add_argument("--gate-sessions", type=int, default=6,
                        help="BFCL sessions replayed with the gate forced (their questions also go to the floor)")
    parser.add_argument("--floor-samples", type=int, default=24, help="floor requests per payload kind")
    parser.add_argument("--interference-samples", type=int, default=16)
    parser.add_argument("--engine-dir", type=Path, default=ROOT / "engines" / "smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "bench")
    parser.add_argument("--grpc-port", type=int, default=8101)
    args = parser.parse_args(argv)
    check_out_dir(parser, args.out)  # before any server starts or anything is written
    counts = ("sessions", "turns", "monitor_sessions", "gate_sessions", "floor_samples", "interference_samples")
    for name in counts:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")
    if not args.think_time >= 0 or args.think_time == float("inf"):
        parser.error(f"--think-time: expected seconds >= 0, got {args.think_time}")
    check_engine_dir(parser, args.engine_dir)
    check_grpc_port(parser, args.grpc_port)

    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = ROOT / ".run" / "bench"
    # One draw: the baselines' sessions are the first of the forced-gate ones.
    bfcl_all = bfcl_sessions(max(args.sessions, args.gate_sessions), think_time_s=args.think_time,
                             max_turns=args.turns)
    bfcl, bfcl_gate = bfcl_all[:args.sessions], bfcl_all[:args.gate_sessions]
    monitor = monitor_sessions(args.monitor_sessions, think_time_s=args.think_time / 2)
    samples: list[Sample] = []
    interrupt_on_sigterm()  # a SIGTERM stops the server on the way out
    try:
        server = variant_server(run_dir, "bench_repository", VARIANTS, args.grpc_port, args.engine_dir).__enter__()
    except RuntimeError as error:  # PortInUseError (names the port and --grpc-port) or the server's own failure
        print(f"bench: the server did not start: {error}", file=sys.stderr)
        return 1
    try:
        url = server.grpc_url
        for mode in ("prepos_stateless", "prepos_prefix", "prepos"):
            samples += replay(url, mode, bfcl, "bfcl")
            samples += replay(url, mode, monitor, "monitor")
        # The gate fires rarely with a small model; forcing it (threshold 0) measures the gated path's cost.
        samples += replay(url, "prepos", bfcl_gate, "bfcl-forced-gate", gate_threshold=0.0)
        asks = lambda traces: [st for t in traces for st in t.steps if st.max_tokens > 0]  # noqa: E731
        samples += measure_floor(url, asks(monitor)[:args.floor_samples], args.think_time / 2, "floor-monitor")
        samples += measure_floor(url, asks(bfcl_gate)[:args.floor_samples], args.think_time / 2, "floor-bfcl")
        samples += replay_paired_with_floor(url, bfcl_gate, gap_s=0.3)
        samples += measure_interference(server, "prepos", args.interference_samples, think_s=0.3)
        time.sleep(1)  # the last counts reach the metrics port at the engine loop's next housekeeping
        collector = collector_figures(server)
    finally:
        server.stop()
    engine = engine_figures(args.engine_dir)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}"
    table, figures = summarize(samples, engine, machine, collector)
    (args.out / "bench.md").write_text(table + "\n")
    (args.out / "samples.json").write_text(json.dumps([asdict(s) for s in samples], indent=1))
    (args.out / "figures.json").write_text(json.dumps({**figures, "engine": engine}, indent=1, default=str))
    print(table)
    print(f"\nwritten: {args.out / 'bench.md'}, samples.json, figures.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
