"""Requests of different sessions that prefill, or decode, at the same time take those engine steps as one batch."""

from __future__ import annotations

import dataclasses

import pytest

from prepos.engines.base import KVCapacityError
from prepos.protocol import Status
from prepos.step_batches import batches
from prepos.serving import PrefillStep
from test_scheduler import Harness, open_session
from test_scheduler_lifecycle import endless_logits  # answers run to max_tokens

SESSIONS = ("a", "b", "c")


def run_all(h, sinks, steps=10_000):
    for _ in range(steps):
        if all(s.done for s in sinks):
            return
        h.sched.run_once()
    raise AssertionError("requests never finished")


def test_concurrent_answers_decode_together_and_match_answers_served_alone(tmp_path):
    h = Harness(tmp_path, logits_fn=endless_logits)
    for sid in SESSIONS:
        open_session(h, sid)
        open_session(h, f"alone-{sid}")
    questions = {"a": "first question", "b": "second one", "c": "third"}
    sinks = {sid: h.submit(h.request(sid, q, max_tokens=6)) for sid, q in questions.items()}
    run_all(h, sinks.values())
    assert h.engine.batches.count(SESSIONS) == 5  # 6 tokens: the first from each prefill, 5 decode steps
    assert not [c for c in h.engine.calls if c[0] == "decode" and c[1] not in SESSIONS]
    decode_batches = h.metrics.sink.observations["prepos_decode_batch_sessions", ()]
    assert decode_batches == [3] * 5
    h.engine.batches.clear()
    for sid, q in questions.items():  # the same conversation, one session at a time
        alone = h.serve(h.request(f"alone-{sid}", q, max_tokens=6))
        assert alone.ids == sinks[sid].ids and len(alone.ids) == 6
        assert h.log(f"alone-{sid}")[-8:] == h.log(sid)[-8:]
    assert set(h.engine.batches) == {(f"alone-{sid}",) for sid in SESSIONS}


@pytest.mark.parametrize("call", ["prefill", "decode"])
def test_a_step_that_fails_fails_only_its_own_request(tmp_path, call):
    h = Harness(tmp_path, logits_fn=endless_logits)
    for sid in (*SESSIONS, "twin"):
        open_session(h, sid)
    log_b = h.log("b")
    original = getattr(h.engine, call)

    def failing_for_b(session_id, tokens):
        if session_id == "b":
            raise KVCapacityError(f"no room for b's {call}")
        return original(session_id, tokens)

    setattr(h.engine, call, failing_for_b)
    sinks = {sid: h.submit(h.request(sid, "same question", max_tokens=4)) for sid in SESSIONS}
    run_all(h, sinks.values())
    assert SESSIONS in (h.engine.prefill_batches if call == "prefill" else h.engine.batches)
    assert sinks["b"].error is not None and sinks["b"].error.status is Status.RESOURCE_EXHAUSTED
    assert f"no room for b's {call}" in str(sinks["b"].error)
    assert h.log("b") == log_b  # its turn was not accepted
    setattr(h.engine, call, original)
    want = h.serve(h.request("twin", "same question", max_tokens=4)).ids
    assert sinks["a"].error is None and sinks["a"].ids == want
    assert sinks["c"].error is None and sinks["c"].ids == want
    assert h.serve(h.request("b", "same question", max_tokens=4)).ids == want  # b goes on as if never asked


def test_a_request_arriving_meanwhile_gets_its_first_token_before_the_others_finish(tmp_path):
    """Requests waiting to decode let every other ready session take a step first: a new request's prefill
    and first token come between two decode batches, not after the long answers end."""
    h = Harness(tmp_path, logits_fn=endless_logits)
    for sid in (*SESSIONS, "late"):
        open_session(h, sid)
    sinks = [h.submit(h.request(sid, "tell me a long story", max_tokens=30)) for sid in SESSIONS]
    while len(sinks[0].chunks) < 3:
        h.sched.run_once()
    late = h.submit(h.request("late", "quick one", max_tokens=30))
    while not late.chunks:
        h.sched.run_once()
    assert all(len(s.chunks) <= 5 for s in sinks)  # the long answers moved on at most one more token or two
    run_all(h, [*sinks, late])
    assert ("a", "b", "c", "late") in h.engine.batches or ("late", "a", "b", "c") in h.engine.batches


