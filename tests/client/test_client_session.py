"""Session and Client against a fake gRPC client: START/END, errors, timeouts, streams."""

from __future__ import annotations

import threading
import time
from typing import Callable

import pytest
from client_fakes import (DRAINING, NO_JOURNAL, SentRequest, SessionRules, echo_responder, make_result,
                          unavailable)
from prepos_client import Client, PreposError, PreposTimeout, PreposUnavailable, Session
from prepos_client.session import NO_DELTA_MAX_TOKENS, SESSION_HEADER
from prepos_client.session_ids import check_session_id
from tritonclient.utils import InferenceServerException


def open_session(**kwargs) -> Session:
    return Client("127.0.0.1:9", timeout_s=kwargs.pop("timeout_s", 2.0)).session(**kwargs)


def reject_first(message: str):
    state = {"num_requests": 0}

    def responder(request):
        state["num_requests"] += 1
        if state["num_requests"] == 1:
            return [InferenceServerException(msg=message)]
        return echo_responder(request)

    return responder


def test_first_request_opens_the_session_and_later_ones_do_not(fake_triton):
    session = open_session(session_id="s-1")
    session.append("system prompt", role="system")
    session.ask("hi")
    first, second = fake_triton[0].requests
    assert (first.sequence_start, second.sequence_start) == (True, False)
    assert first.sequence_id == second.sequence_id == "s-1"
    assert first.request_id != second.request_id
    assert first.enable_empty_final_response and second.enable_empty_final_response
    assert not first.sequence_end and not second.sequence_end


def test_the_stream_carries_the_session_header(fake_triton):
    client = Client("127.0.0.1:9", headers={"x-tenant": "a"})
    client.session(42).ask("hi")
    assert fake_triton[0].stream_headers == [{"x-tenant": "a", SESSION_HEADER: "42"}]
    assert fake_triton[0].requests[0].sequence_id == 42


def test_one_grpc_client_per_session(fake_triton):
    client = Client("127.0.0.1:9")
    client.session("a").ask("x")
    client.session("b").ask("y")
    assert [len(fake.requests) for fake in fake_triton] == [1, 1]


def test_append_sends_the_delta_with_max_tokens_zero(fake_triton):
    update = open_session().append("tool output", role="tool")
    (request,) = fake_triton[0].requests
    assert sorted(request.inputs) == ["max_tokens", "role", "text_input"]
    assert request.inputs["max_tokens"].tolist() == [0]
    assert update.path == "append"
    assert update.finish_reason == "appended"
    assert update.total_ms >= 0


def test_generate_sends_only_what_was_set(fake_triton):
    """max_tokens included: left out, the server's scheduler.default_max_tokens applies (a fixed 64 here was refused
    by every server whose limits.max_tokens is lower)."""
    open_session().ask("q", choices=["yes", "no"], seed=3)
    (request,) = fake_triton[0].requests
    assert sorted(request.inputs) == ["choices", "seed", "text_input"]


def test_an_answer_with_no_delta_and_no_choices_still_asks_for_tokens(fake_triton):
    """The server takes a request without a delta, choices or max_tokens for an update: ask() after an append (the
    answer from the positioned state, path exact) came back an empty `append` when max_tokens was left out."""
    session = open_session()
    session.ask()
    session.ask(max_tokens=None)
    session.ask(max_tokens=5)
    session.ask(choices=["yes", "no"])  # choices make it a question for the server's own default
    requests = fake_triton[0].requests
    assert [r.inputs.get("max_tokens") is not None and r.inputs["max_tokens"].tolist() for r in requests] == [
        [NO_DELTA_MAX_TOKENS], [NO_DELTA_MAX_TOKENS], [5], False]


def test_max_tokens_none_leaves_it_to_the_server(fake_triton):
    open_session().ask(ids=[1, 2], max_tokens=None)
    (request,) = fake_triton[0].requests
    assert sorted(request.inputs) == ["input_ids"]


def test_generate_streams_chunks_and_ask_collects_them(fake_triton):
    session = open_session()
    fake_triton[0].responder = lambda request: [
        make_result(request.request_id, text="Hel", ids=[1], path="prefix", confidence=0.4, first_token_ms=0.3,
                    final=False),
        make_result(request.request_id, text="lo", ids=[2], path="prefix", finish_reason="length", final=True),
    ]
    chunks = list(session.generate("hi"))
    assert [chunk.text for chunk in chunks] == ["Hel", "lo"]
    assert [chunk.final for chunk in chunks] == [False, True]
    answer = session.ask("again")
    assert (answer.text, answer.token_ids, answer.path, answer.finish_reason) == ("Hello", (1, 2), "prefix", "length")
    assert answer.first_token_ms == pytest.approx(0.3)
    assert 0 <= answer.ttft_ms <= answer.total_ms


def test_generate_sends_before_iteration(fake_triton):
    session = open_session()
    session.generate("hi")
    assert len(fake_triton[0].requests) == 1


def test_a_server_error_names_the_field_and_the_session_stays_usable(fake_triton):
    session = open_session()
    session.append("context")
    fake_triton[0].responder = reject_first("max_tokens: must be >= 0, got -1")
    with pytest.raises(PreposError) as raised:
        session.ask("q", max_tokens=-1)
    assert raised.value.field == "max_tokens"
    assert session.ask("q").text == "q"
    assert [request.sequence_start for request in fake_triton[0].requests] == [True, False, False]


