"""Stopping the server with sessions open: it drains (every session ended by the model, its journal kept, once
its requests in flight are served), so a stop takes seconds instead of Triton's exit timeout, also while clients
hold their streams; every session resumes after the restart, answering as a session never interrupted. Without
a drain, Triton waits its exit timeout and then hangs while a stream is held; the launcher kills it soon after."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import psutil
import pytest

from prepos.drain import drained_path
from prepos.journal import SessionJournal
from prepos.launcher import (REPO_ROOT, ServerOptions, TritonServer, prepare_backend_dir, server_command,
                             server_environment)
from prepos.replica_health import HEALTH_PORT_ENV, LEAVING_FILE_ENV
from prepos.supervise import DRAIN_ENV, STOP_GRACE_S
from prepos_client import Client, PreposError

from .conftest import ENGINE_DIR, free_loopback_ports, ports_of, start_server

pytestmark = pytest.mark.integration

SYSTEM = "You are a concise assistant."
EXIT_TIMEOUT_S = 30  # what a stop that waits for open sessions would take, at least


def alive_processes(pid: int) -> list:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def end_if_running(process: subprocess.Popen) -> None:
    """After a test that failed: end the process it started, and everything under it."""
    if process.poll() is None:
        for child in reversed(alive_processes(process.pid)):
            child.kill()
        process.wait()


def http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def wait_until_ready(http_port: int, process: subprocess.Popen, log_tail: Callable[[], str]) -> None:
    """Poll the server's HTTP health endpoint until it says ready; fail with ``log_tail()`` if ``process`` exits
    or 240 s pass."""
    deadline = time.monotonic() + 240
    while True:
        assert process.poll() is None and time.monotonic() < deadline, log_tail()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)


def test_a_drain_ends_every_session_once_served_and_they_resume_after_the_restart(tmp_path):
    env = {"PREPOS_JOURNAL_DIR": str(tmp_path / "journal")}
    server = start_server(tmp_path / "first", env=env, exit_timeout_s=EXIT_TIMEOUT_S)
    client = Client(server.grpc_url)
    asked: dict[str, list[int]] = {}
    try:
        held = client.session("held")  # its client keeps the stream
        held.append(SYSTEM, role="system")
        asked["held"] = held.ask("Name a colour.", max_tokens=3, speculate=False).token_ids
        with client.session("gone") as gone:  # its client went away, leaving it open
            gone.append(SYSTEM, role="system")
            asked["gone"] = gone.ask("Name a fruit.", max_tokens=3, speculate=False).token_ids
            gone.detach()
        busy = client.session("busy")
        busy.append(SYSTEM, role="system")
        long_answer = {}
        answering = threading.Thread(target=lambda: long_answer.update(
            answer=busy.ask("Tell me about the sea.", max_tokens=48, speculate=False)))
        answering.start()
        time.sleep(0.3)  # under way when the drain begins

        server.drain_file.touch()  # the drain a stop begins, here without the stop
        answering.join(60)
        assert long_answer["answer"].finish_reason == "length" and len(long_answer["answer"].token_ids) == 48
        deadline = time.monotonic() + 30
        while not drained_path(server.drain_file).exists():
            assert time.monotonic() < deadline, "no drain report"
            time.sleep(0.05)
        deadline = time.monotonic() + 5  # the gauge is published at least every half second
        while server.metric("prepos_sessions") != 0:
            assert time.monotonic() < deadline, "sessions still open after the drain"
            time.sleep(0.1)
        with pytest.raises(PreposError, match="draining"):  # no new session while draining
            client.session("new").ask("Hello?", max_tokens=2)
        with pytest.raises(PreposError, match="draining"):  # nor a resume; the held session is left to resume
            held.ask("And another?", max_tokens=4, speculate=False)
        assert not held.closed

        processes = alive_processes(server.process.pid)
        began = time.monotonic()
        server.stop()  # drained already: only Triton's own exit (or the kill, with the stream held) is left
        took = time.monotonic() - began
        assert took < EXIT_TIMEOUT_S / 3, took
        assert not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert len(list((tmp_path / "journal").iterdir())) == 3  # every session kept its journal
        held.detach()
    finally:
        server.stop()
        client.close()

    server = start_server(tmp_path / "second", env=env)
    try:
        with Client(server.grpc_url) as client:
            after = {}
            for sid in ("held", "gone", "busy"):
                after[sid] = client.session(sid, resume=True).ask("And another?", max_tokens=4, speculate=False)
                assert after[sid].path == "rebuild"
            with client.session() as twin:
                twin.append(SYSTEM, role="system")
                assert twin.ask("Name a colour.", max_tokens=3, speculate=False).token_ids == asked["held"]
                assert twin.ask("And another?", max_tokens=4, speculate=False).token_ids == after["held"].token_ids
            with client.session() as twin:
                twin.append(SYSTEM, role="system")
                twin.ask("Tell me about the sea.", max_tokens=48, speculate=False)
                assert twin.ask("And another?", max_tokens=4, speculate=False).token_ids == after["busy"].token_ids
    finally:
        server.stop()


def test_a_stop_while_answers_stream_is_drained_once_they_are_served(tmp_path):
    """Sessions asking one answer after another when the stop comes: the drain ends each session after the
    answer under way, which arrives in full; the next one is refused as draining; the stop is a drained one.
    (The drain's END was once sent through Triton, and blocked together with the model's response sends: one
    such stop in four was not drained.)"""
    server = start_server(tmp_path, env={"PREPOS_JOURNAL_DIR": str(tmp_path / "journal")},
                          exit_timeout_s=EXIT_TIMEOUT_S)
    client = Client(server.grpc_url, timeout_s=120)
    num_sessions, streaming = 6, threading.Semaphore(0)
    answers: dict[int, list[list]] = {index: [] for index in range(num_sessions)}
    refusals: dict[int, PreposError] = {}

    def converse(index: int) -> None:
        session = client.session(f"streaming-{index}")
        session.append(SYSTEM, role="system")
        try:
            while True:
                answers[index].append(chunks := [])
                for chunk in session.generate("Tell me a long story about a cat.", max_tokens=40, speculate=False):
                    if not chunks and len(answers[index]) == 1:
                        streaming.release()
                    chunks.append(chunk)
        except PreposError as error:
            refusals[index] = error
        session.detach()

    threads = [threading.Thread(target=converse, args=(index,)) for index in range(num_sessions)]
    try:
        for thread in threads:
            thread.start()
        for _ in threads:
            assert streaming.acquire(timeout=120)
        time.sleep(2)  # answers and requests come and go
        assert server.stop(), "not drained"
        for thread in threads:
            thread.join(60)
        for index in range(num_sessions):
            assert "draining" in str(refusals[index]), refusals[index]
            *served, refused = answers[index]  # the last one's request was refused, unanswered
            assert served and not refused, index
            for chunks in served:
                assert sum(len(chunk.token_ids) for chunk in chunks) == 40 and chunks[-1].finish_reason == "length"
        assert len(list((tmp_path / "journal").iterdir())) == num_sessions
    finally:
        server.stop()
        client.close()


def test_a_stop_right_after_the_server_got_ready_drains_it(tmp_path):
    """A stop before the launcher saw the server ready (a SIGTERM between two of its looks) still drains a server
    that reports ready by then, rather than leave Triton its exit timeout."""
    http, grpc, metrics = free_loopback_ports(3)
    server = TritonServer(ServerOptions(http_port=http, grpc_port=grpc, metrics_port=metrics, run_dir=tmp_path,
                                        exit_timeout_s=EXIT_TIMEOUT_S),
                          env={"PREPOS_ENGINE_DIR": str(ENGINE_DIR), "PREPOS_JOURNAL_DIR": str(tmp_path / "journal")})
    server.start()
    try:
        # The server's readiness as a client sees it, not through wait_ready.
        wait_until_ready(server.options.http_port, server.process, server.log_tail)
        with Client(server.grpc_url) as client:
            session = client.session("opened-at-once")
            session.append(SYSTEM, role="system")
            session.detach()
        assert server.stop(), "not drained"
        assert len(list((tmp_path / "journal").iterdir())) == 1
    finally:
        server.stop()


def open_sessions_until(url: str, stopped: threading.Event) -> None:
    """Open a session and ask it one question, again and again, until ``stopped``; refusals are expected."""
    with Client(url, timeout_s=5) as client:
        while not stopped.is_set():
            session = client.session()
            try:
                session.ask("Hello?", max_tokens=1, speculate=False)
            except PreposError:
                time.sleep(0.005)
            session.detach()


def test_calls_made_while_the_only_server_restarts_wait_for_it_and_go_on_once(tmp_path, tokenizer):
    """`Client(wait_for_ready=True)`: a restart of the one server costs the calls made meanwhile only time; each
    turn is taken once, and the sessions answer as twins never interrupted."""
    journal_dir = tmp_path / "journal"
    env = {"PREPOS_JOURNAL_DIR": str(journal_dir)}
    server = start_server(tmp_path / "first", env=env)
    ports = ports_of(server)
    client = Client(server.grpc_url, timeout_s=300, wait_for_ready=True)
    answers: dict = {}
    try:
        old = client.session("old")  # open across the restart, its journal kept by the drain
        old.append(SYSTEM, role="system")
        first = old.ask("Name a colour.", max_tokens=3, speculate=False)
        stopped = threading.Event()
        hammering = threading.Thread(target=open_sessions_until, args=(server.grpc_url, stopped))
        hammering.start()  # another client opens sessions all along the stop: each START refused while draining
        time.sleep(0.5)
        began = time.monotonic()
        server.stop()
        took = time.monotonic() - began
        stopped.set()
        hammering.join(30)
        assert took < server.options.exit_timeout_s / 2, f"not drained: the stop took {took:.1f} s"
        new = client.session("new")  # its first request comes while the server is down
        calls = {"old": lambda: old.ask("And another?", max_tokens=4, speculate=False),
                 "new": lambda: new.ask("Name a fruit.", max_tokens=4, speculate=False)}
        waiting = [threading.Thread(target=lambda name=name: answers.update({name: calls[name]()}))
                   for name in calls]
        for thread in waiting:
            thread.start()
        time.sleep(2)
        assert all(thread.is_alive() for thread in waiting) and not answers  # waiting, not failed
        server = start_server(tmp_path / "second", env=env, ports=ports)
        for thread in waiting:
            thread.join(120)
        assert sorted(answers) == ["new", "old"], "a waiting call failed (its error is in the log above)"
        assert answers["old"].path == "rebuild"

        journal = SessionJournal(journal_dir, fsync=False)  # each turn in its session's log once
        assert tokenizer.decode(journal.recover("old").token_log).count("And another?") == 1
        assert tokenizer.decode(journal.recover("new").token_log).count("Name a fruit.") == 1
        with Client(server.grpc_url) as fresh:
            with fresh.session() as twin:
                twin.append(SYSTEM, role="system")
                assert twin.ask("Name a colour.", max_tokens=3, speculate=False).token_ids == first.token_ids
                assert twin.ask("And another?", max_tokens=4, speculate=False).token_ids == answers["old"].token_ids
            with fresh.session() as twin:
                assert twin.ask("Name a fruit.", max_tokens=4, speculate=False).token_ids == answers["new"].token_ids
        old.close()
        new.close()
        assert not {"old", "new"} & set(journal.session_ids())  # END deleted their journals
    finally:
        server.stop()
        client.close()


def test_a_stop_without_a_drain_ends_soon_after_the_exit_timeout_with_a_stream_held(tmp_path):
    exit_timeout_s = 2
    env = {"PREPOS_JOURNAL_DIR": str(tmp_path / "journal"), DRAIN_ENV: ""}  # no drain file: the old way
    server = start_server(tmp_path / "first", env=env, exit_timeout_s=exit_timeout_s)
    client = Client(server.grpc_url)
    try:
        held = client.session("held")
        held.append(SYSTEM, role="system")
        held.ask("Name a colour.", max_tokens=3, speculate=False)
        processes = alive_processes(server.process.pid)
        began = time.monotonic()
        server.stop()  # the session is open and its stream held
        took = time.monotonic() - began
        assert exit_timeout_s <= took < exit_timeout_s + STOP_GRACE_S + 5, took
        assert not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert len(list((tmp_path / "journal").iterdir())) == 1  # still journaled
        held.detach()
    finally:
        server.stop()
        client.close()


def test_the_supervisor_drains_tritonserver_on_sigterm_and_exits_cleanly(tmp_path):
    """The production image's entrypoint (python -m prepos.supervise -- tritonserver ...), on the real server."""
    http, grpc, metrics, health = free_loopback_ports(4)
    options = ServerOptions(model_repositories=(REPO_ROOT / "model_repository",), http_port=http, grpc_port=grpc,
                            metrics_port=metrics, run_dir=tmp_path, exit_timeout_s=EXIT_TIMEOUT_S)
    command = server_command(options, prepare_backend_dir(tmp_path))
    leaving = tmp_path / "leaving"
    leaving.touch()  # left by an earlier run: removed at the start
    env = {**server_environment(), "PREPOS_ENGINE_DIR": str(ENGINE_DIR),
           "PREPOS_JOURNAL_DIR": str(tmp_path / "journal"), DRAIN_ENV: str(tmp_path / "drain"),
           HEALTH_PORT_ENV: str(health), LEAVING_FILE_ENV: str(leaving)}
    with open(tmp_path / "supervised.log", "wb") as out:
        supervisor = subprocess.Popen([sys.executable, "-m", "prepos.supervise", "--", *command], env=env,
                                      stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    client = None
    try:
        wait_until_ready(http, supervisor, lambda: (tmp_path / "supervised.log").read_text()[-3000:])
        # The router's health check: Triton's readiness, until the preStop hook's leaving file says otherwise.
        assert http_status(health, "/ready") == 200
        leaving.touch()
        assert http_status(health, "/ready") == 503 and http_status(http, "/v2/health/ready") == 200
        leaving.unlink()
        assert http_status(health, "/ready") == 200
        client = Client(f"127.0.0.1:{grpc}")
        held = client.session("held")  # open, its stream held: Triton 2.51 alone would not exit
        held.append(SYSTEM, role="system")
        held.ask("Name a colour.", max_tokens=3, speculate=False)
        processes = alive_processes(supervisor.pid)
        assert len(processes) >= 3  # the supervisor, tritonserver, its backend stubs
        began = time.monotonic()
        supervisor.send_signal(signal.SIGTERM)
        code = supervisor.wait(EXIT_TIMEOUT_S + STOP_GRACE_S + 10)
        took = time.monotonic() - began
        log = (tmp_path / "supervised.log").read_text()
        assert code == 0 and took < EXIT_TIMEOUT_S / 3, (code, took, log[-3000:])
        assert "drained in" in log
        assert not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert len(list((tmp_path / "journal").iterdir())) == 1  # the session, to resume elsewhere
        held.detach()
    finally:
        end_if_running(supervisor)
        if client is not None:
            client.close()


def _can_make_a_pid_namespace() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can_make_a_pid_namespace(), reason="needs unshare --pid --mount-proc (root)")
def test_the_supervisor_as_pid_1_reaps_orphans_drains_and_exits_cleanly(tmp_path):
    """A container without an init of its own runs the supervisor as PID 1: orphans in the container are its to
    reap, and SIGTERM comes to it alone (PID 1 gets no default signal handling)."""
    http, grpc, metrics = free_loopback_ports(3)
    options = ServerOptions(model_repositories=(REPO_ROOT / "model_repository",), http_port=http, grpc_port=grpc,
                            metrics_port=metrics, run_dir=tmp_path, exit_timeout_s=EXIT_TIMEOUT_S)
    command = server_command(options, prepare_backend_dir(tmp_path))
    env = {**server_environment(), "PREPOS_ENGINE_DIR": str(ENGINE_DIR),
           "PREPOS_JOURNAL_DIR": str(tmp_path / "journal"), DRAIN_ENV: str(tmp_path / "drain")}
    as_pid_1 = "import os, sys; from prepos.supervise import main; assert os.getpid() == 1; sys.exit(main())"
    with open(tmp_path / "supervised.log", "wb") as out:
        # --mount-proc: its /proc is the namespace's, as a container's is (it finds its server's group there)
        namespace = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-c", as_pid_1, "--",
             *command], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    client = None
    try:
        wait_until_ready(http, namespace, lambda: (tmp_path / "supervised.log").read_text()[-3000:])
        (supervisor,) = psutil.Process(namespace.pid).children()
        # an orphan in the namespace: `sleep` outlives the shell that started it, and PID 1 inherits it
        subprocess.run(["nsenter", "--target", str(supervisor.pid), "--pid", "--", "sh", "-c", "sleep 1 &"],
                       check=True, timeout=10)
        orphans = [p for p in supervisor.children() if p.name() == "sleep"]
        assert len(orphans) == 1, supervisor.children()  # it is the supervisor's to reap
        orphans[0].wait(5)  # and gone once it exits: reaped (psutil would see a zombie it left)
        time.sleep(0.5)
        assert not [p for p in supervisor.children() if p.status() == psutil.STATUS_ZOMBIE]
        client = Client(f"127.0.0.1:{grpc}")
        held = client.session("held")
        held.append(SYSTEM, role="system")
        held.ask("Name a colour.", max_tokens=3, speculate=False)
        processes = alive_processes(supervisor.pid)
        supervisor.send_signal(signal.SIGTERM)
        code = namespace.wait(EXIT_TIMEOUT_S + STOP_GRACE_S + 10)
        log = (tmp_path / "supervised.log").read_text()
        assert code == 0 and "drained in" in log, log[-3000:]
        assert not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert len(list((tmp_path / "journal").iterdir())) == 1
        held.detach()
    finally:
        end_if_running(namespace)
        if client is not None:
            client.close()


