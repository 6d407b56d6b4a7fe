"""Durable session journals: every accepted turn, on disk before it is acknowledged.

One append-only file per session in a journal directory (a volume; replicas
that take over each other's sessions share it). A restarted server, or the
replica that now owns the session, reopens it from its journal and rebuilds its
KV from the recovered token log on the next request. Closing a session deletes
its journal.

File format (version 1)::

    magic  b"PREPOSJ\\x01"
    record*  = length (uint32 LE) | crc32 (uint32 LE) | kind (1 byte) | payload (length - 1 bytes)

The CRC covers kind and payload. The first record is the header (kind ``H``,
JSON ``{"session_id": ..., "id_type": "str"|"int"}``); every later record is one
entry (kind ``E``, JSON ``{"t": [token ids], "r": role, "c": [choices] | null}``).

Contracts:

- File names never come from the id itself: they are a SHA-256 of the
  type-tagged id (``int 5`` and ``str "5"`` are different sessions with
  different files), so no id can reach outside the directory. The header holds
  the real id and its type; a header that does not match the id asked for is
  treated as no journal.
- :meth:`SessionJournal.create` and :meth:`SessionJournal.replace` write a temp
  file and rename it over the journal (atomic for other processes sharing the
  directory); :meth:`SessionJournal.append` writes one record with ``O_APPEND``
  in one ``write`` and is durable when it returns (``fsync`` when configured);
  a failed append is cut back off, so later records never follow a torn one.
- Recovery reads records up to the first one that is incomplete, fails its CRC
  or does not parse. Everything before it is kept; that record and everything
  after it are dropped (framing after a bad record cannot be trusted) and the
  file is truncated to the last good record, with a warning. A missing or bad
  magic/header yields ``None`` with a warning, never an exception.

Used by the engine loop only (one thread); several processes may share the
directory as long as only one of them serves a given session at a time.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import struct
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterable

log = logging.getLogger("prepos.journal")

MAGIC = b"PREPOSJ\x01"
SUFFIX = ".journal"
_FRAME = struct.Struct("<II")  # length of kind + payload, crc32 of kind + payload
_HEADER, _ENTRY = b"H", b"E"
_MAX_RECORD_BYTES = 256 << 20  # a longer length field is corruption, not a record
STALE_TEMP_S = 600.0  # a temp file this old was left by a process that died while writing it


@dataclass(frozen=True)
class JournalEntry:
    """One accepted turn appended to the token log; ``role``/``choices`` are the session's
    ``last_role``/``last_choices`` after it."""

    token_ids: tuple[int, ...]
    role: str
    choices: tuple[str, ...] | None


@dataclass(frozen=True)
class RecoveredSession:
    """A session read back from its journal. ``turns`` concatenated is ``token_log``; ``last_role`` and
    ``last_choices`` are those of the last entry (``"user"``/``None`` with no entries)."""

    session_id: str | int
    token_log: list[int]
    turns: list[tuple[int, ...]]
    last_role: str
    last_choices: tuple[str, ...] | None
    num_entries: int
    dropped_tail_bytes: int  # bytes cut off the end of the file (a torn or corrupt tail); 0 when clean


CHANGED = "changed"
"""A journal another server reopened, wrote or replaced since this one last did (``change_elsewhere``)."""
DELETED = "deleted"
"""A journal another server deleted since this one last wrote or read it (``change_elsewhere``)."""


class UnusableJournal(ValueError):
    """A session's journal that exists but cannot reopen it (bad magic or header, or another session's): the text
    says what is wrong."""


class SessionJournal:
    """The journal directory: create, append, recover, replace and delete per-session journals."""

    def __init__(self, directory: str | Path, *, fsync: bool = True) -> None:
        """Use (and create, with parents) ``directory``. ``fsync``: every write reaches the disk before
        the call returns (survives a machine crash); without it a write survives a process crash only."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        # Each journal as this server last left it (inode, size, mtime): another server that reopened or wrote it
        # since (replicas sharing the directory) changed it, and it is then that server's to delete.
        self._left_as: dict[Path, tuple[int, int, int]] = {}
        self._remove_stale_temps()

    # --- writing -------------------------------------------------------

    def create(self, session_id: str | int) -> None:
        """Start an empty journal for a new session (START), atomically replacing any old one for this id.
        Raises OSError on failure (no journal is left half-written)."""
        self.replace(session_id, ())

    def replace(self, session_id: str | int, entries: Iterable[JournalEntry]) -> None:
        """Atomically replace the session's journal by one holding exactly ``entries`` (e.g. after old
        turns were dropped from its log). Raises OSError on failure, leaving the old journal as it was."""
        data = b"".join([MAGIC, _record(_HEADER, _header_payload(session_id)),
                         *(_record(_ENTRY, _entry_payload(entry)) for entry in entries)])
        path = self.path(session_id)
        tmp = self.directory / f".{path.stem}.{uuid.uuid4().hex}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _write_all(fd, data)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        if self.fsync:
            self._fsync_directory()
        self._note(path)

    def append(self, session_id: str | int, entry: JournalEntry) -> None:
        """Append one entry; durable (written, and fsync'ed when configured) when this returns.
        Raises OSError on failure (FileNotFoundError when the session has no journal); a partly written
        record is cut off again so the journal stays readable."""
        record = _record(_ENTRY, _entry_payload(entry))
        path = self.path(session_id)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            before = os.fstat(fd)
            try:
                _write_all(fd, record)
                if self.fsync:
                    os.fsync(fd)
            except OSError:
                try:
                    if os.fstat(fd).st_size != before.st_size:
                        os.ftruncate(fd, before.st_size)
                except OSError:
                    pass  # recovery drops the torn tail
                else:
                    # The cut-back (a write, as far as the file's times go) is this server's own: unless another
                    # server had changed the journal before it, this server's note follows it.
                    if self._left_as.get(path) == _identity(before):
                        self._left_as[path] = _identity(os.fstat(fd))
                raise
            # This server's note follows its own write, unless another server had written the journal since this
            # one last did (a turn of the session's client taken there meanwhile): then the note stays behind, and
            # change_elsewhere() says CHANGED, so this server goes on from the journal, where both turns are.
            after, noted = os.fstat(fd), self._left_as.get(path)
            if noted is None or (noted == _identity(before) and after.st_size == before.st_size + len(record)):
                self._left_as[path] = _identity(after)
        finally:
            os.close(fd)

    def expire(self, older_than_s: float, keep: Collection[Path] = ()) -> int:
        """Delete the journals not written for more than ``older_than_s`` seconds, but those in ``keep`` (the
        sessions this server holds); returns how many. They are sessions whose client never came back to resume
        them after a drain or a crash. A journal is written at every accepted turn, and read back (which counts
        as written) when a session is reopened from it."""
        now = time.time()
        expired = 0
        for path in self.directory.glob(f"*{SUFFIX}"):
            if path in keep:
                continue
            try:
                if now - path.stat().st_mtime > older_than_s:
                    path.unlink()
                    self._left_as.pop(path, None)
                    expired += 1
            except OSError:
                continue  # deleted or reopened meanwhile
        return expired

    def delete(self, session_id: str | int, *, only_if_unchanged: bool = False) -> bool:
        """Delete the session's journal (closing: END or idle timeout); no error when there is none, but
        FileNotFoundError when the directory is gone too (its volume may come back, the journal with it). With
        ``only_if_unchanged`` (an idle timeout), not when another server has reopened or written it since this one
        last did: that server holds the session now (replicas sharing the directory). Returns whether it was
        deleted."""
        path = self.path(session_id)
        # What this server last left is forgotten only once that is settled: a deletion that failed (a read-only
        # or failing disk, the directory gone) keeps it, so that a later try of an idle timeout's compares too.
        if only_if_unchanged:
            try:
                now = _identity(path.stat())
            except FileNotFoundError:
                self._check_directory()
                self._left_as.pop(path, None)
                return False
            if now != self._left_as.get(path):
                self._left_as.pop(path, None)
                log.info("journal of session %r changed since this server last wrote it: another server holds "
                         "the session now; kept", session_id)
                return False
        try:
            path.unlink()
        except FileNotFoundError:
            self._check_directory()
        self._left_as.pop(path, None)
        return True

    def _check_directory(self) -> None:
        """FileNotFoundError when the journal directory is gone: a volume gone for a moment, which may come back with
        the journal in it (a journal missing from a directory that is there is simply not there)."""
        if not self.directory.is_dir():
            raise FileNotFoundError(errno.ENOENT, "the journal directory is gone", str(self.directory))

    def change_elsewhere(self, session_id: str | int) -> str | None:
        """What another server did to the session's journal since this one last wrote or read it (replicas sharing
        the directory), one ``stat``: :data:`CHANGED` (reopened, written or replaced: it holds the session now) or
        :data:`DELETED` (an END or its idle timeout there: the session is over), either of which makes this
        server's copy of the session stale; None when nothing was done to it, this server has no note of it, or it
        cannot be looked at (a failing file system, or its directory gone too: a volume that went away tells
        nothing of the session)."""
        path = self.path(session_id)
        left_as = self._left_as.get(path)
        if left_as is None:
            return None
        try:
            return CHANGED if _identity(path.stat()) != left_as else None
        except FileNotFoundError:
            return DELETED if self.directory.is_dir() else None
        except OSError:
            return None

    # --- reading -------------------------------------------------------

    def recover(self, session_id: str | int) -> RecoveredSession | None:
        """Read the session back; None when it has no journal. A torn or corrupt tail is dropped from the first
        bad record on, the file truncated to the last good record and a warning logged; earlier entries are kept.
        Raises OSError when the journal exists but cannot be read, and :class:`UnusableJournal` (logged) when its
        magic or header is bad or it holds another session: the file is left as it is, for inspection (a START
        without ``resume`` replaces it)."""
        path = self.path(session_id)
        try:
            os.utime(path)  # read back to reopen: written, as far as expire() is concerned
        except FileNotFoundError:
            return None
        except OSError as err:  # a read-only or failing file system: the journal may still be read
            log.warning("journal of session %r: could not mark it reopened (%s); it may expire early", session_id,
                        err.strerror or err)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        header_end = _header_or_problem(data)
        if isinstance(header_end, str):
            log.warning("journal %s of session %r: %s; left as it is, not reopened", path.name, session_id,
                        header_end)
            raise UnusableJournal(header_end)
        stored_id = header_end[0]
        if stored_id != session_id or type(stored_id) is not type(session_id):
            log.warning("journal %s holds session %r, not %r; left as it is, not reopened", path.name, stored_id,
                        session_id)
            raise UnusableJournal(f"it holds another session, {stored_id!r}")
        offset = header_end[1]
        turns: list[tuple[int, ...]] = []
        role, choices = "user", None
        problem = None
        while offset < len(data):
            record = _read_record(data, offset)
            if isinstance(record, str):
                problem = record
                break
            kind, payload, next_offset = record
            entry = _parse_entry(payload) if kind == _ENTRY else None
            if entry is None:
                problem = "unreadable entry" if kind == _ENTRY else f"unexpected record kind {kind!r}"
                break
            turns.append(entry.token_ids)
            role, choices = entry.role, entry.choices
            offset = next_offset
        dropped = len(data) - offset
        if dropped:
            log.warning("journal of session %r: %s at byte %d; %d bytes dropped, %d entries kept",
                        session_id, problem, offset, dropped, len(turns))
            self._truncate(path, offset)
        self._note(path)
        return RecoveredSession(
            session_id=session_id, token_log=[t for turn in turns for t in turn], turns=turns,
            last_role=role, last_choices=choices, num_entries=len(turns), dropped_tail_bytes=dropped,
        )

    def session_ids(self) -> list[str | int]:
        """Ids of the sessions with a readable journal header in the directory (unordered)."""
        ids = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                with open(path, "rb") as f:
                    head = f.read(len(MAGIC) + _FRAME.size)
                    if len(head) == len(MAGIC) + _FRAME.size:
                        length = _FRAME.unpack_from(head, len(MAGIC))[0]
                        head += f.read(min(length, _MAX_RECORD_BYTES))
            except OSError:
                continue  # deleted meanwhile
            header = _read_header(head, path)
            if header is not None:
                ids.append(header[0])
        return ids

    def path(self, session_id: str | int) -> Path:
        """The journal file of ``session_id``: a hash of the type-tagged id, never the id itself."""
        return self.directory / (_id_digest(session_id) + SUFFIX)

    # --- helpers -------------------------------------------------------

    def _note(self, path: Path) -> None:
        try:
            self._left_as[path] = _identity(path.stat())
        except OSError:
            self._left_as.pop(path, None)

    def _truncate(self, path: Path, size: int) -> None:
        try:
            with open(path, "r+b") as f:
                f.truncate(size)
                if self.fsync:
                    os.fsync(f.fileno())
        except OSError as err:
            log.warning("journal %s: could not cut off its bad tail: %s", path.name, err)

    def _remove_stale_temps(self) -> None:
        # Another process's create may be in flight (milliseconds): only old temp files are removed.
        now = time.time()
        for tmp in self.directory.glob(".*.tmp"):
            try:
                if now - tmp.stat().st_mtime > STALE_TEMP_S:
                    tmp.unlink()
                    log.info("removed %s, left by an interrupted journal write", tmp.name)
            except OSError:
                pass  # removed meanwhile

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _identity(stat: os.stat_result) -> tuple[int, int, int]:
    """What tells a journal file apart from itself as another writer left it: replaced, grown or touched."""
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _id_tag(session_id: str | int) -> tuple[str, str]:
    if isinstance(session_id, bool) or not isinstance(session_id, (str, int)):
        raise TypeError(f"session id must be str or int, got {type(session_id).__name__}")
    return ("int", str(session_id)) if isinstance(session_id, int) else ("str", session_id)