def test_a_rejected_first_request_leaves_the_session_unopened(fake_triton):
    session = open_session()
    fake_triton[0].responder = reject_first("role: must be one of user, tool, system, got 'bot'")
    with pytest.raises(PreposError, match="role"):
        session.append("x", role="bot")
    session.append("x")
    assert [request.sequence_start for request in fake_triton[0].requests] == [True, True]


def test_close_sends_a_bare_end_and_releases_the_connection(fake_triton):
    session = open_session()
    session.ask("hi")
    update = session.close()
    end = fake_triton[0].requests[-1]
    assert end.sequence_end and not end.sequence_start
    assert sorted(end.inputs) == ["max_tokens"]
    assert end.inputs["max_tokens"].tolist() == [0]
    assert (update.path, update.finish_reason) == ("close", "closed")
    assert fake_triton[0].stop_calls == [False]
    assert fake_triton[0].closed
    assert session.closed


def test_close_is_idempotent_and_a_closed_session_refuses_requests(fake_triton):
    session = open_session()
    session.ask("hi")
    session.close()
    assert session.close() is None
    assert len(fake_triton[0].requests) == 2
    with pytest.raises(PreposError, match="closed"):
        session.ask("again")


def test_closing_an_unused_session_sends_nothing(fake_triton):
    session = open_session()
    assert session.close() is None
    assert fake_triton[0].requests == []
    assert fake_triton[0].closed


def test_close_after_a_rejected_opening_sends_start_and_end(fake_triton):
    session = open_session()
    fake_triton[0].responder = reject_first("max_tokens: must be >= 0, got -1")
    with pytest.raises(PreposError):
        session.ask("q", max_tokens=-1)
    session.close()
    end = fake_triton[0].requests[-1]
    assert (end.sequence_start, end.sequence_end) == (True, True)


def test_a_resumed_session_opens_with_start_and_resume(fake_triton):
    session = open_session(session_id="old", resume=True)
    session.ask("hi")
    session.close()
    requests = fake_triton[0].requests
    assert [(r.sequence_start, r.sequence_end) for r in requests] == [(True, False), (False, True)]
    assert [r.inputs.get("resume") for r in requests] == [[True], None]


def test_closing_a_session_the_server_could_not_resume_ends_its_sequence_and_raises_nothing(fake_triton, caplog):
    fake_triton.responder = lambda request: [InferenceServerException(msg=NO_JOURNAL + " [NOT_FOUND]")]
    with pytest.raises(PreposError, match="no journal") as raised:
        with open_session(session_id="s", resume=True) as session:
            session.ask("hi")
    assert raised.value.field == "resume" and session.closed
    opening, end = fake_triton[0].requests  # END with START and resume: Triton ends the sequence it began
    assert (end.sequence_start, end.sequence_end) == (True, True) and end.inputs["resume"].tolist() == [True]
    assert "closing session" not in caplog.text  # the with block's exit found nothing to end, and said nothing
    assert session.close() is None and len(fake_triton[0].requests) == 2


def test_closing_a_session_whose_journal_the_server_could_not_use_raises_nothing_more(fake_triton, caplog):
    unusable = ("journal: the session journal cannot reopen it (not a prepos journal (bad magic or version)); it is "
                "left as it is on the server, for inspection; send START without resume to begin a new session, "
                "which replaces it [INTERNAL]")
    fake_triton.responder = lambda request: [InferenceServerException(msg=unusable)]
    with pytest.raises(PreposError, match="cannot reopen it") as raised:
        with open_session(session_id="s", resume=True) as session:
            session.ask("hi")
    assert raised.value.field == "journal" and raised.value.code == "INTERNAL"
    assert "closing session" not in caplog.text  # nothing was opened: nothing to end, nothing to say
    assert session.close() is None and len(fake_triton[0].requests) == 2


def test_closing_a_session_whose_opening_found_it_held_by_another_client_sends_nothing(fake_triton):
    fake_triton.responder = reject_first("START: session 's' is already open [ALREADY_EXISTS]")
    session = open_session(session_id="s")
    with pytest.raises(PreposError, match="already open") as refused:
        session.ask("hi")
    assert refused.value.code == "ALREADY_EXISTS"
    assert session.close() is None and session.closed
    assert len(fake_triton[0].requests) == 1  # no START + END: it would end the other client's sequence in Triton


def test_a_session_opened_after_finding_it_held_elsewhere_is_closed_as_usual(fake_triton):
    fake_triton.responder = reject_first("START: session 's' is already open [ALREADY_EXISTS]")
    session = open_session(session_id="s")
    with pytest.raises(PreposError):
        session.ask("hi")
    session.ask("again")  # the other client closed it meanwhile: this one opens it
    session.close()
    assert fake_triton[0].requests[-1].sequence_end


@pytest.mark.parametrize("refusal", ["START: too many open sessions (limit 2) [RESOURCE_EXHAUSTED]",
                                     DRAINING + " [UNAVAILABLE]"])
def test_closing_a_session_whose_opening_was_refused_for_room_or_a_drain_ends_its_sequence_quietly(fake_triton,
                                                                                                    refusal):
    fake_triton.responder = lambda request: [InferenceServerException(msg=refusal)]
    session = open_session(session_id="s")
    with pytest.raises(PreposError):
        session.append("hi")
    assert session.close() is None and session.closed
    end = fake_triton[0].requests[-1]  # START + END all the same: Triton gives the sequence's slot back
    assert (end.sequence_start, end.sequence_end) == (True, True)


