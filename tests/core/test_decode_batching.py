"""Requests of different sessions that are decoding at the same time take their decode steps as one batch."""

from __future__ import annotations

from prepos.engines.base import KVCapacityError
from prepos.protocol import Status
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


def test_a_decode_that_fails_fails_only_its_own_request(tmp_path):
    h = Harness(tmp_path, logits_fn=endless_logits)
    for sid in SESSIONS:
        open_session(h, sid)
    open_session(h, "twin")
    log_b = h.log("b")
    decode = h.engine.decode

    def failing_for_b(session_id, token_id):
        if session_id == "b":
            raise KVCapacityError("no room for b's next token")
        return decode(session_id, token_id)

    h.engine.decode = failing_for_b
    sinks = {sid: h.submit(h.request(sid, "same question", max_tokens=4)) for sid in SESSIONS}
    run_all(h, sinks.values())
    assert sinks["b"].error is not None and sinks["b"].error.status is Status.RESOURCE_EXHAUSTED
    assert "no room for b's next token" in str(sinks["b"].error)
    assert h.log("b") == log_b  # its turn was not accepted
    h.engine.decode = decode
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
    assert h.sched._decoding  # all three wait for their second token
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
