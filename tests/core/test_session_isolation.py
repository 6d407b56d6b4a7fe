"""A request touches only its own session; request-controlled ids reach the logs escaped."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from prepos.journal import SessionJournal
from prepos.protocol import Status
from test_scheduler import Harness, open_session

CONTROL = [chr(c) for c in (*range(0x20), 0x7F)]


def test_appends_to_one_session_never_show_in_another(tmp_path):
    h = Harness(tmp_path)
    open_session(h, sid="a")
    open_session(h, sid="b")
    b_before = h.log("b")
    for text in ("first", "second"):
        assert h.serve(h.request("a", text, max_tokens=0)).error is None
        assert h.serve(h.request("a", text, max_tokens=3)).error is None
    assert h.log("b") == b_before
    # b answers exactly as a fresh session with b's history does
    open_session(h, sid="twin")
    want = h.serve(h.request("twin", "question", max_tokens=3)).ids
    assert h.serve(h.request("b", "question", max_tokens=3)).ids == want


def test_int_and_str_ids_that_print_alike_are_distinct_sessions(tmp_path):
    h = Harness(tmp_path, journal=SessionJournal(tmp_path / "journal", fsync=False))
    open_session(h, sid=5, text="five as a number")
    open_session(h, sid="5", text="five as text")
    assert h.serve(h.request(5, "more", max_tokens=0)).error is None
    assert h.log(5) != h.log("5")
    assert len(h.log(5)) > len(h.log("5"))
    # ending one leaves the other open, in memory and in the journal
    assert h.serve(h.request("5", None, end=True, max_tokens=0)).error is None
    assert h.sched.store.get("5") is None and h.sched.store.get(5) is not None
    assert SessionJournal(tmp_path / "journal").session_ids() == [5]


def test_a_request_for_a_session_never_started_changes_no_other_session(tmp_path):
    h = Harness(tmp_path)
    open_session(h, sid="a")
    a_before = h.log("a")
    sink = h.serve(h.request("b", "hello", max_tokens=2))
    assert sink.error is not None and sink.error.status is Status.NOT_FOUND
    assert h.log("a") == a_before and h.sched.store.get("b") is None


@pytest.mark.parametrize("evil", ["s\n2026-01-01 INFO prepos: forged line", "\x1b[31mred\x1b[0m", "cr\rlf\x00nul\x7f"])
def test_control_characters_in_ids_never_reach_a_log_line_raw(tmp_path, caplog, evil):
    h = Harness(tmp_path, journal=SessionJournal(tmp_path / "journal", fsync=False))
    with caplog.at_level(logging.DEBUG, logger="prepos"):
        open_session(h, sid=evil)
        request = h.request(evil, "hi", max_tokens=2)
        request = dataclasses.replace(request, request_id=evil)
        h.serve(request)
        h.serve(h.request(evil, "hi", role="no\nsuch\x1brole", max_tokens=2))  # rejected: unknown role
        # a torn last write, then a restart: a second scheduler reopens the session from the journal
        journal = SessionJournal(tmp_path / "journal")
        with open(journal.path(evil), "ab") as f:
            f.write(b"\x10\x00")
        h2 = Harness(tmp_path, journal=SessionJournal(tmp_path / "journal", fsync=False))
        h2.serve(h2.request(evil, "again", max_tokens=2, start=True, resume=True))
        h2.serve(h2.request(evil, None, end=True, max_tokens=0))
    messages = [record.getMessage() for record in caplog.records]
    assert [any(word in m for m in messages) for word in ("bytes dropped", "reopened", "closed")] == [True] * 3
    assert sum(repr(evil) in m for m in messages) >= 3  # the ids are there, escaped
    for message in messages:
        assert not any(c in message for c in CONTROL), message
