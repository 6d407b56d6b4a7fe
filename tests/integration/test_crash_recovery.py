"""kill -9 of the server mid-load: after a restart on the same journal directory, every delta a client
saw acknowledged is in its session's log, once, in order, and the sessions go on (path ``rebuild``)."""

from __future__ import annotations

import threading
import time

import pytest

from prepos.journal import SessionJournal
from prepos.shm_regions import SHM_DIR, region_prefix
from prepos_client import Client, PreposError

from .conftest import kill_hard, start_server

pytestmark = pytest.mark.integration

NUM_SESSIONS = 4


def client_load(server, index: int, acknowledged: list[str], stop: threading.Event, ready: threading.Event) -> None:
    """Alternate updates and questions until the server dies; record each delta once it is acknowledged."""
    try:
        with Client(server.grpc_url) as client:
            session = client.session(f"crash-{index}")
            session.append(f"You keep notes for team {index}.", role="system")
            acknowledged.append(f"You keep notes for team {index}.")
            turn = 0
            while not stop.is_set() and turn < 200:
                delta = f"note {turn} of team {index}: code {1000 * index + turn}"
                if turn % 2:
                    session.ask(delta, max_tokens=2)
                else:
                    session.append(delta)
                acknowledged.append(delta)
                turn += 1
                if turn == 3:
                    ready.set()
            session.detach()
    except (PreposError, OSError, Exception):  # the server went away mid-request: that request was not acknowledged
        ready.set()


def test_kill_9_mid_load_loses_no_acknowledged_delta(tmp_path, tokenizer):
    journal_dir = tmp_path / "journal"
    env = {"PREPOS_JOURNAL_DIR": str(journal_dir)}
    server = start_server(tmp_path / "first", env=env)
    acknowledged: list[list[str]] = [[] for _ in range(NUM_SESSIONS)]
    stop = threading.Event()
    readies = [threading.Event() for _ in range(NUM_SESSIONS)]
    threads = [threading.Thread(target=client_load, args=(server, i, acknowledged[i], stop, readies[i]))
               for i in range(NUM_SESSIONS)]
    try:
        for thread in threads:
            thread.start()
        for ready in readies:
            assert ready.wait(120)
        time.sleep(1.0)  # mid-load
        regions = sorted(SHM_DIR.glob(region_prefix(server.options.grpc_port) + "*"))
        assert regions  # the Python backend's shared memory, named after the server's port
        kill_hard(server)
        assert all(region.exists() for region in regions)  # killed, it could not remove them
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        server.stop()
    assert not any(region.exists() for region in regions)  # the launcher did

    journal = SessionJournal(journal_dir, fsync=False)
    assert sorted(journal.session_ids()) == sorted(f"crash-{i}" for i in range(NUM_SESSIONS))
    for i in range(NUM_SESSIONS):
        recovered = journal.recover(f"crash-{i}")
        text = tokenizer.decode(recovered.token_log)
        position = 0
        for delta in acknowledged[i]:  # in order, each once
            found = text.find(delta, position)
            assert found >= 0, f"session {i}: acknowledged delta {delta!r} is not in the journal"
            assert text.count(delta) == 1
            position = found + len(delta)
        # at most the one request in flight at the kill can be journaled without its acknowledgement
        assert text.count(f"of team {i}:") <= len(acknowledged[i]) - 1 + 1

    restarted = start_server(tmp_path / "second", env=env)
    try:
        with Client(restarted.grpc_url) as client:
            for i in range(NUM_SESSIONS):
                session = client.session(f"crash-{i}", resume=True)
                answer = session.ask("Which team are you?", max_tokens=3)
                assert answer.path == "rebuild"
                session.close()
        assert journal.session_ids() == []  # END deleted them
    finally:
        restarted.stop()
