"""Stopping the server: a backend stub it kills is dead (gone, or a zombie) when stop returns."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from prepos.launcher import ServerOptions, TritonServer, _wait_dead, stopping_message


def test_wait_dead_returns_once_a_killed_process_has_exited_and_not_before():
    slow = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                             "lambda *a: (time.sleep(0.5), exit(0))); time.sleep(30)"])
    try:
        time.sleep(0.5)  # its SIGTERM handler is installed
        process = psutil.Process(slow.pid)
        process.terminate()  # exits half a second later
        began = time.monotonic()
        _wait_dead([process], timeout_s=10)
        assert 0.3 < time.monotonic() - began < 5
        assert process.status() == psutil.STATUS_ZOMBIE  # exited; reaping is its parent's (this test's) business
        _wait_dead([process], timeout_s=10)  # a zombie counts as dead: no wait
    finally:
        slow.kill()
        slow.wait()
    _wait_dead([process], timeout_s=10)  # gone altogether


def test_wait_dead_gives_up_after_its_timeout():
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        began = time.monotonic()
        _wait_dead([psutil.Process(alive.pid)], timeout_s=0.3)
        assert 0.25 < time.monotonic() - began < 3
    finally:
        alive.kill()
        alive.wait()


def test_the_stop_is_told_as_a_drain_only_where_one_runs(tmp_path, monkeypatch):
    """With the drain file set empty (the README's way to turn the drain off) the launcher still said it was
    draining, every session to be ended."""
    monkeypatch.setenv("PREPOS_SCHEDULER_DRAIN_FILE", "")
    server = TritonServer(ServerOptions(run_dir=tmp_path / "run"))
    assert server.drain_file is None
    told = stopping_message(server.drain_file, 30.0)
    assert "no drain" in told and "draining" not in told and "30.0 s" in told
    assert "draining" in stopping_message(tmp_path / "drain", 30.0)