def test_a_request_cancelled_while_it_waits_is_left_out_of_the_batch(tmp_path):
    h = Harness(tmp_path, logits_fn=endless_logits)
    for sid in SESSIONS:
        open_session(h, sid)
    sinks = {sid: h.submit(h.request(sid, "count to ten", max_tokens=10)) for sid in SESSIONS}
    while not all(s.chunks for s in sinks.values()):
        h.sched.run_once()
    assert h.sched._steps.waiting  # all three wait for their second token
    sinks["b"].client_gone = True
    before = len(h.engine.batches)
    run_all(h, sinks.values())
    assert sinks["b"].error.status is Status.CANCELLED
    assert h.engine.batches[before:] == [("a", "c")] * 9
    assert sinks["a"].error is None and len(sinks["a"].ids) == 10


def test_max_decode_batch_splits_the_waiting_decodes(tmp_path):
    h = Harness(tmp_path, logits_fn=endless_logits, max_decode_batch=2)
    for sid in SESSIONS:
        open_session(h, sid)
    sinks = [h.submit(h.request(sid, "count", max_tokens=4)) for sid in SESSIONS]
    run_all(h, sinks)
    assert h.engine.batches == [("a", "b"), ("c",)] * 3
    assert all(s.error is None and len(s.ids) == 4 for s in sinks)


def test_concurrent_prefills_run_as_one_batch_and_answer_as_served_alone(tmp_path):
    """Requests arriving together prefill their turns in one engine call, then decode together; each answer and
    log is what the same request gets alone."""
    h = Harness(tmp_path, logits_fn=endless_logits)
    for sid in SESSIONS:
        open_session(h, sid)
        open_session(h, f"alone-{sid}")
    h.engine.prefill_batches.clear()
    questions = {"a": "first question", "b": "second one", "c": "third"}
    sinks = {sid: h.submit(h.request(sid, q, max_tokens=3)) for sid, q in questions.items()}
    run_all(h, sinks.values())
    assert h.engine.prefill_batches == [SESSIONS]
    assert h.metrics.sink.observations["prepos_prefill_batch_sessions", ()][-1] == 3
    assert all(s.path == "prefix" for s in sinks.values())
    for sid, q in questions.items():
        alone = h.serve(h.request(f"alone-{sid}", q, max_tokens=3))
        assert alone.ids == sinks[sid].ids and len(alone.ids) == 3
        assert h.log(f"alone-{sid}")[-8:] == h.log(sid)[-8:]


def test_a_whole_batch_failing_fails_each_request_with_an_internal_error_and_the_loop_goes_on(tmp_path):
    h = Harness(tmp_path, logits_fn=endless_logits)
    for sid in SESSIONS:
        open_session(h, sid)
    logs = {sid: h.log(sid) for sid in SESSIONS}
    batch = h.engine.prefill_batch

    def broken(session_ids, token_ids):
        raise RuntimeError("device lost")

    h.engine.prefill_batch = broken
    sinks = {sid: h.submit(h.request(sid, "hello", max_tokens=2)) for sid in SESSIONS}
    run_all(h, sinks.values())
    assert all(s.error is not None and s.error.status is Status.INTERNAL for s in sinks.values())
    assert {sid: h.log(sid) for sid in SESSIONS} == logs
    h.engine.prefill_batch = batch
    assert h.serve(h.request("a", "hello", max_tokens=2)).error is None


def test_a_request_cancelled_while_it_waits_to_prefill_is_left_out_and_told_so(tmp_path):
    h = Harness(tmp_path, logits_fn=endless_logits)
    for sid in SESSIONS:
        open_session(h, sid)
    h.engine.prefill_batches.clear()
    sinks = {sid: h.submit(h.request(sid, "a question", max_tokens=3)) for sid in SESSIONS}
    while len(h.sched._steps.waiting) < 3:
        h.sched.run_once()
    sinks["b"].client_gone = True
    run_all(h, sinks.values())
    assert h.engine.prefill_batches == [("a", "c")]
    assert sinks["b"].error.status is Status.CANCELLED and not sinks["b"].chunks
    assert sinks["a"].error is None and len(sinks["a"].ids) == 3


