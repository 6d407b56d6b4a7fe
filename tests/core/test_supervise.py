"""prepos.supervise, the production image's entrypoint, around a stand-in for tritonserver: it asks for the drain
on SIGTERM, kills a drained server that does not exit (and what is left of its process group), and passes the
server's own exit status on otherwise. The real server under it: tests/integration/test_stop.py."""

from __future__ import annotations

import re
import resource
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from prepos.launcher import ServerOptions, server_command
from prepos.shm_regions import SHM_DIR, region_prefix
from prepos.supervise import (BLS_THREADS, DRAIN_ENV, DRAINED_EXIT_S, ENDED_EXIT_S, LOST_STUB_STOP_S, STOP_GRACE_S,
                              STUB_CHECK_S, TRITON_EXIT_TIMEOUT_S, TRITON_GRPC_PORT, bls_threads_argument,
                              exit_timeout_of, grpc_port_of, keepalive_ping_arguments, with_bls_threads,
                              with_keepalive_pings, with_region_prefix)

# Stands in for tritonserver: a model instance's backend stub of its own (a child in its process group, with a
# stub's arguments), and, as models load, a stub that completes a model's configuration and exits (named after
# the model, not an instance); on the drain file it reports the drain as the model does; it ignores SIGTERM, as
# Triton 2.51 does while a client holds a stream.
STAND_IN = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    from pathlib import Path
    folder = Path(sys.argv[1]).parent
    executable = folder / "triton_python_backend_stub"
    executable.write_text("import sys, time; time.sleep(float(sys.argv[9]))")
    model = folder / "repository" / "stand_in_model" / "1" / "model.py"
    def stub(name, seconds):
        return subprocess.Popen([sys.executable, str(executable), str(model), "region", "1048576", "1048576",
                                 str(os.getpid()), "lib", "handle", name, str(seconds)])
    stub("stand_in_model", 1.5)  # the configuration's stub: it exits once done, while the server runs on
    stub = stub("stand_in_model_0_0", 60)
    for arg in sys.argv[2:]:  # a shared-memory region, as the Python backend makes under the prefix it is given
        if arg.startswith("--backend-config=python,shm-region-prefix-name="):
            Path("/dev/shm", arg.rpartition("=")[2] + "stand-in").write_bytes(bytes(4096))
    Path(sys.argv[1]).write_text(str(stub.pid))
    signal.signal(signal.SIGTERM, lambda *_: None)
    drain = Path(os.environ["PREPOS_SCHEDULER_DRAIN_FILE"]) if os.environ.get("PREPOS_SCHEDULER_DRAIN_FILE") else None
    while True:
        if drain is not None and drain.exists() and not os.environ.get("STAND_IN_NO_REPORT"):
            drain.unlink()
            left = int(os.environ.get("STAND_IN_LEFT_OPEN", "0"))
            Path(str(drain) + ".drained").write_text(json.dumps(
                {"num_ended": int(os.environ.get("STAND_IN_ENDED", "2")), "num_failed": left, "num_open": left,
                 "seconds": 0.1}))
        time.sleep(0.02)
