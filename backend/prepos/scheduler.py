"""The engine loop: foreground requests first, pre-positioning in idle windows.

Other threads only call :meth:`Scheduler.submit`. The loop owns the engine,
the session store and every session's state; its steps run under one lock, on
the loop thread, except that a submitting thread that finds the loop idle may
run the new request's first step up to its first engine call (an ``exact`` or
``gated`` answer is a scan: no thread hand-off on the fastest paths).

Work is cooperative: a foreground request is a generator that yields after
each engine call (so sessions interleave token by token). A request about to
prefill or decode yields its :class:`~prepos.serving.PrefillStep` or
:class:`~prepos.serving.DecodeStep` and waits; once every other ready session
has had one step, the waiting prefills run as one batch
(``Engine.prefill_batch``), then the waiting decodes
(``Engine.decode_batch``): one read of the weights for all of each
(:mod:`prepos.step_batches`). Pre-positioning
is a generator that yields after each layer of each chunk of at most
``chunk_tokens`` tokens (:mod:`prepos.background`, which also audits gated
answers). Before every step the loop admits new requests, and a foreground step
always goes before background work: a new request waits at most one layer of
one chunk (or one foreground step of another session).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Iterator

from prepos.background import BackgroundWork
from prepos.config import GateConfig, SchedulerConfig
from prepos.engines.base import Engine
from prepos.gate import Gate
from prepos.gate_watch import GateWatch
from prepos.journal import DELETED
from prepos.kv_writes import WriteReportingEngine
from prepos.metrics import Metrics
from prepos.protocol import (DRAIN_REASON, END_REASON, START_REJECTED_REASON, ProtocolError, Rejection, Request,
                             ResponseSink, Status, closed_all_the_same, sequence_ended_all_the_same)
from prepos.queued_deadlines import QueuedDeadlines
from prepos.residency import Residency
from prepos.scan import ScanFn
from prepos.serving import EngineStep, RequestServer
from prepos.session import Session
from prepos.step_batches import StepBatches
from prepos.template import Framing, Tokenizer
from prepos.turns import TurnBuilder

if TYPE_CHECKING:
    from prepos.journal import SessionJournal

log = logging.getLogger("prepos.scheduler")

HOUSEKEEPING_INTERVAL_S = 0.5
IDLE_REASON = "idle timeout"  # why a session closed that had no request for the session idle timeout
TAKEN_OVER_REASON = "taken over"  # why a session's stale copy was dropped: another server wrote its journal since
# prepos_sessions_closed_total's reason for each reason a session closes
CLOSED_LABELS = {END_REASON: "end", IDLE_REASON: "idle_timeout", DRAIN_REASON: "drain",
                 TAKEN_OVER_REASON: "taken_over", START_REJECTED_REASON: "start_rejected"}

DRAINING_MESSAGE = ("the server is draining before it stops: no session opens or resumes here now; resume the "
                    "session on another replica or once the server is back (a journaled session keeps its log)")


class Scheduler:
    """Owns sessions and the engine; serves requests and pre-positions idle sessions."""

    def __init__(
        self,
        *,
        engine: Engine,
        tokenizer: Tokenizer,
        framing: Framing,
        config: SchedulerConfig,
        gate_config: GateConfig,
        scan: ScanFn,
        metrics: Metrics,
        max_sessions: int,
        kv_budget_bytes: int,
        eviction_policy: str = "lru",
        max_log_tokens: int = 0,
        journal: SessionJournal | None = None,
        journal_expire_s: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
    ):
        engine = WriteReportingEngine(engine, self._kv_written)  # what every component below gets
        self._engine = engine
        self._config = config
        self._metrics = metrics
        self._clock = clock
        self._max_context = engine.info.max_context
        self._turns = TurnBuilder(
            tokenizer, framing, vocab_size=engine.info.vocab_size, overflow=config.context_overflow,
            max_log_tokens=min(self._max_context, max_log_tokens or self._max_context),
        )
        self._residency = Residency(
            engine=engine, metrics=metrics, max_sessions=max_sessions, kv_budget_bytes=kv_budget_bytes,
            eviction_policy=eviction_policy, journal=journal, clock=clock, journal_expire_s=journal_expire_s,
        )
        self.store = self._residency.store
        self._watch = GateWatch(gate_config, metrics)  # the gate's audits: the requests' and the background's
        spec_delta = gate_config.speculative_delta
        self._background = BackgroundWork(
            engine=engine, framing=framing, turns=self._turns, config=config, scan=scan, metrics=metrics,
            residency=self._residency, watch=self._watch,
            speculative_delta_ids=tuple(tokenizer.encode(spec_delta)) if spec_delta else (),
        )
        self._residency.on_evict = self._background.stop_work_for
        self._server = RequestServer(
            engine=engine, tokenizer=tokenizer, framing=framing, turns=self._turns, gate=Gate(gate_config), scan=scan,
            metrics=metrics, residency=self._residency, config=config, clock=clock, journaled=journal is not None,
            close_session=self._close, reject=self._reject,
            watch=self._watch, request_audit=self._background.audits.append,
        )
        self._inbox: queue.SimpleQueue[tuple[Request | Rejection, ResponseSink]] = queue.SimpleQueue()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()  # one token per submit: wakes the loop
        self._loop_lock = threading.Lock()  # held by whichever thread runs loop steps
        self._ready: deque[Session] = deque()
        self._queued_deadlines = QueuedDeadlines()  # requests waiting behind their session's earlier ones
        self._steps = StepBatches(engine=engine, config=config, metrics=metrics, clock=clock,
                                  done=self._foreground_done)
        self._background_after_s = 0.0  # no background work before this time (see background_delay_ms)
        self._next_housekeeping = 0.0
        self._reuse_seen = (0, 0, 0)  # engine block-reuse counters already published (reused, new, missed)
        self._shared_seen = engine.num_shared_tokens  # shared prefix tokens already published
        self._thread: threading.Thread | None = None
        self._running = False
        self._draining = False  # set by drain(), from any thread
        self.drain_listed = False  # the loop has put the sessions open when the drain began in drain_ids
        self.drain_ids: queue.SimpleQueue[str | int] = queue.SimpleQueue()
        """The sessions open when the drain began, for it to end each one with a drain END of its own."""

    # --- other threads -------------------------------------------------

    def submit(self, request: Request | Rejection, sink: ResponseSink, *, inline: bool = False) -> None:
        """Queue a validated request (or a rejection, which keeps its place in the session's order); its
        responses go to ``sink``. Thread-safe, never blocks.

        With ``inline`` and the loop idle, the calling thread admits the request
        and runs its first step itself, under the loop lock, up to the first
        engine call: an ``exact`` or ``gated`` answer (a scan) or an update's
        acknowledgement then costs no thread hand-off. Engine work is always
        left to the loop thread.
        """
        self._inbox.put((request, sink))
        if inline and self._loop_lock.acquire(blocking=False):
            try:
                self._admit_queued()
                ready = self._ready
                if not self._steps.waiting and len(ready) == 1 and ready[0].session_id == request.session_id:
                    self._step_foreground()
            finally:
                self._loop_lock.release()
        self._wake.put(None)

    def drain(self) -> None:
        """Begin draining before a stop (thread-safe): from now on every START (a resume too) is refused with
        UNAVAILABLE, and the ids of the open sessions go to :attr:`drain_ids`, for the caller to end each one by
        an END request with the drain marker (``Request.drain``, :func:`prepos.drain.drain_end`), which keeps its
        journal. Requests of open sessions are served as before, in order, up to that END."""
        self._draining = True
        self._wake.put(None)

    @property
    def open_sessions(self) -> int:
        """Sessions open now (read from any thread)."""
        return len(self.store)

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._run, name="prepos-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop and join it; requests still queued get an UNAVAILABLE error."""
        self._running = False
        self._wake.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)
        while True:
            try:
                _, sink = self._inbox.get_nowait()
            except queue.Empty:
                break
            sink.send_error(ProtocolError("model", "server is shutting down", Status.UNAVAILABLE))
        self._metrics.flush()

    def _run(self) -> None:
        while self._running:
            try:
                with self._loop_lock:
                    busy = self.run_once()
            except Exception:  # the loop must survive anything one request does
                log.exception("engine loop step failed")
                continue
            if not busy:
                self._metrics.flush()  # idle: publish what the requests just served recorded
                # Sleep until a submit, the end of the background grace, or the next housekeeping.
                pause = HOUSEKEEPING_INTERVAL_S
                if self._background.waiting:
                    pause = min(pause, max(1e-4, self._background_after_s - self._clock()))
                try:
                    self._wake.get(timeout=pause)
                except queue.Empty:
                    pass

    # --- the loop ------------------------------------------------------

    def run_once(self) -> bool:
        """Admit queued requests, then run one step: a foreground step, else a pre-positioning step.

        Returns whether any work was done. Callers hold the loop lock (or are the only thread).
        """
        if self._draining and not self.drain_listed:  # every session opened before the flag was seen
            for session in self.store:
                self.drain_ids.put(session.session_id)
            self.drain_listed = True  # after the ids: the drain is done once they are ended
            self._residency.delete_undeleted()  # a last try before the stop, which forgets them
        self._admit_queued()  # first: a session with a request waiting is not idle
        now = self._clock()
        if self._queued_deadlines.due(now):
            for session, request, sink in self._queued_deadlines.expired(now):
                self._server.expire_queued(session, request, sink)
        if now >= self._next_housekeeping:  # also under sustained load: gauges stay fresh, idle sessions close
            self._housekeeping(now)
        if self._steps.due(self._ready):
            self._steps.run(self._ready)
            return True
        if self._ready:
            self._step_foreground()
            return True
        return self._step_background()

    def _admit_queued(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._admit(*item)

    def _admit(self, request: Request | Rejection, sink: ResponseSink) -> None:
        if self._draining and request.start:
            self._reject(request, sink, ProtocolError("START", DRAINING_MESSAGE, Status.UNAVAILABLE))
            return
        if isinstance(request, Rejection):
            session = self.store.get(request.session_id)
            if session is None or request.start:
                self._reject(request, sink, request.error)
                return
            if session.task is None:  # nothing ahead of it: refused now, and the session's background work goes on
                self._refuse(session, request, sink)
                return
        try:
            existing = known = self.store.get(request.session_id)
            if existing is not None and existing.task is None and isinstance(request, Request) and request.start \
                    and not request.resume and self._residency.change_elsewhere(existing) == DELETED:
                # Ended on another server (its journal deleted there): a new session may take the id here.
                self._drop_stale(existing, DELETED)
                existing = None
            if existing is not None and existing.task is None and isinstance(request, Request) \
                    and (not request.start or request.resume) and self._taken_over(existing):
                # Go on from the journal's state, its turns taken elsewhere included; a drain leaves it be (reading
                # it back would count as reopening it, and make the server that holds it now reread it in turn).
                existing = None if request.drain else self._residency.recover(request.session_id)
            if request.start and existing is not None and (existing.ending or any(r.end for r, _ in existing.pending)):
                session = existing  # the id is reused right after an END: it opens once that END is served
            elif request.start and request.resume:
                session = existing or self._open_or_resume(request)
            elif request.start:
                if existing is not None and self._expired(existing, self._clock()):
                    self._close(existing, IDLE_REASON)
                session = self._residency.open(request.session_id, journaled=not request.end)
            else:
                session = existing or self.store.lookup(request.session_id)
        except ProtocolError as err:
            if request.start and request.end and err.status is Status.ALREADY_EXISTS:
                err = sequence_ended_all_the_same(err)  # prepos keeps the session; Triton ended its sequence
            self._reject(request, sink, err)
            return
        except Exception as err:  # noqa: BLE001 - a request is always answered, never left waiting
            log.exception("session %r: admitting a request failed", request.session_id)
            self._reject(request, sink, ProtocolError("request", f"the server failed to admit it: {err}",
                                                      Status.INTERNAL))
            return
        if session.task is not None and isinstance(request, Request) and request.deadline_s is not None \
                and not (request.start or request.end):
            # It waits behind the session's earlier requests: answered once its deadline passes, not when reached.
            # (A START or END keeps its place: it opens or closes the session, which Triton does whatever happens.)
            self._queued_deadlines.watch(session, request, sink)
        session.pending.append((request, sink))
        candidate = session is not known or self._background.is_candidate(session)
        if self._background.drop(session):
            self._metrics.prepositioning_ended("preempted")
        if session.task is None:
            session.task = self._serve_session(session, candidate)
            self._ready.append(session)

    def _taken_over(self, session: Session) -> bool:
        """Drop the session's copy here (keeping its journal) if another server has reopened or written its journal
        since this one last did: it holds the session now, or its client came back here after taking turns there
        (behind a router, a replica lost for a moment and back). Returns whether it was dropped."""
        change = self._residency.change_elsewhere(session)
        if change is None:
            return False
        self._drop_stale(session, change)
        return True

    def _drop_stale(self, session: Session, change: str) -> None:
        """Drop the session's copy here, its journal kept, for what another server did to the journal."""
        if change == DELETED:
            log.warning("session %r: its journal was deleted by another server since this one last wrote it (the "
                        "session was ended there); the copy here is stale and is dropped", session.session_id)
        else:
            log.warning("session %r: its journal was reopened or written by another server since this one last "
                        "wrote it; the copy here is stale and is dropped, the session goes on from its journal",
                        session.session_id)
        self._close(session, TAKEN_OVER_REASON)
        self._metrics.session_taken_over()

    def _open_or_resume(self, request: Request) -> Session:
        """The session a START opens: a new one, or (with ``resume``) the one its journal holds."""
        if not request.resume:
            return self._residency.open(request.session_id, journaled=not request.end)
        session = self._residency.recover(request.session_id)
        if session is None:
            raise ProtocolError("resume", f"session {request.session_id!r} is not open on this server and has no "
                                "journal to reopen it from; send START without resume to begin a new session",
                                Status.NOT_FOUND)
        return session

    def _step_foreground(self) -> None:
        session = self._ready.popleft()
        self._steps.stepped()
        began = self._clock()
        try:
            step = next(session.task)
        except StopIteration:
            session.task = None
            return
        except Exception:  # what the request's own handling could not answer (its client's stream failing, say)
            log.exception("session %r: a request failed outside its error handling", session.session_id)
            session.task = None
            if session.pending:  # the requests behind it are served as usual
                session.task = self._serve_session(session)
                self._ready.append(session)
            return
        finally:
            self._foreground_done(began)
        if isinstance(step, EngineStep):
            self._steps.add(session, step, self._ready)
        else:
            self._ready.append(session)

    def _foreground_done(self, began: float) -> float:
        """Count foreground engine time since ``began`` and hold background work off; returns the seconds."""
        now = self._clock()
        self._metrics.engine_time("foreground", now - began)
        # Background compute holds both cores: let the response just sent leave the process first.
        self._background_after_s = now + self._config.background_delay_ms / 1e3
        return now - began

    def _step_background(self) -> bool:
        if self._clock() < self._background_after_s:
            return False
        began = self._clock()
        if not self._background.step():
            return False
        self._metrics.engine_time("background", self._clock() - began)
        return True

    def _kv_written(self, session_id: str | int) -> None:
        """An engine call is about to change what the session's KV holds: its positioned state no longer describes
        the KV (the request that wrote it, stopped before its turn was accepted, or an audit, must not leave it
        for the next request to decode on)."""
        session = self.store.get(session_id)
        if session is not None:
            session.positioned = None

    def _housekeeping(self, now: float) -> None:
        self._next_housekeeping = now + HOUSEKEEPING_INTERVAL_S
        for session in self.store:
            if self._expired(session, now):
                self._close(session, IDLE_REASON)
        self._residency.expire_journals()  # hourly
        self._queued_deadlines.prune()
        self._metrics.sessions({state.value: n for state, n in self.store.count_by_state().items()})
        kv = self._residency.kv
        self._metrics.kv(kv.used_bytes, kv.budget_bytes, self._engine.kept_prefix_bytes())
        self._publish_reuse()
        self._metrics.flush()  # under sustained load too

    def _publish_reuse(self) -> None:
        """Prefix tokens copied between sessions, and block reuse counted by engines that report it
        (TensorRT-LLM's), as counters since the last call."""
        shared = self._engine.num_shared_tokens
        self._metrics.shared_prefix_tokens(shared - self._shared_seen)
        self._shared_seen = shared
        reuse_stats = getattr(self._engine, "reuse_stats", None)
        if reuse_stats is None:
            return
        now = reuse_stats()
        seen = self._reuse_seen
        self._reuse_seen = (now.reused_blocks, now.new_blocks, now.missed_blocks)
        self._metrics.kv_blocks(*(a - b for a, b in zip(self._reuse_seen, seen)))

    def _expired(self, session: Session, now: float) -> bool:
        idle = not session.serving and not session.pending
        return idle and now - session.last_active_s > self._config.session_idle_timeout_s

    # --- foreground ----------------------------------------------------

    def _serve_session(self, session: Session, candidate: bool = True, queued: bool = False) -> Iterator[None]:
        """Serve the session's requests in order; then it is a pre-positioning candidate again if it is not
        positioned, unless it is evicted, was no candidate (``candidate``) and its requests changed neither its log
        nor its KV (each refused): its KV is not rebuilt in the background, evicting another's, for nothing."""
        before = (len(session.token_log), session.has_kv)
        # ``queued``: the request waited behind an earlier one of its session (a successor's first, behind the END
        # of the session it replaces)
        while session.pending:
            request, sink = session.pending.popleft()
            if self.store.get(session.session_id) is not session:  # closed while this request waited
                if request.start and not isinstance(request, Rejection):  # a new session (or the journal's), same id
                    try:
                        successor = self._open_or_resume(request)
                    except ProtocolError as err:
                        self._reject(request, sink, err)
                        continue
                    successor.pending = deque([(request, sink), *session.pending])
                    session.pending.clear()
                    successor.task = self._serve_session(successor, queued=True)
                    self._ready.append(successor)
                    return
                self._reject(request, sink, ProtocolError(
                    "START", f"session {session.session_id!r} is not open: it was closed while this request waited; "
                    "send START with its first request", Status.NOT_FOUND))
                continue
            if isinstance(request, Rejection):
                self._refuse(session, request, sink)
                continue
            session.note_arrival(request.arrival_s or self._clock())
            session.serving, session.ending = True, request.end
            try:
                yield from self._server.serve(session, request, sink, queued=queued)
            finally:
                session.serving = session.ending = False
                session.last_active_s = self._clock()
                self._residency.fit()
            queued = True
        if self.store.get(session.session_id) is session and session.token_log and not session.positioned_valid() \
                and (candidate or not session.evicted or before != (len(session.token_log), session.has_kv)):
            self._background.went_idle(session)

    # --- lifecycle -----------------------------------------------------

    def _close(self, session: Session, reason: str) -> None:
        self._background.drop(session)
        drained = reason == DRAIN_REASON
        # An idle session here may be open on another replica now (its client moved there and was reopened from
        # the shared journal): its journal is then that replica's.
        self._residency.close(session, reason, keep_journal=drained or reason == TAKEN_OVER_REASON,
                              journal_if_unchanged=reason == IDLE_REASON)
        self._metrics.session_closed(CLOSED_LABELS[reason])
        if drained:
            self._metrics.session_drained()

    def _refuse(self, session: Session, rejection: Rejection, sink: ResponseSink) -> None:
        """Answer a request that failed validation, in its turn; its END still closes the session (Triton ends the
        sequence on END whatever the model answers)."""
        self._reject(rejection, sink, closed_all_the_same(rejection.error) if rejection.end else rejection.error)
        if rejection.end:
            self._close(session, END_REASON)

    def _reject(self, request: Request | Rejection, sink: ResponseSink, err: ProtocolError) -> None:
        if not (isinstance(request, Request) and request.drain):  # the drain's own ENDs are no client's requests
            self._metrics.request_rejected(err.field)
        sink.send_error(err)