def test_close_still_raises_other_refusals_of_an_opening(fake_triton):
    fake_triton.responder = lambda request: [InferenceServerException(msg="START: something else [INTERNAL]")]
    session = open_session(session_id="s", resume=True)
    with pytest.raises(PreposError, match="something else"):
        session.close()
    assert session.closed  # released all the same


def test_close_behind_an_unread_answer_that_carries_end_waits_for_it_and_sends_no_second_end(fake_triton):
    """Triton ends the sequence at the request carrying END: a second END (or any request) would be refused, and
    its refusal, which names no request, used to reach the answer still streaming instead."""
    fake_triton.responder = lambda request: [make_result(request.request_id, text="a", final=False),
                                             make_result(request.request_id, text="b", finish_reason="length",
                                                         final=True)]
    session = open_session(session_id="s")
    answer = session.generate("tell me", end=True)
    assert next(answer).text == "a"  # the caller stops reading here
    with pytest.raises(PreposError, match="is closing: request 1 carried END"):
        session.ask("more")
    assert session.close() is None and session.closed
    assert len(fake_triton[0].requests) == 1


def test_a_caller_who_stops_at_the_final_chunk_leaves_the_session_closed(fake_triton):
    session = open_session(session_id="s")
    answer = session.generate("tell me", end=True)
    assert next(answer).final  # the echo answers in one chunk; the caller reads no further
    assert session.closed and session.close() is None and len(fake_triton[0].requests) == 1


def test_ask_with_end_closes_the_session_with_the_last_request(fake_triton):
    session = open_session()
    answer = session.ask("bye", end=True)
    assert answer.text == "bye"
    assert session.closed
    assert session.close() is None
    assert [(r.sequence_start, r.sequence_end) for r in fake_triton[0].requests] == [(True, True)]


def test_a_rejected_end_request_still_ends_the_session(fake_triton):
    session = open_session()
    session.append("x")
    fake_triton[0].responder = reject_first("max_tokens: must be >= 0, got -1")
    with pytest.raises(PreposError, match="max_tokens"):
        session.ask("q", max_tokens=-1, end=True)
    assert session.closed
    assert session.close() is None
    assert len(fake_triton[0].requests) == 2
    assert fake_triton[0].closed


def test_an_end_request_lost_with_the_stream_leaves_the_session_for_close(fake_triton):
    session = open_session()
    session.append("x")
    fake_triton[0].responder = lambda request: [unavailable()]
    with pytest.raises(PreposUnavailable):
        session.append("y", end=True)
    assert not session.closed
    fake_triton[0].responder = echo_responder
    session.close()
    assert fake_triton[0].requests[-1].sequence_end
    assert session.closed


def test_context_manager_closes(fake_triton):
    with open_session() as session:
        session.ask("hi")
    assert session.closed
    assert fake_triton[0].requests[-1].sequence_end


def test_detach_leaves_the_session_open(fake_triton):
    session = open_session()
    session.ask("hi")
    session.detach()
    assert session.closed
    assert not any(request.sequence_end for request in fake_triton[0].requests)
    assert fake_triton[0].closed


def open_with_rules(fake_triton, **kwargs) -> tuple[Session, SessionRules]:
    session = open_session(session_id="s", timeout_s=0.05, **kwargs)
    rules = fake_triton[0].responder = SessionRules()
    session.append("context")
    return session, rules


def test_a_call_times_out_and_the_session_stays_usable(fake_triton):
    session, rules = open_with_rules(fake_triton)
    with pytest.raises(PreposTimeout, match="within 0.05 s; whether its turn was accepted is not known yet") as info:
        session.ask("SLOW")
    assert info.value.accepted is None
    rules.finish_held(fake_triton[0], accepted=False)  # the server stopped it at its deadline
    assert session.ask("fast").text == "fast"
    assert info.value.accepted is False  # settled before the next request went out
    assert [request.sequence_start for request in fake_triton[0].requests] == [True, False, False]


def test_a_timed_out_turn_accepted_late_is_reported_before_the_caller_sends_it_again(fake_triton, caplog):
    session, rules = open_with_rules(fake_triton)
    with pytest.raises(PreposTimeout) as info:
        session.ask("SLOW")
    threading.Timer(0.1, rules.finish_held, args=(fake_triton[0],), kwargs={"accepted": True}).start()
    session.settle(timeout_s=5.0)
    assert info.value.accepted is True
    assert "request 2 timed out on the client but was accepted after all" in caplog.text
    assert len(fake_triton[0].requests) == 2  # settle sent nothing
    assert session.ask("next").text == "next"
    assert [request.sequence_start for request in fake_triton[0].requests] == [True, False, False]


def test_settle_raises_when_no_outcome_comes_and_settles_later(fake_triton):
    session, rules = open_with_rules(fake_triton)
    with pytest.raises(PreposTimeout) as info:
        session.ask("SLOW")
    with pytest.raises(PreposTimeout, match="request 2 timed out and the server has not reported its outcome") as wait:
        session.settle()
    assert wait.value.accepted is False and info.value.accepted is None
    rules.finish_held(fake_triton[0], accepted=False)
    session.settle()
    assert info.value.accepted is False
    session.settle()  # nothing left to wait for
    assert len(fake_triton[0].requests) == 2