""")


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def unused_port() -> int:
    """A port no server here listens on: the prefix of the regions the supervisor removes is named after it
    (never after Triton's default 8001, which a server running beside the tests may use)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def supervise(tmp_path, env_drain: str | None, *args: str, left_open: int = 0, ended: int = 2,
              no_report: bool = False) -> tuple[subprocess.Popen, int]:
    if not any(arg.startswith("--grpc-port") for arg in args):
        args = (*args, f"--grpc-port={unused_port()}")
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    env = {"PATH": "/usr/bin:/bin", "STAND_IN_LEFT_OPEN": str(left_open), "STAND_IN_ENDED": str(ended)}
    if no_report:  # the model that drains is gone: no drain is reported
        env["STAND_IN_NO_REPORT"] = "1"
    if env_drain is not None:
        env[DRAIN_ENV] = env_drain
    supervisor = subprocess.Popen([sys.executable, "-m", "prepos.supervise", "--", sys.executable, str(script),
                                   str(tmp_path / "stub.pid"), *args],
                                  env={**env, "PYTHONPATH": ":".join(sys.path)}, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not (tmp_path / "stub.pid").exists():
        assert time.monotonic() < deadline and supervisor.poll() is None
        time.sleep(0.05)
    time.sleep(0.2)
    return supervisor, int((tmp_path / "stub.pid").read_text())


@pytest.mark.parametrize("ended", [2, 0])
def test_a_drained_server_that_does_not_exit_is_killed_soon_with_its_stubs_and_the_exit_is_clean(tmp_path, ended):
    """A drain that ended sessions leaves Triton waiting for their sequences: it is killed at once; with none
    ended it is given DRAINED_EXIT_S to exit by itself."""
    supervisor, stub = supervise(tmp_path, str(tmp_path / "drain"), "--exit-timeout-secs=60", ended=ended)
    began = time.monotonic()
    supervisor.send_signal(signal.SIGTERM)
    _, log = supervisor.communicate(timeout=30)
    took = time.monotonic() - began
    assert supervisor.returncode == 0, log
    given = ENDED_EXIT_S if ended else DRAINED_EXIT_S
    assert given <= took < given + 2, (took, log)  # not the 60 s exit timeout
    assert "drained in" in log
    assert not running(stub)  # the stub went with its server's process group


def test_a_stopped_server_is_continued_so_that_it_drains_and_exits_cleanly(tmp_path):
    """SIGSTOPped, it neither took up the drain nor exited on SIGTERM: the stop took its exit timeout and more,
    and ended in a SIGKILL (35 s and status 137 for the real server, its exit timeout 30 s)."""
    supervisor, _ = supervise(tmp_path, str(tmp_path / "drain"), "--exit-timeout-secs=60")
    (server,) = [child for child in psutil.Process(supervisor.pid).children() if child.pid != supervisor.pid]
    server.suspend()
    began = time.monotonic()
    supervisor.send_signal(signal.SIGTERM)
    _, log = supervisor.communicate(timeout=90)
    took = time.monotonic() - began
    assert supervisor.returncode == 0 and "drained in" in log, log
    assert f"tritonserver's processes {server.pid} are stopped" in log and took < ENDED_EXIT_S + 5, (took, log)


def test_a_server_whose_backend_stub_died_is_drained_and_stopped_and_the_exit_is_an_error(tmp_path):
    """Triton 2.51 does not restart a dead stub: its model refuses every request while the server reports itself
    ready. The supervisor stops such a server (draining the models still there) so that it is restarted."""
    supervisor, stub = supervise(tmp_path, str(tmp_path / "drain"), "--exit-timeout-secs=60")
    time.sleep(STUB_CHECK_S + 1.5)  # the supervisor has seen the stub, and the configuration's stub exit
    assert supervisor.poll() is None  # which is no lost stub
    began = time.monotonic()
    psutil.Process(stub).kill()
    _, log = supervisor.communicate(timeout=30)
    took = time.monotonic() - began
    assert supervisor.returncode == 1, log
    assert f"the backend stub of model stand_in_model (instance stand_in_model_0_0, pid {stub}) exited while " \
        "tritonserver runs" in log, log
    assert log.count("exited while tritonserver runs") == 1, log  # not the configuration's stub
    assert "drained in" in log and took < DRAINED_EXIT_S + 5, (took, log)  # not the 60 s exit timeout


def test_a_server_whose_draining_model_died_is_killed_after_a_bounded_wait_not_its_exit_timeout(tmp_path):
    supervisor, stub = supervise(tmp_path, str(tmp_path / "drain"), "--exit-timeout-secs=60", no_report=True)
    time.sleep(STUB_CHECK_S + 0.5)
    began = time.monotonic()
    psutil.Process(stub).kill()
    _, log = supervisor.communicate(timeout=60)
    took = time.monotonic() - began
    assert supervisor.returncode == 1 and "exited while tritonserver runs" in log, log
    # The dead model takes no drain file up (given up after 1 s), and the server is killed STOP_GRACE_S after
    # SIGTERM: not 60 s and 5 more, nor the rest of LOST_STUB_STOP_S (16 s seen on the real server)
    assert "did not take up the drain file" in log, log
    assert STOP_GRACE_S <= took < LOST_STUB_STOP_S, (took, log)


def test_a_stop_given_a_time_after_sigterm_kills_then_rather_than_wait_out_the_rest():
    """A server that lost its backend stub gets SIGTERM and a short grace, not the rest of its stop's time: nothing
    it runs can finish there, and its clients' streams wait for its exit (16 s seen after a stub's kill -9)."""
    from prepos.supervise import stop_server

    ignoring = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print(flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    ignoring.stdout.readline()  # SIGTERM is ignored from here on
    began = time.monotonic()
    stop = stop_server(ignoring, drain_file=None, exit_timeout_s=60, timeout_s=10, then_s=0.5)
    took = time.monotonic() - began
    assert stop.killed and not stop.drained
    assert took < 3, took  # 10 s without then_s


def test_without_a_drain_the_server_gets_its_exit_timeout_and_grace_then_its_status_is_passed_on(tmp_path):
    supervisor, stub = supervise(tmp_path, None, "--exit-timeout-secs", "1")
    began = time.monotonic()
    supervisor.send_signal(signal.SIGINT)
    _, log = supervisor.communicate(timeout=30)
    took = time.monotonic() - began
    assert supervisor.returncode == 128 + signal.SIGKILL, log  # killed: it never exited by itself
    assert 5.0 <= took < 12, took  # max(STOP_GRACE_S, exit timeout + grace - drain) = 6 s
    assert not running(stub)


def test_a_drain_that_left_sessions_open_stops_as_without_one(tmp_path):
    # Their ENDs were not served: requests of theirs may still run, so the server gets its exit timeout.
    supervisor, stub = supervise(tmp_path, str(tmp_path / "drain"), "--exit-timeout-secs=1", left_open=1)
    began = time.monotonic()
    supervisor.send_signal(signal.SIGTERM)
    _, log = supervisor.communicate(timeout=30)
    took = time.monotonic() - began
    assert supervisor.returncode == 128 + signal.SIGKILL, log
    assert 5.0 <= took < 12, took
    assert "the drain left 1 sessions open" in log and not running(stub)


def test_a_server_that_exits_by_itself_has_its_status_passed_on(tmp_path):
    result = subprocess.run([sys.executable, "-m", "prepos.supervise", "--", sys.executable, "-c", "exit(3)",
                             f"--grpc-port={unused_port()}"], capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}, timeout=30)
    assert result.returncode == 3 and "tritonserver exited with status 3" in result.stderr, result.stderr
    crash = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    crashed = subprocess.run([sys.executable, "-m", "prepos.supervise", "--", sys.executable, "-c", crash,
                              f"--grpc-port={unused_port()}"], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}, timeout=30)
    assert crashed.returncode == 128 + signal.SIGSEGV, crashed.stderr
    assert "tritonserver was killed by SIGSEGV (signal 11): it crashed" in crashed.stderr, crashed.stderr
    nothing = subprocess.run([sys.executable, "-m", "prepos.supervise"], capture_output=True, text=True, timeout=30,
                             env={"PYTHONPATH": ":".join(sys.path)})
    assert nothing.returncode == 2 and "usage" in nothing.stderr


