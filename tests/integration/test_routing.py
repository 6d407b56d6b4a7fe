"""Session-affine routing on loopback: two real replicas, the client-side ring hash, one replica lost.

Both replicas share one session journal directory. Sessions are placed by the
same ring hash as the chart's Envoy router; every request of a session must
reach its replica (the other one would refuse it: Triton knows no sequence
there). Then one replica is killed: the survivor's sessions go on untouched,
and the lost replica's sessions move to the survivor (START with `resume`),
which reopens each from its journal, rebuilds its KV (path `rebuild`) and
answers exactly as a stateless prefill of the whole conversation would.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from prepos.journal import SessionJournal
from prepos_client import Client, PreposTimeout
from prepos_client.ring import HashRing
from prepos_client.routing import DRAIN_READMIT_AFTER_S, HEALTH_TIMEOUT_S, RoutedClient

from .conftest import kill_hard, ports_of, start_server
from .test_server import SYSTEM, Conversation, check_answer, eventually

pytestmark = pytest.mark.integration

NUM_SESSIONS_PER_REPLICA = 4
QUESTIONS = ["Name a fruit.", "Name a color.", "Name an animal.", "Name a country."]


@pytest.fixture(scope="module")
def journal_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("journal")


@contextmanager
def two_replicas(run_dirs: list[Path], journal_dir: Path) -> Iterator[list]:
    """Two real replicas on one journal directory, started at once (both load the model together); stopped on
    the way out. Each runs its engine on one thread: two replicas with a thread per core each, beside the
    clients, left this 2-core machine's OpenMP barriers waiting on descheduled threads (a drain of three
    6-token answers took 10-13 s at times)."""
    env = {"PREPOS_JOURNAL_DIR": str(journal_dir), "PREPOS_ENGINE_NUM_THREADS": "1"}
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start_server, run_dir, env) for run_dir in run_dirs]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, journal_dir):
    with two_replicas([tmp_path_factory.mktemp(f"replica-{name}") for name in "ab"], journal_dir) as started:
        yield started


def record(conv: Conversation, answer, text: str) -> None:
    """Extend the expected log by a user turn and its answer, without checking the answer."""
    conv.answered(conv.prompt("user", text), answer.token_ids, answer.finish_reason)


def requests_served(server) -> float:
    return server.metric("prepos_requests_total")


def test_sessions_stay_on_their_replica_and_only_the_lost_replicas_sessions_move(
        replicas, journal_dir, engine_manifest, tokenizer, reference_model):
    survivor, lost = replicas
    addresses = [survivor.grpc_url, lost.grpc_url]
    ring = HashRing(addresses)  # the chart's ring: default sizes, xxHash, keyed by ip:port
    candidates = (f"routed-{i}" for i in range(1000))
    by_replica: dict[str, list[str]] = {address: [] for address in addresses}
    for session_id in candidates:
        owner = by_replica[ring.lookup(session_id)]
        if len(owner) < NUM_SESSIONS_PER_REPLICA:
            owner.append(session_id)
        if all(len(ids) == NUM_SESSIONS_PER_REPLICA for ids in by_replica.values()):
            break

    with RoutedClient(addresses, timeout_s=120) as client:
        sessions, conversations = {}, {}
        for address, session_ids in by_replica.items():
            for session_id in session_ids:
                sessions[session_id] = session = client.session(session_id)
                conversations[session_id] = conv = Conversation(engine_manifest, tokenizer)
                session.append(SYSTEM, role="system")
                conv.append("system", SYSTEM)
                question = QUESTIONS[len(sessions) % len(QUESTIONS)]
                record(conv, session.ask(question, max_tokens=6, speculate=False), question)
                assert session.replica == address and not session.failovers
        # Server-side count: each replica served exactly its own sessions' requests (2 each).
        eventually(lambda: requests_served(survivor) == 2 * NUM_SESSIONS_PER_REPLICA)
        eventually(lambda: requests_served(lost) == 2 * NUM_SESSIONS_PER_REPLICA)
        assert sorted(SessionJournal(journal_dir).session_ids()) == sorted(sessions)  # one shared directory

        # The replica is lost abruptly (a node failure); a graceful stop would wait for the open streams.
        kill_hard(lost)

        served_before = requests_served(survivor)
        for session_id in by_replica[survivor.grpc_url]:
            session = sessions[session_id]
            answer = session.ask("And another?", max_tokens=8, speculate=False)
            assert answer.path in ("exact", "prepaid", "prefix") and session.replica == survivor.grpc_url
            assert not session.failovers
            check_answer(reference_model, conversations[session_id], answer, "user", "And another?", 8)

        recovered_before = survivor.metric("prepos_sessions_recovered_total")
        for session_id in by_replica[lost.grpc_url]:
            session = sessions[session_id]
            answer = session.ask("And another?", max_tokens=8, speculate=False)
            assert [(f.from_replica, f.to_replica) for f in session.failovers] == [(lost.grpc_url,
                                                                                     survivor.grpc_url)]
            assert session.replica == survivor.grpc_url
            assert answer.path == "rebuild"
            check_answer(reference_model, conversations[session_id], answer, "user", "And another?", 8)
            # ... and it goes on there as any resident session.
            answer = session.ask("Thanks.", max_tokens=6, speculate=False)
            assert answer.path in ("exact", "prepaid", "prefix")
            record(conversations[session_id], answer, "Thanks.")
        assert client.replicas == (survivor.grpc_url,)
        eventually(lambda: survivor.metric("prepos_sessions_recovered_total") - recovered_before
                   == NUM_SESSIONS_PER_REPLICA)
        eventually(lambda: requests_served(survivor) - served_before == 3 * NUM_SESSIONS_PER_REPLICA)
    assert SessionJournal(journal_dir).session_ids() == []  # END on the survivor deleted every journal


def test_a_draining_replicas_sessions_move_to_the_other_replica_without_an_error(
        tmp_path, engine_manifest, tokenizer, reference_model):
    """A replica drains before a stop (its drain file, as prepos.supervise writes it on SIGTERM): its sessions
    are ended with their journals kept, and their next calls move to the other replica, answered as before."""
    with two_replicas([tmp_path / f"replica-{name}" for name in "ab"], tmp_path / "journal") as started:
        staying, draining = started
        ring = HashRing([staying.grpc_url, draining.grpc_url])
        moving = [sid for sid in (f"drained-{i}" for i in range(1000)) if ring.lookup(sid) == draining.grpc_url][:2]
        with RoutedClient([staying.grpc_url, draining.grpc_url], timeout_s=120) as client:
            sessions, conversations = {}, {}
            for session_id in moving:
                sessions[session_id] = session = client.session(session_id)
                conversations[session_id] = conv = Conversation(engine_manifest, tokenizer)
                session.append(SYSTEM, role="system")
                conv.append("system", SYSTEM)
                record(conv, session.ask("Name a fruit.", max_tokens=6, speculate=False), "Name a fruit.")
                assert session.replica == draining.grpc_url

            draining.drain_file.touch()
            eventually(lambda: draining.metric("prepos_sessions_drained_total") == len(moving))
            for session_id in moving:
                session = sessions[session_id]
                answer = session.ask("And another?", max_tokens=8, speculate=False)
                assert session.replica == staying.grpc_url and answer.path == "rebuild"
                assert [(f.from_replica, f.to_replica) for f in session.failovers] == [(draining.grpc_url,
                                                                                         staying.grpc_url)]
                check_answer(reference_model, conversations[session_id], answer, "user", "And another?", 8)
            assert client.replicas == (staying.grpc_url,)
        assert SessionJournal(tmp_path / "journal").session_ids() == []  # ended on the replica that stayed


def test_a_session_that_moved_and_came_back_goes_on_from_its_journal_not_from_the_stale_copy(
        tmp_path, engine_manifest, tokenizer, reference_model):
    """Behind the router, a replica lost for a moment and back: its session's client took a turn on the other
    replica (reopened there from the shared journal) and comes back on its first stream. The first replica still
    holds the session, without that turn: it must drop its copy and answer from the journal, turn included."""
    with two_replicas([tmp_path / f"replica-{name}" for name in "ab"], tmp_path / "journal") as started:
        first, second = started
        conv = Conversation(engine_manifest, tokenizer)
        with Client(first.grpc_url, timeout_s=120) as here, Client(second.grpc_url, timeout_s=120) as there:
            session = here.session("came-back")
            session.append(SYSTEM, role="system")
            conv.append("system", SYSTEM)
            check_answer(reference_model, conv, session.ask("Name a fruit.", max_tokens=6, speculate=False),
                         "user", "Name a fruit.", 6)
            moved = there.session("came-back", resume=True)
            answer = moved.ask("Name a colour.", max_tokens=6, speculate=False)
            assert answer.path == "rebuild"
            check_answer(reference_model, conv, answer, "user", "Name a colour.", 6)
            moved.detach()

            answer = session.ask("Name an animal.", max_tokens=6, speculate=False)  # no START: its old stream
            assert answer.path == "rebuild"
            check_answer(reference_model, conv, answer, "user", "Name an animal.", 6)
            eventually(lambda: first.metric("prepos_sessions_taken_over_total") == 1)
            session.close()
        assert SessionJournal(tmp_path / "journal").session_ids() == []


def test_a_replica_stopped_under_load_fails_no_call_and_loses_no_turn(
        tmp_path, engine_manifest, tokenizer, reference_model):
    """A rolling restart's step under load: sessions ask in turn on both replicas while one replica is stopped
    (drained, then stopped). No call fails, the stopped replica's sessions move, and every answer of every
    session, before, across and after the move, is the stateless reference's for the conversation so far. Started
    again, the replica rejoins the client's ring and takes the sessions opened from then on that hash to it."""
    with two_replicas([tmp_path / f"replica-{name}" for name in "ab"], tmp_path / "journal") as started:
        staying, stopping = started
        addresses = [staying.grpc_url, stopping.grpc_url]
        ring = HashRing(addresses)
        ids = {address: [sid for sid in (f"load-{i}" for i in range(1000)) if ring.lookup(sid) == address][:3]
               for address in addresses}
        questions = [f"Name {thing}." for thing in ("a fruit", "a colour", "an animal", "a country", "a tree",
                                                     "a river", "a metal", "a planet")]
        asked = threading.Semaphore(0)
        results: dict[str, list] = {}
        errors: list[BaseException] = []

        def converse(client: RoutedClient, session_id: str) -> None:
            try:
                session = client.session(session_id)
                session.append(SYSTEM, role="system")
                results[session_id] = answers = []
                for question in questions:
                    answers.append(session.ask(question, max_tokens=6, speculate=False))
                    asked.release()
                results[session_id + "/failovers"] = session.failovers
                session.close()
            except BaseException as err:  # noqa: BLE001 - reported by the test thread
                errors.append(err)

        restarted = None
        with RoutedClient(addresses, timeout_s=120, readmit_interval_s=0.5) as client:
            threads = [threading.Thread(target=converse, args=(client, sid))
                       for sids in ids.values() for sid in sids]
            for thread in threads:
                thread.start()
            for _ in range(2 * len(threads)):  # two answers each, on average, before the stop
                assert asked.acquire(timeout=120)
            # Drain (answers under way finish, sessions end keeping their journals), then stop.
            assert stopping.stop(), "not drained within the exit timeout"
            for thread in threads:
                thread.join(300)
            # The step's end: the replica starts again on its ports, rejoins the ring, and takes new sessions.
            ports = ports_of(stopping)
            restarted = start_server(tmp_path / "replica-b-again", {"PREPOS_JOURNAL_DIR": str(tmp_path / "journal")},
                                     ports=ports)
            try:
                later = next(sid for sid in (f"later-{i}" for i in range(1000)) if ring.lookup(sid) == addresses[1])
                # It rejoins at a placement once ready: at once if a placement saw it down since it left draining,
                # else once DRAIN_READMIT_AFTER_S have passed since it left (its restart may be quicker here).
                deadline = time.monotonic() + DRAIN_READMIT_AFTER_S + 5
                while client.replica_for(later) != stopping.grpc_url:
                    assert time.monotonic() < deadline, client.replicas
                    time.sleep(0.5)
                with client.session(later) as session:
                    session.append(SYSTEM, role="system")
                    answer = session.ask(questions[0], max_tokens=6, speculate=False)
                    assert session.replica == stopping.grpc_url and client.replicas == tuple(addresses)
                conv = Conversation(engine_manifest, tokenizer)
                conv.append("system", SYSTEM)
                check_answer(reference_model, conv, answer, "user", questions[0], 6)
            finally:
                restarted.stop()
        assert not errors, errors
        for address, sids in ids.items():
            for session_id in sids:
                moved = results[session_id + "/failovers"]
                assert [(f.from_replica, f.to_replica) for f in moved] == (
                    [(stopping.grpc_url, staying.grpc_url)] if address == stopping.grpc_url else [])
                conv = Conversation(engine_manifest, tokenizer)
                conv.append("system", SYSTEM)
                for question, answer in zip(questions, results[session_id], strict=True):
                    check_answer(reference_model, conv, answer, "user", question, 6)
        assert SessionJournal(tmp_path / "journal").session_ids() == []  # every session closed in the end