def _id_digest(session_id: str | int) -> str:
    kind, text = _id_tag(session_id)
    return hashlib.sha256(f"{kind}:".encode() + text.encode("utf-8", "surrogatepass")).hexdigest()


def _header_payload(session_id: str | int) -> bytes:
    kind, _ = _id_tag(session_id)
    return json.dumps({"session_id": session_id, "id_type": kind}).encode("ascii")


def _entry_payload(entry: JournalEntry) -> bytes:
    body: dict[str, Any] = {"t": [int(t) for t in entry.token_ids], "r": entry.role,
                            "c": None if entry.choices is None else list(entry.choices)}
    return json.dumps(body, separators=(",", ":")).encode("ascii")


def _record(kind: bytes, payload: bytes) -> bytes:
    body = kind + payload
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _read_record(data: bytes, offset: int) -> tuple[bytes, bytes, int] | str:
    """(kind, payload, next offset), or a description of why no whole good record starts at ``offset``."""
    if offset + _FRAME.size > len(data):
        return "truncated record frame"
    length, crc = _FRAME.unpack_from(data, offset)
    if not 1 <= length <= _MAX_RECORD_BYTES:
        return f"bad record length {length}"
    start, end = offset + _FRAME.size, offset + _FRAME.size + length
    if end > len(data):
        return "truncated record"
    body = data[start:end]
    if zlib.crc32(body) != crc:
        return "record checksum mismatch"
    return body[:1], body[1:], end