def test_how_a_server_asked_to_stop_ended_is_logged_and_passed_on(tmp_path):
    # Triton 2.51 could crash on its way out: the log says how it ended, not only the exit status
    server = ("import os, signal, sys, time; from pathlib import Path; "
              "signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGSEGV)); "
              "Path(sys.argv[1]).write_text('up'); time.sleep(60)")
    supervisor = subprocess.Popen([sys.executable, "-m", "prepos.supervise", "--", sys.executable, "-c", server,
                                   str(tmp_path / "up"), f"--grpc-port={unused_port()}"], stderr=subprocess.PIPE,
                                  text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    deadline = time.monotonic() + 20
    while not (tmp_path / "up").exists():
        assert time.monotonic() < deadline and supervisor.poll() is None
        time.sleep(0.05)
    supervisor.send_signal(signal.SIGTERM)
    _, log = supervisor.communicate(timeout=30)
    assert supervisor.returncode == 128 + signal.SIGSEGV, log
    assert "tritonserver was killed by SIGSEGV (signal 11): it crashed" in log and "once asked to stop" in log, log


def test_a_sigkill_from_elsewhere_during_the_stop_is_told_as_such(tmp_path):
    """Only the supervisor's own SIGKILL goes untold (it says so when it sends it): one from the out-of-memory
    killer during a drain was taken for it."""
    supervisor, _ = supervise(tmp_path, None, "--exit-timeout-secs=60")
    (server,) = [child for child in psutil.Process(supervisor.pid).children() if child.pid != supervisor.pid]
    supervisor.send_signal(signal.SIGTERM)
    time.sleep(1.0)  # the stand-in ignores SIGTERM: the supervisor waits for it
    server.kill()
    _, log = supervisor.communicate(timeout=30)
    assert supervisor.returncode == 128 + signal.SIGKILL, log
    assert "tritonserver was killed by SIGKILL (signal 9): the kernel's out-of-memory killer, or someone, killed it" \
        ", once asked to stop" in log, log


@pytest.mark.parametrize(("args", "expected"), [
    (["--exit-timeout-secs=100"], 100.0),
    (["--exit-timeout-secs", "7", "--log-verbose=1"], 7.0),
    (["--exit-timeout-secs=5", "--exit-timeout-secs=9"], 9.0),  # the last one, as Triton reads them
    (["--http-port=8000"], TRITON_EXIT_TIMEOUT_S),
    (["--exit-timeout-secs=soon"], TRITON_EXIT_TIMEOUT_S),
])
def test_the_exit_timeout_is_read_from_the_servers_arguments(args, expected):
    assert exit_timeout_of(args) == expected


def test_the_supervisor_runs_on_the_standard_library_alone():
    """The image installs prepos without its dependencies for the entrypoint: importing the supervisor, and the
    drain it asks for, must load no third-party package."""
    check = ("import sys; before = set(sys.modules); import prepos.supervise, prepos.drain; "
             "added = {m.split('.')[0] for m in set(sys.modules) - before}; "
             "print(sorted(added - set(sys.stdlib_module_names) - {'prepos'}))")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason=f"{SHM_DIR} is not here")
