"""TraceReplayer: which requests a simulated user sends, what it measures, and how long it waits."""

from __future__ import annotations

import random

import pytest

from prepos_client import Answer, PreposError, PreposTimeout, PreposUnavailable, Update
from prepos_loadtest.replay import (
    END_SETTLE_S,
    SERVER_TTFT,
    TOTAL,
    TPOT,
    TTFT,
    UNAVAILABLE_BACKOFF_S,
    ReplayOptions,
    TraceReplayer,
    failure_kind,
    trace_pool,
)
from prepos_loadtest.workloads import SessionTrace, Step


class FakeSession:
    """Records requests; answers from a script of paths, or raises the scripted error."""

    def __init__(self, session_id: str, log: list, failures: dict):
        self.session_id = session_id
        self.closed = False
        self._log = log
        self._failures = failures  # delta -> error to raise

    def _maybe_fail(self, delta):
        if delta in self._failures:
            raise self._failures[delta]

    def append(self, text=None, *, role=None, **_):
        self._log.append((self.session_id, "append", text, role))
        self._maybe_fail(text)
        return Update("append", "appended", 0.1, 0.2, total_ms=3.0)

    def ask(self, text=None, *, role=None, max_tokens=None, choices=None, **_):
        self._log.append((self.session_id, "ask", text, role, max_tokens, choices))
        self._maybe_fail(text)
        return Answer(text="yes", token_ids=(1, 2)[:max_tokens], path="exact", confidence=0.9, finish_reason="stop",
                      queue_ms=0.1, compute_ms=0.5, first_token_ms=0.7, ttft_ms=1.5, total_ms=4.0, num_chunks=1)

    def settle(self, *, timeout_s=None):
        self._log.append((self.session_id, "settle", timeout_s))

    def close(self, *, timeout_s=None):
        self._log.append((self.session_id, "close"))
        self.closed = True
        return Update("close", "closed", 0.1, 0.1, total_ms=2.0)


class FakeClient:
    def __init__(self, failures=None):
        self.log: list = []
        self.sessions: list[FakeSession] = []
        self.failures = failures or {}

    def session(self):
        session = FakeSession(f"s{len(self.sessions)}", self.log, self.failures)
        self.sessions.append(session)
        return session


TRACES = [
    SessionTrace("a", (Step(0.0, "system", "sys", 0), Step(2.0, "user", "q1", 2, ("yes", "no")))),
    SessionTrace("empty", ()),
    SessionTrace("b", (Step(1.0, "user", "q2", 1),)),
]


def replayer(client, **options):
    return TraceReplayer(client.session, trace_pool(TRACES), ReplayOptions(**options), random.Random(0))


def test_sessions_open_at_the_first_step_and_close_after_the_last():
    client = FakeClient()
    user = replayer(client)
    for _ in range(4):
        user.run_step()
    assert [entry for entry in client.log if entry[1] != "settle"] == [
        ("s0", "append", "sys", "system"),
        ("s0", "ask", "q1", "user", 2, ["yes", "no"]),
        ("s0", "close"),
        ("s1", "ask", "q2", "user", 1, None),
        ("s1", "close"),
        ("s2", "append", "sys", "system"),  # the pool cycles, skipping traces with no step
    ]


def test_measurements_are_named_by_served_path():
    client = FakeClient()
    user = replayer(client)
    update = user.run_step()
    assert [(m.kind, m.name, m.elapsed_ms, m.num_tokens, m.error) for m in update] == [(TOTAL, "append", 3.0, 0, None)]
    answer_and_close = user.run_step()
    assert [(m.kind, m.name, m.elapsed_ms, m.num_tokens) for m in answer_and_close] == [
        (TTFT, "exact", 1.5, 2), (TOTAL, "exact", 4.0, 2), (SERVER_TTFT, "exact", 0.7, 2),
        (TOTAL, "close", 2.0, 0)]  # no TPOT for a choice: its tokens after the first are forced, not decoded
    assert {(m.session_id, m.trace) for m in update + answer_and_close} == {("s0", "a")}
    one_token = user.run_step()  # no time per output token for an answer of one
    assert [(m.kind, m.num_tokens) for m in one_token] == [(TTFT, 1), (TOTAL, 1), (SERVER_TTFT, 1), (TOTAL, 0)]


def test_an_answer_decoded_token_by_token_has_a_time_per_output_token():
    client = FakeClient()
    user = TraceReplayer(client.session, trace_pool([SessionTrace("c", (Step(0.0, "user", "q3", 2),))]),
                         ReplayOptions(), random.Random(0))
    measured = user.run_step()
    assert (TPOT, "exact", 2.5, 2) in [(m.kind, m.name, m.elapsed_ms, m.num_tokens) for m in measured]  # (4.0 - 1.5)


