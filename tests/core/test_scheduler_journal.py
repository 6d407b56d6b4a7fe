"""Session journals through the scheduler: accepted turns survive a restart; closing deletes them."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

from fakes import IM_END, CollectSink
from prepos.drain import drain_end
from prepos.journal import JournalEntry, SessionJournal
from prepos.protocol import Status
from test_scheduler import Harness, open_session


def restarted(tmp_path, journal_dir, **kw):
    """A new scheduler with a new engine (nothing in memory) on the same journal directory."""
    return Harness(tmp_path, journal=SessionJournal(journal_dir, fsync=False), **kw)


def test_a_restarted_server_reopens_the_session_from_its_journal(tmp_path):
    journal_dir = tmp_path / "journal"
    h = restarted(tmp_path, journal_dir)
    open_session(h)
    h.serve(h.request("s1", "first question", max_tokens=4))
    h.serve(h.request("s1", "an update", max_tokens=0))
    h.idle()
    log = h.log("s1")  # everything the first server acknowledged

    h2 = restarted(tmp_path, journal_dir)
    assert h2.sched.store.get("s1") is None
    prompt = [*log, *h2.framing.entry_ids["user"], *h2.tok.encode("what next?"), *h2.framing.cue_ids]
    want = [t for t in h2.reference(prompt, 5) if t != IM_END]
    assert h2.serve(h2.request("s1", "what next?", max_tokens=5)).error.status is Status.NOT_FOUND  # no START
    sink = h2.serve(h2.request("s1", "what next?", max_tokens=5, start=True, resume=True))
    assert sink.path == "rebuild" and sink.ids == want
    assert h2.log("s1")[: len(log)] == log
    assert h2.metrics.sink.get("prepos_sessions_recovered_total") == 1


def test_end_deletes_the_journal_and_start_replaces_it(tmp_path, caplog):
    journal_dir = tmp_path / "journal"
    h = restarted(tmp_path, journal_dir)
    journal = h.sched._residency._journal
    open_session(h)
    h.serve(h.request("s1", "hello", max_tokens=2))
    assert journal.session_ids() == ["s1"]
    h.serve(h.request("s1", None, end=True, max_tokens=0))
    assert journal.session_ids() == []
    open_session(h, sid="s2", text="old")
    h2 = restarted(tmp_path, journal_dir)  # s2 was left behind by a crash; a START under its id begins anew
    with caplog.at_level("WARNING", logger="prepos.residency"):
        open_session(h2, sid="s2", text="new")
    assert journal.recover("s2").token_log == h2.log("s2")
    assert [r.getMessage() for r in caplog.records] == [
        "session 's2': START without resume replaced the journal of an earlier session under this id (its turns are "
        "gone)"]  # and only there: s1's START found none
    missing = h2.serve(h2.request("s3", "hello", start=True, resume=True))
    assert missing.error.field == "resume" and missing.error.status is Status.NOT_FOUND
    assert h2.sched.store.get("s3") is None
    # START + resume on a session the server holds just continues it
    held = h2.serve(h2.request("s2", "more", start=True, resume=True, max_tokens=0))
    assert held.error is None and len(h2.log("s2")) > len(journal.recover("s2").token_log) - 1


def test_rejected_and_cancelled_requests_leave_the_journal_unchanged(tmp_path):
    journal_dir = tmp_path / "journal"
    h = restarted(tmp_path, journal_dir)
    journal = h.sched._residency._journal
    open_session(h)
    before = journal.recover("s1").token_log
    assert h.serve(h.request("s1", "hi", role="wizard")).error.field == "role"
    sink = h.submit(h.request("s1", "a long answer please", max_tokens=40))
    while not sink.chunks:
        h.sched.run_once()
    sink.client_gone = True
    while not sink.done:
        h.sched.run_once()
    assert journal.recover("s1").token_log == before == h.log("s1")


def test_an_update_whose_client_went_away_while_it_waited_is_not_accepted(tmp_path):
    """An update (no engine step) queued behind a generate on a stream the client cancelled was accepted all the
    same: into the log and the journal, its acknowledgement lost, so that a client sending it again had it twice."""
    h = restarted(tmp_path, tmp_path / "journal")
    journal = h.sched._residency._journal
    open_session(h)
    before = journal.recover("s1").token_log
    generate = h.submit(h.request("s1", "a long answer please", max_tokens=40))
    update = h.submit(h.request("s1", "the code word is KIWI", max_tokens=0))
    while not generate.chunks:
        h.sched.run_once()
    generate.client_gone = update.client_gone = True  # the stream both were sent on is cancelled
    while not (generate.done and update.done):
        h.sched.run_once()
    assert update.error.status is Status.CANCELLED and "not accepted" in str(update.error)
    assert journal.recover("s1").token_log == before == h.log("s1")
    assert h.metrics.sink.get("prepos_requests_abandoned_total", reason="cancelled") == 2
    # an update whose client is still there is accepted as before, and so is an END without a delta
    assert h.serve(h.request("s1", "the code word is KIWI", max_tokens=0)).error is None
    assert len(h.log("s1")) > len(before)
    gone = h.request("s1", None, end=True, max_tokens=0)
    sink = h.submit(gone)
    sink.client_gone = True
    while not sink.done:
        h.sched.run_once()
    assert sink.error is None and h.sched.store.get("s1") is None and journal.session_ids() == []


def test_an_update_that_waited_for_nothing_is_not_asked_whether_its_client_went_away(tmp_path):
    """The question is a round trip to the server: an update served as it comes (its session idle) does not ask it,
    so a client that cancels it in flight may still see it accepted, as for any request answered at once."""
    h = restarted(tmp_path, tmp_path / "journal")
    open_session(h)
    asked = []
    update = h.request("s1", "the code word is KIWI", max_tokens=0)
    sink = h.submit(update)
    sink.cancelled = lambda: asked.append(True) or True
    while not sink.done:
        h.sched.run_once()
    assert asked == [] and sink.error is None


class BrokenJournal(SessionJournal):
    def append(self, session_id, entry):
        raise OSError(28, "No space left on device")


def test_a_journal_write_failure_is_an_error_and_the_turn_is_not_accepted(tmp_path):
    h = Harness(tmp_path, journal=BrokenJournal(tmp_path / "journal", fsync=False))
    open_session(h, text="")  # an empty update writes nothing
    for max_tokens in (0, 3):
        sink = h.serve(h.request("s1", "hello", max_tokens=max_tokens))
        assert sink.error.field == "journal" and sink.error.status is Status.UNAVAILABLE
        assert "not accepted" in str(sink.error)
        assert h.log("s1") == []


def test_dropping_turns_rewrites_the_journal(tmp_path):
    journal_dir = tmp_path / "journal"
    h = restarted(tmp_path, journal_dir, max_log_tokens=90, context_overflow="drop_oldest")
    open_session(h, text="sys")
    for text in ("first question", "second question", "third question", "y" * 40):
        assert h.serve(h.request("s1", text, max_tokens=4)).error is None
    assert h.metrics.sink.get("prepos_turns_dropped_total") >= 1
    recovered = h.sched._residency._journal.recover("s1")
    assert recovered.token_log == h.log("s1")
    assert [list(t) for t in recovered.turns] == h.sched.store.lookup("s1").turns()


def test_a_request_stopped_after_making_room_drops_no_turn(tmp_path):
    """Under drop_oldest the turns that make room go when the turn is accepted: a request stopped before then
    leaves the log and the journal as they were, and the next request makes room again."""
    journal_dir = tmp_path / "journal"
    h = restarted(tmp_path, journal_dir, max_log_tokens=90, context_overflow="drop_oldest")
    open_session(h, text="sys")
    for text in ("first question", "second question", "third question"):
        assert h.serve(h.request("s1", text, max_tokens=4)).error is None
    log, journal = h.log("s1"), h.sched._residency._journal
    dropped = h.metrics.sink.get("prepos_turns_dropped_total")
    sink = h.submit(h.request("s1", "y" * 40, max_tokens=10))  # needs the oldest turns' room
    while not sink.chunks and not sink.done:
        h.sched.run_once()
    assert sink.chunks and not sink.done
    sink.client_gone = True
    while not sink.done:
        h.sched.run_once()
    assert sink.error.status is Status.CANCELLED
    assert h.log("s1") == log and journal.recover("s1").token_log == log
    assert h.metrics.sink.get("prepos_turns_dropped_total") == dropped
    again = h.serve(h.request("s1", "y" * 40, max_tokens=4))
    assert again.error is None and h.metrics.sink.get("prepos_turns_dropped_total") > dropped
    assert journal.recover("s1").token_log == h.log("s1") and len(h.log("s1")) <= 90


def test_a_resume_queued_behind_a_closing_request_names_resume(tmp_path):
    h = Harness(tmp_path)
    first = h.submit(h.request("s1", "hi", start=True, role="wizard"))  # rejected START: no session stays
    resumed = h.submit(h.request("s1", None, start=True, resume=True, end=True, max_tokens=0))
    while not (first.done and resumed.done):
        h.sched.run_once()
    assert first.error.field == "role"
    assert resumed.error.field == "resume" and resumed.error.status is Status.NOT_FOUND
    assert h.sched.store.get("s1") is None


def test_a_one_step_answer_goes_out_before_its_turn_is_journaled_and_is_acknowledged_after(tmp_path):
    h = restarted(tmp_path, tmp_path / "journal", threshold=0.0)  # every positioned request with a delta is gated
    journal = h.sched._residency._journal
    open_session(h)
    h.idle()
    seen = []  # per response: (final, text, entries in the journal when it was sent)

    class Recording(CollectSink):
        def send(self, chunk, final):
            seen.append((final, chunk.text, chunk.finish_reason, journal.recover("s1").num_entries))
            super().send(chunk, final)

    before = journal.recover("s1").num_entries
    sink = Recording()
    h.sched.submit(h.request("s1", "a new question", max_tokens=1), sink)
    h.sched.run_once()
    assert sink.done and sink.path == "gated"
    (first_final, first_text, first_finish, first_entries), (last_final, last_text, last_finish, last_entries) = seen
    assert not first_final and first_text and first_finish == "" and first_entries == before  # not yet journaled
    assert last_final and last_text == "" and last_finish == "length" and last_entries == before + 1
    assert sink.text == first_text and journal.recover("s1").token_log == h.log("s1")


def test_journals_no_client_came_back_for_expire_and_held_ones_stay(tmp_path):
    journal_dir = tmp_path / "journal"
    left = Harness(tmp_path, journal=SessionJournal(journal_dir, fsync=False))  # the server before a crash
    for sid in ("left", "held", "fresh"):
        open_session(left, sid=sid)
    h = Harness(tmp_path, journal=SessionJournal(journal_dir, fsync=False), journal_expire_s=3600.0,
                idle_timeout_s=7200.0)
    journal = h.sched._residency._journal
    day_ago = time.time() - 86400
    for sid in ("left", "held"):  # not written for a day
        os.utime(journal.path(sid), (day_ago, day_ago))
    h.sched._residency.store.open("held", h.clock())  # as if reopened here but not written since
    h.sched.run_once()  # the first housekeeping
    assert sorted(journal.session_ids()) == ["fresh", "held"]
    assert h.metrics.sink.get("prepos_journals_expired_total") == 1
    os.utime(journal.path("fresh"), (day_ago, day_ago))
    h.clock.t += 60
    h.sched.run_once()
    assert "fresh" in journal.session_ids()  # the next pass is an hour later
    h.clock.t += 3600
    h.sched.run_once()
    assert journal.session_ids() == ["held"]
    resumed = h.serve(h.request("fresh", "back?", start=True, resume=True, max_tokens=0))
    assert resumed.error.field == "resume"  # gone: a client coming back after that starts anew


def test_reopening_a_session_from_its_journal_counts_as_writing_it(tmp_path):
    journal = SessionJournal(tmp_path, fsync=False)
    journal.create("s")
    day_ago = time.time() - 86400
    os.utime(journal.path("s"), (day_ago, day_ago))
    assert journal.recover("s") is not None
    assert journal.expire(3600.0) == 0 and journal.session_ids() == ["s"]
    os.utime(journal.path("s"), (day_ago, day_ago))
    assert journal.expire(3600.0, keep={journal.path("s")}) == 0
    assert journal.expire(3600.0) == 1 and journal.session_ids() == []


def test_an_idle_timeout_leaves_the_journal_of_a_session_another_replica_reopened(tmp_path):
    """Two replicas on one journal directory. A session moved from one to the other (reopened there from the
    journal) while the first still held it: the first's idle timeout must not delete the journal, which the
    second writes to at its next turn. A session no other replica took is closed with its journal as before."""
    journal_dir = tmp_path / "journal"
    first = Harness(tmp_path, journal=SessionJournal(journal_dir, fsync=False), idle_timeout_s=60.0)
    open_session(first, sid="moved")
    open_session(first, sid="stays")
    first.serve(first.request("moved", "first question", max_tokens=2))
    second = restarted(tmp_path, journal_dir)
    reopened = second.serve(second.request("moved", "where was I?", start=True, resume=True, max_tokens=2))
    assert reopened.error is None and reopened.path == "rebuild"
    first.clock.t += 61
    first.sched.run_once()  # housekeeping: both sessions idle past the timeout on the first replica
    assert first.sched.store.get("moved") is None and first.sched.store.get("stays") is None
    journal = SessionJournal(journal_dir, fsync=False)
    assert sorted(journal.session_ids()) == ["moved"]  # the other replica's stays, the first's own is gone
    answered = second.serve(second.request("moved", "and now?", max_tokens=2))
    assert answered.error is None  # its turn is journaled: the file is still there
    assert journal.recover("moved").num_entries == second.sched._residency._journal.recover("moved").num_entries


def test_a_replica_whose_copy_of_a_session_went_stale_goes_on_from_the_journal(tmp_path):
    """Two replicas on one journal directory. A session's client moved to the second (reopened there from the
    journal, a turn taken there) and came back to the first, which still held it (behind a router, a replica lost
    for a moment and back). The first must not answer from its stale copy, nor write its turn after it: it drops
    its copy and goes on from the journal, as if it had never held the session; it answers what the second would."""
    journal_dir = tmp_path / "journal"
    first = restarted(tmp_path, journal_dir)
    open_session(first, sid="moved")
    open_session(first, sid="stays")
    first.serve(first.request("moved", "first question", max_tokens=2))
    first.serve(first.request("stays", "first question", max_tokens=2))
    first.idle()
    second = restarted(tmp_path, journal_dir)
    assert second.serve(second.request("moved", "taken elsewhere", start=True, resume=True, max_tokens=3)).error is None
    log = second.log("moved")  # the journal's, the turn taken on the second replica included

    back = first.serve(first.request("moved", "and back here?", max_tokens=4))  # no START: its client's stream
    assert back.error is None and back.path == "rebuild"
    prompt = [*log, *first.framing.entry_ids["user"], *first.tok.encode("and back here?"), *first.framing.cue_ids]
    assert back.ids == [t for t in first.reference(prompt, 4) if t != IM_END]
    assert first.log("moved")[: len(log)] == log
    assert first.metrics.sink.get("prepos_sessions_taken_over_total") == 1
    assert first.metrics.sink.get("prepos_sessions_closed_total", reason="taken_over") == 1
    journal = SessionJournal(journal_dir, fsync=False)
    assert [t for turn in journal.recover("moved").turns for t in turn] == first.log("moved")
    # A session no other server touched is served from its copy here, as before.
    assert first.serve(first.request("stays", "and now?", max_tokens=2)).path != "rebuild"
    assert first.metrics.sink.get("prepos_sessions_taken_over_total") == 1
    # And the second replica, whose copy is now the stale one, goes on from the journal in turn.
    again = second.serve(second.request("moved", "and there again?", max_tokens=2))
    assert again.error is None and again.path == "rebuild" and second.log("moved")[: len(first.log("moved"))] == \
        first.log("moved")


def moved_to_a_second_server(tmp_path):
    """Two servers on one journal directory; session "moved" took a turn on the first, then was reopened on the
    second and took a turn there. Returns both Harnesses."""
    journal_dir = tmp_path / "journal"
    first = restarted(tmp_path, journal_dir)
    open_session(first, sid="moved")
    first.serve(first.request("moved", "first question", max_tokens=2))
    second = restarted(tmp_path, journal_dir)
    assert second.serve(second.request("moved", "taken elsewhere", start=True, resume=True, max_tokens=2)).error is None
    return first, second


def test_a_journal_with_a_damaged_header_fails_its_resume_naming_the_journal_not_as_absent(tmp_path):
    """The client is not told that there is no journal (and to start over) when there is one the server cannot
    use: the resume fails naming `journal`, the file stays for inspection, and a START without resume replaces
    it."""
    journal_dir = tmp_path / "journal"
    h = restarted(tmp_path, journal_dir)
    open_session(h)
    h.serve(h.request("s1", "first question", max_tokens=2))
    path = SessionJournal(journal_dir, fsync=False).path("s1")
    damaged = b"\0" * 8 + path.read_bytes()[8:]
    path.write_bytes(damaged)
    h2 = restarted(tmp_path, journal_dir)
    refused = h2.serve(h2.request("s1", "again?", max_tokens=2, start=True, resume=True))
    assert refused.error.field == "journal" and refused.error.status is Status.INTERNAL
    assert "not a prepos journal" in str(refused.error) and "START without resume" in str(refused.error)
    assert path.read_bytes() == damaged and h2.sched.store.get("s1") is None
    assert h2.serve(h2.request("s1", "anew", max_tokens=2, start=True)).error is None
    assert SessionJournal(journal_dir, fsync=False).recover("s1").token_log == h2.log("s1")


def test_a_journal_holding_token_ids_outside_the_vocabulary_fails_its_resume_naming_the_journal(tmp_path):
    """A journal another model's server wrote (replicas on one directory, a model changed between restarts) reads
    back fine: its resume succeeded, and every answer after failed as an internal error."""
    journal_dir = tmp_path / "journal"
    h = restarted(tmp_path, journal_dir)
    open_session(h)
    h.serve(h.request("s1", "first question", max_tokens=2))
    vocab = h.engine.info.vocab_size
    journal = SessionJournal(journal_dir, fsync=False)
    journal.append("s1", JournalEntry(token_ids=(1, vocab), role="user", choices=None))  # the third turn
    before = journal.path("s1").read_bytes()
    h2 = restarted(tmp_path, journal_dir)
    refused = h2.serve(h2.request("s1", "again?", max_tokens=2, start=True, resume=True))
    assert refused.error.field == "journal" and refused.error.status is Status.INTERNAL
    assert f"turn 3 holds token id {vocab}, outside this model's vocabulary [0, {vocab})" in str(refused.error)
    assert journal.path("s1").read_bytes() == before and h2.sched.store.get("s1") is None
    assert h2.serve(h2.request("s1", "anew", max_tokens=2, start=True)).error is None  # replaces it


def test_a_session_ended_on_another_server_is_no_longer_held_here(tmp_path):
    """Its client moved to a second server and ended the session there (the journal deleted). The first server's
    copy is stale: a request to it is refused as not open (not failed as a journal write), a resume finds no
    journal, and a new session may take the id (it was refused as already open, until the idle timeout)."""
    first, second = moved_to_a_second_server(tmp_path)
    assert second.serve(second.request("moved", None, end=True, max_tokens=0)).error is None
    stale = first.serve(first.request("moved", "still here?", max_tokens=2))
    assert stale.error.field == "START" and stale.error.status is Status.NOT_FOUND
    assert first.sched.store.get("moved") is None
    assert first.metrics.sink.get("prepos_sessions_closed_total", reason="taken_over") == 1
    assert first.metrics.sink.get("prepos_request_errors_total", field="journal") == 0
    resumed = first.serve(first.request("moved", "still here?", max_tokens=2, start=True, resume=True))
    assert resumed.error.field == "resume" and resumed.error.status is Status.NOT_FOUND


def test_a_turn_taken_on_another_server_while_this_one_answered_is_not_missed(tmp_path):
    """The other server's write landed while this one served a request of the session; this server's own append
    then noted the journal's new state as its own, and it answered from then on without the other's turn (while
    the journal, and any restart, had both)."""
    first, second = moved_to_a_second_server(tmp_path)
    first.serve(first.request("moved", "back here", start=True, resume=True, max_tokens=2))  # moved back
    elsewhere = second.tok.encode("taken elsewhere meanwhile")
    journal = SessionJournal(tmp_path / "journal", fsync=False)

    def taken_elsewhere():
        first.engine.on_compute = None
        journal.append("moved", JournalEntry(token_ids=tuple(elsewhere), role="user", choices=None))

    first.engine.on_compute = taken_elsewhere
    assert first.serve(first.request("moved", "a question", max_tokens=2)).error is None
    again = first.serve(first.request("moved", "and now?", max_tokens=2))
    assert again.error is None and again.path == "rebuild"  # it went on from the journal
    log = first.log("moved")
    assert any(log[i:i + len(elsewhere)] == elsewhere for i in range(len(log)))  # the other server's turn too
    assert [t for turn in journal.recover("moved").turns for t in turn] == log


def test_a_session_ended_while_its_journal_directory_was_gone_does_not_come_back_with_it(tmp_path, caplog):
    """A missing journal counted as deleted: the END was answered, and once the directory was back (a volume
    remounted) a resume reopened the ended session from it."""
    journal_dir = tmp_path / "journal"
    h = restarted(tmp_path, journal_dir)
    open_session(h)
    h.serve(h.request("s1", "first question", max_tokens=2))
    journal_dir.rename(tmp_path / "away")
    assert h.serve(h.request("s1", None, end=True, max_tokens=0)).error is None  # the session is over
    assert "session 's1': could not delete its journal" in caplog.text
    # a one-turn session had no journal: nothing to remember of it, nothing logged as an error
    assert h.serve(h.request("one", "hi", start=True, end=True, max_tokens=2)).error is None
    assert "session 'one': could not delete" not in caplog.text
    (tmp_path / "away").rename(journal_dir)
    resumed = h.serve(h.request("s1", "again?", max_tokens=2, start=True, resume=True))
    assert resumed.error.field == "resume" and resumed.error.status is Status.NOT_FOUND
    assert not SessionJournal(journal_dir, fsync=False).path("s1").exists()  # deleted at that resume


def test_a_new_session_may_take_the_id_of_one_ended_on_another_server(tmp_path):
    first, second = moved_to_a_second_server(tmp_path)
    assert second.serve(second.request("moved", None, end=True, max_tokens=0)).error is None
    opened = first.serve(first.request("moved", "a new one", start=True, max_tokens=2))
    assert opened.error is None and opened.path != "rebuild"
    assert first.serve(first.request("moved", "and on", max_tokens=2)).path != "rebuild"  # its own copy now
    assert first.metrics.sink.get("prepos_sessions_taken_over_total") == 1
    journal = SessionJournal(tmp_path / "journal", fsync=False)  # (reading it back counts as reopening it)
    assert [t for turn in journal.recover("moved").turns for t in turn] == first.log("moved")


def test_a_new_session_may_not_take_the_id_of_one_another_server_holds(tmp_path):
    first, second = moved_to_a_second_server(tmp_path)  # the second holds it now; its journal is there
    refused = first.serve(first.request("moved", "a new one", start=True, max_tokens=2))
    assert refused.error.field == "START" and refused.error.status is Status.ALREADY_EXISTS
    assert second.serve(second.request("moved", "and on", max_tokens=2)).path != "rebuild"


def test_a_drain_leaves_the_journal_of_a_session_another_server_took_over_untouched(tmp_path):
    from prepos.drain import drain_end

    first, second = moved_to_a_second_server(tmp_path)
    journal = second.sched._residency._journal
    left_as = journal.path("moved").stat()
    first.sched.drain()
    ended = first.serve(drain_end("moved"))
    assert ended.error is not None and first.sched.store.get("moved") is None  # nothing of it held here now
    after = journal.path("moved").stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (left_as.st_ino, left_as.st_size, left_as.st_mtime_ns)
    assert journal.change_elsewhere("moved") is None  # the server that holds it goes on with its copy
    assert second.serve(second.request("moved", "and now?", max_tokens=2)).path != "rebuild"


def test_a_malformed_request_to_a_stale_copy_is_refused_for_itself_and_the_next_goes_on_from_the_journal(tmp_path):
    from prepos.protocol import ProtocolError, Rejection

    first, second = moved_to_a_second_server(tmp_path)
    refused = CollectSink()
    first.sched.submit(Rejection("moved", start=False, end=False, error=ProtocolError("temperature", "bad")), refused)
    for _ in range(100):
        if refused.done:
            break
        first.sched.run_once()
    assert refused.error.field == "temperature"
    back = first.serve(first.request("moved", "and back here?", max_tokens=2))
    assert back.error is None and back.path == "rebuild" and first.log("moved")[: len(second.log("moved"))] == \
        second.log("moved")


def test_a_session_reopened_by_a_bare_resume_is_rebuilt_and_positioned_in_the_background(tmp_path):
    """A START with `resume` and nothing else reopens the session from its journal without its KV: it is a
    pre-positioning candidate, so its KV is rebuilt before its next request."""
    journal_dir = tmp_path / "journal"
    h = restarted(tmp_path, journal_dir)
    open_session(h)
    h.serve(h.request("s1", "first question", max_tokens=4))
    h.idle()
    h2 = restarted(tmp_path, journal_dir)
    sink = h2.serve(h2.request("s1", "", max_tokens=0, start=True, resume=True))
    assert sink.error is None and h2.sched.store.lookup("s1").evicted
    h2.idle()
    session = h2.sched.store.lookup("s1")
    assert session.has_kv and session.positioned_valid()
    assert h2.serve(h2.request("s1", "", max_tokens=1)).path in ("exact", "gated")  # from the positioned distribution


def test_a_turn_refused_for_a_full_disk_is_not_taken_for_a_takeover(tmp_path, monkeypatch):
    # The journal's cut-back after a failed write used to look like another server's write: the next request
    # dropped the session's KV and rebuilt it from the journal (path rebuild, counted as taken over).
    from prepos import journal as journal_module

    h = restarted(tmp_path, tmp_path / "journal")
    open_session(h)
    assert h.serve(h.request("s1", "first question", max_tokens=3)).error is None
    log = h.log("s1")
    real_write = os.write

    def full(fd, data):
        real_write(fd, bytes(data[:len(data) // 2]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal_module.os, "write", full)
    refused = h.serve(h.request("s1", "second question", max_tokens=3))
    assert refused.error.field == "journal" and h.log("s1") == log
    monkeypatch.setattr(journal_module.os, "write", real_write)
    again = h.serve(h.request("s1", "second question", max_tokens=3))
    assert again.error is None and again.path != "rebuild"
    assert h.metrics.sink.get("prepos_sessions_taken_over_total") in (None, 0)
    assert h.sched._residency._journal.recover("s1").token_log == h.log("s1")


class UnreadableJournal(SessionJournal):
    def recover(self, session_id):
        raise OSError(5, "Input/output error")


def test_a_journal_that_cannot_be_read_is_a_named_error_even_while_another_session_is_served(tmp_path):
    journal_dir = tmp_path / "journal"
    open_session(restarted(tmp_path, journal_dir), sid="old")  # left by the server before a restart
    h = Harness(tmp_path, journal=UnreadableJournal(journal_dir, fsync=False))
    open_session(h, sid="busy")
    busy = h.submit(h.request("busy", "a long answer please", max_tokens=30))
    h.sched.run_once()
    resumed = h.serve(h.request("old", "back", start=True, resume=True, max_tokens=2))
    assert resumed.error.field == "journal" and resumed.error.status is Status.UNAVAILABLE
    assert "could not read the session journal (Input/output error)" in str(resumed.error)
    assert h.sched.store.get("old") is None
    while not busy.done:
        h.sched.run_once()
    assert busy.error is None


class FailingDeletes(SessionJournal):
    failing = True

    def delete(self, session_id, *, only_if_unchanged=False):
        if self.failing:
            raise OSError(30, "Read-only file system")
        return super().delete(session_id, only_if_unchanged=only_if_unchanged)


def test_a_session_ended_while_its_journal_could_not_be_deleted_is_not_reopened_from_it(tmp_path):
    h = Harness(tmp_path, journal=FailingDeletes(tmp_path / "journal", fsync=False), journal_expire_s=86400.0)
    journal = h.sched._residency._journal
    for sid in ("s1", "s2"):
        open_session(h, sid=sid)
        assert h.serve(h.request(sid, "hello", max_tokens=2, end=True)).error is None
    assert sorted(journal.session_ids()) == ["s1", "s2"]  # left behind by the failing disk
    resumed = h.serve(h.request("s1", "back", start=True, resume=True, max_tokens=2))
    assert resumed.error.field == "resume" and resumed.error.status is Status.NOT_FOUND  # ended: not revived
    journal.failing = False
    h.clock.t += 3600
    h.sched.run_once()  # hourly housekeeping deletes what is left
    assert journal.session_ids() == []
    assert h.serve(h.request("s2", "back", start=True, resume=True, max_tokens=2)).error.field == "resume"
    open_session(h, sid="s1")  # the id is free for a new session, journaled as any
    assert journal.session_ids() == ["s1"]


class CountingJournal(SessionJournal):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.writes = []

    def replace(self, session_id, entries):
        self.writes.append(("replace", session_id))
        super().replace(session_id, entries)

    def append(self, session_id, entry):
        self.writes.append(("append", session_id))
        super().append(session_id, entry)


def test_a_session_opened_and_ended_by_one_request_writes_no_journal(tmp_path):
    # Nothing could resume it; a journal left under its id is deleted as before.
    h = Harness(tmp_path, journal=CountingJournal(tmp_path / "journal", fsync=False))
    journal = h.sched._residency._journal
    one_turn = h.serve(h.request("once", "hello", start=True, end=True, max_tokens=3))
    assert one_turn.error is None and one_turn.ids and one_turn.done
    assert journal.writes == [] and journal.session_ids() == []
    open_session(h, sid="old")
    h.sched.store.close("old")  # as if left by a crash
    assert h.serve(h.request("old", "hello", start=True, end=True, max_tokens=2)).error is None
    assert journal.session_ids() == []
    assert h.serve(h.request("kept", "hello", start=True, max_tokens=2)).error is None
    assert ("replace", "kept") in journal.writes and ("append", "kept") in journal.writes


def test_a_start_and_end_that_took_no_turn_leaves_a_journal_kept_under_its_id(tmp_path, caplog):
    """A client gives back the slot of a refused START with START and END together and nothing else: that deleted
    the journal a drain had kept under the id (the refused START had left it, as documented)."""
    h = Harness(tmp_path, journal=CountingJournal(tmp_path / "journal", fsync=False))
    journal = h.sched._residency._journal
    open_session(h, sid="kept")
    h.sched.store.close("kept")  # as if kept by a drain
    before = journal.path("kept").read_bytes()
    bare = h.serve(h.request("kept", None, start=True, end=True, max_tokens=0))
    assert bare.error is None
    assert journal.path("kept").read_bytes() == before
    refused = h.serve(h.request("kept", "hello", start=True, end=True, role="wizard"))  # refused when served
    assert refused.error is not None and journal.path("kept").read_bytes() == before
    resumed = h.serve(h.request("kept", "again", start=True, resume=True, max_tokens=2))
    assert resumed.error is None and resumed.path == "rebuild"  # the session is still there to resume
    # a turn whose journal cannot be written: the log says which session and file
    def full(session_id, entry):
        raise OSError(28, "No space left on device")

    journal.append = full
    with caplog.at_level("ERROR", logger="prepos.residency"):
        failed = h.serve(h.request("kept", "more", max_tokens=0))
    assert failed.error is not None and failed.error.field == "journal"
    assert (f"session 'kept': its journal write failed, the turn was not accepted: No space left on device "
            f"({journal.path('kept')})") in caplog.text


class BuggyJournal(SessionJournal):
    def recover(self, session_id):
        raise RuntimeError("unexpected")


def test_a_request_whose_admission_fails_unexpectedly_is_answered_with_an_internal_error(tmp_path):
    h = Harness(tmp_path, journal=BuggyJournal(tmp_path / "journal", fsync=False))
    failed = h.serve(h.request("old", "back", start=True, resume=True, max_tokens=2))
    assert failed.error.status is Status.INTERNAL and "unexpected" in str(failed.error)
    open_session(h)  # the loop goes on


def test_a_drain_tries_again_to_delete_the_journals_of_ended_sessions(tmp_path):
    h = Harness(tmp_path, journal=FailingDeletes(tmp_path / "journal", fsync=False))
    journal = h.sched._residency._journal
    open_session(h, sid="ended")
    assert h.serve(h.request("ended", "hello", max_tokens=2, end=True)).error is None
    open_session(h, sid="open")
    journal.failing = False  # the disk is back before the stop
    h.sched.drain()
    h.sched.run_once()
    assert journal.session_ids() == ["open"]  # the drained session's is kept, the ended one's is gone


def test_sessions_opened_and_closed_are_counted_once_each_by_reason(tmp_path):
    h = restarted(tmp_path, tmp_path / "journal", idle_timeout_s=60.0)
    sink = h.metrics.sink

    def counts():
        closed = {reason: sink.get("prepos_sessions_closed_total", reason=reason)
                  for reason in ("end", "idle_timeout", "drain", "taken_over", "start_rejected")}
        return sink.get("prepos_sessions_opened_total"), sink.get("prepos_sessions_recovered_total"), closed

    for sid in ("ended", "idle", "drained", "kept"):
        open_session(h, sid=sid)
    assert h.serve(h.request("refused", "hi", start=True, role="wizard")).error.field == "role"
    assert h.serve(h.request("refused once", "hi", start=True, end=True, role="wizard")).error.field == "role"
    assert h.serve(h.request("ended", None, end=True, max_tokens=0)).error is None
    assert h.serve(h.request("once", "hi", start=True, end=True, max_tokens=2)).error is None
    assert h.serve(h.request("ended", "again?", start=True, resume=True)).error.field == "resume"  # opens nothing
    h.clock.t += 30
    for sid in ("drained", "kept"):
        h.serve(h.request(sid, "still here", max_tokens=0))
    h.clock.t += 40
    h.sched.run_once()  # "idle" passed its idle timeout
    opened, recovered, closed = counts()
    assert (opened, recovered) == (7, 0)
    # a refused one-turn request (START and END) is a rejected START too, not an END
    assert closed == {"end": 2, "idle_timeout": 1, "drain": 0, "taken_over": 0, "start_rejected": 2}
    assert opened + recovered - sum(closed.values()) == h.sched.open_sessions == 2
    closes = h.metrics.sink.get("prepos_requests_total", path="close")
    h.sched.drain()
    h.sched.run_once()
    while not h.sched.drain_ids.empty():
        h.serve(drain_end(h.sched.drain_ids.get_nowait()))
    assert counts()[2]["drain"] == 2 and h.sched.open_sessions == 0
    assert h.metrics.sink.get("prepos_requests_total", path="close") == closes  # the drain's ENDs are no client's
    h2 = restarted(tmp_path, tmp_path / "journal")
    assert h2.serve(h2.request("kept", "back", start=True, resume=True, max_tokens=0)).error is None
    assert h2.metrics.sink.get("prepos_sessions_recovered_total") == 1
    assert h2.metrics.sink.get("prepos_sessions_opened_total") == 0


def test_a_session_its_idle_timeout_ended_on_a_read_only_disk_does_not_come_back(tmp_path, monkeypatch, caplog):
    """An idle timeout whose journal could not be deleted (a read-only disk) left the journal to reopen the session
    (path rebuild) once the disk was writable, as if it had never ended; an END in its place never did. Unless another
    server has written the journal since (it took the session), the session stays over and its journal goes."""
    journal_dir = tmp_path / "journal"
    h = restarted(tmp_path, journal_dir, idle_timeout_s=60.0)
    for sid in ("ended", "taken"):
        open_session(h, sid=sid)
        h.serve(h.request(sid, "first question", max_tokens=2))
    journal = SessionJournal(journal_dir, fsync=False)
    real_unlink = Path.unlink

    def read_only(path, *args, **kwargs):
        if path.parent == journal_dir:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", read_only)
    h.clock.t += 61
    h.sched.run_once()  # housekeeping: both idle past the timeout
    assert h.sched.store.get("ended") is None and h.sched.store.get("taken") is None
    assert "session 'ended': could not delete its journal" in caplog.text
    monkeypatch.setattr(Path, "unlink", real_unlink)  # the disk is writable again
    second = restarted(tmp_path, journal_dir)  # another server takes "taken" meanwhile
    assert second.serve(second.request("taken", "elsewhere", start=True, resume=True, max_tokens=2)).error is None
    resumed = h.serve(h.request("ended", "again?", max_tokens=2, start=True, resume=True))
    assert resumed.error is not None and resumed.error.field == "resume" and resumed.error.status is Status.NOT_FOUND
    assert not journal.path("ended").exists()  # deleted at that resume
    taken = h.serve(h.request("taken", "and back here?", max_tokens=2, start=True, resume=True))
    assert taken.error is None and taken.path == "rebuild"  # the other server's journal, reopened
    assert journal.path("taken").exists()
