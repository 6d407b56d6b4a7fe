"""RoutedClient against fake replicas: placement by the ring, stickiness, failover, lost sessions."""

from __future__ import annotations

import time

import pytest
import tritonclient.grpc as grpcclient
from client_fakes import FakeTriton, SessionRules, echo_responder, unavailable
from prepos_client import PreposError, PreposTimeout, PreposUnavailable
from prepos_client.ring import HashRing
from prepos_client.routing import RoutedClient
from tritonclient.utils import InferenceServerException

REPLICAS = ["127.0.0.1:8001", "127.0.0.1:9001", "127.0.0.1:10001"]


class Replicas:
    """Fake gRPC clients by replica address; requests to a replica in `dead` fail as unreachable,
    those to a replica in `errors` get that error, the others an echo."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.errors: dict[str, InferenceServerException] = {}
        self.created: list[FakeTriton] = []

    def factory(self, url, *args, **kwargs) -> FakeTriton:
        fake = FakeTriton(url, responder=lambda request: self.respond(url, request),
                          ready=lambda: self.ready(url))
        self.created.append(fake)
        return fake

    def ready(self, url: str) -> bool:
        if url in self.dead:
            raise unavailable()
        return url not in self.errors

    def num_ready_checks(self, url: str) -> int:
        return sum(fake.num_ready_checks for fake in self.created if fake.url == url)

    def respond(self, url: str, request) -> list:
        if url in self.dead:
            return [unavailable()]
        if url in self.errors:
            return [self.errors[url]]
        return echo_responder(request)

    def requests(self, url: str, session_id: str) -> list:
        return [r for fake in self.created if fake.url == url for r in fake.requests if r.sequence_id == session_id]


@pytest.fixture
def replicas(monkeypatch) -> Replicas:
    fakes = Replicas()
    monkeypatch.setattr(grpcclient, "InferenceServerClient", fakes.factory)
    return fakes


def session_ids_on(replica: str, ring: HashRing, count: int) -> list[str]:
    found = (f"s-{i}" for i in range(10_000))
    return [sid for sid in found if ring.lookup(sid) == replica][:count]


def test_each_session_lives_on_its_ring_owner(replicas):
    client = RoutedClient(REPLICAS, timeout_s=2)
    ring = HashRing(REPLICAS)
    for i in range(30):
        session = client.session(f"s-{i}")
        session.append("system", role="system")
        session.ask("hi")
        session.ask("again")
        assert session.replica == ring.lookup(f"s-{i}") == client.replica_for(f"s-{i}")
        assert [r.sequence_start for r in replicas.requests(session.replica, f"s-{i}")] == [True, False, False]
    assert {fake.url for fake in replicas.created} == set(REPLICAS)


def test_a_lost_replica_leaves_the_ring_and_its_session_resumes_on_the_new_owner(replicas):
    client = RoutedClient(REPLICAS, timeout_s=2)
    lost = REPLICAS[1]
    (moving,) = session_ids_on(lost, client.ring, 1)
    (staying,) = session_ids_on(REPLICAS[0], client.ring, 1)
    a, b = client.session(moving), client.session(staying)
    a.ask("one")
    b.ask("one")

    replicas.dead.add(lost)
    answer = a.ask("two")
    owner = HashRing(REPLICAS).without(lost).lookup(moving)
    assert answer.text == "two" and a.replica == owner
    assert lost not in client.replicas and client.replica_for(moving) == owner
    assert [(f.from_replica, f.to_replica) for f in a.failovers] == [(lost, owner)]
    # The new owner does not know the session: its first request there carries START and `resume`.
    (first,) = replicas.requests(owner, moving)
    assert first.sequence_start and first.inputs["resume"].tolist() == [True]
    assert first.inputs["text_input"].tolist() == [b"two"]
    a.ask("three")
    later = replicas.requests(owner, moving)[1]
    assert not later.sequence_start and "resume" not in later.inputs

    b.ask("two")
    assert b.replica == REPLICAS[0] and not b.failovers
    assert [r.sequence_start for r in replicas.requests(REPLICAS[0], staying)] == [True, False]


def test_a_request_whose_stream_broke_is_not_sent_again_but_the_session_moves(replicas):
    """The replica died while the request was under way: it may have taken the turn (and journaled it), so the
    request is not sent to the new owner, which would take it a second time; the call raises, as Session's does,
    and the next one goes on on the new owner."""
    client = RoutedClient(REPLICAS, timeout_s=2)
    lost = REPLICAS[1]
    (session_id,) = session_ids_on(lost, client.ring, 1)
    session = client.session(session_id)
    session.ask("one")
    replicas.errors[lost] = InferenceServerException(msg="Socket closed", status="StatusCode.UNAVAILABLE")
    with pytest.raises(PreposUnavailable, match="Socket closed"):
        session.ask("two")
    owner = HashRing(REPLICAS).without(lost).lookup(session_id)
    assert session.replica == owner and lost not in client.replicas
    assert [(f.from_replica, f.to_replica) for f in session.failovers] == [(lost, owner)]
    assert replicas.requests(owner, session_id) == []  # "two" was not sent there
    assert session.ask("three").text == "three"
    (first,) = replicas.requests(owner, session_id)
    assert first.sequence_start and first.inputs["resume"].tolist() == [True]
    assert first.inputs["text_input"].tolist() == [b"three"]


def test_a_draining_replica_leaves_the_ring_and_its_session_resumes_on_the_new_owner(replicas):
    client = RoutedClient(REPLICAS, timeout_s=2)
    draining = REPLICAS[2]
    (moving,) = session_ids_on(draining, client.ring, 1)
    session = client.session(moving)
    session.ask("one")
    not_open = InferenceServerException(
        msg=f"inference request for sequence {moving} to model 'prepos' must specify the START flag on the first "
            "request of the sequence")
    refused = InferenceServerException(msg="START: the server is draining before it stops: no session opens or "
                                           "resumes here now; resume the session on another replica ...")
    replicas.respond = lambda url, request, respond=replicas.respond: (
        ([refused] if request.sequence_start else [not_open]) if url == draining else respond(url, request))
    answer = session.ask("two")
    owner = HashRing(REPLICAS).without(draining).lookup(moving)
    assert answer.text == "two" and session.replica == owner and draining not in client.replicas
    assert [(f.from_replica, f.to_replica) for f in session.failovers] == [(draining, owner)]
    # On the draining replica: refused as not open, then START and `resume` refused, on the old and a new stream.
    assert [r.sequence_start for r in replicas.requests(draining, moving)] == [True, False, True, True]
    (first,) = replicas.requests(owner, moving)
    assert first.sequence_start and first.inputs["resume"].tolist() == [True]


@pytest.mark.parametrize("refusal", [
    "Request for unknown model: 'prepos' has no available versions",  # drained, then the model unloaded
    "Server is stopping, scheduler for model has stopped accepting new inference requests",  # stopped, no drain
])
def test_a_replica_no_longer_serving_the_model_leaves_the_ring_and_its_session_resumes_on_the_new_owner(
        replicas, refusal):
    client = RoutedClient(REPLICAS, timeout_s=2)
    stopped = REPLICAS[0]
    (moving,) = session_ids_on(stopped, client.ring, 1)
    session = client.session(moving)
    session.ask("one")
    replicas.errors[stopped] = InferenceServerException(msg=refusal)
    answer = session.ask("two")
    owner = HashRing(REPLICAS).without(stopped).lookup(moving)
    assert answer.text == "two" and session.replica == owner and stopped not in client.replicas
    assert [(f.from_replica, f.to_replica, f.reason) for f in session.failovers] == [(stopped, owner, refusal)]
    assert [r.sequence_start for r in replicas.requests(stopped, moving)] == [True, False]
    (first,) = replicas.requests(owner, moving)
    assert first.sequence_start and first.inputs["resume"].tolist() == [True]
    # A model name the replica does not serve is the caller's mistake: it moves nothing.
    other = client.session(session_ids_on(REPLICAS[1], client.ring, 1)[0])
    replicas.errors[REPLICAS[1]] = InferenceServerException(msg="Request for unknown model: 'prepos2' is not found")
    with pytest.raises(PreposError, match="is not found"):
        other.ask("one")
    assert not other.failovers and REPLICAS[1] in client.replicas


def test_a_session_lost_before_it_opened_opens_on_the_new_owner(replicas):
    client = RoutedClient(REPLICAS[:2], timeout_s=2)
    (session_id,) = session_ids_on(REPLICAS[0], client.ring, 1)
    session = client.session(session_id)
    replicas.dead.add(REPLICAS[0])
    session.append("system", role="system")
    (first,) = replicas.requests(REPLICAS[1], session_id)
    assert first.sequence_start and "resume" not in first.inputs


def test_a_resumed_session_resumes_on_the_new_owner_too(replicas):
    client = RoutedClient(REPLICAS[:2], timeout_s=2)
    (session_id,) = session_ids_on(REPLICAS[0], client.ring, 1)
    session = client.session(session_id, resume=True)
    replicas.dead.add(REPLICAS[0])
    session.ask("hi")
    (first,) = replicas.requests(REPLICAS[1], session_id)
    assert first.sequence_start and first.inputs["resume"].tolist() == [True]


def test_the_first_chunk_of_a_generate_fails_over(replicas):
    client = RoutedClient(REPLICAS[:2], timeout_s=2)
    (session_id,) = session_ids_on(REPLICAS[1], client.ring, 1)
    session = client.session(session_id)
    session.append("system", role="system")
    replicas.dead.add(REPLICAS[1])
    chunks = list(session.generate("hello"))
    assert [c.text for c in chunks] == ["hello"] and session.replica == REPLICAS[0]


def test_every_replica_lost_raises_unavailable_after_one_try_each(replicas):
    client = RoutedClient(REPLICAS, timeout_s=2)
    session = client.session("s-1")
    replicas.dead.update(REPLICAS)
    with pytest.raises(PreposUnavailable):
        session.ask("hi")
    assert client.replicas == () and len(session.failovers) == 2
    assert sorted((fake.url, len(fake.requests)) for fake in replicas.created) == sorted((r, 1) for r in REPLICAS)


def test_other_errors_do_not_move_the_session(replicas):
    client = RoutedClient(REPLICAS, timeout_s=2)
    session = client.session("s-1")
    home = session.replica
    (fake,) = replicas.created
    fake.responder = lambda request: [InferenceServerException(msg="max_tokens: must be >= 0")]
    with pytest.raises(PreposError) as error:
        session.ask("hi", max_tokens=3)
    assert error.value.field == "max_tokens" and not isinstance(error.value, PreposUnavailable)
    assert session.replica == home and client.replicas == tuple(REPLICAS) and not session.failovers


def test_removed_and_added_replicas_change_where_new_sessions_go(replicas):
    client = RoutedClient(REPLICAS[:2])
    assert client.remove_replica(REPLICAS[0]) and not client.remove_replica(REPLICAS[0])
    assert all(client.replica_for(f"s-{i}") == REPLICAS[1] for i in range(50))
    client.add_replica(REPLICAS[2])
    assert client.ring.hosts == (REPLICAS[1], REPLICAS[2])
    assert client.session("s-7").replica == HashRing(REPLICAS[1:]).lookup("s-7")


def test_close_ends_every_session_on_its_replica(replicas):
    with RoutedClient(REPLICAS, timeout_s=2) as client:
        sessions = [client.session(f"s-{i}") for i in range(5)]
        for session in sessions:
            session.ask("hi")
    assert all(session.closed for session in sessions)
    for session in sessions:
        requests = replicas.requests(session.replica, session.session_id)
        assert requests[-1].sequence_end and len(requests) == 2


@pytest.mark.parametrize("bad", [[], ["127.0.0.1:1", "127.0.0.1:1"], {"127.0.0.1:1": 0}])
def test_bad_replicas_are_refused(bad):
    with pytest.raises(ValueError, match="replicas|hosts"):
        RoutedClient(bad)


def test_a_moved_session_is_ended_on_its_new_owner_even_unused_there(replicas):
    client = RoutedClient(REPLICAS[:2], timeout_s=2)
    (session_id,) = session_ids_on(REPLICAS[0], client.ring, 1)
    session = client.session(session_id)
    session.ask("one")
    replicas.dead.add(REPLICAS[0])
    session.close()
    (end,) = replicas.requests(REPLICAS[1], session_id)
    assert end.sequence_start and end.sequence_end and end.inputs["resume"].tolist() == [True]
    assert "text_input" not in end.inputs and session.closed


def test_without_a_journal_the_new_owner_refuses_the_moved_session(replicas):
    client = RoutedClient(REPLICAS[:2], timeout_s=2)
    (session_id,) = session_ids_on(REPLICAS[0], client.ring, 1)
    session = client.session(session_id)
    session.ask("one")
    replicas.dead.add(REPLICAS[0])
    replicas.errors[REPLICAS[1]] = InferenceServerException(
        msg=f"resume: session {session_id!r} is not open on this server and has no journal to reopen it from")
    with pytest.raises(PreposError) as error:
        session.ask("two")
    assert error.value.field == "resume" and not isinstance(error.value, PreposUnavailable)
    assert session.replica == REPLICAS[1]


def test_the_access_token_and_session_header_go_to_every_replica(replicas):
    client = RoutedClient(REPLICAS[:2], timeout_s=2, token="secret")
    (session_id,) = session_ids_on(REPLICAS[0], client.ring, 1)
    session = client.session(session_id)
    session.ask("one")
    replicas.dead.add(REPLICAS[0])
    session.ask("two")
    headers = [h for fake in replicas.created for h in fake.stream_headers]
    assert len(headers) == 2 and all(h == {"triton-grpc-protocol-prepos-access-token": "secret",
                                            "prepos-session-id": session_id} for h in headers)


def test_a_generate_that_never_answered_does_not_count_as_opening_the_session(replicas):
    client = RoutedClient(REPLICAS[:2], timeout_s=2)
    (session_id,) = session_ids_on(REPLICAS[0], client.ring, 1)
    session = client.session(session_id)
    replicas.dead.add(REPLICAS[0])
    assert [c.text for c in session.generate("hello")] == ["hello"]
    (first,) = replicas.requests(REPLICAS[1], session_id)
    assert first.sequence_start and "resume" not in first.inputs


def test_a_routed_session_settles_a_timed_out_call_on_its_replica(replicas):
    rules = SessionRules()
    replicas.respond = lambda url, request: rules(request)
    session = RoutedClient(REPLICAS, timeout_s=0.05).session("s-0")
    session.append("system", role="system")
    with pytest.raises(PreposTimeout) as info:
        session.ask("SLOW")
    fake = next(f for f in replicas.created if f.url == session.replica)
    rules.finish_held(fake, accepted=True)
    session.settle(timeout_s=2.0)
    assert info.value.accepted is True and rules.accepted[-1] == "SLOW"


def no_answer() -> InferenceServerException:
    return InferenceServerException(msg="Deadline Exceeded", status="StatusCode.DEADLINE_EXCEEDED")


def test_a_call_that_times_out_on_a_hung_replica_moves_the_session(replicas):
    rules = SessionRules()
    replicas.respond = lambda url, request: rules(request)
    client = RoutedClient(REPLICAS, timeout_s=0.05)
    hung = REPLICAS[1]
    (session_id,) = session_ids_on(hung, client.ring, 1)
    session = client.session(session_id)
    session.append("system", role="system")
    replicas.ready = lambda url: _raise(no_answer()) if url == hung else True  # accepts, answers nothing
    with pytest.raises(PreposTimeout):
        session.ask("SLOW")
    assert hung not in client.replicas and session.replica == client.ring.lookup(session_id) != hung
    assert [f.from_replica for f in session.failovers] == [hung]
    assert session.ask("again").text == "again"
    (resumed,) = replicas.requests(session.replica, session_id)
    assert resumed.sequence_start and resumed.inputs["resume"][0]  # the session was opened: it resumes there
    assert rules.accepted == ["system", "again"]  # the timed-out turn was not sent again


def test_a_call_that_times_out_on_a_replica_that_answers_ready_leaves_the_session_there(replicas):
    rules = SessionRules()
    replicas.respond = lambda url, request: rules(request)
    client = RoutedClient(REPLICAS, timeout_s=0.05)
    session = client.session("s-0")
    session.append("system", role="system")
    placed = session.replica
    with pytest.raises(PreposTimeout):
        session.ask("SLOW")
    assert session.replica == placed and client.replicas == tuple(REPLICAS) and not session.failovers
    assert replicas.num_ready_checks(placed) == 1  # asked once: a slow replica, not a hung one


def _raise(error: Exception):
    raise error


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), float("inf")])
def test_a_health_timeout_that_is_not_finite_and_positive_is_refused(timeout_s):
    with pytest.raises(ValueError, match="health_timeout_s"):
        RoutedClient(REPLICAS, health_timeout_s=timeout_s)


def back_after(replicas: Replicas, replica: str, num_checks: int) -> None:
    """`replica` is down until it was asked whether it is ready `num_checks` times."""
    replicas.dead.add(replica)

    def ready(url: str) -> bool:
        if url == replica and replica in replicas.dead and replicas.num_ready_checks(replica) >= num_checks:
            replicas.dead.discard(replica)
        return Replicas.ready(replicas, url)
    replicas.ready = ready


def test_with_wait_for_ready_a_call_to_a_lone_replica_that_is_down_waits_for_it(replicas):
    rules = SessionRules()
    replicas.respond = lambda url, request: rules(request) if url not in replicas.dead else [unavailable()]
    client = RoutedClient(REPLICAS[:1], timeout_s=10, wait_for_ready=True)
    session = client.session("s-0")
    session.append("system", role="system")
    back_after(replicas, REPLICAS[0], 2)
    assert session.ask("hello").text == "hello"
    assert session.replica == REPLICAS[0] and not session.failovers and rules.accepted == ["system", "hello"]
    assert replicas.num_ready_checks(REPLICAS[0]) >= 2


def test_with_wait_for_ready_a_session_still_moves_while_another_replica_is_on_the_ring(replicas):
    client = RoutedClient(REPLICAS[:2], timeout_s=10, wait_for_ready=True)
    (session_id,) = session_ids_on(REPLICAS[0], client.ring, 1)
    session = client.session(session_id)
    session.append("system", role="system")
    replicas.dead.add(REPLICAS[0])
    assert session.ask("hello").text == "hello"
    assert session.replica == REPLICAS[1] and [f.from_replica for f in session.failovers] == [REPLICAS[0]]
    assert replicas.num_ready_checks(REPLICAS[0]) == 0  # moved at once, not waited for
    back_after(replicas, REPLICAS[1], 2)  # now the last one left: waited for
    assert session.ask("again").text == "again" and session.replica == REPLICAS[1]


def test_with_wait_for_ready_a_call_that_finds_its_replica_the_last_one_only_when_it_fails_waits_too(replicas):
    """A full outage, two sessions' calls at once: one went out while the other replica was still on the ring (so
    without waiting), and failed after the other call had taken that replica off it. It raised at once."""
    rules = SessionRules()
    client = RoutedClient(REPLICAS[:2], timeout_s=10, wait_for_ready=True)
    (session_id,) = session_ids_on(REPLICAS[1], client.ring, 1)
    session = client.session(session_id)
    session.append("system", role="system")
    replicas.dead.update(REPLICAS[:2])

    def respond(url, request):
        if url in replicas.dead:
            client.lose_replica(REPLICAS[0])  # the other session's call, meanwhile
            return [unavailable()]
        return rules(request)

    replicas.respond = respond
    back_after(replicas, REPLICAS[1], 2)
    assert session.ask("hello").text == "hello"
    assert session.replica == REPLICAS[1] and not session.failovers


def test_with_wait_for_ready_a_replica_back_since_is_asked_before_the_session_waits_for_its_own(replicas):
    """A rolling update with no placement between its steps: the other replica left the ring and came back, but
    nothing asked it since. The session's replica going down moves the session there, rather than waiting."""
    client = RoutedClient(REPLICAS[:2], timeout_s=10, wait_for_ready=True, readmit_interval_s=0.01)
    (session_id,) = session_ids_on(REPLICAS[0], client.ring, 1)
    session = client.session(session_id)
    session.append("system", role="system")
    client.lose_replica(REPLICAS[1])  # it restarted meanwhile ...
    time.sleep(0.05)  # ... and is back, unasked
    replicas.dead.add(REPLICAS[0])
    started = time.monotonic()
    assert session.ask("hello").text == "hello"
    assert session.replica == REPLICAS[1] and time.monotonic() - started < 5
    assert replicas.num_ready_checks(REPLICAS[0]) == 0  # not waited for


