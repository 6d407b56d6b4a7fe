"""Locust, headless, against the real Triton server and model: stats by served path, END on stop, the error bound."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from integration.conftest import ports_of, start_server

pytestmark = pytest.mark.integration

LOADTEST_DIR = Path(__file__).resolve().parents[2] / "loadtest"
SERVED_PATHS = {"exact", "gated", "prepaid", "prefix", "rebuild"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("triton"))
    yield srv
    srv.stop()


def run_loadtest(server, out: Path, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "prepos_loadtest.run", "--host", server.grpc_url, "--out", str(out),
               "--stop-timeout", "20", *args]
    return subprocess.run(command, cwd=LOADTEST_DIR, capture_output=True, text=True, timeout=timeout_s)


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_headless_run_reports_latency_by_served_path(server, tmp_path):
    closes_before = server.metric("prepos_requests_total", path="close")
    done = run_loadtest(server, tmp_path, "--workload", "monitor", "--users", "2", "--spawn-rate", "2",
                        "--run-time", "10s", "--think-scale", "0.1", "--workload-sessions", "4")
    assert done.returncode == 0, done.stdout + done.stderr

    rows = read_csv(tmp_path / "loadtest_stats.csv")
    ttft_paths = {row["Name"] for row in rows if row["Type"] == "TTFT"}
    assert ttft_paths and ttft_paths <= SERVED_PATHS
    assert {row["Type"] for row in rows if row["Name"] != "Aggregated"} == {"TTFT", "SRVTTFT", "TOTAL"}
    assert any(row["Type"] == "TOTAL" and row["Name"] == "append" for row in rows)
    aggregated = next(row for row in rows if row["Name"] == "Aggregated")
    assert int(aggregated["Request Count"]) > 0 and int(aggregated["Failure Count"]) == 0
    assert read_csv(tmp_path / "loadtest_failures.csv") == []
    assert read_csv(tmp_path / "loadtest_exceptions.csv") == []
    report = tmp_path / "report.html"
    assert report.is_file() and "TTFT" in report.read_text()
    assert "error rate 0.00%" in done.stdout
    assert all(f"\n{path} " in done.stdout for path in ttft_paths)  # the printed table, by path

    # Every session a user opened was ended (END), each END measured once, and none is left open.
    closes = sum(int(row["Request Count"]) for row in rows if row["Type"] == "TOTAL" and row["Name"] == "close")
    assert closes >= 2
    assert wait_for(lambda: server.metric("prepos_requests_total", path="close") - closes_before == closes)
    assert wait_for(lambda: server.metric("prepos_sessions") == 0)


def test_error_rate_above_the_bound_fails_the_run(server, tmp_path):
    trace = tmp_path / "bad.jsonl"
    steps = [
        {"session": "bad", "delay_s": 0.0, "role": "system", "delta": "Answer yes or no.", "max_tokens": 0,
         "choices": None},
        {"session": "bad", "delay_s": 0.1, "role": "user", "delta": "Is water wet?", "max_tokens": -1,
         "choices": None},
        {"session": "bad", "delay_s": 0.1, "role": "user", "delta": "Is fire hot?", "max_tokens": 1,
         "choices": ["yes", "no"]},
    ]
    trace.write_text("".join(json.dumps(step) + "\n" for step in steps))
    out = tmp_path / "out"
    done = run_loadtest(server, out, "--trace", str(trace), "--users", "1", "--spawn-rate", "1",
                        "--run-time", "3s", "--max-error-rate", "0.01")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL" in done.stdout

    failures = read_csv(out / "loadtest_failures.csv")
    assert [(f["Method"], f["Name"]) for f in failures] == [("TOTAL", "generate")]
    assert "max_tokens" in failures[0]["Error"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["locust_exit_status"] == 0 and summary["passed"] is False
    # One bad request in three per session, so about a quarter of all requests (END included) fail.
    assert 0.1 < summary["error_rate"] < 0.5
    assert wait_for(lambda: server.metric("prepos_sessions") == 0)


def test_with_wait_for_ready_a_restart_of_the_server_fails_no_request(tmp_path):
    """The server is stopped (drained) and started again on the same ports and journals in the middle of a run:
    with --wait-for-ready every request made meanwhile waits for it, and the sessions open across the restart
    go on from their journals."""
    env = {"PREPOS_JOURNAL_DIR": str(tmp_path / "journal")}
    first = start_server(tmp_path / "first", env=env)
    ports = ports_of(first)
    command = [sys.executable, "-m", "prepos_loadtest.run", "--host", first.grpc_url, "--out", str(tmp_path / "out"),
               "--stop-timeout", "30", "--workload", "monitor", "--users", "2", "--spawn-rate", "2", "--run-time",
               "25s", "--think-scale", "0.2", "--workload-sessions", "4", "--wait-for-ready",
               "--request-timeout-s", "120"]
    loadtest = subprocess.Popen(command, cwd=LOADTEST_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    second = None
    try:
        time.sleep(8)  # under load
        first.stop()  # drained, or after the exit timeout under heavy load: the requests wait either way
        time.sleep(2)  # down: the users' requests wait
        second = start_server(tmp_path / "second", env=env, ports=ports)
        output, _ = loadtest.communicate(timeout=180)
        assert loadtest.returncode == 0, output
        rows = read_csv(tmp_path / "out" / "loadtest_stats.csv")
        aggregated = next(row for row in rows if row["Name"] == "Aggregated")
        assert int(aggregated["Request Count"]) > 0 and int(aggregated["Failure Count"]) == 0, output
        assert read_csv(tmp_path / "out" / "loadtest_exceptions.csv") == []
        assert wait_for(lambda: second.metric("prepos_sessions_recovered_total") > 0)  # went on from their journals
        assert wait_for(lambda: second.metric("prepos_sessions") == 0)
    finally:
        if loadtest.poll() is None:
            loadtest.kill()
            loadtest.wait()
        first.stop()
        if second is not None:
            second.stop()
