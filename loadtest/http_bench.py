"""HTTP bridge benchmark: what a request pays to reach prepos through ``prepos_http``, against gRPC straight to it.

Starts the real server on the default model repository (``prepos`` and the
bridge ``prepos_http``) and times, client side, one round trip of a request that
asks the engine for nothing (an update with an empty delta on an open session),
so the figure is the transport and the bridge. Three ways, in alternating blocks
of ``--block`` requests, each on a session of its own:

- ``grpc``: a gRPC stream to ``prepos`` (the session as the correlation id);
- ``grpc_bridge``: the same stream to ``prepos_http`` (the session as an input):
  the bridge's relay, a BLS call to prepos, alone;
- ``http_bridge``: ``POST /v2/models/prepos_http/generate`` on one kept-alive
  HTTP connection: what a curl-style client pays.

Reported: median and p99 per way and each median over ``grpc``'s.

    python loadtest/http_bench.py [--requests 600] [--block 50] [--out out/http_bench]
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import platform
import queue
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for sub in ("backend", "client", "loadtest"):
    sys.path.insert(0, str(ROOT / sub))

import tritonclient.grpc as grpcclient  # noqa: E402

from prepos.launcher import ServerOptions, TritonServer, interrupt_on_sigterm  # noqa: E402
from prepos_loadtest.repository import check_out_dir, free_loopback_ports  # noqa: E402
from prepos_loadtest.stats import percentile  # noqa: E402

log = logging.getLogger("prepos.http_bench")
WAYS = ("grpc", "grpc_bridge", "http_bridge")


TRITON_DATATYPES = {"object": "BYTES", "int32": "INT32", "int64": "INT64", "bool": "BOOL"}


def _tensor(name: str, value: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(value.shape), TRITON_DATATYPES[value.dtype.name])
    tensor.set_data_from_numpy(value)
    return tensor


class GrpcWay:
    """Empty updates over one gRPC stream, to prepos (correlation id) or to the bridge (``session_id`` input)."""

    def __init__(self, url: str, bridge: bool, session_id: str):
        self.client = grpcclient.InferenceServerClient(url)
        self.results: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put(error))
        self.bridge, self.session_id = bridge, session_id
        self.request(start=True)

    @staticmethod
    def inputs(bridge: bool, session_id: str, start: bool = False, end: bool = False) -> dict[str, np.ndarray]:
        """An empty update's inputs: prepos's max_tokens is INT32, the bridge's INT64 (README: HTTP)."""
        inputs = {"text_input": np.array([b""], dtype=np.object_),
                  "max_tokens": np.array([0], np.int64 if bridge else np.int32)}
        if bridge:
            inputs["session_id"] = np.array([session_id.encode()], dtype=np.object_)
            inputs |= {"start": np.array([True])} if start else {}
            inputs |= {"end": np.array([True])} if end else {}
        return inputs

    def request(self, start: bool = False, end: bool = False) -> float:
        inputs = self.inputs(self.bridge, self.session_id, start, end)
        kwargs = {}
        if not self.bridge:
            kwargs = {"sequence_id": self.session_id, "sequence_start": start, "sequence_end": end}
        began = time.perf_counter()
        self.client.async_stream_infer("prepos_http" if self.bridge else "prepos",
                                       [_tensor(n, v) for n, v in inputs.items()], **kwargs)
        error = self.results.get(timeout=60)  # an update is one response
        if error is not None:
            raise RuntimeError(error)
        return time.perf_counter() - began

    def close(self) -> None:
        self.request(end=True)
        self.client.stop_stream()
        self.client.close()


class HttpWay:
    """Empty updates as ``generate`` calls on one kept-alive HTTP connection."""

    def __init__(self, host: str, port: int, session_id: str):
        self.connection = http.client.HTTPConnection(host, port, timeout=60)
        self.session_id = session_id
        self.request(start=True)

    def request(self, start: bool = False, end: bool = False) -> float:
        body = {"session_id": self.session_id, "text_input": "", "max_tokens": 0}
        body |= {"start": True} if start else {}
        body |= {"end": True} if end else {}
        began = time.perf_counter()
        self.connection.request("POST", "/v2/models/prepos_http/generate", json.dumps(body),
                                {"Content-Type": "application/json"})
        response = self.connection.getresponse()
        text = response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {text[:200]!r}")
        return time.perf_counter() - began

    def close(self) -> None:
        self.request(end=True)
        self.connection.close()


def run(requests: int, block: int, run_dir: Path) -> dict:
    http_port, grpc_port, metrics_port = free_loopback_ports(3)
    options = ServerOptions(http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, run_dir=run_dir,
                            journal_dir="off")
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    with TritonServer(options):
        grpc_url = f"{options.host}:{grpc_port}"
        ways = {"grpc": GrpcWay(grpc_url, False, "bench-grpc"),
                "grpc_bridge": GrpcWay(grpc_url, True, "bench-grpc-bridge"),
                "http_bridge": HttpWay(options.host, http_port, "bench-http-bridge")}
        for way in ways.values():  # warm-up
            for _ in range(20):
                way.request()
        for _ in range(max(1, requests // block)):
            for name, way in ways.items():
                times[name] += [way.request() for _ in range(block)]
        for way in ways.values():
            way.close()
    return summarize(times)


def summarize(times: dict[str, list[float]]) -> dict:
    """Per way (seconds per request): count, median and p99 in ms, and the median over ``grpc``'s."""
    base = statistics.median(times["grpc"])
    return {name: {"requests": len(t), "median_ms": statistics.median(t) * 1e3,
                   "p99_ms": percentile(t, 99) * 1e3, "median_over_grpc": statistics.median(t) / base}
            for name, t in times.items()}


def table(result: dict, machine: str) -> str:
    lines = [f"HTTP bridge round trip, an empty update ({machine})", "",
             "| way | requests | median ms | p99 ms | median / grpc |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {name} | {r['requests']} | {r['median_ms']:.2f} | {r['p99_ms']:.2f} | {r['median_over_grpc']:.2f} |"
              for name, r in result.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=600, help="timed requests per way (%(default)s)")
    p.add_argument("--block", type=int, default=50, help="requests per way before the next way's turn (%(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "http_bench")
    args = p.parse_args(argv)
    check_out_dir(p, args.out)  # before any server starts or anything is written
    if args.requests < 1 or args.block < 1:
        p.error("--requests and --block must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    interrupt_on_sigterm()  # a SIGTERM stops the server on the way out
    result = run(args.requests, args.block, args.out / "run")
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    text = table(result, machine)
    (args.out / "http_bench.json").write_text(json.dumps({"machine": machine, "ways": result}, indent=2) + "\n")
    (args.out / "http_bench.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