def test_with_wait_for_ready_a_session_waiting_for_its_replica_moves_to_another_once_that_one_is_back(replicas):
    """After an outage of every replica, a session waited its whole time limit for its own replica, which did not
    come back, while another was ready again within seconds."""
    client = RoutedClient(REPLICAS[:2], timeout_s=30, wait_for_ready=True, readmit_interval_s=0.01)
    (session_id,) = session_ids_on(REPLICAS[0], client.ring, 1)
    session = client.session(session_id)
    session.append("system", role="system")
    client.lose_replica(REPLICAS[1])
    back_after(replicas, REPLICAS[1], 3)  # back while the session waits
    replicas.dead.add(REPLICAS[0])  # never back
    started = time.monotonic()
    assert session.ask("hello").text == "hello"
    assert session.replica == REPLICAS[1] and time.monotonic() - started < 10
    assert [f.from_replica for f in session.failovers] == [REPLICAS[0]]
    assert replicas.num_ready_checks(REPLICAS[0]) >= 1  # it did wait for its own first


def test_a_waiting_call_asks_the_replicas_off_the_ring_only_while_it_has_time_for_the_asking(replicas):
    """Each check of a replica off the ring may take two calls of `health_timeout_s`: asked with less time left
    than that, a call would overrun its time limit."""
    client = RoutedClient(REPLICAS, wait_for_ready=True, readmit_interval_s=1e-6, health_timeout_s=1.0)
    client.lose_replica(REPLICAS[1])
    client.lose_replica(REPLICAS[2])  # both ready again, unasked
    assert client.keeps_waiting_for(REPLICAS[0], 3.9) is True  # too little time to ask both: not asked
    assert replicas.num_ready_checks(REPLICAS[1]) == replicas.num_ready_checks(REPLICAS[2]) == 0
    assert client.keeps_waiting_for(REPLICAS[0], 4.1) is False  # asked: both back, so the call moves on
    assert replicas.num_ready_checks(REPLICAS[1]) == replicas.num_ready_checks(REPLICAS[2]) == 1
    assert set(client.replicas) == set(REPLICAS)


