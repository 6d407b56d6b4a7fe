"""The replica health a router polls (prepos.replica_health): Triton's readiness, failed once the replica is leaving.
Against a stand-in for Triton's HTTP port here; on the real server under prepos.supervise: tests/integration/
test_stop.py."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prepos.replica_health import HEALTH_PORT_ENV, LEAVING_FILE_ENV, ReplicaHealth, forget_leaving
from prepos.supervise import TRITON_HTTP_PORT, http_port_of, replica_health_from


class TritonStandIn:
    """Answers GET /v2/health/ready with `status` (200 until changed)."""

    def __init__(self) -> None:
        self.status = 200
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                self.send_response(stand_in.status if self.path == "/v2/health/ready" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def get(port: int, path: str = "/ready") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture
def triton():
    stand_in = TritonStandIn()
    yield stand_in
    stand_in.stop()


@pytest.fixture
def health(triton, tmp_path):
    served = ReplicaHealth(0, triton.port, tmp_path / "leaving", host="127.0.0.1").start()
    yield served
    served.close()


def test_ready_while_triton_is_ready_and_the_replica_is_not_leaving(health):
    assert get(health.port) == (200, "ready\n")


def test_not_ready_while_triton_is_not(health, triton):
    triton.status = 503
    status, text = get(health.port)
    assert status == 503 and "Triton's /v2/health/ready answered 503" in text
    triton.status = 200
    assert get(health.port)[0] == 200


def test_not_ready_when_triton_does_not_answer(health, triton):
    triton.stop()
    status, text = get(health.port)
    assert status == 503 and "did not answer" in text


def test_not_ready_when_triton_answers_no_http(tmp_path):
    with socket.socket() as garbage:
        garbage.bind(("127.0.0.1", 0))
        garbage.listen()

        def answer_garbage() -> None:
            connection, _ = garbage.accept()
            with connection:
                connection.recv(1024)
                connection.sendall(b"garbage\r\n\r\n")

        threading.Thread(target=answer_garbage, daemon=True).start()
        health = ReplicaHealth(0, garbage.getsockname()[1], host="127.0.0.1").start()
        try:
            status, text = get(health.port)
        finally:
            health.close()
    assert status == 503 and "did not answer (BadStatusLine" in text


def test_a_leaving_file_fails_it_while_triton_is_still_ready(health, tmp_path):
    (tmp_path / "leaving").touch()
    status, text = get(health.port)
    assert status == 503 and text.startswith("leaving:") and str(tmp_path / "leaving") in text
    (tmp_path / "leaving").unlink()
    assert get(health.port)[0] == 200


def test_once_the_stop_began_it_fails_for_good(health, tmp_path):
    health.leave()
    assert get(health.port) == (503, "leaving: stopping\n")


def test_other_paths_are_not_found(health):
    status, text = get(health.port, "/v2/health/ready")
    assert status == 404 and "GET /ready" in text


def test_a_leaving_file_an_earlier_run_left_is_removed(tmp_path):
    left = tmp_path / "leaving"
    left.touch()
    forget_leaving(left)
    assert not left.exists()
    forget_leaving(left)  # none: nothing to do
    forget_leaving(None)


@pytest.mark.parametrize("args, expected", [
    ([], TRITON_HTTP_PORT),
    (["--http-port=9000"], 9000),
    (["--http-port", "9000", "--grpc-port=9001"], 9000),
    (["--http-port=nine"], TRITON_HTTP_PORT),
])
def test_the_http_port_is_read_from_the_servers_arguments(args, expected):
    assert http_port_of(args) == expected


def test_no_health_server_unless_its_port_is_set():
    assert replica_health_from({}, []) is None
    assert replica_health_from({HEALTH_PORT_ENV: ""}, []) is None


def test_the_health_server_asks_triton_on_its_http_port(triton, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    health = replica_health_from({HEALTH_PORT_ENV: str(port), LEAVING_FILE_ENV: str(tmp_path / "leaving")},
                                 [f"--http-port={triton.port}"])
    try:
        assert health.triton_http_port == triton.port and health.leaving_file == tmp_path / "leaving"
        health.start()
        assert get(port) == (200, "ready\n")
    finally:
        health.close()


@pytest.mark.parametrize("env, named", [
    ({HEALTH_PORT_ENV: "ready"}, HEALTH_PORT_ENV),
    ({HEALTH_PORT_ENV: "0"}, HEALTH_PORT_ENV),
    ({HEALTH_PORT_ENV: "70000"}, HEALTH_PORT_ENV),
    ({HEALTH_PORT_ENV: "-1"}, HEALTH_PORT_ENV),
    ({HEALTH_PORT_ENV: "8003", LEAVING_FILE_ENV: "tmp/leaving"}, LEAVING_FILE_ENV),
])
def test_a_bad_setting_is_refused_naming_it(env, named):
    with pytest.raises(ValueError, match=named):
        replica_health_from(env, [])


def test_a_port_in_use_is_refused_naming_it():
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        with pytest.raises(ValueError, match=f"{HEALTH_PORT_ENV}=.*cannot listen"):
            replica_health_from({HEALTH_PORT_ENV: str(sock.getsockname()[1])}, [])


def run_supervisor(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m prepos.supervise ARGS`` with ``env`` beside a bare PATH and this test run's import path."""
    return subprocess.run([sys.executable, "-m", "prepos.supervise", *args], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), **env})


