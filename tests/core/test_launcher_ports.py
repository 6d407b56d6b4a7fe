"""The launcher's ports: a port another process holds is refused before Triton starts, and only the launcher's own
server counts as ready."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest

from prepos import launcher
from prepos.launcher import ServerOptions, TritonServer, server_command
from prepos.ports import PortInUseError, taken_endpoints
from prepos_loadtest.repository import free_loopback_ports

PORT_FIELDS = ("http_port", "grpc_port", "metrics_port")


def options_on_free_ports(tmp_path, **kwargs) -> ServerOptions:
    http, grpc, metrics = free_loopback_ports(3)
    return ServerOptions(http_port=http, grpc_port=grpc, metrics_port=metrics, run_dir=tmp_path, **kwargs)


@pytest.fixture
def hold_port():
    """Listen on a loopback port, as another server would; closed after the test."""
    held = []

    def hold(port: int) -> socket.socket:
        listener = socket.socket()
        listener.bind(("127.0.0.1", port))
        listener.listen()
        held.append(listener)
        return listener

    yield hold
    for listener in held:
        listener.close()


@pytest.fixture
def no_triton(monkeypatch):
    """Fail the test if the launcher starts a process."""
    started = []

    def popen(command, *args, **kwargs):
        started.append(command)
        raise AssertionError(f"started {command[0]}")

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    return started


class _ReadyEverywhere(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"nv_inference_count 0\n")

    def log_message(self, *args):
        pass


@pytest.fixture
def foreign_ready_server():
    """An HTTP server on a loopback port that answers every health and metrics probe: another server."""
    servers = []

    def serve(port: int) -> None:
        server = ThreadingHTTPServer(("127.0.0.1", port), _ReadyEverywhere)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)])


def fake_server(options: ServerOptions, before: str = "") -> subprocess.Popen:
    """A process that listens on the options' three ports and answers every HTTP probe, as a ready tritonserver
    does, after running ``before``."""
    return child(textwrap.dedent(before) + textwrap.dedent(f"""
        import socket, threading, time
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Ready(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()

        for port in ({options.http_port}, {options.metrics_port}):
            threading.Thread(target=ThreadingHTTPServer(("127.0.0.1", port), Ready).serve_forever,
                             daemon=True).start()
        grpc = socket.socket()
        grpc.bind(("127.0.0.1", {options.grpc_port}))
        grpc.listen()
        time.sleep(60)
    """))


def assert_gone(process: subprocess.Popen) -> None:
    assert process.poll() is not None, "the launcher left its process running"
    assert not psutil.pid_exists(process.pid)


@pytest.mark.parametrize("field", PORT_FIELDS)
def test_a_port_another_process_listens_on_is_refused_before_triton_starts(tmp_path, hold_port, no_triton, field):
    options = options_on_free_ports(tmp_path)
    port = getattr(options, field)
    hold_port(port)
    with pytest.raises(PortInUseError) as refused:
        TritonServer(options).start()
    flag = "--" + field.replace("_", "-")
    assert f"port {port} " in str(refused.value) and flag in str(refused.value)
    assert [(e.port, e.flag) for e in refused.value.taken] == [(port, flag)]
    assert no_triton == []
    assert not (tmp_path / "backends").exists()  # nothing was prepared either


def test_serve_names_the_taken_port_and_its_flag_and_never_says_ready(tmp_path, hold_port, no_triton, capsys,
                                                                      monkeypatch):
    monkeypatch.setattr(launcher.signal, "signal", lambda *args: None)  # serve() installs a SIGTERM handler
    http, grpc, metrics = free_loopback_ports(3)
    hold_port(grpc)
    code = launcher.main(["--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                          "--run-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 1
    assert "ready" not in out
    assert f"port {grpc} (gRPC, --grpc-port) on 127.0.0.1 is already in use" in err
    assert no_triton == []


def test_every_taken_port_is_named_at_once(tmp_path, hold_port):
    options = options_on_free_ports(tmp_path)
    hold_port(options.http_port)
    hold_port(options.metrics_port)
    assert [e.name for e in taken_endpoints(options)] == ["HTTP", "metrics"]
    message = str(PortInUseError(options.host, taken_endpoints(options)))
    assert "--http-port N --metrics-port N" in message and "ports " in message


def test_free_ports_pass_the_check(tmp_path):
    assert taken_endpoints(options_on_free_ports(tmp_path)) == ()


def test_a_ready_server_on_the_ports_that_is_not_ours_does_not_count(tmp_path, foreign_ready_server):
    """A port taken after the check (or shared): the other server answers every probe, ours never listens."""
    options = options_on_free_ports(tmp_path, ready_timeout_s=1.0)
    foreign_ready_server(options.http_port)
    foreign_ready_server(options.metrics_port)
    server = TritonServer(options)
    server.process = ours = child("import time; time.sleep(60)")  # loading its models, say
    try:
        with pytest.raises(RuntimeError, match="not ready") as not_ready:
            server.wait_ready()
        assert str(options.grpc_port) in str(not_ready.value)
    finally:
        server.stop()
    assert_gone(ours)


def test_a_server_that_exits_on_a_taken_port_names_it(tmp_path, hold_port):
    options = options_on_free_ports(tmp_path, ready_timeout_s=30.0)
    hold_port(options.grpc_port)
    server = TritonServer(options)
    server.log_file.write_text("failed to start GRPC service: Unavailable - Socket already in use\n")
    server.process = ours = child("raise SystemExit(1)")  # what Triton does when it cannot bind
    with pytest.raises(PortInUseError) as refused:
        server.wait_ready()
    assert f"port {options.grpc_port} (gRPC, --grpc-port)" in str(refused.value)
    assert "tritonserver exited with status 1; its log ends" in str(refused.value)
    assert_gone(ours)


def test_our_own_server_listening_on_every_port_is_ready(tmp_path):
    options = options_on_free_ports(tmp_path, ready_timeout_s=30.0)
    server = TritonServer(options)
    server.process = ours = fake_server(options)
    try:
        server.wait_ready()
        assert server.unbound_endpoints() == ()
    finally:
        server.stop()
    assert_gone(ours)


def test_a_stub_left_behind_by_a_server_that_died_is_killed_at_stop(tmp_path):
    options = options_on_free_ports(tmp_path, ready_timeout_s=30.0)
    server = TritonServer(options)
    stub_pid_file = tmp_path / "stub.pid"
    # A server with one backend stub that, like a python_backend stub hung on a dead server, ignores SIGTERM
    # and does not follow its parent out.
    server.process = ours = fake_server(options, before=f"""
        import subprocess, sys
        stub = subprocess.Popen([sys.executable, "-c",
                                 "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
        open({str(stub_pid_file)!r}, "w").write(str(stub.pid))
    """)
    try:
        server.wait_ready()
        stub = psutil.Process(int(stub_pid_file.read_text()))
        ours.kill()  # the server dies on its own (OOM, a crash); its stub is orphaned and stays
        ours.wait()
        assert stub.is_running() and stub.status() != psutil.STATUS_ZOMBIE
        server.stop()
        stub.wait(timeout=10)  # reaped by stop, though the server was already gone (TimeoutExpired if not)
        assert not stub.is_running()
    finally:
        server.stop()
        if stub_pid_file.exists() and psutil.pid_exists(int(stub_pid_file.read_text())):
            psutil.Process(int(stub_pid_file.read_text())).kill()


@pytest.mark.parametrize(("argv", "named"), [
    (["--grpc-port", "0"], "--grpc-port"),
    (["--metrics-port", "70000"], "--metrics-port"),
    (["--http-port", "8200", "--grpc-port", "8200"], "must differ"),
    (["--ready-timeout-s", "-1"], "--ready-timeout-s"),
    (["--ready-timeout-s", "nan"], "--ready-timeout-s"),
    (["--exit-timeout-s", "-5"], "--exit-timeout-s"),
])
def test_serve_refuses_bad_options_naming_the_flag(argv, named, no_triton, capsys):
    with pytest.raises(SystemExit) as exited:
        launcher.main(argv)
    assert exited.value.code == 2
    assert named in capsys.readouterr().err
    assert no_triton == []


@pytest.mark.parametrize(("argv", "named"), [
    (["--model-repository", "/nonexistent-repository"], "--model-repository: /nonexistent-repository"),
    (["--host", "nonsense.invalid"], "--host: 'nonsense.invalid' has no IPv4 address"),
])
def test_serve_refuses_a_missing_repository_or_host_before_triton_starts(argv, named, no_triton, tmp_path, capsys):
    assert launcher.main([*argv, "--run-dir", str(tmp_path)]) == 2
    assert named in capsys.readouterr().err
    assert no_triton == []


@pytest.mark.parametrize("environ, expected", [
    ({}, "default"),  # the run folder's drain file
    ({"PREPOS_SCHEDULER_DRAIN_FILE": ""}, None),  # `PREPOS_SCHEDULER_DRAIN_FILE= make serve`: no drain
    ({"PREPOS_SCHEDULER_DRAIN_FILE": "/elsewhere/drain"}, "/elsewhere/drain"),
])
def test_the_drain_file_set_in_the_environment_is_kept_and_an_empty_one_turns_the_drain_off(tmp_path, monkeypatch,
                                                                                              environ, expected):
    monkeypatch.delenv("PREPOS_SCHEDULER_DRAIN_FILE", raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    server = launcher.TritonServer(launcher.ServerOptions(run_dir=tmp_path, grpc_port=9101))
    if expected == "default":
        assert server.drain_file == tmp_path.resolve() / "drain-9101"
    else:
        assert server.drain_file == (None if expected is None else launcher.Path(expected))


def _self_signed(folder, name, rsa_bits=0):
    """A self-signed certificate and its unencrypted key (EC, or RSA of ``rsa_bits``), as PEM files."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(65537, rsa_bits) if rsa_bits else ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now)
                   .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    cert, key_file = folder / f"{name}.pem", folder / f"{name}.key"
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert, key_file


def test_tls_files_go_together_and_must_be_readable(tmp_path):
    cert, key = _self_signed(tmp_path, "server")
    with pytest.raises(ValueError, match="--tls-cert-file and --tls-key-file go together"):
        ServerOptions(tls_cert_file=str(cert))
    with pytest.raises(ValueError, match="--tls-key-file: no readable file at"):
        ServerOptions(tls_cert_file=str(cert), tls_key_file=str(tmp_path / "missing.key"))
    command = server_command(ServerOptions(tls_cert_file=str(cert), tls_key_file=str(key)), tmp_path)
    assert "--grpc-use-ssl=true" in command and f"--grpc-server-cert={cert}" in command
    assert not any("ssl" in argument for argument in server_command(ServerOptions(), tmp_path))


def test_a_tls_pair_tritonserver_could_not_use_is_refused_naming_both_flags(tmp_path):
    """Triton took such files and then failed with "Socket ... already in use" for a free port."""
    cert, key = _self_signed(tmp_path, "server")
    other_cert, other_key = _self_signed(tmp_path, "other")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    for cert_file, key_file in ((garbage, garbage), (cert, other_key), (key, cert)):  # junk, mismatched, swapped
        with pytest.raises(ValueError, match=rf"^--tls-cert-file {cert_file} and --tls-key-file {key_file}: not a "
                                             "PEM certificate chain and its unencrypted private key"):
            ServerOptions(tls_cert_file=str(cert_file), tls_key_file=str(key_file))
    ServerOptions(tls_cert_file=str(other_cert), tls_key_file=str(other_key))
    # a small RSA key is the pair's owner's choice, not a malformed pair (this OpenSSL's policy refused it)
    small_cert, small_key = _self_signed(tmp_path, "small", rsa_bits=1024)
    ServerOptions(tls_cert_file=str(small_cert), tls_key_file=str(small_key))


@pytest.mark.parametrize("host", ["::1", "[::1]", "::"])
def test_an_ipv6_host_is_refused_naming_the_flag(host):
    with pytest.raises(ValueError, match=rf"^--host: {re.escape(host)} is an IPv6 address"):
        ServerOptions(host=host)


def test_a_repository_with_no_model_or_an_unusable_run_dir_is_refused_naming_the_flag(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^--model-repository: no model in .*empty"):
        TritonServer(ServerOptions(model_repositories=(tmp_path / "empty",), run_dir=tmp_path / "run"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for run_dir in (blocker, blocker / "run"):
        with pytest.raises(ValueError, match=rf"^--run-dir: cannot use {re.escape(str(run_dir))} \("):
            TritonServer(ServerOptions(run_dir=run_dir))


def test_a_stop_interrupted_by_a_second_signal_still_removes_the_servers_shared_memory_regions(tmp_path, monkeypatch):
    """A second SIGTERM (or Ctrl-C) during the stop killed tritonserver and its stubs at once, and the launcher
    left their regions in /dev/shm for a later server on the port to find."""
    from prepos.shm_regions import region_prefix

    options = options_on_free_ports(tmp_path)
    server = TritonServer(options)
    server.process = ours = child("import time; time.sleep(60)")
    region = Path("/dev/shm") / f"{region_prefix(options.grpc_port)}left-by-the-test"
    region.write_bytes(b"x" * 100)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # the second signal, during the drain
    monkeypatch.setattr(launcher, "stop_server", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            server.stop()
        assert ours.poll() is not None  # killed
        assert not region.exists()
    finally:
        region.unlink(missing_ok=True)
        if ours.poll() is None:
            ours.kill()