def test_with_wait_for_ready_a_session_placed_while_every_replica_is_away_waits_for_its_owner(replicas):
    client = RoutedClient(REPLICAS[:1], timeout_s=10, wait_for_ready=True, readmit_interval_s=0.01)
    client.lose_replica(REPLICAS[0])  # its stream broke, say
    back_after(replicas, REPLICAS[0], 3)
    session = client.session("s-0")  # placed though the ring is empty
    assert session.replica == REPLICAS[0]
    assert session.ask("hello").text == "hello"
    gone = RoutedClient(REPLICAS[:1], wait_for_ready=True)
    gone.remove_replica(REPLICAS[0])  # removed for good: no owner to wait for
    with pytest.raises(LookupError):
        gone.session("s-1")


def test_the_servers_own_deadline_error_asks_no_readiness_check(replicas):
    deadline = InferenceServerException(msg="timeout: the request's deadline passed; its turn was not accepted "
                                            "[DEADLINE_EXCEEDED]")
    client = RoutedClient(REPLICAS, timeout_s=2)
    session = client.session("s-0")
    session.append("system", role="system")
    replicas.errors[session.replica] = deadline
    with pytest.raises(PreposTimeout) as raised:
        session.ask("hello")
    assert raised.value.field == "timeout"
    assert replicas.num_ready_checks(session.replica) == 0 and not session.failovers