def test_a_rejected_request_is_one_failed_total_and_the_trace_goes_on():
    error = PreposError("max_tokens: must be in [0, 4096], got -1", field="max_tokens")
    client = FakeClient({"q1": error})
    user = replayer(client)
    user.run_step()
    failed = user.run_step()
    assert [(m.kind, m.name, m.error) for m in failed] == [(TOTAL, "generate", error), (TOTAL, "close", None)]
    assert failed[0].elapsed_ms >= 0
    assert client.sessions[0].closed


def test_an_unreachable_server_abandons_the_session_and_backs_off():
    client = FakeClient({"sys": PreposUnavailable("connection refused")})
    user = replayer(client, think_jitter=0.0)
    failed = user.run_step()
    assert [(m.kind, m.name) for m in failed] == [(TOTAL, "append")]
    assert client.sessions[0].closed
    assert user.trace.name == "b"
    assert user.next_delay_s() == UNAVAILABLE_BACKOFF_S  # b's own delay (1.0 s) is not longer
    assert user.next_delay_s() == 1.0


def test_think_time_is_scaled_and_jittered():
    user = replayer(FakeClient(), think_scale=0.5, think_jitter=0.2)
    user.run_step()  # next: q1 after 2.0 s
    delays = [user.next_delay_s() for _ in range(200)]
    assert all(0.8 <= delay <= 1.2 for delay in delays)
    assert max(delays) - min(delays) > 0.2
    exact = replayer(FakeClient(), think_scale=0.5, think_jitter=0.0)
    exact.run_step()
    assert exact.next_delay_s() == 1.0


def test_close_ends_the_open_session_once():
    client = FakeClient()
    user = replayer(client)
    assert user.close() == []  # nothing open yet
    assert user.trace.name == "a"
    user.run_step()  # trace a opens s0
    assert [(m.kind, m.name) for m in user.close()] == [(TOTAL, "close")]
    assert user.close() == []
    assert user.trace.name == "b"  # the next session starts a new trace
    assert [entry[:2] for entry in client.log] == [("s0", "append"), ("s0", "settle"), ("s0", "close")]


def test_the_end_first_waits_a_while_for_the_outcome_of_requests_that_timed_out():
    """With a short request time limit, an END behind a request that timed out waited for its outcome within that
    limit only, sent nothing when it did not come, and left the session open on the server until its idle timeout."""
    for request_timeout_s, waited_s in ((0.3, END_SETTLE_S), (60.0, 60.0)):
        client = FakeClient()
        user = replayer(client, request_timeout_s=request_timeout_s)
        user.run_step()
        user.close()
        assert client.log[-2:] == [("s0", "settle", waited_s), ("s0", "close")]


def test_failures_are_grouped_without_their_session_and_request_numbers():
    one = PreposTimeout("session 3f2a: request 7 timed out and the server has not reported its outcome within 0.3 s; "
                        "nothing was sent", accepted=False)
    other = PreposTimeout("session 9b1c: request 12 timed out and the server has not reported its outcome within "
                          "0.3 s; nothing was sent", accepted=False)
    queued = PreposError('timeout: the request\'s deadline passed (request "4") [DEADLINE_EXCEEDED]', field="timeout")
    assert repr(failure_kind(one, "3f2a")) == repr(failure_kind(other, "9b1c")) == (
        "PreposTimeout('session <session>: request <n> timed out and the server has not reported its outcome within "
        "0.3 s; nothing was sent')")
    assert str(failure_kind(queued, "s")) == "timeout: the request's deadline passed (request <n>) [DEADLINE_EXCEEDED]"
    grouped = failure_kind(one, "3f2a")
    assert isinstance(grouped, PreposTimeout) and grouped.accepted is False
    assert str(one).startswith("session 3f2a: request 7")  # the error itself, for the log, is left as it was
    not_open = PreposError("inference request for sequence 3f2a to model 'prepos' must specify the START flag on "
                           "the first request of the sequence [NOT_FOUND]")
    assert str(failure_kind(not_open, "3f2a")).startswith("inference request for sequence <session> to model")
    plain = ValueError("x")
    assert failure_kind(plain, "s") is plain


def test_a_stopping_users_end_does_not_wait_for_a_server_that_is_down():
    client = FakeClient()
    user = replayer(client)
    user.run_step()  # trace a opens s0
    client.sessions[0].wait_for_ready = True
    user.close(last=True)
    assert client.sessions[0].wait_for_ready is False and client.sessions[0].closed
    user.run_step()  # trace b: s1, opened and ended by its one step
    user.run_step()  # trace a again: s2
    client.sessions[2].wait_for_ready = True
    user.close()  # between traces: the END waits like every request
    assert client.sessions[2].wait_for_ready is True and client.sessions[2].closed


def test_pool_needs_a_trace_with_steps():
    with pytest.raises(ValueError, match="no session trace has a step"):
        next(trace_pool([SessionTrace("empty", ())]))


@pytest.mark.parametrize(("options", "field"), [({"think_scale": -1.0}, "think_scale"),
                                                ({"think_jitter": 1.5}, "think_jitter"),
                                                ({"request_timeout_s": 0.0}, "request_timeout_s")])
def test_replay_options_name_the_bad_field(options, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        ReplayOptions(**options)