def test_requests_timed_out_in_a_pipeline_are_settled_in_the_order_sent(fake_triton):
    session, rules = open_with_rules(fake_triton)
    first, second = session.generate("SLOW"), session.generate("SLOW")
    with pytest.raises(PreposTimeout) as second_error:
        list(second)
    with pytest.raises(PreposTimeout) as first_error:
        list(first)
    rules.finish_held(fake_triton[0], accepted=True)
    rules.finish_held(fake_triton[0], accepted=False)
    assert session.append("more").finish_reason == "appended"
    assert (first_error.value.accepted, second_error.value.accepted) == (True, False)


def test_a_stream_lost_before_the_outcome_leaves_it_unknown_and_resumes(fake_triton):
    session, rules = open_with_rules(fake_triton)
    with pytest.raises(PreposTimeout) as info:
        session.ask("SLOW")
    fake_triton[0].callback(result=None, error=unavailable())  # the stream ends: the request's fate is unknown
    fake_triton[0].callback = None
    fake_triton[0].responder = echo_responder
    assert session.ask("again").text == "again"
    assert info.value.accepted is None
    assert fake_triton[0].requests[-1].inputs.get("resume") == [True]


def session_with_a_timed_out_opening(fake_triton, **kwargs) -> tuple[Session, SessionRules]:
    """A session whose first request (START) timed out, on a fake that keeps sessions like the server."""
    session = open_session(session_id="s", timeout_s=0.05, **kwargs)
    rules = fake_triton[0].responder = SessionRules()
    with pytest.raises(PreposTimeout):
        session.ask("SLOW")
    return session, rules


def test_a_timed_out_opening_stopped_by_the_server_is_sent_again_with_start(fake_triton):
    session, rules = session_with_a_timed_out_opening(fake_triton)
    rules.finish_held(fake_triton[0], accepted=False)  # the server stopped it at the deadline: no session
    assert session.ask("again", timeout_s=2.0).text == "again"
    assert session.ask("then", timeout_s=2.0).text == "then"
    assert [request.sequence_start for request in fake_triton[0].requests] == [True, True, False]


def test_the_next_call_waits_for_the_outcome_of_a_timed_out_opening(fake_triton):
    session, rules = session_with_a_timed_out_opening(fake_triton)
    # The server's deadline error comes a little after the client's: a START sent before it would be refused
    # as already open, since the server is still finishing the first.
    threading.Timer(0.1, rules.finish_held, args=(fake_triton[0],), kwargs={"accepted": False}).start()
    assert session.append("again", timeout_s=5.0).finish_reason == "appended"
    assert [request.sequence_start for request in fake_triton[0].requests] == [True, True]


def test_a_timed_out_opening_whose_final_response_came_late_opened_the_session(fake_triton):
    session, rules = session_with_a_timed_out_opening(fake_triton)
    rules.finish_held(fake_triton[0], accepted=True)  # its last response was already on its way
    assert session.ask("again", timeout_s=2.0).text == "again"
    session.close()
    requests = fake_triton[0].requests
    assert [(r.sequence_start, r.sequence_end) for r in requests] == [(True, False), (False, False), (False, True)]


def test_a_resumed_session_whose_opening_timed_out_resumes_again(fake_triton):
    session, rules = session_with_a_timed_out_opening(fake_triton, resume=True)
    rules.finish_held(fake_triton[0], accepted=False)
    session.ask("again", timeout_s=2.0)
    assert [request.inputs.get("resume") for request in fake_triton[0].requests] == [[True], [True]]


def test_a_call_with_no_outcome_of_the_timed_out_opening_sends_nothing(fake_triton):
    session, rules = session_with_a_timed_out_opening(fake_triton)
    with pytest.raises(PreposTimeout, match="has not reported its outcome within 0.05 s"):
        session.ask("again")
    assert len(fake_triton[0].requests) == 1
    rules.finish_held(fake_triton[0], accepted=False)
    assert session.ask("again").text == "again"
    assert [request.sequence_start for request in fake_triton[0].requests] == [True, True]


def test_closing_after_a_timed_out_opening_opens_and_ends_at_once(fake_triton):
    session, rules = session_with_a_timed_out_opening(fake_triton)
    rules.finish_held(fake_triton[0], accepted=False)
    update = session.close()
    assert (update.path, update.finish_reason) == ("close", "closed")
    end = fake_triton[0].requests[-1]
    assert (end.sequence_start, end.sequence_end) == (True, True)
    assert session.closed and fake_triton[0].closed and not rules.open_ids


def test_closing_after_a_timed_out_opening_that_also_ended_sends_nothing_more(fake_triton):
    session = open_session(session_id="s", timeout_s=0.05)
    rules = fake_triton[0].responder = SessionRules()
    with pytest.raises(PreposTimeout):
        session.ask("SLOW", end=True)
    rules.finish_held(fake_triton[0], accepted=True)
    assert session.close() is None
    assert session.closed and len(fake_triton[0].requests) == 1


