"""The drain before a stop: STARTs refused, every session ended by the drain's own END with its journal kept
(the scheduler), and the drain file watched, taken up and reported on (the Drainer), without Triton."""

from __future__ import annotations

import itertools
import queue
import threading
import time

import numpy as np
import pytest
from prepos.config import LimitsConfig
from prepos.drain import DrainReport, Drainer, drained_path, request_drain
from prepos.journal import SessionJournal
from prepos.protocol import Status, end_reason, parse_request
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
    for resume in (False, True):  # a new session, and a resume, are refused; their ids are to be ended too
        refused = h.serve(h.request(f"new-{resume}", "hello", start=True, resume=resume))
        assert refused.error.status is Status.UNAVAILABLE and "draining" in str(refused.error)
        assert h.sched.store.get(f"new-{resume}") is None
    assert drain_ids(h) == ["new-False", "new-True"]
    both = h.serve(h.request("new-both", None, start=True, end=True, max_tokens=0))  # Triton ends that one itself
    assert both.error.status is Status.UNAVAILABLE and drain_ids(h) == []

    # A request of an open session sent before the drain's END is served as before, then the END closes it.
    before = h.submit(h.request("s1", "one more", max_tokens=0))
    drain_end = h.request("s1", None, end=True, max_tokens=0, drain=True)
    assert end_reason(drain_end) == "drain"
    closed = h.submit(drain_end)
    while not closed.done:
        h.sched.run_once()
    assert before.chunks[-1].finish_reason == "appended" and closed.chunks[-1].finish_reason == "closed"
    assert h.sched.store.get("s1") is None and h.sched.open_sessions == 1
    assert h.metrics.sink.get("prepos_sessions_drained_total") == 1
    assert sorted(journal.session_ids()) == ["s1", "s2"]  # kept: s1 resumes after the restart
    assert journal.recover("s1").token_log[: len(logs["s1"])] == logs["s1"]

    h.serve(h.request("s2", None, end=True, max_tokens=0))  # a client's own END still deletes the journal
    assert journal.session_ids() == ["s1"] and h.sched.open_sessions == 0

    h2 = journaled(tmp_path, journal_dir)  # the restarted server
    resumed = h2.serve(h2.request("s1", "and now?", max_tokens=3, start=True, resume=True))
    assert resumed.error is None and resumed.path == "rebuild"


class FakeScheduler:
    """What a Drainer drives: ends sessions as the model would when their drain END reaches it."""

    def __init__(self, open_ids):
        self.open = set(open_ids)
        self.drain_ids: queue.SimpleQueue = queue.SimpleQueue()
        self.drain_listed = False
        self.drained = threading.Event()

    def drain(self):
        self.drained.set()
        for sid in sorted(self.open):
            self.drain_ids.put(sid)
        self.drain_listed = True

    @property
    def open_sessions(self):
        return len(self.open)