def test_without_wait_for_ready_a_lone_replica_that_is_down_raises_at_once(replicas):
    client = RoutedClient(REPLICAS[:1], timeout_s=10)
    session = client.session("s-0")
    session.append("system", role="system")
    replicas.dead.add(REPLICAS[0])
    started = time.monotonic()
    with pytest.raises(PreposUnavailable):
        session.ask("hello")
    assert time.monotonic() - started < 5 and replicas.num_ready_checks(REPLICAS[0]) == 0


def test_closing_a_routed_client_does_not_wait_for_a_replica_that_is_down(replicas):
    client = RoutedClient(REPLICAS[:1], timeout_s=10, wait_for_ready=True)
    session = client.session("s-0")
    session.append("system", role="system")
    replicas.dead.add(REPLICAS[0])
    started = time.monotonic()
    client.close()  # the END fails, is logged, and is not waited for
    assert time.monotonic() - started < 5 and replicas.num_ready_checks(REPLICAS[0]) == 0


def test_a_lost_replica_rejoins_the_ring_once_ready_and_moved_sessions_stay(replicas):
    client = RoutedClient(REPLICAS, timeout_s=2, readmit_interval_s=0.05)
    lost = REPLICAS[1]
    moving, later = session_ids_on(lost, client.ring, 2)
    session = client.session(moving)
    session.ask("one")
    replicas.dead.add(lost)
    session.ask("two")  # moved to the smaller ring's owner
    owner = session.replica
    assert owner != lost and lost not in client.replicas
    assert client.replica_for(later) != lost  # asked within the interval: not asked again yet
    assert replicas.num_ready_checks(lost) == 0
    time.sleep(0.06)
    assert client.replica_for(later) != lost and replicas.num_ready_checks(lost) == 1  # asked: still down
    replicas.dead.discard(lost)
    time.sleep(0.06)
    assert client.replica_for(later) == lost and client.replicas == tuple(REPLICAS)  # back, in the order given
    assert client.ring.entries == HashRing(REPLICAS).entries  # the ring as it was
    session.ask("three")
    assert session.replica == owner  # a moved session stays where it is
    fresh = client.session(later)
    fresh.ask("hi")
    assert fresh.replica == lost