def test_a_timed_out_request_that_carried_end_leaves_the_session_closed(fake_triton):
    session = open_session(session_id="s", timeout_s=0.05)
    rules = SessionRules()  # holds the SLOW request: no response within the time limit
    fake_triton[0].responder = rules
    session.append("context")
    with pytest.raises(PreposTimeout, match="carried END, so the session is closed"):
        session.ask("SLOW", end=True)
    # The END is not cancelled: cancelled, it would not reach the server, and the session's sequence would stay
    # open there (its id refused as already open) until the idle timeout. Its stream ends once it is answered.
    assert session.closed and not fake_triton[0].closed and fake_triton[0].stop_calls == []
    rules.finish_held(fake_triton[0], accepted=False)  # the server's deadline error: the END ended it all the same
    deadline = time.monotonic() + 5
    while not fake_triton[0].closed:
        assert time.monotonic() < deadline, "the stream was not closed once the END was answered"
        time.sleep(0.01)
    assert fake_triton[0].stop_calls == [False] and "s" not in rules.open_ids
    with pytest.raises(PreposError, match="session s is closed"):
        session.ask("again")  # not sent without START, which the ended sequence would refuse
    assert session.close() is None
    assert len(fake_triton[0].requests) == 2


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan")])
def test_a_time_limit_that_is_not_positive_is_refused_before_anything_is_sent(fake_triton, timeout_s):
    with pytest.raises(ValueError, match="timeout_s: expected seconds > 0"):
        Client("127.0.0.1:9", timeout_s=timeout_s)
    session = open_session()
    with pytest.raises(ValueError, match="timeout_s: expected seconds > 0"):
        session.ask("hi", timeout_s=timeout_s)
    with pytest.raises(TypeError, match="timeout_s: expected seconds as a number"):
        session.ask("hi", timeout_s="5")
    assert fake_triton[0].requests == []
    assert session.ask("hi").text == "hi"  # nothing changed: the session opens with its first real request
    assert fake_triton[0].requests[0].sequence_start


def test_an_infinite_timeout_waits_without_limit(fake_triton):
    session = open_session(timeout_s=float("inf"))
    assert session.ask("hi").text == "hi"


def test_a_per_call_timeout_overrides_the_default(fake_triton):
    session = open_session(timeout_s=60.0)
    fake_triton[0].responder = lambda request: []
    with pytest.raises(PreposTimeout, match="within 0.01 s"):
        session.append("x", timeout_s=0.01)


def test_detach_with_a_request_still_running_cancels_it(fake_triton):
    session = open_session(timeout_s=0.01)
    fake_triton[0].responder = lambda request: []
    with pytest.raises(PreposTimeout):
        session.ask("slow")
    session.detach()
    assert fake_triton[0].stop_calls == [True]


def streaming_without_end(request: SentRequest) -> list:
    """An answer that streams one chunk and then runs on (no final chunk yet); acks and ENDs as the server."""
    max_tokens = request.inputs.get("max_tokens")
    if "text_input" in request.inputs and (max_tokens is None or int(max_tokens[0]) > 0):
        return [make_result(request.request_id, text="Once", ids=[1], path="prefix", final=False)]
    return echo_responder(request)


def test_cancel_stops_an_answer_no_one_reads_and_close_then_does_not_wait_for_it(fake_triton):
    """Ctrl-C during `prepos chat`: END went out behind the answer still running and waited for it to end."""
    session = open_session(session_id="s", timeout_s=30)
    session.append("system", role="system")
    fake_triton[0].responder = streaming_without_end
    chunks = session.generate("Tell a long story.")
    assert next(chunks).text == "Once"
    session.cancel()
    assert fake_triton[0].stop_calls == [True] and not session.closed  # cancelled; the session goes on
    started = time.monotonic()
    assert session.close().finish_reason == "closed"
    assert time.monotonic() - started < 5  # not the 30 s time limit
    end = fake_triton[0].requests[-1]
    assert (end.sequence_start, end.sequence_end) == (False, True)  # still open on the server: no START
    assert len(fake_triton[0].stream_headers) == 2  # on a new stream


def test_cancel_of_an_answer_carrying_end_closes_the_session(fake_triton):
    """`prepos ask ... | head`: the answer carried END; cancelled, it ends the session all the same."""
    session = open_session(session_id="s", timeout_s=30)
    session.append("system", role="system")
    fake_triton[0].responder = streaming_without_end
    chunks = session.generate("Tell a long story.", end=True)
    assert next(chunks).text == "Once"
    session.cancel()
    assert session.closed and fake_triton[0].stop_calls == [True]
    assert session.close() is None and len(fake_triton[0].requests) == 2  # nothing more to send


class JournallessRules(SessionRules):
    """SessionRules whose server keeps no journal: START with `resume` for a session it does not hold is refused."""

    def __call__(self, request):
        resume = request.inputs.get("resume")
        if request.sequence_start and resume is not None and resume[0] and request.sequence_id not in self.open_ids:
            return [InferenceServerException(msg=NO_JOURNAL)]
        return super().__call__(request)


def test_cancelling_a_new_sessions_opening_leaves_the_session_to_open_with_a_plain_start(fake_triton):
    """The opening went as a lost stream's: every later request carried START with `resume`, which the server,
    having closed the cancelled START's empty session, refused for want of a journal."""
    rules = JournallessRules()
    fake_triton.responder = rules
    session = open_session(session_id="s", timeout_s=5)
    session.generate("SLOW story")  # the opening, still running
    session.cancel()
    rules.held.clear()
    rules.open_ids.discard("s")  # a cancelled START with nothing in its log leaves no session
    assert session.ask("hello").text == "hello"
    last = fake_triton[0].requests[-1]
    assert last.sequence_start and "resume" not in last.inputs


