"""Stopping the server while sessions are open and their clients still hold streams: Triton waits its exit
timeout for the open sessions and then hangs instead of exiting; the launcher kills it soon after, and every
session resumes from its journal after the restart, answering as a session that was never interrupted."""

from __future__ import annotations

import time

import psutil
import pytest

from prepos.launcher import STOP_GRACE_S
from prepos_client import Client

from .conftest import start_server

pytestmark = pytest.mark.integration

SYSTEM = "You are a concise assistant."
EXIT_TIMEOUT_S = 2


def test_a_stop_with_streams_held_ends_soon_after_the_exit_timeout_and_the_sessions_resume(tmp_path):
    env = {"PREPOS_JOURNAL_DIR": str(tmp_path / "journal")}
    server = start_server(tmp_path / "first", env=env, exit_timeout_s=EXIT_TIMEOUT_S)
    client = Client(server.grpc_url)
    try:
        held = client.session("held")
        held.append(SYSTEM, role="system")
        first = held.ask("Name a colour.", max_tokens=3, speculate=False).token_ids
        processes = [psutil.Process(server.process.pid), *psutil.Process(server.process.pid).children(recursive=True)]
        began = time.monotonic()
        server.stop()  # the session is open and its stream held
        took = time.monotonic() - began
        assert EXIT_TIMEOUT_S <= took < EXIT_TIMEOUT_S + STOP_GRACE_S + 5, took  # a fixed 30 s before
        assert not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        held.detach()
    finally:
        server.stop()
        client.close()

    server = start_server(tmp_path / "second", env=env)
    try:
        with Client(server.grpc_url) as client:
            resumed = client.session("held", resume=True)
            after = resumed.ask("And another?", max_tokens=4, speculate=False)
            assert after.path == "rebuild"
            with client.session() as twin:
                twin.append(SYSTEM, role="system")
                assert twin.ask("Name a colour.", max_tokens=3, speculate=False).token_ids == first
                assert twin.ask("And another?", max_tokens=4, speculate=False).token_ids == after.token_ids
            resumed.close()
    finally:
        server.stop()
