"""Where session state lives: the open sessions, their KV under the memory budget, and their journals.

Owned by the engine loop (not thread-safe). The token log is the source of
truth and is never dropped while a session is open; over the KV budget the
least valuable state goes first:

0. the engine's kept prefixes (closed sessions' opening turns, kept for
   later sessions to copy), least recently copied first;
1. speculative state (the positioned distribution and the KV of its
   speculative tokens) of idle sessions, and the KV of an answer stopped
   before its turn was accepted, least recently active first;
2. the whole KV of idle sessions, in the eviction policy's order (those whose
   KV other sessions all hold by reference, which would free nothing, after
   the rest); the session is rebuilt from its log on its next request (path
   ``rebuild``);
3. for background work, finally, the KV it was building.

With a journal, every accepted turn is written before it is acknowledged, a
session this server does not hold is reopened from its journal, and closing a
session deletes its journal.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Sequence

from prepos.engines.base import Engine
from prepos.journal import UnusableJournal
from prepos.memory import KvLedger
from prepos.metrics import Metrics
from prepos.protocol import ProtocolError, Status
from prepos.session import Session, SessionStore

if TYPE_CHECKING:
    from prepos.journal import SessionJournal

log = logging.getLogger("prepos.residency")

JOURNAL_EXPIRY_INTERVAL_S = 3600.0
"""How often expired journals are looked for (and at the first housekeeping, right after the start)."""
KEPT_PREFIXES = ("kept prefixes",)
"""The ledger's entry for the engine's kept prefixes (closed sessions' opening turns); no session id is a tuple."""


def foreign_token(turns: Sequence[Sequence[int]], vocab_size: int) -> str:
    """The first token id of ``turns`` outside ``[0, vocab_size)``, described (``turn 3 holds token id 50000,
    outside this model's vocabulary [0, 49152)``); empty when there is none."""
    for index, turn in enumerate(turns):
        for token_id in turn:
            if not 0 <= token_id < vocab_size:
                return (f"turn {index + 1} holds token id {token_id}, outside this model's vocabulary "
                        f"[0, {vocab_size})")
    return ""


class Residency:
    """Open sessions, their KV bytes against the budget, and their journals."""

    def __init__(self, *, engine: Engine, metrics: Metrics, max_sessions: int, kv_budget_bytes: int,
                 eviction_policy: str, journal: SessionJournal | None, clock: Callable[[], float],
                 journal_expire_s: float = 0.0):
        self.store = SessionStore(max_sessions)
        self._journal_expire_s = journal_expire_s  # 0: journals never expire
        self._next_expiry = 0.0  # clock time of the next expire_journals pass
        # Ended sessions whose journal could not be deleted, each to whether its deletion waits on the journal being
        # left unchanged (an idle timeout's: another server may take the session meanwhile) or not (an END's).
        self._undeleted: dict[str | int, bool] = {}
        self.kv = KvLedger(kv_budget_bytes, eviction_policy, kv_total=engine.kv_total_bytes)
        self._engine = engine
        self._metrics = metrics
        self._journal = journal
        self._clock = clock
        self.on_evict: Callable[[Session], None] = lambda session: None  # the scheduler stops work for it

    # --- lifecycle -----------------------------------------------------

    def open(self, session_id: str | int, *, journaled: bool = True) -> Session:
        """A new session (START); its journal starts empty, replacing any left under the same id. Not
        ``journaled`` (a START+END request: the session ends with the request that opens it, and nothing could
        resume it), it has none; a journal left under its id is deleted when it closes, as any is, if it took a
        turn: one that took none (a bare START+END, as a client sends to give back the slot of a refused START,
        or one refused) changed nothing, and leaves that journal as it was."""
        session = self.store.open(session_id, self._clock())
        session.journaled = journaled
        if self._journal is not None and journaled:
            replaced = self._journal.path(session_id).is_file()
            try:
                self._journal.create(session_id)
            except OSError as err:
                self.store.close(session_id)
                log.error("session %r: could not create its journal %s: %s", session_id,
                          self._journal.path(session_id), err)
                raise ProtocolError("journal", f"could not create the session journal ({err.strerror or err})",
                                    Status.UNAVAILABLE) from None
            if replaced:  # kept by a drain or left by a crash: a START with resume would have continued it
                log.warning("session %r: START without resume replaced the journal of an earlier session under this "
                            "id (its turns are gone)", session_id)
            self._undeleted.pop(session_id, None)
        self._metrics.session_opened()
        return session

    def recover(self, session_id: str | int) -> Session | None:
        """Reopen a session this server does not hold from its journal (a restart, or a replica taking
        over); its KV is rebuilt from the log on its next request (path ``rebuild``). None: no journal, or
        one this server failed to delete when the session closed (it is deleted now, if it can be), unless another
        server has written it since an idle timeout's failed deletion (it took the session: reopened from it).

        Raises ProtocolError (UNAVAILABLE) when the journal cannot be read."""
        if self._journal is None:
            return None
        if session_id in self._undeleted and self._delete_undeleted(session_id):
            return None
        try:
            recovered = self._journal.recover(session_id)
        except OSError as err:
            log.error("session %r: could not read its journal: %s", session_id, err)
            raise ProtocolError("journal", f"could not read the session journal ({err.strerror or err})",
                                Status.UNAVAILABLE) from None
        except UnusableJournal as err:
            raise ProtocolError("journal", f"the session journal cannot reopen it ({err}); it is left as it is on "
                                "the server, for inspection; send START without resume to begin a new session, "
                                "which replaces it", Status.INTERNAL) from None
        if recovered is None:
            return None
        problem = foreign_token(recovered.turns, self._engine.info.vocab_size)
        if problem:  # every answer would fail on it: refused now, naming the journal, as an unreadable one is
            log.error("session %r: its journal cannot reopen it: %s", session_id, problem)
            raise ProtocolError("journal", f"the session journal cannot reopen it ({problem}: written by a server "
                                "with another model?); it is left as it is on the server, for inspection; send START "
                                "without resume to begin a new session, which replaces it", Status.INTERNAL)
        session = self.store.open(session_id, self._clock())
        for turn in recovered.turns:
            session.append(turn)
        session.last_role, session.last_choices = recovered.last_role, recovered.last_choices
        session.evicted = True
        self._metrics.session_recovered()
        log.info("session %r reopened from its journal: %d turns, %d tokens", session_id, len(recovered.turns),
                 len(session.token_log))
        return session

    def change_elsewhere(self, session: Session) -> str | None:
        """What another server did to the session's journal since this one last wrote or read it (``CHANGED``: its
        client moved there, a replica lost for a moment behind the router, say, and may have taken turns there;
        ``DELETED``: the session was ended there), either of which makes this server's copy stale; None without a
        journal or a change (:meth:`prepos.journal.SessionJournal.change_elsewhere`)."""
        return None if self._journal is None else self._journal.change_elsewhere(session.session_id)

    def close(self, session: Session, reason: str, *, keep_journal: bool = False,
              journal_if_unchanged: bool = False) -> None:
        """Forget the session: its KV is released (the engine may keep its opening turn's for later sessions to
        copy) and its journal deleted, unless ``keep_journal`` (a drain: the session resumes after the restart or
        on another replica), or, with ``journal_if_unchanged`` (an idle timeout), unless another server has
        reopened or written the journal since this one last did (it holds the session now)."""
        opening = session.turn_starts[1] if len(session.turn_starts) > 1 else len(session.token_log)
        kept = session.has_kv and self._engine.keep_prefix(session.session_id, opening)
        self.release_kv(session)
        self._record_kept()
        self.store.close(session.session_id)
        took_nothing = not session.journaled and not session.token_log  # see open
        if self._journal is not None and not keep_journal and not took_nothing:
            try:
                self._journal.delete(session.session_id, only_if_unchanged=journal_if_unchanged)
            except FileNotFoundError as err:
                if session.journaled:  # one that never had a journal (START and END together) leaves nothing
                    self._remember_undeleted(session, err, journal_if_unchanged)
            except OSError as err:
                self._remember_undeleted(session, err, journal_if_unchanged)
        log.info("session %r closed (%s), %d tokens in its log%s", session.session_id, reason, len(session.token_log),
                 f"; its opening turn ({opening} tokens) is kept for later sessions to copy" if kept else "")

    def _remember_undeleted(self, session: Session, err: OSError, journal_if_unchanged: bool) -> None:
        """Log that the journal of a closed session could not be deleted: the session is over, and its journal is
        deleted later (:meth:`delete_undeleted`), never reopened here; after an idle timeout (``journal_if_unchanged``)
        only while no other server has written it (one that did holds the session)."""
        log.error("session %r: could not delete its journal: %s; this server will not reopen the session from it%s, "
                  "and tries again at its next reopening, hourly and at the drain before a stop", session.session_id,
                  err, " unless another server writes it meanwhile" if journal_if_unchanged else "")
        self._undeleted[session.session_id] = journal_if_unchanged

    def expire_journals(self) -> int:
        """Delete the journals of sessions this server does not hold that were not written for
        ``journal_expire_s`` (:meth:`prepos.journal.SessionJournal.expire`), at most once every
        :data:`JOURNAL_EXPIRY_INTERVAL_S`; returns how many went. Journals of ended sessions that could not be
        deleted then are tried again too."""
        now = self._clock()
        if self._journal is None or now < self._next_expiry:
            return 0
        self._next_expiry = now + JOURNAL_EXPIRY_INTERVAL_S
        self.delete_undeleted()
        if not self._journal_expire_s:
            return 0
        held = {self._journal.path(session.session_id) for session in self.store}
        expired = self._journal.expire(self._journal_expire_s, keep=held)
        if expired:
            self._metrics.journals_expired(expired)
            log.info("%d session journals expired (not written for %g s, sessions no client came back for)",
                     expired, self._journal_expire_s)
        return expired

    def delete_undeleted(self) -> None:
        """Try again to delete the journals of ended sessions that could not be deleted when they closed."""
        for session_id in list(self._undeleted):
            self._delete_undeleted(session_id)

    def _delete_undeleted(self, session_id: str | int) -> bool:
        """Try again to delete the journal of a session that ended while it could not be deleted (a read-only or
        failing disk). Returns whether the session stays over: False when it was an idle timeout's and another
        server has written the journal since (it holds the session now), or that journal is gone."""
        try:
            deleted = self._journal.delete(session_id, only_if_unchanged=self._undeleted[session_id])
        except OSError as err:
            log.warning("session %r: its journal still cannot be deleted: %s", session_id, err)
            return True
        del self._undeleted[session_id]
        if deleted:
            log.info("session %r: its journal, left when the session ended, is deleted", session_id)
        return deleted

    # --- the token log -------------------------------------------------

    def accept(self, session: Session, turn_ids: Sequence[int], role: str, choices: tuple[str, ...] | None,
               kept: Sequence[Sequence[int]] | None = None) -> None:
        """Accept a turn: journal it (durable before it is acknowledged), then append it to the log. With
        ``kept`` (the turns the context overflow policy keeps to make room), the log becomes those turns first,
        and the journal is replaced by them and the new turn in one write.

        Raises ProtocolError (UNAVAILABLE) and changes nothing when the journal cannot be written.
        """
        if self._journal is not None and session.journaled and (turn_ids or kept is not None):
            from prepos.journal import JournalEntry

            if kept is None:
                entry = JournalEntry(tuple(turn_ids), role, choices)
                self._write_journal(session, lambda: self._journal.append(session.session_id, entry))
            else:
                entries = [JournalEntry(tuple(turn), role, choices) for turn in [*kept, turn_ids] if turn]
                self._write_journal(session, lambda: self._journal.replace(session.session_id, entries))
        if kept is not None:
            dropped = len(session.turn_starts) - len(kept)
            session.replace_turns(kept)
            self._metrics.turns_dropped(dropped)
            log.info("session %r: dropped its %d oldest turns to fit the context", session.session_id, dropped)
        session.append(turn_ids)
        session.last_role, session.last_choices = role, choices

    def _write_journal(self, session: Session, write: Callable[[], None]) -> None:
        try:
            write()
        except OSError as err:
            log.error("session %r: its journal write failed, the turn was not accepted: %s (%s)", session.session_id,
                      err.strerror or err, self._journal.path(session.session_id))
            raise ProtocolError("journal", f"could not write the session journal ({err.strerror or err}); "
                                "the turn was not accepted", Status.UNAVAILABLE) from None

    # --- memory --------------------------------------------------------

    def note_kv(self, session: Session, background: bool = False) -> None:
        """Record the session's KV (and positioned distribution) bytes; over the budget, free state in the
        order of the module docstring. Background work may only displace sessions less recently active
        than its own; when that is not enough, it gives way itself."""
        session.has_kv, session.evicted = True, False
        self._record(session)
        self._record_kept()  # the engine may have dropped some to make room
        self._free_idle(protect=session, older_than=session.last_active_s if background else None)
        if background and self.kv.over_budget:
            self.evict(session)

    def fit(self) -> None:
        """Over the budget, free idle sessions' state in the order of the module docstring until under it, or
        until only sessions being served hold KV. For when a request ends: while every session holding KV was
        being served, the budget could not be kept, and nothing else would bring it back under until the next
        session's KV changes."""
        if self.kv.over_budget:  # the kept prefixes' bytes, recorded when they last changed, make it cheap to ask
            self._record_kept()
            self._free_idle(protect=None, older_than=None)

    def _free_idle(self, *, protect: Session | None, older_than: float | None) -> None:
        if not self.kv.over_budget:
            return
        victims = self.kv.victims(self.store, protect=protect, older_than=older_than, now_s=self._clock())
        for victim in victims:
            if not self.kv.over_budget:
                return
            if victim.positioned is not None:
                self._drop_speculative(victim)
            elif len(self._engine.cached_token_ids(victim.session_id)) > len(victim.token_log):
                # Past the log the KV holds a pre-positioning under way (it stops) or the tokens of an answer
                # stopped before its turn was accepted: speculative too, they go before any accepted KV.
                self.on_evict(victim)
                self._drop_speculative(victim)
        # A session whose KV other sessions hold too (shared by reference) frees nothing when it goes: it waits
        # until those that do free bytes have gone, and by then it may hold its pages alone.
        frees_nothing = []
        for victim in victims:
            if not self.kv.over_budget:
                return
            if self._engine.kv_release_bytes(victim.session_id) == 0:
                frees_nothing.append(victim)
            else:
                self.evict(victim)
        for victim in frees_nothing:
            if not self.kv.over_budget:
                return
            self.evict(victim)

    def _record_kept(self) -> None:
        """Record the kept prefixes' bytes; over the budget, drop them, least recently copied first."""
        self.kv.record(KEPT_PREFIXES, self._engine.kept_prefix_bytes())
        while self.kv.over_budget and self._engine.drop_kept_prefix():
            self.kv.record(KEPT_PREFIXES, self._engine.kept_prefix_bytes())

    def _record(self, session: Session) -> None:
        positioned_bytes = session.positioned.logits.nbytes if session.positioned is not None else 0
        self.kv.record(session.session_id, self._engine.kv_bytes(session.session_id), positioned_bytes)

    def _drop_speculative(self, victim: Session) -> None:
        self._engine.truncate(victim.session_id, len(victim.token_log))
        victim.positioned = None
        self._record(victim)
        self._metrics.evicted("speculative")

    def evict(self, victim: Session) -> None:
        """Drop one session's KV; its next request rebuilds it from the token log."""
        self.on_evict(victim)
        self.release_kv(victim)
        victim.mark_evicted()
        self._metrics.evicted("kv")
        log.info("session %r KV evicted (over the %d-byte budget)", victim.session_id, self.kv.budget_bytes)

    def release_kv(self, session: Session) -> None:
        self._engine.release(session.session_id)
        self.kv.forget(session.session_id)
        session.mark_kv(False)