def test_closing_after_cancelling_the_opening_sends_end_alone(fake_triton):
    """Ctrl-C during a chat's first answer: its START+END went next to the cancelled START, which the server was
    still stopping, and was refused as already open (`prepos chat` then exited 1)."""
    rules = JournallessRules()
    fake_triton.responder = rules
    session = open_session(session_id="s", timeout_s=5)
    session.generate("SLOW story")
    session.cancel()
    rules.held.clear()
    rules.open_ids.discard("s")  # stopped at last: a cancelled START with nothing in its log leaves no session
    assert session.close() is None and session.closed
    end, reopened = fake_triton[0].requests[-2:]
    assert (end.sequence_start, end.sequence_end) == (False, True)  # END alone first, then sent again to reopen
    assert (reopened.sequence_start, reopened.sequence_end) == (True, True) and reopened.inputs["resume"][0]


def test_cancelling_an_opening_that_did_open_the_session_goes_on_in_it(fake_triton):
    rules = JournallessRules()
    fake_triton.responder = rules
    session = open_session(session_id="s", timeout_s=5)
    session.generate("SLOW story")
    session.cancel()
    rules.held.clear()  # its answer was under way: the session stays open on the server
    with pytest.raises(PreposError, match="had opened it; the next call continues the session"):
        session.ask("hello")  # START refused as already open: the opening did open it
    assert session.ask("hello").text == "hello"
    assert session.close().finish_reason == "closed" and "s" not in rules.open_ids


def test_cancel_after_an_opening_that_timed_out_and_was_accepted_late_keeps_the_session_open(fake_triton):
    """The settled opening's START was sent again: `close()` was refused as already open, and the session stayed
    open on the server until its idle timeout."""
    rules = JournallessRules()
    fake_triton.responder = rules
    session = open_session(session_id="s", timeout_s=0.3)
    with pytest.raises(PreposTimeout):
        session.ask("SLOW story")
    rules.finish_held(fake_triton[0], accepted=True)  # its final response, late: the session opened
    session.cancel()
    assert session.close(timeout_s=2).finish_reason == "closed"
    assert "s" not in rules.open_ids
    end = fake_triton[0].requests[-1]
    assert (end.sequence_start, end.sequence_end) == (False, True)


def test_cancel_on_a_stream_that_had_ended_resumes_the_session_on_the_next(fake_triton):
    """A server restart while the session was idle, then cancel(): the next request went without START."""
    rules = SessionRules()
    fake_triton.responder = rules
    session = open_session(session_id="s", timeout_s=5)
    session.append("hi")
    fake_triton[0].callback(result=None, error=InferenceServerException(msg="Socket closed",
                                                                         status="StatusCode.UNAVAILABLE"))
    session.cancel()
    session.append("more")
    sent = fake_triton[0].requests[-1]
    assert sent.sequence_start and sent.inputs["resume"].tolist() == [True]


def test_an_unreachable_server_raises_unavailable_and_a_new_stream_is_tried(fake_triton):
    session = open_session()
    fake_triton[0].responder = lambda request: [unavailable()]
    with pytest.raises(PreposUnavailable):
        session.ask("hi")
    fake_triton[0].responder = echo_responder
    assert session.ask("hi").text == "hi"
    assert len(fake_triton[0].stream_headers) == 2
    assert fake_triton[0].requests[-1].sequence_start


def test_a_stream_that_died_before_sending_raises_its_error(fake_triton):
    session = open_session()
    fake_triton[0].fail_enqueue = True
    with pytest.raises(PreposUnavailable):
        session.append("x")
    assert fake_triton[0].stop_calls == [False]


@pytest.mark.parametrize("session_id", ["", "sé", "a\nb", "x" * 129, 0, -1, 2**63, True, 1.5])
def test_session_ids_the_server_cannot_carry_are_refused(session_id):
    with pytest.raises((ValueError, TypeError), match="session_id"):
        check_session_id(session_id)
    assert check_session_id("x" * 128) == "x" * 128  # Triton's longest


@pytest.mark.parametrize("url", [None, 8001])
def test_a_url_that_is_no_address_is_named(url):
    with pytest.raises(TypeError, match="url: expected host:port"):
        Client(url)


def test_a_missing_session_id_becomes_a_fresh_random_one(fake_triton):
    client = Client("127.0.0.1:9")
    first, second = client.session(), client.session()
    assert isinstance(first.session_id, str) and len(first.session_id) == 32
    assert first.session_id != second.session_id


def test_client_close_closes_sessions_still_open(fake_triton):
    with Client("127.0.0.1:9") as client:
        used = client.session("a")
        used.ask("hi")
        detached = client.session("b")
        detached.ask("hi")
        detached.detach()
    assert used.closed
    assert fake_triton[0].requests[-1].sequence_end
    assert not fake_triton[1].requests[-1].sequence_end


def test_is_ready_is_false_for_an_unreachable_server():
    assert Client("127.0.0.1:1", timeout_s=2.0).is_ready() is False


def test_after_a_lost_stream_an_opened_session_resumes_with_start(fake_triton):
    session = open_session()
    session.ask("hi")
    fake_triton[0].responder = lambda request: [unavailable()]  # the server restarted under us, say
    with pytest.raises(PreposUnavailable):
        session.ask("lost")
    fake_triton[0].responder = echo_responder
    session.ask("again")
    again = fake_triton[0].requests[-1]
    assert again.sequence_start and again.inputs["resume"].tolist() == [True]
    session.ask("then")
    assert not fake_triton[0].requests[-1].sequence_start and "resume" not in fake_triton[0].requests[-1].inputs


