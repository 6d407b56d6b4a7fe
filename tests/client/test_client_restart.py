"""A session whose server stops and starts again (`wait_for_ready`): a call made meanwhile waits, within its time
limit, for the server to be ready and is sent again then, its turn taken once; refusals that may have changed
something are never sent again."""

from __future__ import annotations

import time

import pytest
from client_fakes import UNLOADED, RestartingServer, unavailable
from prepos_client import Client, PreposError, PreposUnavailable, Session
from tritonclient.utils import InferenceServerException

@pytest.fixture
def server(fake_triton) -> RestartingServer:
    restarting = RestartingServer()
    fake_triton.responder = restarting
    return restarting


def open_session(fake_triton, server, *, wait_for_ready: bool = True, timeout_s: float = 10.0, **kwargs) -> Session:
    session = Client("127.0.0.1:9", timeout_s=timeout_s, wait_for_ready=wait_for_ready).session(**kwargs)
    fake_triton[-1].ready = server.ready
    return session


def test_a_call_made_during_a_restart_waits_for_the_server_and_its_turn_is_taken_once(fake_triton, server):
    session = open_session(fake_triton, server, session_id="s")
    session.append("context")
    server.stop("draining", "draining", "unloaded", "down", "down", "up")
    answer = session.ask("hello")
    assert answer.text == "hello"
    assert server.rules.accepted == ["context", "hello"]
    requests = fake_triton[0].requests
    # refused as not held, reopened and refused as draining, on a new stream refused again, then sent again after
    # each look that found the model ready: once more while draining, and once the server was back
    assert [(r.sequence_start, "resume" in r.inputs) for r in requests] == [
        (True, False), (False, False), (True, True), (True, True), (True, True), (True, True)]
    assert all(r.inputs["text_input"][0] == b"hello" for r in requests[1:])
    assert fake_triton[0].num_ready_checks == 5
    session.ask("again")  # the session is open again: no START
    assert not fake_triton[0].requests[-1].sequence_start and server.rules.accepted[-1] == "again"


NOT_CONNECTED = [
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:8001: Failed to connect to remote "
    "host: Connection refused",  # gRPC's own: nothing to connect to
    "no healthy upstream",  # the chart's Envoy router: no replica ready
    "upstream connect error or disconnect/reset before headers. reset reason: connection failure",  # Envoy's
]


@pytest.mark.parametrize("message", NOT_CONNECTED)
def test_a_new_session_opened_while_the_server_is_down_opens_once_it_is_back(fake_triton, server, message):
    server.refusal_when_down = InferenceServerException(msg=message, status="StatusCode.UNAVAILABLE")
    server.stop("down", "down", "up")
    session = open_session(fake_triton, server, session_id="s")
    assert session.ask("hello").text == "hello"
    requests = fake_triton[0].requests
    assert [r.sequence_start for r in requests] == [True, True]
    assert all("resume" not in r.inputs for r in requests)  # never opened: START alone, not a resume
    assert server.rules.accepted == ["hello"]


def test_a_request_refused_by_triton_stopping_without_a_drain_waits_too(fake_triton, server):
    session = open_session(fake_triton, server, session_id="s")
    session.append("context")
    stopping = InferenceServerException(
        msg="Server is stopping, scheduler for model has stopped accepting new inference requests")
    fake_triton[0].responder = lambda request: [stopping]
    fake_triton[0].ready = lambda: setattr(fake_triton[0], "responder", server) or True  # back
    assert session.ask("hello").text == "hello"
    assert server.rules.accepted == ["context", "hello"] and fake_triton[0].num_ready_checks == 1


def test_without_wait_for_ready_the_refusal_is_raised_at_once(fake_triton, server):
    session = open_session(fake_triton, server, session_id="s", wait_for_ready=False)
    session.append("context")
    server.stop("unloaded", "up")
    with pytest.raises(PreposError, match="unknown model"):
        session.ask("hello")
    assert fake_triton[0].num_ready_checks == 0 and len(fake_triton[0].requests) == 2


def test_a_server_that_does_not_come_back_within_the_time_limit_gets_the_refusal(fake_triton, server):
    session = open_session(fake_triton, server, session_id="s", timeout_s=0.6)
    session.append("context")
    server.stop("down")
    began = time.monotonic()
    with pytest.raises(PreposUnavailable, match="failed to connect"):
        session.ask("hello")
    assert 0.6 <= time.monotonic() - began < 3
    assert 2 <= fake_triton[0].num_ready_checks <= 8  # looks spaced out, not a tight loop
    assert server.rules.accepted == ["context"]
    server.phase = "up"
    assert session.ask("hello").text == "hello"  # usable: reopened from its journal
    assert fake_triton[0].requests[-1].sequence_start and server.rules.accepted == ["context", "hello"]