def serve_ready(tmp_path, **popen) -> tuple[subprocess.Popen, int]:
    """``make serve``'s launcher on free loopback ports, its output in ``serve.log``, once it says it is ready; and
    its gRPC port."""
    http, grpc, metrics = free_loopback_ports(3)
    env = {**os.environ, "PREPOS_ENGINE_DIR": str(ENGINE_DIR)}
    with open(tmp_path / "serve.log", "wb") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "prepos.launcher", "--http-port", str(http), "--grpc-port", str(grpc),
             "--metrics-port", str(metrics), "--run-dir", str(tmp_path / "run")],
            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True, **popen)
    deadline = time.monotonic() + 240
    while b"Press Ctrl-C" not in (tmp_path / "serve.log").read_bytes():
        if launcher.poll() is not None or time.monotonic() > deadline:
            end_if_running(launcher)
            raise AssertionError((tmp_path / "serve.log").read_text())
        time.sleep(0.5)
    return launcher, grpc


@pytest.mark.parametrize("disposition", [signal.SIG_DFL, signal.SIG_IGN], ids=["foreground", "background"])
def test_ctrl_c_in_a_terminal_drains_make_serve(tmp_path, disposition):
    """A terminal's Ctrl-C reaches the launcher's whole process group: tritonserver must not take it itself (it
    would begin its exit before the drain) but be drained and stopped by the launcher. Started as a background job
    of a script (SIGINT ignored, as such a shell leaves it), the launcher stops on SIGINT all the same."""
    launcher, grpc = serve_ready(tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, disposition))
    client = None
    try:
        client = Client(f"127.0.0.1:{grpc}")
        held = client.session("held")
        held.append(SYSTEM, role="system")
        held.ask("Name a colour.", max_tokens=3, speculate=False)
        began = time.monotonic()
        os.killpg(launcher.pid, signal.SIGINT)
        code = launcher.wait(EXIT_TIMEOUT_S)
        took = time.monotonic() - began
        log = (tmp_path / "serve.log").read_text()
        assert code == 0 and took < 10, (code, took, log[-3000:])
        assert "drained in" in log and "1 sessions ended" in log, log[-3000:]
        held.detach()
    finally:
        end_if_running(launcher)
        if client is not None:
            client.close()