def drain(replicas: Replicas, draining: str) -> None:
    """`draining` refuses every START as draining and answers any other request as for a session not open, while
    it still reports the model ready (as a draining server does)."""
    refused = InferenceServerException(msg="START: the server is draining before it stops: no session opens or "
                                           "resumes here now; resume the session on another replica ...")
    not_open = InferenceServerException(msg="... must specify the START flag on the first request of the sequence")
    respond = replicas.respond
    replicas.respond = lambda url, request: (
        ([refused] if request.sequence_start else [not_open]) if url == draining else respond(url, request))


def drained_and_lost(replicas: Replicas, client: RoutedClient, draining: str, count: int) -> list[str]:
    """Drain `draining` and move a session off it; returns the ids of `count` sessions it owns on the whole ring."""
    moving, *later = session_ids_on(draining, client.ring, count + 1)
    session = client.session(moving)
    session.ask("one")
    drain(replicas, draining)
    session.ask("two")
    assert session.replica != draining and draining not in client.replicas
    return later


def test_a_replica_that_left_draining_rejoins_only_once_it_was_seen_not_ready(replicas):
    client = RoutedClient(REPLICAS, timeout_s=2, readmit_interval_s=0.05)
    draining = REPLICAS[1]
    (later,) = drained_and_lost(replicas, client, draining, 1)
    time.sleep(0.06)
    assert client.replica_for(later) != draining and replicas.num_ready_checks(draining) == 1  # ready, but draining
    replicas.dead.add(draining)  # its stop began
    time.sleep(0.06)
    assert client.replica_for(later) != draining and replicas.num_ready_checks(draining) == 2
    del replicas.respond  # restarted: serving again
    replicas.dead.discard(draining)
    time.sleep(0.06)
    assert client.replica_for(later) == draining and client.replicas == tuple(REPLICAS)
    fresh = client.session(later)
    assert fresh.ask("hi").text == "hi" and fresh.replica == draining and not fresh.failovers