def test_the_servers_shared_memory_regions_are_named_by_its_port_and_removed_once_it_is_gone(tmp_path):
    port = unused_port()
    prefix = region_prefix(port)
    left = SHM_DIR / f"{prefix}left-by-a-killed-server"
    other = SHM_DIR / f"prepos_{port}0_another-servers"  # its prefix begins with the same digits
    left.write_bytes(bytes(4096))
    other.write_bytes(bytes(4096))
    try:
        supervisor, _ = supervise(tmp_path, None, f"--grpc-port={port}", "--exit-timeout-secs=0")
        made = SHM_DIR / f"{prefix}stand-in"
        assert not left.exists() and other.exists()  # removed before the server started
        assert made.exists()  # the server was told the prefix
        supervisor.send_signal(signal.SIGTERM)
        _, log = supervisor.communicate(timeout=30)
        assert supervisor.returncode == 128 + signal.SIGKILL, log  # the stand-in ignores SIGTERM: killed
        assert not made.exists() and other.exists(), log  # what the killed server left is removed
        assert "removed 1 shared-memory region(s)" in log
    finally:
        for path in (left, other, SHM_DIR / f"{prefix}stand-in"):
            path.unlink(missing_ok=True)


@pytest.mark.parametrize(("args", "expected"), [
    (["tritonserver", "--grpc-port=9001"], (["tritonserver", "--grpc-port=9001",
                                            "--backend-config=python,shm-region-prefix-name=prepos_9001_"],
                                           "prepos_9001_")),
    (["tritonserver", "--grpc-port", "9002"], (["tritonserver", "--grpc-port", "9002",
                                               "--backend-config=python,shm-region-prefix-name=prepos_9002_"],
                                              "prepos_9002_")),
    (["tritonserver"], (["tritonserver", f"--backend-config=python,shm-region-prefix-name=prepos_{TRITON_GRPC_PORT}_"],
                        f"prepos_{TRITON_GRPC_PORT}_")),
    # A prefix the arguments set is kept, whichever form they set it in.
    (["tritonserver", "--backend-config=python,shm-region-prefix-name=mine_"],
     (["tritonserver", "--backend-config=python,shm-region-prefix-name=mine_"], "mine_")),
    (["tritonserver", "--backend-config", "python,shm-region-prefix-name=mine_"],
     (["tritonserver", "--backend-config", "python,shm-region-prefix-name=mine_"], "mine_")),
])
def test_the_region_prefix_is_added_to_the_servers_arguments_unless_they_set_one(args, expected):
    assert with_region_prefix(args) == expected