def _stub(launcher: subprocess.Popen, instance: str) -> psutil.Process:
    """The backend stub of a model instance (``prepos_0_0``, say) under ``make serve``'s launcher."""
    (stub,) = [p for p in psutil.Process(launcher.pid).children(recursive=True) if instance in p.cmdline()]
    return stub


def test_make_serve_stops_with_an_error_when_a_backend_stub_dies(tmp_path):
    """Triton 2.51 does not restart a dead backend stub: its model refuses every request ("Stub process ... is not
    healthy") while the server reports itself ready. The launcher stops such a server, draining prepos (the open
    session keeps its journal), and exits with an error."""
    launcher, grpc = serve_ready(tmp_path)
    client = None
    try:
        client = Client(f"127.0.0.1:{grpc}")
        held = client.session("held")
        held.append(SYSTEM, role="system")
        bridge = _stub(launcher, "prepos_http_0_0")
        time.sleep(1.5)  # the launcher has looked for the stubs since the server got ready
        began = time.monotonic()
        bridge.kill()
        code = launcher.wait(60)
        took = time.monotonic() - began
        log = (tmp_path / "serve.log").read_text()
        assert code == 1, log[-3000:]
        assert f"the backend stub of model prepos_http (instance prepos_http_0_0, pid {bridge.pid}) exited while " \
            "tritonserver runs" in log
        assert "drained in" in log and "1 sessions ended" in log and took < 15, (took, log[-3000:])
        assert len(list((tmp_path / "run" / "journal").iterdir())) == 1  # the session, to resume after a restart
        held.detach()
    finally:
        end_if_running(launcher)
        if client is not None:
            client.close()