def test_a_replica_that_left_draining_and_was_never_seen_not_ready_rejoins_after_the_drain_allowance(replicas):
    client = RoutedClient(REPLICAS, timeout_s=2, readmit_interval_s=0.05, drain_readmit_after_s=0.3)
    draining = REPLICAS[1]
    (later,) = drained_and_lost(replicas, client, draining, 1)
    del replicas.respond  # restarted between two asks
    time.sleep(0.06)
    assert client.replica_for(later) != draining  # ready, but not yet seen down nor past the allowance
    time.sleep(0.3)
    assert client.replica_for(later) == draining and client.replicas == tuple(REPLICAS)


def test_a_single_replica_that_restarted_takes_new_sessions_again(replicas):
    client = RoutedClient(REPLICAS[:1], timeout_s=2, readmit_interval_s=0.05)
    first = client.session("a")
    first.ask("one")
    replicas.dead.add(REPLICAS[0])
    with pytest.raises(PreposUnavailable):
        first.ask("two")  # no replica left
    with pytest.raises(LookupError):
        client.session("b")
    assert not first.closed  # it stays on its replica, to resume there once that is back
    replicas.dead.clear()
    time.sleep(0.06)
    again = client.session("b")
    assert again.ask("hi").text == "hi" and again.replica == REPLICAS[0]
    assert first.ask("three").text == "three" and first.replica == REPLICAS[0]
    resumed = replicas.requests(REPLICAS[0], "a")[-1]
    assert resumed.sequence_start and resumed.inputs["resume"].tolist() == [True]