@pytest.mark.parametrize(("args", "expected"), [
    (["tritonserver", "--grpc-port=9002"], ["tritonserver", "--grpc-port=9002",
                                           f"--backend-config=python,thread-pool-size={BLS_THREADS}"]),
    # A number the arguments set is kept, whichever form they set it in; another backend's setting is not it.
    (["tritonserver", "--backend-config=python,thread-pool-size=64"],
     ["tritonserver", "--backend-config=python,thread-pool-size=64"]),
    (["tritonserver", "--backend-config", "python,thread-pool-size=64"],
     ["tritonserver", "--backend-config", "python,thread-pool-size=64"]),
    (["tritonserver", "--backend-config=onnxruntime,thread-pool-size=4"],
     ["tritonserver", "--backend-config=onnxruntime,thread-pool-size=4",
      f"--backend-config=python,thread-pool-size={BLS_THREADS}"]),
])
def test_the_python_backend_gets_threads_for_every_bridged_request_unless_the_arguments_set_a_number(args, expected):
    assert with_bls_threads(args) == expected


def test_there_are_more_bls_threads_than_the_bridge_relays_at_once():
    """Each relayed request holds a Business Logic Scripting thread until prepos answers it: with fewer threads
    than the bridge's requests, requests queued on one session stall every other session's."""
    config = (Path(__file__).resolve().parents[2] / "model_repository" / "prepos_http" / "config.pbtxt").read_text()
    max_streams = int(re.search(r'key: "bridge.max_streams" value: \{ string_value: "(\d+)" \}', config).group(1))
    assert BLS_THREADS > max_streams
    assert bls_threads_argument() in server_command(ServerOptions(), Path("/b"))


def test_the_grpc_port_is_read_from_the_servers_arguments():
    assert grpc_port_of(["--grpc-port=7001", "--grpc-port", "7002"]) == 7002
    assert grpc_port_of(["--http-port=8000"]) == TRITON_GRPC_PORT == 8001
    assert grpc_port_of(["--grpc-port=soon"]) == TRITON_GRPC_PORT