def test_a_hung_replicas_session_moves_after_one_timed_out_call(tmp_path, engine_manifest, tokenizer,
                                                                  reference_model):
    """A replica that accepts connections and answers nothing (its Triton frozen, SIGSTOP): the call placed there
    times out, the replica answers no readiness check either, so it leaves the ring and the session moves; its
    next call resumes it on the other replica from the shared journal, without the turn that timed out."""
    with two_replicas([tmp_path / f"replica-{name}" for name in "ab"], tmp_path / "journal") as started:
        staying, hung = started
        ring = HashRing([staying.grpc_url, hung.grpc_url])
        session_id = next(sid for sid in (f"hung-{i}" for i in range(1000)) if ring.lookup(sid) == hung.grpc_url)
        with RoutedClient([staying.grpc_url, hung.grpc_url], timeout_s=120) as client:
            session = client.session(session_id)
            conv = Conversation(engine_manifest, tokenizer)
            session.append(SYSTEM, role="system")
            conv.append("system", SYSTEM)
            record(conv, session.ask("Name a fruit.", max_tokens=6, speculate=False), "Name a fruit.")
            assert session.replica == hung.grpc_url

            os.kill(hung.process.pid, signal.SIGSTOP)
            try:
                started_at = time.monotonic()
                with pytest.raises(PreposTimeout):
                    session.ask("Name a colour.", max_tokens=6, speculate=False, timeout_s=3)
                assert time.monotonic() - started_at < 3 + 2 * HEALTH_TIMEOUT_S  # one readiness check more
                assert client.replicas == (staying.grpc_url,) and session.replica == staying.grpc_url
                answer = session.ask("Name an animal.", max_tokens=8, speculate=False)
                assert answer.path == "rebuild"
                check_answer(reference_model, conv, answer, "user", "Name an animal.", 8)
                session.close()
            finally:
                os.kill(hung.process.pid, signal.SIGCONT)
        assert SessionJournal(tmp_path / "journal").session_ids() == []