@pytest.mark.parametrize("broken_message", [
    "Socket closed",  # gRPC's
    "upstream connect error or disconnect/reset before headers. reset reason: connection termination",  # Envoy's
])
def test_a_stream_broken_after_it_connected_is_not_sent_again(fake_triton, server, broken_message):
    """Its request may have been served: only a refusal that changed nothing is sent again."""
    session = open_session(fake_triton, server, session_id="s")
    session.append("context")
    broken = InferenceServerException(msg=broken_message, status="StatusCode.UNAVAILABLE")
    fake_triton[0].responder = lambda request: [broken]
    with pytest.raises(PreposUnavailable, match=broken_message.split(".")[0]):
        session.ask("hello")
    assert fake_triton[0].num_ready_checks == 0 and len(fake_triton[0].requests) == 2
    session.detach()


def test_a_server_back_without_the_sessions_journal_closes_it_with_a_clear_error(fake_triton):
    server = RestartingServer(journal=False)
    fake_triton.responder = server
    session = open_session(fake_triton, server, session_id="s")
    session.append("context")
    server.stop("unloaded", "up")
    with pytest.raises(PreposError, match="session s is no longer open on the server .* open a new session"):
        session.ask("hello")
    assert session.closed and server.rules.accepted == ["context"]


def test_pipelined_requests_are_not_sent_again(fake_triton, server):
    session = open_session(fake_triton, server, session_id="s")
    session.append("context")
    server.stop("unloaded", "up")
    held = []
    fake_triton[0].responder = lambda request: held.append(request) or []
    first, second = session.generate("one"), session.generate("two")
    for request in held:  # both refused: sending one again could put it after the other
        fake_triton[0].callback(result=None, error=InferenceServerException(msg=UNLOADED))
    for answer in (first, second):
        with pytest.raises(PreposError, match="unknown model"):
            list(answer)
    assert fake_triton[0].num_ready_checks == 0 and len(fake_triton[0].requests) == 3
    fake_triton[0].responder = server
    assert session.ask("three").text == "three"  # alone: sent again once the server is back, reopening the session
    assert server.rules.accepted == ["context", "three"]


def test_a_stream_that_fails_before_the_request_is_queued_is_sent_once_the_server_is_ready(fake_triton, server):
    """gRPC refuses to queue the request on a stream to a server it cannot connect to: nothing was sent."""
    session = open_session(fake_triton, server, session_id="s")
    session.append("context")
    fake = fake_triton[0]
    fake.fail_enqueue = True
    looks = []

    def ready() -> bool:
        looks.append(None)
        if len(looks) < 3:
            raise unavailable()
        fake.fail_enqueue = False
        return True

    fake.ready = ready
    assert session.ask("hello").text == "hello"
    assert len(looks) == 3 and server.rules.accepted == ["context", "hello"]
    assert len(fake.requests) == 2 and len(fake.stream_headers) == 2  # the one that failed, then a new one


def test_wait_for_ready_is_off_by_default_and_passed_on_to_sessions():
    assert not Client("127.0.0.1:9").session().wait_for_ready
    assert Client("127.0.0.1:9", wait_for_ready=True).session().wait_for_ready


def test_cleanup_does_not_wait_for_a_server_that_is_down(fake_triton, server):
    """`Client.close` and a `with` block left on an error try each END once; a call made by the caller waits."""
    client = Client("127.0.0.1:9", timeout_s=5.0, wait_for_ready=True)
    sessions = [client.session(session_id=f"s{index}") for index in range(3)]
    for fake, session in zip(fake_triton, sessions):
        fake.ready = server.ready
        session.append("context")
    server.stop("down")  # for good
    began = time.monotonic()
    with pytest.raises(RuntimeError), sessions[0]:
        raise RuntimeError("the caller's own error")
    client.close()
    assert time.monotonic() - began < 2 and all(session.closed for session in sessions)
    assert sum(fake.num_ready_checks for fake in fake_triton) == 0


def test_a_model_name_the_server_does_not_serve_is_refused_at_once(fake_triton, server):
    """Waiting would not mend a wrong model name: Triton answers it "is not found", not "has no versions"."""
    session = open_session(fake_triton, server, session_id="s")
    fake_triton[0].responder = lambda request: [InferenceServerException(
        msg="Request for unknown model: 'prepos2' is not found")]
    with pytest.raises(PreposError, match="is not found"):
        session.ask("hello")
    assert fake_triton[0].num_ready_checks == 0


def test_a_ctrl_c_while_a_request_carrying_end_waits_for_the_server_leaves_close_nothing_to_wait_for(
        fake_triton, server, monkeypatch):
    """The refused request was still taken for one in flight: close() waited for its answer, which could not come,
    to the end of the time limit (10 s after a Ctrl-C in `prepos ask --wait-for-ready`)."""
    import prepos_client.session_requests as session_requests

    server.stop("down", "up")
    session = open_session(fake_triton, server, session_id="s", timeout_s=10.0)

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(session_requests, "wait_until_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.ask("hello", end=True)
    session.wait_for_ready = False  # as the command line leaves: the END is tried once
    began = time.monotonic()
    with pytest.raises(PreposUnavailable):  # the END, tried once, finds the server still down
        session.close()
    assert time.monotonic() - began < 2 and session.closed
    assert server.rules.accepted == []  # nothing was taken