def test_a_replica_removed_by_hand_is_not_asked_back(replicas):
    client = RoutedClient(REPLICAS, timeout_s=2, readmit_interval_s=0.01)
    client.remove_replica(REPLICAS[0])
    time.sleep(0.02)
    assert REPLICAS[0] not in client.replicas and client.replica_for("x") != REPLICAS[0]
    assert replicas.num_ready_checks(REPLICAS[0]) == 0


@pytest.mark.parametrize("interval", [0, -1, float("nan")])
def test_a_readmit_interval_that_is_not_positive_is_refused(interval):
    with pytest.raises(ValueError, match="readmit_interval_s"):
        RoutedClient(REPLICAS, readmit_interval_s=interval)


@pytest.mark.parametrize("allowance", [-1, float("nan")])
def test_a_drain_readmit_allowance_that_is_negative_is_refused(allowance):
    with pytest.raises(ValueError, match="drain_readmit_after_s"):
        RoutedClient(REPLICAS, drain_readmit_after_s=allowance)


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), "5"])
def test_a_bad_timeout_is_refused_when_the_client_is_made(timeout_s):
    with pytest.raises((ValueError, TypeError), match="timeout_s"):
        RoutedClient(REPLICAS, timeout_s=timeout_s)


@pytest.mark.parametrize(("options", "named"), [({"readmit_interval_s": "x"}, "readmit_interval_s"),
                                                ({"drain_readmit_after_s": "x"}, "drain_readmit_after_s"),
                                                ({"headers": {"x-a": 5}}, "headers: 'x-a'")])