def test_prefill_batches_are_cut_by_sessions_and_by_new_tokens(tmp_path):
    h = Harness(tmp_path, logits_fn=endless_logits, max_prefill_batch=2)
    for sid in SESSIONS:
        open_session(h, sid)
    h.engine.prefill_batches.clear()
    sinks = [h.submit(h.request(sid, "count", max_tokens=2)) for sid in SESSIONS]
    run_all(h, sinks)
    assert h.engine.prefill_batches == [("a", "b"), ("c",)]
    h = Harness(tmp_path, logits_fn=endless_logits, max_prefill_batch_tokens=40)
    for sid in SESSIONS:
        open_session(h, sid)
    h.engine.prefill_batches.clear()
    texts = {"a": "x" * 10, "b": "y" * 50, "c": "z" * 10}  # b's turn alone is past 40 new tokens
    sinks = [h.submit(h.request(sid, text, max_tokens=2)) for sid, text in texts.items()]
    run_all(h, sinks)
    # Each prefill (with the opening turn, 61 tokens for a and c, 101 for b) goes in as few pieces of at most 40
    # new tokens as it takes, of even sizes, one step each, the sessions taking turns: a, b, c, then a's and c's
    # last pieces and b's second and third.
    assert h.engine.prefill_batches == [("a",), ("b",), ("c",), ("a",), ("b",), ("c",), ("b",)]
    assert [n for call, _, n in h.engine.calls if call == "prefill"] == [30, 33, 30, 31, 34, 31, 34]
    assert all(s.error is None for s in sinks)


def test_batches_keep_order_and_limits():
    steps = [PrefillStep(session_id=str(i), token_ids=[], new_tokens=n) for i, n in enumerate([5, 5, 20, 1, 1, 1])]
    cut = [[int(st.session_id) for st in b] for b in batches(steps, 3, 12)]
    assert cut == [[0, 1], [2], [3, 4, 5]]
    assert [[int(st.session_id) for st in b] for b in batches(steps, 4)] == [[0, 1, 2, 3], [4, 5]]
    assert list(batches([], 4, 10)) == []


def test_each_prefill_batch_sends_its_first_tokens_before_the_next_batch_runs(tmp_path):
    """With prefills taken one at a time, a request's first token goes out right after its own prefill, not
    after every waiting prefill (as before prefill batching); the decodes wait for the prefills."""
    h = Harness(tmp_path, logits_fn=endless_logits, max_prefill_batch=1)
    for sid in SESSIONS:
        open_session(h, sid)
    sinks = {sid: h.submit(h.request(sid, "hello there", max_tokens=3)) for sid in SESSIONS}
    seen = []  # (what the engine runs, first tokens already out)
    h.engine.on_compute = lambda: seen.append((h.engine.calls[-1][:2] if h.engine.calls else None,
                                               [len(s.chunks) for s in sinks.values()]))
    run_all(h, sinks.values())
    prefills = [out for (call, out) in seen if call and call[0] == "prefill"]
    assert prefills == [[0, 0, 0], [1, 0, 0], [1, 1, 0]]
    assert h.engine.prefill_batches[-3:] == [("a",), ("b",), ("c",)]
    assert h.engine.batches == [SESSIONS] * 2  # then the three decode together


def test_a_long_prefill_does_not_hold_up_the_short_ones_that_came_before_it(tmp_path):
    h = Harness(tmp_path, logits_fn=endless_logits)  # the default limits
    for sid in SESSIONS:
        open_session(h, sid)
    h.engine.prefill_batches.clear()
    texts = {"a": "short one", "b": "another", "c": "w" * 600}  # c: past max_prefill_batch_tokens on its own
    sinks = {sid: h.submit(h.request(sid, text, max_tokens=2)) for sid, text in texts.items()}
    first_tokens_out = []
    h.engine.on_compute = lambda: first_tokens_out.append(sum(bool(s.chunks) for s in sinks.values()))
    run_all(h, sinks.values())
    # c's in two pieces of at most 512 new tokens, the first in one step with a's and b's turns (512 at most)
    assert h.engine.prefill_batches == [("a", "b", "c"), ("c",)]
    assert first_tokens_out[3] == 2  # computes: a's, b's, c's first piece, then c's second, a and b answered
    assert all(s.error is None for s in sinks.values())


