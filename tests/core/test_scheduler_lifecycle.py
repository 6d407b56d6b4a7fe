"""The scheduler's lifecycle guarantees: cancellation, deadlines, context overflow, engine-time accounting."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fakes import IM_END, hashed_logits
from prepos.protocol import Status
from test_scheduler import Harness, open_session


def endless_logits(seq, vocab):
    logits = hashed_logits(seq, vocab)
    logits[IM_END] = -1e9  # never stops by itself
    return logits


def run_until(h, sink, steps=10_000):
    for _ in range(steps):
        if sink.done:
            return sink
        h.sched.run_once()
    raise AssertionError("request never finished")


def test_a_cancelled_request_stops_engine_work_and_leaves_the_log_unchanged(tmp_path):
    h = Harness(tmp_path, logits_fn=endless_logits)
    open_session(h)
    log_before = h.log("s1")
    sink = h.submit(h.request("s1", "tell me a long story", max_tokens=50))
    while not sink.chunks:
        h.sched.run_once()
    sink.client_gone = True  # the client closes its stream after the first token
    calls = len(h.engine.calls)
    run_until(h, sink)
    assert sink.error.status is Status.CANCELLED and "not accepted" in str(sink.error)
    assert len(h.engine.calls) == calls  # no decode after the client went away
    assert h.log("s1") == log_before
    assert h.metrics.sink.get("prepos_requests_abandoned_total", reason="cancelled") == 1
    # the session goes on as if the cancelled turn had never been sent: like a twin that never sent it
    open_session(h, sid="twin")
    want = h.serve(h.request("twin", "short one", max_tokens=3)).ids
    assert h.serve(h.request("s1", "short one", max_tokens=3)).ids == want


@pytest.mark.parametrize("text, threshold, path", [("", None, "exact"), ("a question", 0.0, "gated")])
def test_a_request_stopped_mid_answer_leaves_no_positioned_state_that_its_tokens_overwrote(tmp_path, text, threshold,
                                                                                          path):
    h = Harness(tmp_path, logits_fn=endless_logits)
    open_session(h)
    h.idle()  # positioned: the KV holds log + entry + cue
    log_before = h.log("s1")
    sink = h.submit(h.request("s1", text, max_tokens=5, gate_threshold=threshold))
    while len(sink.chunks) < 2:  # its first token, and a second decoded onto the KV
        h.sched.run_once()
    assert sink.path == path
    sink.client_gone = True
    run_until(h, sink)
    assert sink.error.status is Status.CANCELLED and h.log("s1") == log_before
    # the next question is answered as a stateless prefill of the unchanged log, not from a KV that holds the
    # stopped answer's tokens past the positioned state
    seq, want = h.prompt("s1", ""), []
    for _ in range(4):
        want.append(int(np.argmax(endless_logits(seq + want, h.engine.info.vocab_size))))
    assert h.serve(h.request("s1", "", max_tokens=4)).ids == want


@pytest.mark.parametrize("journaled", [False, True])
def test_an_answer_whose_deadline_passed_during_its_last_step_is_not_accepted(tmp_path, journaled):
    """A one-token answer whose prefill ran past the deadline: its token is out, but the client gave up at the
    deadline, so the turn is not accepted (a call that timed out never took effect)."""
    from prepos.journal import SessionJournal

    journal = SessionJournal(tmp_path / "journal", fsync=False) if journaled else None
    h = Harness(tmp_path, token_time_s=0.001, step_time_s=0.005, preposition=False, journal=journal)
    open_session(h, text="a long system turn " * 5)  # about 100 tokens to prefill with the question
    log_before = h.log("s1")
    request = dataclasses.replace(h.request("s1", "yes or no?", max_tokens=1), deadline_s=h.clock() + 0.05)
    sink = run_until(h, h.submit(request))
    assert h.engine.calls and h.engine.calls[-1][2] > 50  # one prefill, longer than the deadline allowed
    assert sink.error is not None and sink.error.status is Status.DEADLINE_EXCEEDED
    assert h.log("s1") == log_before
    if journaled:
        assert journal.recover("s1").token_log == log_before


def test_a_request_past_its_deadline_stops_with_a_deadline_error(tmp_path):
    h = Harness(tmp_path, token_time_s=0.001, step_time_s=0.005, logits_fn=endless_logits)
    open_session(h)
    log_before = h.log("s1")
    request = h.request("s1", "count to fifty", max_tokens=50)
    request = dataclasses.replace(request, deadline_s=h.clock() + 0.05)
    sink = run_until(h, h.submit(request))
    assert sink.error.status is Status.DEADLINE_EXCEEDED and sink.error.field == "timeout"
    assert 0 < len(sink.chunks) < 50  # it streamed until the deadline, then stopped
    assert h.log("s1") == log_before
    late = h.request("s1", "too late", max_tokens=5)
    late = dataclasses.replace(late, deadline_s=h.clock() - 1)
    calls = len(h.engine.calls)
    assert h.serve(late).error.status is Status.DEADLINE_EXCEEDED
    assert len(h.engine.calls) == calls  # expired before it started: no engine work


def test_an_end_whose_deadline_passed_says_that_it_closed_the_session_all_the_same(tmp_path):
    """Triton ends the sequence at END whatever the model answers: an END whose answer ran past its deadline
    closed the session while its error said only "its turn was not accepted"."""
    h = Harness(tmp_path, token_time_s=0.001, step_time_s=0.005, logits_fn=endless_logits)
    open_session(h)
    request = dataclasses.replace(h.request("s1", "count to fifty", max_tokens=50, end=True),
                                  deadline_s=h.clock() + 0.05)
    sink = run_until(h, h.submit(request))
    assert sink.error.status is Status.DEADLINE_EXCEEDED and sink.error.field == "timeout"
    assert sink.error.problem.endswith("its turn was not accepted; the request carried END, so the session is "
                                       "closed all the same")
    assert h.sched.store.get("s1") is None
    one_turn = dataclasses.replace(h.request("s2", "count to fifty", max_tokens=50, start=True, end=True),
                                   deadline_s=h.clock() + 0.05)
    sink = run_until(h, h.submit(one_turn))  # opened by the request itself: nothing to say of a session
    assert sink.error.status is Status.DEADLINE_EXCEEDED and "carried END" not in str(sink.error)


def test_a_request_waiting_behind_a_long_answer_is_answered_when_its_deadline_passes(tmp_path):
    """A request queued behind its session's long answer gets its deadline error once the deadline passes, while
    that answer still streams, not when its turn comes; the requests behind it keep their order."""
    h = Harness(tmp_path, token_time_s=0.001, step_time_s=0.005, logits_fn=endless_logits, preposition=False)
    open_session(h)
    long = h.submit(h.request("s1", "count to fifty", max_tokens=50))
    h.sched.run_once()
    short_request = dataclasses.replace(h.request("s1", "quick?", max_tokens=2), deadline_s=h.clock() + 0.05)
    short_request_id = short_request.request_id
    short = h.submit(short_request)
    later = h.submit(h.request("s1", "", max_tokens=0))  # an update without a deadline, behind both
    while not short.done:
        h.sched.run_once()
    assert short.error is not None and short.error.status is Status.DEADLINE_EXCEEDED and short.error.field == "timeout"
    assert not long.done and 0 < len(long.chunks) < 50  # answered while the long answer streams
    # ahead of the long answer's end: it names its request, which a gRPC stream's error does not carry
    assert str(short.error).endswith(f'(request "{short_request_id}")')
    assert h.metrics.sink.get("prepos_requests_abandoned_total", reason="deadline") == 1
    run_until(h, later)
    assert long.done and long.error is None and len(long.chunks) == 50 and later.error is None
    # the log holds the long answer's turn and the update, as a twin's that never sent the expired request
    open_session(h, sid="twin")
    h.serve(h.request("twin", "count to fifty", max_tokens=50))
    h.serve(h.request("twin", "", max_tokens=0))
    assert h.log("s1") == h.log("twin")


def test_a_queued_end_keeps_its_place_past_its_deadline(tmp_path):
    """An END waiting behind an answer is not taken out of the queue at its deadline: it closes the session in
    its turn (Triton ends the sequence whatever the answer), with the deadline error."""
    h = Harness(tmp_path, token_time_s=0.001, step_time_s=0.005, logits_fn=endless_logits, preposition=False)
    open_session(h)
    long = h.submit(h.request("s1", "count to fifty", max_tokens=50))
    h.sched.run_once()
    end = h.submit(dataclasses.replace(h.request("s1", "", max_tokens=0, end=True), deadline_s=h.clock() + 0.01))
    run_until(h, end)
    assert long.done and long.error is None and len(long.chunks) == 50  # the END waited for the answer
    assert end.error.status is Status.DEADLINE_EXCEEDED and h.sched.store.get("s1") is None


def test_context_overflow_reject_names_the_input_and_changes_nothing(tmp_path):
    h = Harness(tmp_path, max_log_tokens=80)
    open_session(h, text="sys")
    h.serve(h.request("s1", "first question", max_tokens=4))
    log_before = h.log("s1")
    sink = h.serve(h.request("s1", "x" * 60, max_tokens=4))
    assert sink.error.field == "text_input" and "'reject'" in str(sink.error)
    assert h.log("s1") == log_before


def test_context_overflow_drop_oldest_keeps_the_system_turn_and_answers_like_a_fresh_prompt(tmp_path):
    h = Harness(tmp_path, max_log_tokens=90, context_overflow="drop_oldest")
    open_session(h, text="sys")
    for text in ("first question", "second question", "third question"):
        assert h.serve(h.request("s1", text, max_tokens=4)).error is None
    session = h.sched.store.lookup("s1")
    system_turn, num_turns = session.turns()[0], len(session.turns())
    sink = h.submit(h.request("s1", "y" * 40, max_tokens=6))
    run_until(h, sink)
    assert sink.error is None and h.metrics.sink.get("prepos_turns_dropped_total") >= 1
    session = h.sched.store.lookup("s1")
    assert session.turns()[0] == system_turn and len(session.token_log) <= 90
    # greedy answer identical to a stateless prefill of the kept log + the new turn
    kept = session.token_log[: session.turn_starts[-1]]
    prompt = [*kept, *h.framing.entry_ids["user"], *h.tok.encode("y" * 40), *h.framing.cue_ids]
    want = [t for t in h.reference(prompt, 6) if t != IM_END]
    assert sink.ids == want[: len(sink.ids)] and sink.ids
    assert len(session.turns()) - 1 < num_turns  # older turns went, the new one came in


@pytest.mark.parametrize("limit", ["max_context", "max_log_tokens"])
def test_an_answer_that_reaches_the_context_limit_stops_with_length_and_the_log_stays_within_it(tmp_path, limit):
    size = 80
    kw = {"max_context": size} if limit == "max_context" else {"max_log_tokens": size}
    h = Harness(tmp_path, logits_fn=endless_logits, **kw)
    open_session(h, text="sys")
    before = len(h.log("s1"))
    turn = len(h.prompt("s1", "q" * 20)) - before
    room = size - before - turn - len(h.framing.answer_terminator_ids)
    assert 1 <= room < 40  # fits with one answer token, not with 40
    sink = h.serve(h.request("s1", "q" * 20, max_tokens=40))
    assert sink.error is None and sink.chunks[-1].finish_reason == "length" and len(sink.ids) == room
    assert len(h.log("s1")) == size  # the answer and its closing filled the log exactly
    h.idle()  # pre-positioning finds no room for another turn and leaves the session as it is
    assert len(h.log("s1")) == size
    after = h.serve(h.request("s1", "more", max_tokens=4))
    assert after.error.field == "text_input" and "'reject'" in str(after.error) and len(h.log("s1")) == size
    # An empty delta sends no text_input to name: its turn's framing alone has no room.
    empty = h.serve(h.request("s1", "", max_tokens=4))
    assert empty.error.field == "max_tokens" and "the session has no room for another turn" in str(empty.error)
    chosen = h.serve(h.request("s1", "", max_tokens=4, choices=("yes", "no")))
    assert chosen.error.field == "choices" and "the session has no room for another turn" in str(chosen.error)
    assert len(h.log("s1")) == size


def test_choices_that_do_not_fit_the_context_are_rejected_whole_not_cut(tmp_path):
    h = Harness(tmp_path, max_context=80)
    open_session(h, text="sys")
    before = h.log("s1")
    long_choices = ("a" * 40, "b" * 40)
    sink = h.serve(h.request("s1", "pick one", choices=long_choices))
    assert sink.error.field == "choices" and "the longest choice needs 43 tokens" in str(sink.error)
    assert h.log("s1") == before
    sole = h.serve(h.request("s1", "pick one", choices=("a" * 40,)))  # forced whole: counted as the choice's too
    assert sole.error.field == "choices" and "the longest choice needs 43 tokens" in str(sole.error)
    too_long = h.serve(h.request("s1", "q" * 80, choices=("a", "b")))  # the turn itself does not fit
    assert too_long.error.field == "text_input" and h.log("s1") == before
    fits = h.serve(h.request("s1", "pick one", choices=("a" * 8, "b" * 8)))
    assert fits.error is None and fits.text in ("a" * 8, "b" * 8) and len(h.log("s1")) <= 80


def test_under_drop_oldest_a_max_tokens_no_dropping_can_make_room_for_is_refused_naming_max_tokens(tmp_path):
    h = Harness(tmp_path, max_log_tokens=90, context_overflow="drop_oldest")
    open_session(h, text="sys")
    assert h.serve(h.request("s1", "first question", max_tokens=4)).error is None
    before, first = h.log("s1"), len(h.sched.store.lookup("s1").turns()[0])
    turn = len(h.prompt("s1", "next")) - len(before)
    largest = 90 - first - turn - len(h.framing.answer_terminator_ids)
    sink = h.serve(h.request("s1", "next", max_tokens=largest + 1))
    assert sink.error.field == "max_tokens" and f"at most {largest} " in str(sink.error)
    assert h.log("s1") == before  # nothing dropped, nothing added
    served = h.serve(h.request("s1", "next", max_tokens=largest))
    assert served.error is None and h.metrics.sink.get("prepos_turns_dropped_total") >= 1
    assert len(h.log("s1")) <= 90
    opening = h.serve(h.request("s2", "hi", start=True, max_tokens=89))  # a first turn: nothing to drop
    assert opening.error.field == "max_tokens" and "this turn takes" in str(opening.error)
    assert h.sched.store.get("s2") is None or h.log("s2") == []


def test_a_turn_longer_than_the_whole_limit_is_rejected_under_either_policy(tmp_path):
    for policy in ("reject", "drop_oldest"):
        h = Harness(tmp_path, max_log_tokens=50, context_overflow=policy)
        open_session(h, text="sys")
        before = h.log("s1")
        sink = h.serve(h.request("s1", "z" * 80, max_tokens=0))
        assert sink.error.field == "text_input" and h.log("s1") == before


def test_engine_time_is_split_between_foreground_and_background(tmp_path):
    h = Harness(tmp_path)
    open_session(h)
    h.serve(h.request("s1", "hello there", max_tokens=3))
    foreground = h.metrics.sink.get("prepos_engine_seconds_total", where="foreground")
    assert foreground > 0
    h.idle()  # pre-positioning
    background = h.metrics.sink.get("prepos_engine_seconds_total", where="background")
    assert background > 0
    assert h.metrics.sink.get("prepos_engine_seconds_total", where="foreground") == pytest.approx(foreground)


def test_five_hundred_sessions_under_a_small_budget_all_answer_like_a_stateless_prefill(tmp_path):
    # room for about ten sessions' KV at 100 bytes per token
    h = Harness(tmp_path, kv_budget=10 * 100 * 60, max_sessions=500)
    ledger = h.sched._residency.kv
    num_sessions = 500
    for i in range(num_sessions):
        open_session(h, sid=f"s{i}", text=f"sys {i % 7}")
    peak = 0
    for round_ in range(2):
        for i in range(num_sessions):
            sid = f"s{i}"
            text = f"q{round_} {i}"
            want = [t for t in h.reference(h.prompt(sid, text), 4) if t != IM_END]
            sink = h.serve(h.request(sid, text, max_tokens=4))
            assert sink.error is None and sink.ids == want, sid
            assert sink.path in ("prefix", "rebuild", "prepaid")
            peak = max(peak, ledger.used_bytes)
            assert ledger.used_bytes <= ledger.budget_bytes
            if i % 10 == 0:
                h.idle()  # pre-positioning competes for the budget too
                assert ledger.used_bytes <= ledger.budget_bytes
                want = [t for t in h.reference(h.prompt(sid, "and?"), 4) if t != IM_END]
                follow_up = h.serve(h.request(sid, "and?", max_tokens=4))
                assert follow_up.path == "prepaid" and follow_up.ids == want
    assert h.metrics.sink.get("prepos_kv_evictions_total", what="kv") >= num_sessions
    assert h.metrics.sink.get("prepos_requests_total", path="rebuild") >= num_sessions  # second round: all rebuilt
    assert 0 < peak <= ledger.budget_bytes
    assert h.metrics.sink.get("prepos_requests_total", path="prepaid") > 0  # pre-positioned sessions were served


def test_the_budget_passed_while_every_session_was_served_is_kept_again_once_one_is_idle(tmp_path):
    # room for 250 tokens of KV; two sessions of about 150 each, their questions served together
    h = Harness(tmp_path, kv_budget=100 * 250, preposition=False)
    ledger = h.sched._residency.kv
    open_session(h, sid="a", text="a" * 120)
    open_session(h, sid="b", text="b" * 120)  # appended only: without pre-positioning, prefilled by the question
    first, second = h.submit(h.request("a", "one?", max_tokens=3)), h.submit(h.request("b", "two?", max_tokens=3))
    over = False
    for _ in range(1000):
        if first.done and second.done:
            break
        h.sched.run_once()
        serving = [s for s in h.sched.store if s.serving]
        if ledger.used_bytes > ledger.budget_bytes:
            over = True  # only while both are served: neither may be evicted then
            assert all(s.serving or not s.has_kv for s in h.sched.store), [s.session_id for s in serving]
    assert first.error is None and second.error is None and over
    # both answered: one gave its KV back, without waiting for another request to make it
    assert ledger.used_bytes <= ledger.budget_bytes
    assert len([s for s in h.sched.store if s.has_kv]) == 1
    assert h.metrics.sink.get("prepos_kv_evictions_total", what="kv") == 1


def test_idle_sessions_time_out_even_while_the_loop_is_always_busy(tmp_path):
    h = Harness(tmp_path, idle_timeout_s=5.0)
    open_session(h, sid="abandoned")
    open_session(h, sid="busy")
    h.clock.t += 6.0  # "abandoned" has been idle past the timeout
    h.serve(h.request("busy", "still here", max_tokens=3))  # every step does foreground work
    assert h.sched.store.get("abandoned") is None and h.sched.store.get("busy") is not None


def test_a_client_stream_that_fails_does_not_stall_the_session_behind_it(tmp_path):
    from fakes import CollectSink

    class BrokenSink(CollectSink):
        def send(self, chunk, final):
            raise ConnectionError("stream gone")

        def send_error(self, error):
            raise ConnectionError("stream gone")

    h = Harness(tmp_path)
    open_session(h)
    broken = BrokenSink()
    h.sched.submit(h.request("s1", "first", max_tokens=3), broken)
    after = h.submit(h.request("s1", "second", max_tokens=3))
    run_until(h, after)
    assert after.error is None and after.chunks[-1].finish_reason in ("stop", "length")
    later = h.serve(h.request("s1", "third", max_tokens=3))
    assert later.error is None and later.ids


def test_a_start_and_end_refused_as_already_open_says_the_sequence_ended_and_keeps_the_session(tmp_path):
    """Triton ends the sequence at a refused START+END's END: its owner's next request was refused as not started,
    while the refusal said only "already open"; it now says what the next request must carry."""
    h = Harness(tmp_path)
    open_session(h)
    log_before = h.log("s1")
    refused = h.serve(h.request("s1", "hi", start=True, end=True, max_tokens=0)).error
    assert refused.field == "START" and refused.status is Status.ALREADY_EXISTS
    assert refused.problem == ("session 's1' is already open; the request carried END, so Triton ended the session's "
                               "sequence all the same: its next request must carry START and resume (the session is "
                               "kept as it was)")
    assert h.log("s1") == log_before
    again = h.serve(h.request("s1", "hi", start=True, max_tokens=0)).error  # START alone: no END, nothing ended
    assert again.status is Status.ALREADY_EXISTS and "carried END" not in again.problem
    resumed = h.serve(h.request("s1", "Go on.", start=True, resume=True, max_tokens=0))
    assert resumed.error is None and h.log("s1")[:len(log_before)] == log_before
