"""A tritonserver that dies under its models (kill -9, a crash, the OOM killer) takes its backend stubs with it.

python_backend's stub leaves once it sees its server gone, unless a call to the server (a metric update, a
cancellation check) was then waiting for the dead server's reply: prepos makes none while it idles, asks about
cancellation at most every 50 ms per request, and makes none once the server is gone, so an idle server's stubs
always leave on their own. Under load a call can still be in flight at the kill (1 or 2 kills in 10 here,
`make server-death`): the launcher kills a stub that stays (also tests/core/test_launcher_ports.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from prepos_client import Client, PreposError

from .conftest import start_server

pytestmark = pytest.mark.integration


def kill_server_and_wait_for_its_stubs(server) -> list:
    """SIGKILL tritonserver alone; its stubs still running 20 s later."""
    stubs = psutil.Process(server.process.pid).children(recursive=True)
    assert len(stubs) == 2  # prepos and prepos_http
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait()
    _, alive = psutil.wait_procs(stubs, timeout=20)
    return alive


def test_the_backend_stubs_leave_with_a_killed_idle_server(tmp_path):
    server = start_server(tmp_path)
    try:
        with Client(server.grpc_url) as client:
            session = client.session("death-1")
            for turn in range(3):  # requests served: counters, histograms and gauges to publish
                session.ask(f"Say hello number {turn}.", max_tokens=3)
            session.close()
        time.sleep(2.0)  # idle: several housekeeping rounds, each of which used to publish every gauge again
        alive = kill_server_and_wait_for_its_stubs(server)
        assert not alive, f"backend stubs {[stub.pid for stub in alive]} outlived their server"
    finally:
        server.stop()


def test_no_backend_stub_outlives_a_server_killed_mid_decode(tmp_path):
    server = start_server(tmp_path)
    stop = threading.Event()
    decoding = threading.Barrier(4 + 1)

    def load(index: int) -> None:
        try:
            with Client(server.grpc_url, timeout_s=30) as client:
                session = client.session(f"death-load-{index}")
                session.ask("Count from one to five.", max_tokens=4)
                decoding.wait(60)
                for _ in range(500):  # bounded: the server is killed long before
                    if stop.is_set():
                        break
                    session.ask("Tell me a long story about the sea.", max_tokens=48)
        except (PreposError, threading.BrokenBarrierError, OSError):
            pass  # the server went away

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    try:
        for thread in threads:
            thread.start()
        decoding.wait(120)
        time.sleep(1.5)  # four sessions decoding: sends, cancellation checks and metrics in flight
        stubs = psutil.Process(server.process.pid).children(recursive=True)
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait()
        server.stop()  # the server is gone already: this reaps whatever stub a call in flight at the kill hung
        assert not [stub for stub in stubs if stub.is_running() and stub.status() != psutil.STATUS_ZOMBIE]
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        server.stop()