def marking_server(marker: Path) -> tuple[str, ...]:
    """A stand-in server that only creates ``marker``: whether the supervisor started it."""
    return "--", sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"


def test_the_supervisor_refuses_a_bad_health_port_before_it_starts_the_server(tmp_path):
    marker = tmp_path / "started"
    result = run_supervisor(*marking_server(marker), **{HEALTH_PORT_ENV: "eighty"})
    assert result.returncode == 2 and f"{HEALTH_PORT_ENV}='eighty'" in result.stderr, result.stderr
    assert not marker.exists()


@pytest.mark.parametrize("variable, value, problem", [
    ("PREPOS_SCHEDULER_DRAIN_FILE", "prepos-drain", "must be an absolute path"),
    ("PREPOS_SCHEDULER_DRAIN_FILE", "/nonexistent/dir/prepos-drain", "cannot write in /nonexistent/dir"),
    (LEAVING_FILE_ENV, "/nonexistent/dir/leaving", "cannot write in /nonexistent/dir"),
])
def test_the_supervisor_refuses_a_drain_or_leaving_file_that_could_not_serve_a_stop_before_it_starts(
        tmp_path, variable, value, problem):
    """Found only at SIGTERM, a relative or unwritable drain file made the stop go without a drain: the exit
    timeout and more (105 s with the chart's), and a leaving file in a missing folder kept the health port ready
    through the preStop hook."""
    marker = tmp_path / "started"
    result = run_supervisor(*marking_server(marker), **{variable: value})
    assert result.returncode == 2, result.stderr
    assert f"prepos.supervise: {variable}={value!r}: " in result.stderr and problem in result.stderr
    assert not marker.exists()
    # an empty drain file is no drain, as documented: the server runs
    empty = run_supervisor(*marking_server(marker), PREPOS_SCHEDULER_DRAIN_FILE="")
    assert empty.returncode == 0 and marker.exists(), empty.stderr


def test_the_supervisors_help_and_a_server_it_cannot_run_are_told_as_a_shell_would(tmp_path):
    """--help was run as the server (exit 127); a file that is not executable was 127, a shell's "not found"."""
    shown = run_supervisor("--help")
    assert shown.returncode == 0 and shown.stdout.startswith("usage: python -m prepos.supervise -- tritonserver")
    plain = tmp_path / "not-executable"
    plain.write_text("echo hi\n")
    for server, code in ((tmp_path / "missing", 127), (plain, 126), (tmp_path, 126)):
        ran = run_supervisor("--", str(server))
        assert ran.returncode == code and f"cannot run {server}: " in ran.stderr, (server, ran.stderr)
