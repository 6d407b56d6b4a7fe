"""The drain before a stop: STARTs refused, every session ended by the drain's own END with its journal kept
(the scheduler), and the drain file watched, taken up and reported on (the Drainer), without Triton."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from prepos.drain import DrainReport, Drainer, drain_end, drained_path, request_drain
from prepos.journal import SessionJournal
from prepos.protocol import ProtocolError, ResponseChunk, Status, end_reason
from test_scheduler import Harness, open_session


def journaled(tmp_path, journal_dir):
    return Harness(tmp_path, journal=SessionJournal(journal_dir, fsync=False))


def drain_ids(h) -> list:
    found = []
    while True:
        try:
            found.append(h.sched.drain_ids.get_nowait())
        except queue.Empty:
            return found


def test_a_drain_refuses_starts_lists_the_open_sessions_and_its_end_keeps_their_journals(tmp_path):
    journal_dir = tmp_path / "journal"
    h = journaled(tmp_path, journal_dir)
    journal = h.sched._residency._journal
    for sid in ("s1", "s2"):
        open_session(h, sid=sid)
        h.serve(h.request(sid, f"question of {sid}", max_tokens=3))
    logs = {sid: h.log(sid) for sid in ("s1", "s2")}

    h.sched.drain()
    h.sched.run_once()
    assert h.sched.drain_listed and sorted(drain_ids(h)) == ["s1", "s2"]
    for resume in (False, True):  # a new session, and a resume, are refused (and hold nothing to end)
        refused = h.serve(h.request(f"new-{resume}", "hello", start=True, resume=resume))
        assert refused.error.status is Status.UNAVAILABLE and "draining" in str(refused.error)
        assert h.sched.store.get(f"new-{resume}") is None
    both = h.serve(h.request("new-both", None, start=True, end=True, max_tokens=0))
    assert both.error.status is Status.UNAVAILABLE and drain_ids(h) == []

    # A request of an open session sent before the drain's END is served as before, then the END closes it.
    before = h.submit(h.request("s1", "one more", max_tokens=0))
    end = drain_end("s1")
    assert end_reason(end) == "drain" and end.end and not end.start
    closed = h.submit(end)
    behind = h.submit(h.request("s1", "sent after the drain's END", max_tokens=3))
    while not behind.done:
        h.sched.run_once()
    assert before.chunks[-1].finish_reason == "appended" and closed.chunks[-1].finish_reason == "closed"
    # One that came behind the END is refused as for a session not open, which the client resumes elsewhere.
    assert behind.error.field == "START" and behind.error.status is Status.NOT_FOUND
    assert "is not open" in str(behind.error)
    assert h.sched.store.get("s1") is None and h.sched.open_sessions == 1
    # A request its client sends later is refused as for a session not open (the client then resumes it, with
    # START and `resume`, which is refused as draining: elsewhere, or after the restart).
    later = h.serve(h.request("s1", "and now?", max_tokens=3))
    assert later.error.field == "START" and later.error.status is Status.NOT_FOUND and "not open" in str(later.error)
    assert h.metrics.sink.get("prepos_sessions_drained_total") == 1
    assert sorted(journal.session_ids()) == ["s1", "s2"]  # kept: s1 resumes after the restart
    assert journal.recover("s1").token_log[: len(logs["s1"])] == logs["s1"]

    h.serve(h.request("s2", None, end=True, max_tokens=0))  # a client's own END still deletes the journal
    assert journal.session_ids() == ["s1"] and h.sched.open_sessions == 0

    h2 = journaled(tmp_path, journal_dir)  # the restarted server
    resumed = h2.serve(h2.request("s1", "and now?", max_tokens=3, start=True, resume=True))
    assert resumed.error is None and resumed.path == "rebuild"


class FakeScheduler:
    """What a Drainer drives: answers each drain END as the engine loop would, at once unless its session is in
    ``held`` (an END waiting behind a long answer: ``answer`` sends it later) or ``refused``."""

    def __init__(self, open_ids, *, held=(), refused=()):
        self.open = set(open_ids)
        self.held, self.refused = set(held), set(refused)
        self.drain_ids: queue.SimpleQueue = queue.SimpleQueue()
        self.drain_listed = False
        self.drained = threading.Event()
        self.ends: dict = {}  # session id -> the sink of its drain END
        self.lock = threading.Lock()

    def drain(self):
        self.drained.set()
        for sid in sorted(self.open):
            self.drain_ids.put(sid)
        self.drain_listed = True

    def submit(self, request, sink):
        assert request.end and request.drain and not request.start
        with self.lock:
            self.ends[request.session_id] = sink
        if request.session_id in self.refused:
            sink.send_error(ProtocolError("START", f"session {request.session_id!r} is not open", Status.NOT_FOUND))
        elif request.session_id not in self.held:
            self.answer(request.session_id)

    def answer(self, sid):
        self.open.discard(sid)
        self.ends[sid].send(ResponseChunk("", (), "update", 1.0, "closed", 0.0, 0.0, 0.0), final=True)

    @property
    def open_sessions(self):
        return len(self.open)


def wait_for(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_drainer_waits_for_its_file_ends_every_session_and_then_reports(tmp_path):
    scheduler = FakeScheduler(["a", "b", "c"], held={"b"}, refused={"c"})
    drain_file = tmp_path / "drain"
    drainer = Drainer(drain_file, scheduler, poll_s=0.01)
    drainer.start()
    try:
        time.sleep(0.1)
        assert not scheduler.drained.is_set()  # nothing happens before the file appears
        drain_file.touch()
        wait_for(lambda: not drain_file.exists())  # taken up
        wait_for(lambda: set(scheduler.ends) == {"a", "b", "c"})
        time.sleep(0.1)
        assert not drained_path(drain_file).exists()  # b's END is still under way
        scheduler.answer("b")
        wait_for(drained_path(drain_file).exists)
        report = DrainReport.from_json(drained_path(drain_file).read_text())
        assert (report.num_ended, report.num_failed, report.num_open) == (2, 1, 1)
        drained_path(drain_file).unlink()
        drain_file.touch()  # asked again (a stop after a drain begun by hand): taken up and reported again
        wait_for(drained_path(drain_file).exists)
        assert DrainReport.from_json(drained_path(drain_file).read_text()).num_ended == 2
        assert not drain_file.exists()
    finally:
        drainer.stop()


def test_a_drain_ends_sessions_with_answers_streaming_after_those_answers(tmp_path):
    """The engine loop running, as in the server: each session's drain END is queued behind the answer its client
    asked for, which is streamed in full first; the report comes once every END is answered."""
    journal_dir = tmp_path / "journal"
    h = journaled(tmp_path, journal_dir)
    for sid in ("s1", "s2", "s3"):
        open_session(h, sid=sid)
    h.sched.start()
    drain_file = tmp_path / "drain"
    drainer = Drainer(drain_file, h.sched, poll_s=0.01)
    drainer.start()
    try:
        answers = {sid: h.submit(h.request(sid, f"a long question of {sid}", max_tokens=40)) for sid in ("s1", "s2", "s3")}
        drain_file.touch()
        wait_for(drained_path(drain_file).exists)
        report = DrainReport.from_json(drained_path(drain_file).read_text())
        assert (report.num_ended, report.num_failed, report.num_open) == (3, 0, 0)
        for sid, answer in answers.items():
            assert answer.done and answer.error is None, sid
            assert answer.chunks[-1].finish_reason in ("length", "stop"), sid
            assert h.sched.store.get(sid) is None
        assert sorted(h.sched._residency._journal.session_ids()) == ["s1", "s2", "s3"]
        assert h.metrics.sink.get("prepos_sessions_drained_total") == 3
    finally:
        drainer.stop()
        h.sched.stop()


def test_a_drain_file_left_by_an_earlier_server_is_removed_at_start(tmp_path):
    drain_file = tmp_path / "drain"
    drain_file.touch()
    drained_path(drain_file).write_text("{}")
    scheduler = FakeScheduler(["a"])
    drainer = Drainer(drain_file, scheduler, poll_s=0.01)
    drainer.start()
    try:
        time.sleep(0.1)
        assert not scheduler.drained.is_set() and not drain_file.exists()
        assert not drained_path(drain_file).exists()
    finally:
        drainer.stop()


def test_request_drain_returns_the_report_or_none_when_nobody_takes_the_file_up(tmp_path):
    drain_file = tmp_path / "drain"
    began = time.monotonic()
    assert request_drain(drain_file, 5.0, alive=lambda: True, pickup_s=0.2, poll_s=0.01) is None
    assert time.monotonic() - began < 3 and not drain_file.exists()  # no model watching: gave up, cleaned up

    scheduler = FakeScheduler(["a"])
    drainer = Drainer(drain_file, scheduler, poll_s=0.01)
    drainer.start()
    try:
        report = request_drain(drain_file, 5.0, alive=lambda: True, pickup_s=1.0, poll_s=0.01)
        assert report is not None and report.num_ended == 1 and scheduler.open_sessions == 0
    finally:
        drainer.stop()


def test_request_drain_gives_up_when_the_drain_is_not_done_in_time(tmp_path):
    drain_file = tmp_path / "drain"
    scheduler = FakeScheduler(["a"], held={"a"})
    drainer = Drainer(drain_file, scheduler, poll_s=0.01)
    drainer.start()
    try:
        assert request_drain(drain_file, 0.3, alive=lambda: True, poll_s=0.01) is None
    finally:
        drainer.stop()


@pytest.mark.parametrize("text", ["", "[]", '{"num_ended": 1}', '{"num_ended": 1, "num_failed": 0, "num_open": 0, '
                                  '"seconds": 0.1, "extra": 1}'])
def test_anything_but_a_drain_report_is_refused(text):
    with pytest.raises(ValueError):
        DrainReport.from_json(text)
    report = DrainReport(num_ended=2, num_failed=0, num_open=0, seconds=0.25)
    assert DrainReport.from_json(report.to_json()) == report



def test_the_drains_own_ends_are_counted_as_drained_sessions_not_as_client_requests(tmp_path):
    h = journaled(tmp_path, tmp_path / "journal")
    for sid in ("s1", "s2"):
        open_session(h, sid=sid)
        h.serve(h.request(sid, "a question", max_tokens=2))
    sink = h.metrics.sink

    def errors():
        return sum(v for (name, _), v in sink.values.items() if name == "prepos_request_errors_total")

    closes, errors_before = sink.get("prepos_requests_total", path="close"), errors()
    h.sched.drain()
    closed = h.serve(drain_end("s1"))
    refused = h.serve(drain_end("s1"))  # ended already, as a session closed while its drain END waited would be
    assert closed.chunks[-1].finish_reason == "closed" and refused.error.status is Status.NOT_FOUND
    assert sink.get("prepos_sessions_drained_total") == 1
    assert sink.get("prepos_requests_total", path="close") == closes and errors() == errors_before
    # A client's END, and a client's request refused, still count.
    assert h.serve(h.request("s2", None, end=True, max_tokens=0)).error is None
    assert h.serve(h.request("s1", "still there?", max_tokens=2)).error.status is Status.NOT_FOUND
    assert sink.get("prepos_requests_total", path="close") == closes + 1 and errors() == errors_before + 1