def test_a_knob_of_the_wrong_type_is_refused_naming_it(options, named):
    with pytest.raises(TypeError, match=named):
        RoutedClient(REPLICAS, **options)


@pytest.mark.parametrize("replicas", [["127.0.0.1:84437"], {"127.0.0.1:8001": 1, "127.0.0.1:0": 1}])
def test_a_replica_whose_port_grpc_would_wrap_is_refused(replicas):
    # 84437 is 18901 + 65536: gRPC would have talked to port 18901.
    with pytest.raises(ValueError, match="not in 1-65535"):
        RoutedClient(replicas)
    with pytest.raises(ValueError, match="not in 1-65535"):
        RoutedClient(REPLICAS).add_replica("127.0.0.1:70000")


def test_a_routed_session_cancels_on_its_replica(replicas):
    client = RoutedClient(REPLICAS, timeout_s=5)
    session = client.session("s-0")
    session.append("system", role="system")
    stopped = []
    session._session.cancel = lambda: stopped.append(session.replica)
    session.cancel()
    assert stopped == [session.replica]


def test_pipelined_requests_on_a_replica_that_died_move_the_session_once(replicas):
    """Each of three requests sent before any was read failed over again: three moves listed for one, a new
    session opened on the new owner each time, and the stream of the request sent again there left open."""
    client = RoutedClient(REPLICAS[:2], timeout_s=10)
    (session_id,) = session_ids_on(REPLICAS[0], client.ring, 1)
    session = client.session(session_id)
    session.append("system", role="system")
    replicas.dead.add(REPLICAS[0])
    pipelined = [session.generate(text) for text in ("one", "two", "three")]
    assert ["".join(chunk.text for chunk in chunks) for chunks in pipelined] == ["one", "two", "three"]
    assert [(f.from_replica, f.to_replica) for f in session.failovers] == [(REPLICAS[0], REPLICAS[1])]
    assert len([fake for fake in replicas.created if fake.url == REPLICAS[1]]) == 1  # one session opened there