def _read_header(data: bytes, path: Path) -> tuple[str | int, int] | None:
    """(stored session id, offset of the first entry), or None (logged) when magic or header are bad."""
    header = _header_or_problem(data)
    if isinstance(header, str):
        log.warning("journal %s: %s; ignored", path.name, header)
        return None
    return header


def _header_or_problem(data: bytes) -> tuple[str | int, int] | str:
    """(stored session id, offset of the first entry), or what is wrong with magic or header."""
    if not data.startswith(MAGIC):
        return "not a prepos journal (bad magic or version)"
    record = _read_record(data, len(MAGIC))
    if isinstance(record, str):
        return record
    kind, payload, end = record
    try:
        header = json.loads(payload) if kind == _HEADER else None
        session_id, id_type = header["session_id"], header["id_type"]
        if (id_type, type(session_id)) in (("int", int), ("str", str)):
            return session_id, end
        return "header id type does not match"
    except (ValueError, TypeError, KeyError):
        return "unreadable header"


def _parse_entry(payload: bytes) -> JournalEntry | None:
    try:
        body = json.loads(payload)
        token_ids, role, choices = body["t"], body["r"], body["c"]
    except (ValueError, TypeError, KeyError):
        return None
    if not (isinstance(token_ids, list) and all(type(t) is int for t in token_ids) and isinstance(role, str)):
        return None
    if choices is not None and not (isinstance(choices, list) and all(isinstance(c, str) for c in choices)):
        return None
    return JournalEntry(tuple(token_ids), role, None if choices is None else tuple(choices))
