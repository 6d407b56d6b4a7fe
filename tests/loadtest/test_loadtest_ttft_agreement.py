"""Locust's first-token times against the server's own, request by request, over loopback on the real server.

Each answer fires a client `TTFT` event and a `SRVTTFT` event (the server's
arrival-to-first-response time) back to back; a listener in the task file
records both, so every request's pair can be compared.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from integration.conftest import start_server

pytestmark = pytest.mark.integration

LOADTEST_DIR = Path(__file__).resolve().parents[2] / "loadtest"

# The server's interval (arrival in execute -> first response handed to Triton) lies inside the client's
# (request sent -> first response received), so the client's TTFT can never be the shorter one. What lies
# between them is transport only: gRPC both ways, Triton's sequence batcher and the Python backend's IPC,
# about 1-3 ms on this machine (the no-op model's round trip, README). 10 ms is that floor plus room for a
# 2-core machine where the server's background compute holds both cores for a moment after each response;
# it is a bound on the median because single requests on a shared machine can wait a scheduler slice or two.
# A TTFT taken from anything other than the first response (session open, the last token, an extra decode
# step of 30+ ms) breaks it.
MAX_MEDIAN_TRANSPORT_MS = 10.0

TASK_FILE = """
import json, os, sys
sys.path.insert(0, {loadtest!r})
from locust import events
from prepos_loadtest.grpc_user import PreposUser

_events = open(os.environ["PREPOS_EVENTS_FILE"], "a")


@events.request.add_listener
def _record(request_type, name, response_time, context=None, exception=None, **_kwargs):
    if request_type in ("TTFT", "SRVTTFT") and exception is None:
        _events.write(json.dumps({{"type": request_type, "path": name, "ms": response_time,
                                   "session": (context or {{}}).get("session_id")}}) + "\\n")
        _events.flush()


class MonitorUser(PreposUser):
    workload = "monitor"
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("triton"))
    yield srv
    srv.stop()


def pairs(events: list[dict]) -> list[tuple[str, float, float]]:
    """(path, client TTFT, server first token) per request: a TTFT event and the SRVTTFT fired next in its session."""
    open_ttft: dict[str, dict] = {}
    result = []
    for event in events:
        if event["type"] == "TTFT":
            open_ttft[event["session"]] = event
        elif event["session"] in open_ttft:
            client = open_ttft.pop(event["session"])
            assert client["path"] == event["path"]
            result.append((client["path"], client["ms"], event["ms"]))
    return result


def test_pairs_match_each_ttft_with_the_server_time_of_the_same_request():
    events = [{"type": "TTFT", "path": "exact", "ms": 3.0, "session": "a"},
              {"type": "TTFT", "path": "prefix", "ms": 300.0, "session": "b"},
              {"type": "SRVTTFT", "path": "exact", "ms": 1.0, "session": "a"},
              {"type": "SRVTTFT", "path": "prefix", "ms": 297.0, "session": "b"}]
    assert pairs(events) == [("exact", 3.0, 1.0), ("prefix", 300.0, 297.0)]


def test_locust_ttft_is_the_server_first_token_plus_transport(server, tmp_path):
    task_file = tmp_path / "recording_monitor.py"
    task_file.write_text(textwrap.dedent(TASK_FILE.format(loadtest=str(LOADTEST_DIR))))
    events_file = tmp_path / "events.jsonl"
    command = [sys.executable, "-m", "prepos_loadtest.run", "--host", server.grpc_url, "--out", str(tmp_path / "out"),
               "--locustfile", str(task_file), "--users", "2", "--spawn-rate", "2", "--run-time", "12s",
               "--think-scale", "0.3", "--workload-sessions", "4", "--stop-timeout", "20"]
    done = subprocess.run(command, cwd=LOADTEST_DIR, capture_output=True, text=True, timeout=150,
                          env={**os.environ, "PREPOS_EVENTS_FILE": str(events_file)})
    assert done.returncode == 0, done.stdout + done.stderr

    measured = pairs([json.loads(line) for line in events_file.read_text().splitlines()])
    assert len(measured) >= 5, measured
    assert {path for path, _, _ in measured} <= {"exact", "gated", "prepaid", "prefix", "rebuild"}
    for path, client_ms, server_ms in measured:
        assert client_ms >= server_ms, (path, client_ms, server_ms)
    gaps = [client_ms - server_ms for _, client_ms, server_ms in measured]
    assert statistics.median(gaps) <= MAX_MEDIAN_TRANSPORT_MS, sorted(gaps)