@pytest.mark.parametrize("held, total, max_new, ends", [
    (0, 10, 4, [3, 6, 10]),  # three pieces of at most 4: 3, 3, 4 (not 4, 4, 2)
    (0, 8, 4, [4, 8]),
    (0, 513, 512, [256, 513]),  # not 512 and a step for one token
    (3, 10, 4, [6, 10]),
    (0, 4, 4, [4]),
    (9, 10, 4, [10]),
    (10, 10, 4, [10]),  # all held: one piece, its last token computed again for its logits
    (0, 1, 512, [1]),
])
def test_prefill_pieces_are_as_few_as_fit_of_even_sizes_and_end_at_the_whole(held, total, max_new, ends):
    from prepos.serving import prefill_piece_ends

    assert prefill_piece_ends(held, total, max_new) == ends


def test_a_long_prefill_goes_in_pieces_with_other_sessions_steps_between_and_stops_at_its_deadline(tmp_path):
    """A prefill past ``max_prefill_batch_tokens`` new tokens ran as one engine step: every other session's answer
    stopped streaming until it ended (a long prompt: seconds on a CPU), and its own deadline or cancellation was
    seen only after it. It goes in pieces now, one step each."""
    h = Harness(tmp_path, logits_fn=endless_logits, max_prefill_batch_tokens=16, preposition=False)
    for sid in ("talker", "reader"):
        open_session(h, sid)
    talker = h.submit(h.request("talker", "go", max_tokens=40))
    while not talker.chunks:  # the talker's answer streams ...
        h.sched.run_once()
    h.engine.calls.clear()
    reader = h.submit(h.request("reader", "w" * 100, max_tokens=2))  # ... when a long turn comes in
    run_all(h, [talker, reader])
    calls = [(call, sid) for call, sid, _ in h.engine.calls]
    pieces = [i for i, (call, sid) in enumerate(calls) if sid == "reader" and call == "prefill"]
    assert len(pieces) >= 7 and all(n <= 16 for call, sid, n in h.engine.calls if call == "prefill")
    # the talker decodes between every two pieces of the reader's prefill
    assert all(("decode", "talker") in calls[i:j] for i, j in zip(pieces, pieces[1:]))
    assert talker.error is None and reader.error is None and len(reader.ids) == 2
    (tmp_path / "whole").mkdir()
    want = Harness(tmp_path / "whole", logits_fn=endless_logits, preposition=False)
    for sid in ("talker", "reader"):
        open_session(want, sid)
    assert want.serve(want.request("reader", "w" * 100, max_tokens=2)).ids == reader.ids  # as one prefill gives

    # A deadline that passes during the pieces stops the prefill there, and the turn is not accepted.
    log_before = h.log("reader")
    request = dataclasses.replace(h.request("reader", "v" * 100, max_tokens=2), deadline_s=h.clock() + 0.05)
    h.engine.calls.clear()
    late = h.submit(request)
    run_all(h, [late])
    assert late.error is not None and late.error.status is Status.DEADLINE_EXCEEDED and not late.chunks
    assert 0 < len(h.engine.calls) < 7  # stopped after the pieces its time allowed (0.021 s each)
    assert h.log("reader") == log_before

    # So does a client that goes away during the pieces.
    h.engine.calls.clear()
    gone = h.submit(h.request("reader", "u" * 100, max_tokens=2))
    while not h.engine.calls:  # its first piece
        h.sched.run_once()
    gone.client_gone = True
    run_all(h, [gone])
    assert gone.error is not None and gone.error.status is Status.CANCELLED and not gone.chunks
    assert 0 < len(h.engine.calls) < 7 and h.log("reader") == log_before