def _stream_then_kill_the_prepos_stub(tmp_path):
    """``make serve`` with a session streaming a long answer, then its ``prepos`` stub killed: (launcher, chunks left
    to read, the session, the client, when the stub was killed)."""
    launcher, grpc = serve_ready(tmp_path)
    client = Client(f"127.0.0.1:{grpc}", timeout_s=60)
    streaming = client.session("streaming")
    streaming.append(SYSTEM, role="system")
    stub = _stub(launcher, "prepos_0_0")
    time.sleep(1.5)  # the launcher has looked for the stubs since the server got ready
    chunks = streaming.generate("Write a very long, detailed story of at least 2000 words about a lighthouse keeper "
                                "and his cat.", max_tokens=2000, speculate=False)  # runs long: it ends by length
    next(chunks)  # streaming
    killed = time.monotonic()
    stub.kill()
    return launcher, chunks, streaming, client, killed


@pytest.mark.parametrize("told_to_stop", [False, True], ids=["alone", "sigterm-during-the-stop"])
def test_make_serve_with_a_dead_prepos_stub_ends_its_streams_soon_and_exits_1(tmp_path, told_to_stop):
    """With the prepos stub dead nothing in flight can finish, yet the launcher gave Triton the rest of its 15 s
    after SIGTERM (a stream in flight got its error after 16 s); and a SIGTERM during that stop made it exit 0."""
    launcher, chunks, streaming, client, killed = _stream_then_kill_the_prepos_stub(tmp_path)
    try:
        if told_to_stop:
            deadline = time.monotonic() + 30
            while b"stopping (start it again" not in (tmp_path / "serve.log").read_bytes():
                assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
                time.sleep(0.1)
            os.kill(launcher.pid, signal.SIGTERM)  # told to stop while it stops: killed at once
        with pytest.raises(PreposError):
            for _ in chunks:
                pass
        ended = time.monotonic() - killed
        code = launcher.wait(60)
        log = (tmp_path / "serve.log").read_text()
        assert code == 1, log[-3000:]
        assert ended < 12, (ended, log[-3000:])  # 16 s before: the rest of the 15 s after SIGTERM
        if not told_to_stop:
            assert "did not take up the drain file" in log, log[-3000:]  # the drain gave up: SIGTERM, 5 s
        streaming.detach()
    finally:
        end_if_running(launcher)
        client.close()


def test_make_serve_continues_a_stopped_tritonserver_to_drain_it(tmp_path):
    """A tritonserver stopped by SIGSTOP (a debugger, ^Z of its group) could neither drain nor exit: the launcher's
    stop took its exit timeout and a SIGKILL (20 s), where the image's supervisor already sent SIGCONT."""
    launcher, grpc = serve_ready(tmp_path)
    try:
        (triton,) = [p for p in psutil.Process(launcher.pid).children() if "tritonserver" in p.name()]
        triton.suspend()
        time.sleep(0.5)
        began = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(60)
        took = time.monotonic() - began
        log = (tmp_path / "serve.log").read_text()
        assert code == 0 and "continuing them so that they can drain and exit" in log, log[-3000:]
        assert "drained in" in log and took < 10, (took, log[-3000:])
    finally:
        end_if_running(launcher)