def wait_for(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_drainer_waits_for_its_file_ends_every_session_and_then_reports(tmp_path):
    scheduler = FakeScheduler(["a", "b", "c"])
    release = threading.Event()
    ended = []

    def end_session(sid):
        if sid == "b":
            release.wait(10)  # an END waiting behind a long answer
        if sid == "c":
            raise RuntimeError("Triton no longer holds the sequence")
        ended.append(sid)
        scheduler.open.discard(sid)

    drain_file = tmp_path / "drain"
    drainer = Drainer(drain_file, scheduler, end_session, poll_s=0.01)
    drainer.start()
    try:
        time.sleep(0.1)
        assert not scheduler.drained.is_set()  # nothing happens before the file appears
        drain_file.touch()
        wait_for(lambda: not drain_file.exists())  # taken up
        wait_for(lambda: "a" in ended)
        time.sleep(0.1)
        assert not drained_path(drain_file).exists()  # b's END is still under way
        release.set()
        wait_for(drained_path(drain_file).exists)
        report = DrainReport.from_json(drained_path(drain_file).read_text())
        assert (report.num_ended, report.num_failed, report.num_open) == (2, 1, 1)
        scheduler.drain_ids.put("late")  # a START refused after the report is ended too
        wait_for(lambda: "late" in ended)
        drained_path(drain_file).unlink()
        drain_file.touch()  # asked again (a stop after a drain begun by hand): taken up and reported again
        wait_for(drained_path(drain_file).exists)
        assert DrainReport.from_json(drained_path(drain_file).read_text()).num_ended == 3
        assert not drain_file.exists()
    finally:
        drainer.stop()


def test_a_steady_stream_of_refused_starts_does_not_hold_the_report_back(tmp_path):
    """Clients that keep trying to open or resume sessions while the server drains (a load test, or clients that
    wait for the server) have their refused STARTs queued for an END without a pause: the report waits for the ENDs
    of the sessions open at the drain and of the ids queued by then, not for a quiet moment."""
    scheduler = FakeScheduler(["a", "b"])
    ended = []

    def end_session(sid):
        time.sleep(0.005)  # an END's round trip through Triton
        ended.append(sid)
        scheduler.open.discard(sid)

    stop_refusing = threading.Event()

    def refuse_starts():  # a refused START every 2 ms, faster than the drainer looks for new ids
        for number in itertools.count():
            if stop_refusing.wait(0.002):
                return
            if scheduler.drained.is_set():
                scheduler.drain_ids.put(f"refused-{number}")

    drain_file = tmp_path / "drain"
    drainer = Drainer(drain_file, scheduler, end_session, poll_s=0.05)
    refusing = threading.Thread(target=refuse_starts)
    refusing.start()
    drainer.start()
    try:
        drain_file.touch()
        wait_for(drained_path(drain_file).exists, timeout_s=5)
        report = DrainReport.from_json(drained_path(drain_file).read_text())
        assert report.num_open == 0 and {"a", "b"} <= set(ended) and report.seconds < 3
        num_ended = len(ended)
        wait_for(lambda: len(ended) > num_ended + 10)  # STARTs refused after the report are still ended
    finally:
        stop_refusing.set()
        refusing.join()
        drainer.stop()


def test_a_drain_file_left_by_an_earlier_server_is_removed_at_start(tmp_path):
    drain_file = tmp_path / "drain"
    drain_file.touch()
    drained_path(drain_file).write_text("{}")
    scheduler = FakeScheduler(["a"])
    drainer = Drainer(drain_file, scheduler, lambda sid: None, poll_s=0.01)
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
    drainer = Drainer(drain_file, scheduler, lambda sid: scheduler.open.discard(sid), poll_s=0.01)
    drainer.start()
    try:
        report = request_drain(drain_file, 5.0, alive=lambda: True, pickup_s=1.0, poll_s=0.01)
        assert report is not None and report.num_ended == 1 and scheduler.open_sessions == 0
    finally:
        drainer.stop()


def test_request_drain_gives_up_when_the_drain_is_not_done_in_time(tmp_path):
    drain_file = tmp_path / "drain"
    scheduler = FakeScheduler(["a"])
    release = threading.Event()
    drainer = Drainer(drain_file, scheduler, lambda sid: release.wait(10), poll_s=0.01)
    drainer.start()
    try:
        assert request_drain(drain_file, 0.3, alive=lambda: True, poll_s=0.01) is None
    finally:
        release.set()
        drainer.stop()


@pytest.mark.parametrize("drain", [False, True])
def test_only_an_end_carries_the_drain_marker(tmp_path, drain):
    inputs = {"START": np.array([0], dtype=np.int32), "END": np.array([int(drain)], dtype=np.int32)}
    request = parse_request(inputs, session_id="s", request_id="r", limits=LimitsConfig(), default_max_tokens=8,
                            drain=True)
    assert request.drain is drain


@pytest.mark.parametrize("text", ["", "[]", '{"num_ended": 1}', '{"num_ended": 1, "num_failed": 0, "num_open": 0, '
                                  '"seconds": 0.1, "extra": 1}'])
def test_anything_but_a_drain_report_is_refused(text):
    with pytest.raises(ValueError):
        DrainReport.from_json(text)
    report = DrainReport(num_ended=2, num_failed=0, num_open=0, seconds=0.25)
    assert DrainReport.from_json(report.to_json()) == report
