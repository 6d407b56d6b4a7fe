"""Session journals: round trips, torn and corrupt tails, bad headers, unsafe ids."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prepos import journal as journal_module
from prepos.journal import CHANGED, DELETED, MAGIC, JournalEntry, SessionJournal, UnusableJournal

ENTRIES = [
    JournalEntry((1, 2, 3), "system", None),
    JournalEntry((4, 5), "user", ("yes", "no")),
    JournalEntry((6, 7, 8, 9), "tool", ("état", "日本語", "🙂")),
]


def written(tmp_path, session_id="s", entries=ENTRIES, fsync=False):
    journal = SessionJournal(tmp_path / "j", fsync=fsync)
    journal.create(session_id)
    for entry in entries:
        journal.append(session_id, entry)
    return journal


def record_offsets(path):
    """Start offset of every record after the magic (header first), and the file size."""
    data = path.read_bytes()
    offsets, offset = [], len(MAGIC)
    while offset < len(data):
        offsets.append(offset)
        length = int.from_bytes(data[offset:offset + 4], "little")
        offset += 8 + length
    assert offset == len(data)
    return offsets, len(data)


@pytest.mark.parametrize("session_id", ["chat-1", 7, 2**64 - 1, "ünïcødé 🙂", "5"])
@pytest.mark.parametrize("fsync", [False, True])
def test_round_trip_keeps_entries_and_id_type(tmp_path, session_id, fsync):
    journal = written(tmp_path, session_id, fsync=fsync)
    got = journal.recover(session_id)
    assert got.session_id == session_id and type(got.session_id) is type(session_id)
    assert got.turns == [(1, 2, 3), (4, 5), (6, 7, 8, 9)]
    assert got.token_log == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert (got.last_role, got.last_choices) == ("tool", ("état", "日本語", "🙂"))
    assert (got.num_entries, got.dropped_tail_bytes) == (3, 0)
    assert journal.session_ids() == [session_id] and type(journal.session_ids()[0]) is type(session_id)


def test_fsync_is_called_on_create_and_append_when_configured(tmp_path, monkeypatch):
    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(journal_module.os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd)))
    journal = SessionJournal(tmp_path, fsync=True)
    journal.create("s")
    num_create = len(calls)
    journal.append("s", ENTRIES[0])
    assert num_create >= 2  # the file and its directory
    assert len(calls) == num_create + 1
    calls.clear()
    quiet = SessionJournal(tmp_path, fsync=False)
    quiet.append("s", ENTRIES[1])
    assert calls == []
    assert journal.recover("s").turns == [(1, 2, 3), (4, 5)]


def test_empty_journal_recovers_with_defaults(tmp_path):
    journal = written(tmp_path, entries=[])
    got = journal.recover("s")
    assert (got.token_log, got.turns, got.last_role, got.last_choices, got.num_entries) == ([], [], "user", None, 0)


def test_no_journal_is_none_and_append_without_one_raises(tmp_path):
    journal = SessionJournal(tmp_path)
    assert journal.recover("absent") is None
    with pytest.raises(FileNotFoundError):
        journal.append("absent", ENTRIES[0])


def test_create_replaces_an_old_journal_and_replace_rewrites_it(tmp_path):
    journal = written(tmp_path)
    journal.create("s")
    assert journal.recover("s").turns == []
    journal.replace("s", ENTRIES[1:])
    got = journal.recover("s")
    assert got.turns == [(4, 5), (6, 7, 8, 9)] and got.last_role == "tool"
    assert [p.name for p in (tmp_path / "j").iterdir()] == [journal.path("s").name]  # no temp file left


def test_int_and_str_ids_are_different_sessions(tmp_path):
    journal = SessionJournal(tmp_path)
    journal.create(5)
    journal.append(5, ENTRIES[0])
    journal.create("5")
    assert journal.recover(5).turns == [(1, 2, 3)]
    assert journal.recover("5").turns == []
    assert journal.path(5) != journal.path("5")
    assert sorted(journal.session_ids(), key=repr) == sorted([5, "5"], key=repr)


def test_delete_removes_the_journal_and_tolerates_absence(tmp_path):
    journal = written(tmp_path)
    journal.delete("s")
    assert journal.recover("s") is None and journal.session_ids() == []
    journal.delete("s")


def test_truncated_last_record_at_every_offset_keeps_earlier_entries(tmp_path, caplog):
    journal = written(tmp_path)
    path = journal.path("s")
    full = path.read_bytes()
    offsets, size = record_offsets(path)
    last_start = offsets[-1]
    for cut in range(last_start + 1, size):
        path.write_bytes(full[:cut])
        with caplog.at_level(logging.WARNING, logger="prepos.journal"):
            got = journal.recover("s")
        assert got.turns == [(1, 2, 3), (4, 5)], cut
        assert (got.last_role, got.last_choices) == ("user", ("yes", "no"))
        assert got.dropped_tail_bytes == cut - last_start
        assert path.stat().st_size == last_start  # the torn tail is cut off the file
        assert "bytes dropped" in caplog.text
        caplog.clear()
    path.write_bytes(full[:last_start])
    assert journal.recover("s").dropped_tail_bytes == 0
    journal.append("s", ENTRIES[2])  # appends after a repaired tail are readable again
    assert journal.recover("s").turns == [(1, 2, 3), (4, 5), (6, 7, 8, 9)]


@pytest.mark.parametrize("where", ["frame", "payload"])
def test_corrupt_middle_record_drops_it_and_everything_after(tmp_path, where, caplog):
    journal = written(tmp_path)
    path = journal.path("s")
    data = bytearray(path.read_bytes())
    offsets, size = record_offsets(path)
    middle = offsets[2]  # header, entry 0, entry 1 (the middle entry), entry 2
    data[middle + (5 if where == "frame" else 12)] ^= 0x40
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="prepos.journal"):
        got = journal.recover("s")
    assert got.turns == [(1, 2, 3)] and got.last_role == "system"
    assert got.dropped_tail_bytes == size - middle
    assert "record checksum mismatch" in caplog.text or "bad record length" in caplog.text


def test_huge_length_field_is_corruption_not_an_allocation(tmp_path):
    journal = written(tmp_path)
    path = journal.path("s")
    offsets, _ = record_offsets(path)
    data = bytearray(path.read_bytes())
    data[offsets[1]:offsets[1] + 4] = (0xFFFFFFFF).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    assert journal.recover("s").turns == []


@pytest.mark.parametrize("damage", ["magic", "header_crc", "empty_file", "header_cut", "other_id"])
def test_bad_header_is_none_with_a_warning(tmp_path, damage, caplog):
    journal = written(tmp_path)
    path = journal.path("s")
    data = bytearray(path.read_bytes())
    if damage == "magic":
        data[7] = 0x02  # a future format version
    elif damage == "header_crc":
        data[len(MAGIC) + 10] ^= 0x01
    elif damage == "empty_file":
        data = bytearray()
    elif damage == "header_cut":
        data = data[:len(MAGIC) + 6]
    else:  # a file holding another session under this id's name
        other = SessionJournal(tmp_path / "other")
        other.create("t")
        data = bytearray(other.path("t").read_bytes())
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="prepos.journal"), pytest.raises(UnusableJournal) as unusable:
        journal.recover("s")
    assert "left as it is, not reopened" in caplog.text
    assert ("another session, 't'" in str(unusable.value)) == (damage == "other_id")
    if damage != "other_id":
        assert journal.session_ids() == []
    assert path.read_bytes() == bytes(data)  # left for inspection; the next create replaces it


@pytest.mark.parametrize("session_id", [
    "../../etc/passwd", "a/b", "..", "/", "nul\x00id", "x" * 100_000, "\udc80", "line\nbreak", "",
])
def test_unsafe_ids_stay_inside_the_directory(tmp_path, session_id):
    directory = tmp_path / "j"
    journal = written(tmp_path, session_id)
    assert journal.path(session_id).parent == directory
    assert [p.name for p in directory.iterdir()] == [journal.path(session_id).name]
    assert [p.name for p in tmp_path.iterdir()] == ["j"]
    assert journal.recover(session_id).turns == [(1, 2, 3), (4, 5), (6, 7, 8, 9)]
    assert journal.session_ids() == [session_id]
    journal.delete(session_id)
    assert list(directory.iterdir()) == []


def test_non_id_types_are_refused(tmp_path):
    journal = SessionJournal(tmp_path)
    for bad in (True, 1.5, None, b"bytes"):
        with pytest.raises(TypeError):
            journal.create(bad)


def test_failed_append_leaves_no_torn_record(tmp_path, monkeypatch):
    journal = written(tmp_path)
    real_write = os.write

    def half_write_then_fail(fd, data):
        if len(data) > 4:
            real_write(fd, bytes(data[:len(data) // 2]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal_module.os, "write", half_write_then_fail)
    with pytest.raises(OSError):
        journal.append("s", JournalEntry((10, 11, 12), "user", None))
    monkeypatch.setattr(journal_module.os, "write", real_write)
    journal.append("s", JournalEntry((13,), "user", None))
    got = journal.recover("s")
    assert got.turns == [(1, 2, 3), (4, 5), (6, 7, 8, 9), (13,)] and got.dropped_tail_bytes == 0


def test_two_handles_on_one_directory_see_each_others_writes(tmp_path):
    first, second = SessionJournal(tmp_path), SessionJournal(tmp_path)  # two replicas on one volume
    first.create("s")
    first.append("s", ENTRIES[0])
    second.append("s", ENTRIES[1])  # the session moved to the other replica
    assert first.recover("s").turns == [(1, 2, 3), (4, 5)]


entries_strategy = st.lists(
    st.builds(
        JournalEntry,
        st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=20).map(tuple),
        st.text(max_size=8),
        st.none() | st.lists(st.text(min_size=1, max_size=6), max_size=4).map(tuple),
    ),
    max_size=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=entries_strategy, session_id=st.text(max_size=12) | st.integers(0, 2**64 - 1),
       cut_fraction=st.floats(0.0, 1.0))
def test_random_entries_and_truncation_keep_a_prefix(tmp_path_factory, entries, session_id, cut_fraction):
    journal = SessionJournal(tmp_path_factory.mktemp("j"), fsync=False)
    journal.create(session_id)
    for entry in entries:
        journal.append(session_id, entry)
    got = journal.recover(session_id)
    assert got.turns == [e.token_ids for e in entries]
    path = journal.path(session_id)
    offsets, size = record_offsets(path)
    cut = offsets[1] + round(cut_fraction * (size - offsets[1])) if len(offsets) > 1 else size
    path.write_bytes(path.read_bytes()[:cut])
    got = journal.recover(session_id)
    entry_ends = [*offsets[2:], size] if entries else []
    num_whole = sum(1 for end in entry_ends if end <= cut)  # entries whose record ends by the cut
    assert got.turns == [e.token_ids for e in entries[:num_whole]]
    last = entries[num_whole - 1] if num_whole else None
    assert (got.last_role, got.last_choices) == ((last.role, last.choices) if last else ("user", None))
    assert got.session_id == session_id and type(got.session_id) is type(session_id)


def test_stale_temp_files_of_interrupted_creates_are_removed(tmp_path):
    journal = written(tmp_path)
    stale, fresh = tmp_path / "j" / ".abc.1.tmp", tmp_path / "j" / ".abc.2.tmp"
    stale.write_bytes(MAGIC)
    fresh.write_bytes(MAGIC)  # another process may be writing it right now
    old = os.stat(stale).st_mtime - journal_module.STALE_TEMP_S - 1
    os.utime(stale, (old, old))
    SessionJournal(tmp_path / "j")
    assert not stale.exists() and fresh.exists()
    assert journal.recover("s").num_entries == 3 and journal.session_ids() == ["s"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=entries_strategy.filter(bool), where=st.floats(0.0, 1.0, exclude_max=True), flip=st.integers(1, 255))
def test_a_flipped_byte_keeps_exactly_the_entries_before_its_record(tmp_path_factory, entries, where, flip):
    journal = SessionJournal(tmp_path_factory.mktemp("j"), fsync=False)
    journal.create("s")
    for entry in entries:
        journal.append("s", entry)
    path = journal.path("s")
    offsets, size = record_offsets(path)
    data = bytearray(path.read_bytes())
    position = offsets[1] + int(where * (size - offsets[1]))
    data[position] ^= flip
    path.write_bytes(bytes(data))
    num_before = sum(1 for start in offsets[2:] if start <= position)  # whole entries before the damaged record
    got = journal.recover("s")
    assert got.turns == [e.token_ids for e in entries[:num_before]]
    assert got.dropped_tail_bytes == size - offsets[1 + num_before]


def test_a_journal_another_server_reopened_or_wrote_since_is_not_deleted_if_unchanged_is_asked(tmp_path):
    mine, other = SessionJournal(tmp_path, fsync=False), SessionJournal(tmp_path, fsync=False)
    for sid in ("reopened", "written", "replaced", "untouched"):
        mine.create(sid)
        mine.append(sid, ENTRIES[0])
    assert [mine.change_elsewhere(sid) for sid in ("reopened", "written", "replaced", "untouched")] == [None] * 4
    assert other.recover("reopened") is not None  # read back to reopen: touched
    other.recover("written")
    other.append("written", ENTRIES[1])
    other.replace("replaced", ENTRIES[:1])
    assert [mine.change_elsewhere(sid) for sid in ("reopened", "written", "replaced", "untouched")] == \
        [CHANGED, CHANGED, CHANGED, None]
    assert other.change_elsewhere("untouched") is None  # no note of it there: nothing to tell
    for sid in ("reopened", "written", "replaced"):
        assert not mine.delete(sid, only_if_unchanged=True) and mine.path(sid).exists()
    assert mine.delete("untouched", only_if_unchanged=True) and not mine.path("untouched").exists()
    assert not mine.delete("untouched", only_if_unchanged=True)  # none left
    assert mine.delete("reopened") and not mine.path("reopened").exists()  # an END deletes it whoever wrote it
    assert other.delete("written", only_if_unchanged=True)  # the server that wrote it last may


def test_a_journal_another_server_deleted_tells_that_the_session_ended_there(tmp_path):
    mine, other = SessionJournal(tmp_path / "j", fsync=False), SessionJournal(tmp_path / "j", fsync=False)
    for sid in ("ended", "kept"):
        mine.create(sid)
        mine.append(sid, ENTRIES[0])
    assert mine.change_elsewhere("ended") is None
    other.recover("ended")
    assert other.delete("ended")
    assert mine.change_elsewhere("ended") == DELETED
    assert mine.change_elsewhere("kept") is None and other.change_elsewhere("never-seen") is None
    assert mine.delete("ended") and mine.change_elsewhere("ended") is None  # closed here too: no note left
    shutil.rmtree(tmp_path / "j")  # the whole directory gone (a volume that went away): tells nothing
    assert mine.change_elsewhere("kept") is None


@pytest.mark.parametrize("written_before_failing", [0, 1, 2])  # nothing, half the record, all but its fsync
def test_a_failed_append_is_not_taken_for_another_servers_write(tmp_path, monkeypatch, written_before_failing):
    # The cut-back after a failed write touches the file; it is this server's own doing, not a takeover.
    mine, other = SessionJournal(tmp_path, fsync=True), SessionJournal(tmp_path, fsync=False)
    for sid in ("mine", "taken"):
        mine.create(sid)
        mine.append(sid, ENTRIES[0])
    other.append("taken", ENTRIES[1])  # another server wrote it: that must still show after the failure
    real_write, real_fsync = os.write, os.fsync

    def failing_write(fd, data):
        if written_before_failing == 2:
            return real_write(fd, data)
        if written_before_failing == 1 and len(data) > 4:
            real_write(fd, bytes(data[:len(data) // 2]))
        raise OSError(28, "No space left on device")

    def failing_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(journal_module.os, "write", failing_write)
    if written_before_failing == 2:
        monkeypatch.setattr(journal_module.os, "fsync", failing_fsync)
    for sid in ("mine", "taken"):
        size = mine.path(sid).stat().st_size
        with pytest.raises(OSError):
            mine.append(sid, JournalEntry((10, 11, 12), "user", None))
        assert mine.path(sid).stat().st_size == size
    monkeypatch.setattr(journal_module.os, "write", real_write)
    monkeypatch.setattr(journal_module.os, "fsync", real_fsync)
    assert mine.change_elsewhere("mine") is None
    assert mine.change_elsewhere("taken") == CHANGED
    assert mine.delete("mine", only_if_unchanged=True)  # an idle timeout deletes it, as after no failure


def test_a_journal_on_a_read_only_file_system_is_still_read_back(tmp_path, monkeypatch, caplog):
    journal = written(tmp_path)

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(journal_module.os, "utime", read_only)
    with caplog.at_level(logging.WARNING, logger="prepos.journal"):
        assert journal.recover("s").turns == [(1, 2, 3), (4, 5), (6, 7, 8, 9)]
    assert "could not mark it reopened (Read-only file system)" in caplog.text


def test_a_journal_that_cannot_be_looked_at_is_not_taken_for_another_servers_write(tmp_path, monkeypatch):
    journal = written(tmp_path)

    class Failing(type(journal.path("s"))):
        def stat(self, *args, **kwargs):
            raise OSError(5, "Input/output error")

    failing = Failing(journal.path("s"))
    monkeypatch.setattr(journal, "path", lambda session_id: failing)
    assert journal.change_elsewhere("s") is None