def test_the_servers_request_timeout_is_the_calls_time_limit_less_the_way_back():
    from prepos_client.deadlines import server_timeout_us

    # a tenth of the limit, at most 50 ms, for the final response to reach the client before it gives up
    assert server_timeout_us(60.0) == 59_950_000 and server_timeout_us(0.05) == 45_000
    assert server_timeout_us(1e-9) == 1  # never 0, which Triton reads as no timeout
    for unlimited in (float("inf"), 0.0, -1.0, float("nan")):
        assert server_timeout_us(unlimited) is None


def test_a_timed_out_request_answered_before_the_end_that_closed_the_session_has_its_outcome(fake_triton):
    session, rules = open_with_rules(fake_triton)
    first = session.generate("SLOW")
    last = session.generate("bye", end=True)
    with pytest.raises(PreposTimeout) as info:
        list(first)
    rules.finish_held(fake_triton[0], accepted=True)  # the server answers in order: the timed-out one first
    list(last)
    assert session.closed and info.value.accepted is True
    session.settle()  # a closed session has nothing to wait for


def test_an_opening_lost_with_its_stream_that_had_opened_the_session_is_continued(fake_triton):
    session = open_session(session_id="s", timeout_s=0.05)
    rules = fake_triton[0].responder = SessionRules()
    with pytest.raises(PreposTimeout) as info:
        session.ask("SLOW")  # its START is held: the session is open on the server, its answer yet to come
    fake_triton[0].callback(result=None, error=unavailable())  # the stream is lost, the server stays up
    fake_triton[0].callback = None
    rules.held.clear()
    with pytest.raises(PreposError, match="is already open: the request that was to open it, whose answer was lost"):
        session.ask("again")  # sent with START again, refused: it changed nothing
    assert info.value.accepted is None
    assert session.ask("then").text == "then"
    assert [request.sequence_start for request in fake_triton[0].requests] == [True, True, False]


def test_an_opening_lost_with_a_server_that_had_not_opened_the_session_opens_it_again(fake_triton):
    session = open_session(session_id="s", timeout_s=0.05)
    rules = fake_triton[0].responder = SessionRules()
    with pytest.raises(PreposTimeout):
        session.ask("SLOW")
    fake_triton[0].callback(result=None, error=unavailable())  # the server restarted: it holds nothing
    fake_triton[0].callback = None
    rules.held.clear()
    rules.open_ids.clear()
    assert session.ask("again").text == "again"
    assert [request.sequence_start for request in fake_triton[0].requests] == [True, True]


NOT_OPEN_REFUSALS = [
    # Triton's, for a sequence it no longer holds (ended by a drain, its idle timeout, or another client's END)
    "[request id: 3] inference request for sequence s to model 'prepos' must specify the START flag on the first "
    "request of the sequence",
    "START: session 's' is not open; send START with its first request",  # prepos's own
]


def refusing_unopened(refusal: str, reopening: Callable[[SentRequest], list]) -> Callable[[SentRequest], list]:
    """A server that does not hold the session: a request without START gets ``refusal``, one with START (and
    `resume`, which it must carry) what ``reopening`` answers."""
    def respond(request: SentRequest) -> list:
        if not request.sequence_start:
            return [InferenceServerException(msg=refusal)]
        assert bool(request.inputs["resume"][0])
        return reopening(request)
    return respond


@pytest.mark.parametrize("refusal", NOT_OPEN_REFUSALS)
def test_a_session_the_server_no_longer_holds_is_closed_with_a_clear_error(fake_triton, refusal):
    session = open_session(session_id="s")
    session.append("context")
    fake_triton[0].responder = refusing_unopened(refusal, lambda request: [InferenceServerException(msg=NO_JOURNAL)])
    with pytest.raises(PreposError, match="session s is no longer open on the server .* open a new session"):
        session.ask("hello")
    assert session.closed
    with pytest.raises(PreposError, match="session s is closed"):
        session.ask("again")
    requests = fake_triton[0].requests
    assert session.close() is None and len(requests) == 3  # nothing more was sent
    assert [r.sequence_start for r in requests] == [True, False, True]  # the refused ask, then sent to reopen
    assert requests[2].inputs["text_input"][0] == b"hello" and "resume" not in requests[1].inputs


@pytest.mark.parametrize("refusal", NOT_OPEN_REFUSALS)
def test_closing_a_session_the_server_no_longer_holds_nor_has_a_journal_of_returns_none(fake_triton, refusal):
    """Its idle timeout ended it: close() raised "no longer open", for a session with nothing left to end."""
    session = open_session(session_id="s")
    session.append("context")
    fake_triton[0].responder = refusing_unopened(refusal, lambda request: [InferenceServerException(msg=NO_JOURNAL)])
    assert session.close() is None and session.closed
    requests = fake_triton[0].requests
    assert [(r.sequence_start, r.sequence_end) for r in requests] == [(True, False), (False, True), (True, True)]
    assert session.close() is None and len(requests) == 3  # nothing more was sent


@pytest.mark.parametrize("refusal", NOT_OPEN_REFUSALS)
def test_a_session_ended_with_its_journal_kept_is_reopened_within_the_same_call(fake_triton, refusal):
    session = open_session(session_id="s")
    session.append("context")
    fake_triton[0].responder = refusing_unopened(refusal, echo_responder)  # a drained session, on a new server
    assert session.ask("hello").text == "hello"
    fake_triton[0].responder = echo_responder
    assert session.ask("again").text == "again"
    requests = fake_triton[0].requests
    assert [r.sequence_start for r in requests] == [True, False, True, False]
    assert not session.closed