@pytest.mark.parametrize("soft_kib, child_kib", [
    ("8192", "1048576"),  # the usual 8 MiB: raised
    ("unlimited", "1048576"),  # unlimited gives threads 2 MiB: limited
    ("2097152", "2097152"),  # already more: kept
])
def test_tritonserver_starts_with_a_stack_limit_its_http_threads_survive_a_large_form_body_with(soft_kib, child_kib):
    """Triton 2.51's HTTP front end copies a form-data body onto its thread's stack and parses JSON recursively
    there; the threads' stacks are as large as the stack limit the server started with."""
    script = textwrap.dedent("""
        import resource, subprocess, sys
        from prepos.supervise import server_stack_limit
        soft = sys.argv[1]
        resource.setrlimit(resource.RLIMIT_STACK, (resource.RLIM_INFINITY if soft == "unlimited" else int(soft) << 10,
                                                   resource.getrlimit(resource.RLIMIT_STACK)[1]))
        with server_stack_limit():
            inside = subprocess.run(["sh", "-c", "ulimit -s"], capture_output=True, text=True).stdout.strip()
        after = subprocess.run(["sh", "-c", "ulimit -s"], capture_output=True, text=True).stdout.strip()
        print(inside, after)
    """)
    if resource.getrlimit(resource.RLIMIT_STACK)[1] != resource.RLIM_INFINITY:
        pytest.skip("this machine's hard stack limit is not unlimited")
    out = subprocess.run([sys.executable, "-c", script, soft_kib], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": ":".join(sys.path), "PATH": "/usr/bin:/bin"}).stdout.split()
    assert out == [child_kib, soft_kib]  # the server's limit inside; this process's own restored after


@pytest.mark.parametrize(("args", "expected"), [
    (["tritonserver"], ["tritonserver", *keepalive_ping_arguments()]),
    # A setting the arguments make is kept, whichever form they make it in.
    (["tritonserver", "--grpc-keepalive-permit-without-calls=0"],
     ["tritonserver", "--grpc-keepalive-permit-without-calls=0",
      "--grpc-http2-min-recv-ping-interval-without-data=1000"]),
    (["tritonserver", "--grpc-http2-min-recv-ping-interval-without-data", "60000"],
     ["tritonserver", "--grpc-http2-min-recv-ping-interval-without-data", "60000",
      "--grpc-keepalive-permit-without-calls=1"]),
])
def test_the_server_accepts_keepalive_pings_unless_the_arguments_say_otherwise(args, expected):
    assert with_keepalive_pings(args) == expected
    assert set(keepalive_ping_arguments()) <= set(server_command(ServerOptions(), Path("/b")))


@pytest.mark.parametrize(("code", "said"), [
    (0, "exited with status 0"),
    (3, "exited with status 3"),
    (-signal.SIGSEGV, "was killed by SIGSEGV (signal 11): it crashed (one known cause: an HTTP body"),
    (-signal.SIGABRT, "was killed by SIGABRT (signal 6): it crashed"),
    (-signal.SIGKILL, "was killed by SIGKILL (signal 9): the kernel's out-of-memory killer, or someone, killed it"),
    (-signal.SIGTERM, "was killed by SIGTERM (signal 15)"),
    (-200, "was killed by signal 200"),
])
def test_an_exit_is_described_by_its_status_or_its_signal(code, said):
    from prepos.supervise import describe_exit

    assert describe_exit(code).startswith(said)
    assert ("crashed" in describe_exit(code)) == (code in (-signal.SIGSEGV, -signal.SIGABRT))


def test_an_access_token_with_whitespace_around_it_is_trimmed_and_an_empty_one_refused(tmp_path, caplog):
    """The chart puts the Secret's value in tritonserver's arguments as it is: a Secret made from a file ending in
    a newline made Triton want a header value no client can send, and every call was refused."""
    from prepos.triton_args import with_tokens_trimmed

    args = ["tritonserver", "--grpc-restricted-protocol=inference,health:prepos-access-token=abc=def\n",
            "--http-restricted-api=inference:prepos-access-token= tok ", "--log-verbose=0"]
    with caplog.at_level("WARNING", logger="prepos.triton_args"):
        assert with_tokens_trimmed(args) == ["tritonserver",
                                             "--grpc-restricted-protocol=inference,health:prepos-access-token=abc=def",
                                             "--http-restricted-api=inference:prepos-access-token=tok",
                                             "--log-verbose=0"]
    assert caplog.text.count("has whitespace around it") == 2 and "abc" not in caplog.text  # the token unsaid
    assert with_tokens_trimmed(args[3:]) == args[3:]
    result = subprocess.run([sys.executable, "-m", "prepos.supervise", "--", sys.executable, "-c", "exit(0)",
                             "--grpc-restricted-protocol=inference:prepos-access-token=\n",
                             f"--grpc-port={unused_port()}"], capture_output=True, text=True, timeout=30,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert result.returncode == 2, result.stderr
    assert "--grpc-restricted-protocol: the access token for header 'prepos-access-token' is empty" in result.stderr