def test_a_session_refused_by_a_draining_server_tries_a_new_stream_and_stays_to_be_resumed(fake_triton):
    session = open_session(session_id="s")
    session.append("context")
    fake_triton[0].responder = refusing_unopened(NOT_OPEN_REFUSALS[0],
                                                 lambda request: [InferenceServerException(msg=DRAINING)])
    with pytest.raises(PreposError, match="draining"):
        session.ask("hello")
    assert not session.closed
    with pytest.raises(PreposError, match="draining"):  # still draining: START and `resume` again
        session.ask("hello")
    fake_triton[0].responder = refusing_unopened(NOT_OPEN_REFUSALS[0], echo_responder)  # back, from its journal
    assert session.ask("hello").text == "hello"
    # Each refused START went again once on a new stream (a router would take it to another replica).
    assert [r.sequence_start for r in fake_triton[0].requests] == [True, False, True, True, True, True, True]
    assert len(fake_triton[0].stream_headers) == 3 and fake_triton[0].stop_calls == [False, False]


def test_pipelined_requests_refused_as_not_open_leave_the_reopening_to_the_next_call(fake_triton):
    session = open_session(session_id="s")
    session.append("context")
    held = []
    fake_triton[0].responder = lambda request: held.append(request) or []
    first, second = session.generate("one"), session.generate("two")
    for request in held:  # the server refuses both: it no longer holds the session
        fake_triton[0].callback(result=None, error=InferenceServerException(msg=NOT_OPEN_REFUSALS[0]))
    for answer in (first, second):
        with pytest.raises(PreposError, match="is not open on the server .* the next call asks the server to reopen"):
            list(answer)
    fake_triton[0].responder = refusing_unopened(NOT_OPEN_REFUSALS[0], echo_responder)
    assert session.ask("three").text == "three"
    assert [r.sequence_start for r in fake_triton[0].requests] == [True, False, False, True]


@pytest.mark.parametrize("says_closed", [False, True])
def test_the_servers_deadline_error_for_a_request_that_carried_end_says_it_was_not_accepted(fake_triton,
                                                                                              says_closed):
    """The server's own error says the session closed all the same (an older one's did not): said once."""
    session = open_session(session_id="s")
    closed = "; the request carried END, so the session is closed all the same" if says_closed else ""
    deadline = InferenceServerException(msg="timeout: the request's deadline passed before it finished; its turn "
                                            f"was not accepted{closed} [DEADLINE_EXCEEDED]")
    fake_triton[0].responder = lambda request: [deadline] if request.sequence_end else echo_responder(request)
    session.append("context")
    with pytest.raises(PreposTimeout, match="carried END, so the session is closed") as raised:
        session.ask("hi", end=True)
    assert str(raised.value).count("carried END") == 1
    assert raised.value.accepted is False and raised.value.field == "timeout" and session.closed


def test_headers_that_are_not_strings_are_refused_naming_them():
    with pytest.raises(TypeError, match="headers: 'x-a': expected str names and values"):
        Client("127.0.0.1:9", headers={"x-a": 5})


def test_a_session_opened_from_two_threads_at_once_says_so(fake_triton):
    session = open_session(session_id="s")
    fake_triton[0].start_stream = lambda **kwargs: (_ for _ in ()).throw(InferenceServerException(
        msg="cannot start another stream with one already running. 'InferenceServerClient' supports only a "
            "single active stream at a given time."))
    with pytest.raises(PreposError, match="session s: used from two threads at once; a Session is for one thread"):
        session.ask("hi")


def test_a_request_sent_behind_an_unread_refused_opening_opens_the_session(fake_triton):
    """The opening's refusal is not read yet when the next call sends: that request must carry START (it went
    without one, was refused as not open, and its reopening found no journal: the session was lost)."""
    rules = SessionRules()

    def respond(request):
        if "choices" in request.inputs:  # the server refuses the whole request, its START too
            return [InferenceServerException(msg="choices: duplicate entries [INVALID_ARGUMENT]")]
        return rules(request)

    session = open_session(session_id="s")
    fake_triton[0].responder = respond
    refused = session.generate("Pick one.", choices=["yes", "yes"])  # sent, its answer not read
    assert session.ask("Hello!").text == "Hello!"
    with pytest.raises(PreposError, match="duplicate entries"):
        list(refused)
    assert session.ask("again").text == "again"
    assert [r.sequence_start for r in fake_triton[0].requests] == [True, True, False]
    assert rules.accepted == ["Hello!", "again"]


def test_a_request_sent_behind_an_unread_accepted_opening_goes_without_start(fake_triton):
    session = open_session(session_id="s")
    fake_triton[0].responder = SessionRules()
    first = session.generate("Hello!")  # sent, its answer not read
    assert session.ask("again").text == "again"
    assert [c.text for c in first] == ["Hello!"]
    assert [r.sequence_start for r in fake_triton[0].requests] == [True, False]


def test_a_request_behind_an_unread_resume_that_found_no_journal_resumes_again(fake_triton):
    session = open_session(session_id="s", resume=True)
    fake_triton[0].responder = lambda request: [InferenceServerException(msg=NO_JOURNAL + " [NOT_FOUND]")]
    resumed = session.generate("hi")  # sent, its answer not read
    with pytest.raises(PreposError, match="no journal") as refused:
        session.ask("again")
    assert refused.value.field == "resume"
    assert [(r.sequence_start, r.inputs["resume"].tolist()) for r in fake_triton[0].requests] == [(True, [True])] * 2
    with pytest.raises(PreposError, match="no journal"):
        list(resumed)
