"""The engine loop's background work: pre-positioning idle sessions, and auditing gated answers.

It runs only when no foreground work waits (the :class:`~prepos.scheduler.Scheduler`
calls :meth:`BackgroundWork.step` then), one step at a time: a pre-positioning
yields after each layer of each chunk of at most ``chunk_tokens`` tokens, so a
new request waits at most one layer of one chunk.

Between steps the idle policy may prefer another session (with
``most_recent``, the one just served). At a chunk boundary the running
pre-positioning goes back to the candidates (its KV holds every finished
chunk); inside a chunk it is set aside whole and resumed once the preferred
one is positioned, so a long pre-positioning neither delays a short one by a
chunk nor loses the layers it has done. One pre-positioning at most is set
aside at a time.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from prepos.config import SchedulerConfig
from prepos.engines.base import Engine, KVCapacityError, common_prefix_length
from prepos.gate_watch import Audit, GateWatch
from prepos.metrics import Metrics
from prepos.policies import IDLE_POLICIES
from prepos.residency import Residency
from prepos.scan import ScanFn
from prepos.session import Positioned, Session
from prepos.template import Framing

if TYPE_CHECKING:
    from prepos.turns import TurnBuilder

log = logging.getLogger("prepos.scheduler")

RESERVE_FRACTION = 16  # a positioned session's KV keeps room for this fraction more of its length (see _reserve_ahead)
RESERVE_MIN_TOKENS = 512  # below it a growth's copy costs little (about 1 ms at 576 tokens here), and room costs memory
_CHUNK_BOUNDARY = object()  # what a pre-positioning task yields between chunks (engine steps yield None)


@dataclass
class _Task:
    """A background task of one session: its pre-positioning, or the audit of its gated answer."""

    session: Session
    task: Iterator[object]
    positioning: bool
    at_chunk_boundary: bool = False

    def stop(self) -> None:
        self.task.close()


class BackgroundWork:
    """Idle sessions waiting to be pre-positioned, the audits waiting to run, and the task the loop steps."""

    def __init__(
        self,
        *,
        engine: Engine,
        framing: Framing,
        turns: TurnBuilder,
        config: SchedulerConfig,
        scan: ScanFn,
        metrics: Metrics,
        residency: Residency,
        watch: GateWatch,
        speculative_delta_ids: tuple[int, ...],
    ):
        self._engine = engine
        self._framing = framing
        self._turns = turns
        self._config = config
        self._scan = scan
        self._metrics = metrics
        self._residency = residency
        self._watch = watch
        self._speculative_delta_ids = speculative_delta_ids
        self._max_context = engine.info.max_context
        self._idle_policy = IDLE_POLICIES[config.idle_policy]()
        self.audits: deque[Audit] = deque()  # gated answers to audit, oldest first
        self.idle: dict[str | int, Session] = {}  # idle sessions that are not positioned
        self._went_idle = False  # a session joined idle since the policy last chose
        self.running: _Task | None = None  # the background task the loop steps
        self._paused: _Task | None = None  # a pre-positioning set aside inside a chunk, resumed next
        self._stepping = False

    @property
    def waiting(self) -> bool:
        """Whether there is background work to do once the loop may do it."""
        return bool(self.idle) or self.running is not None or self._paused is not None

    def went_idle(self, session: Session) -> None:
        """The session has no request left and is not positioned: a candidate for pre-positioning."""
        self.idle[session.session_id] = session
        self._went_idle = True

    def is_candidate(self, session: Session) -> bool:
        """Whether the session waits for pre-positioning or is being positioned (set aside included)."""
        tasks = (self.running, self._paused)
        return session.session_id in self.idle or any(
            task is not None and task.positioning and task.session is session for task in tasks)

    def drop(self, session: Session) -> bool:
        """The session is served, closed or evicted: stop its background task and forget it as a candidate;
        returns whether a pre-positioning or audit was stopped."""
        self.idle.pop(session.session_id, None)
        return self._drop_task(session)

    def stop_work_for(self, victim: Session) -> None:
        """Before a session's KV is evicted: a running pre-positioning of it stops (one evicting its own
        KV sees ``has_kv`` go False and stops by itself), and it is no longer an idle candidate."""
        if self._drop_task(victim, running=not self._stepping):
            self._metrics.prepositioning_ended("preempted")
        self.idle.pop(victim.session_id, None)

    def step(self) -> bool:
        """Run one step of background work; returns whether there was any."""
        if self.running is None and self._paused is not None:
            self.running, self._paused = self._paused, None  # resumed where it was set aside
        elif self.running is None and self._start_audit():
            pass
        elif self.running is None:
            if not (self._config.preposition and self._config.retain_kv and self.idle):
                return False
            self._start_prepositioning(self._idle_policy.pick(list(self.idle.values())))
        elif self.idle and self.running.positioning and (self._went_idle or self.running.at_chunk_boundary):
            self._reconsider()
        background = self.running
        self._stepping = True
        try:
            background.at_chunk_boundary = next(background.task) is _CHUNK_BOUNDARY
        except StopIteration:
            self.running = None
        except KVCapacityError as err:  # the session stays as it was; it is served from its log when asked
            what = "pre-positioning" if background.positioning else "gate audit"
            log.warning("%s of session %r abandoned: %s", what, background.session.session_id, err)
            self.running = None
            if background.positioning:
                self._metrics.prepositioning_ended("abandoned")
            else:
                self._metrics.gate_audit_void()
        finally:
            self._stepping = False
        return True

    def _reconsider(self) -> None:
        """The policy may prefer a session that went idle meanwhile (the one just served, say)."""
        self._went_idle = False
        current = self.running
        preferred = self._idle_policy.pick([*self.idle.values(), current.session])
        if preferred is current.session:
            return
        if current.at_chunk_boundary:  # back to the candidates: it goes on from its KV later
            current.stop()
            self._metrics.prepositioning_ended("preempted")
            self.idle[current.session.session_id] = current.session
            self._start_prepositioning(preferred)
        elif self._paused is None:  # inside a chunk: set aside whole, resumed after the preferred one
            self._paused = current
            self._start_prepositioning(preferred)

    def _drop_task(self, session: Session, running: bool = True) -> bool:
        """Stop the session's background task, the one set aside included (``running``: the one being
        stepped too); returns whether one was stopped."""
        stopped = False
        if self._paused is not None and self._paused.session is session:
            self._paused.stop()
            self._paused = None
            stopped = True
        if running and self.running is not None and self.running.session is session:
            self.running.stop()
            if not self.running.positioning:  # an audit stopped part way: its prefill is void
                self._metrics.gate_audit_void()
            self.running = None
            stopped = True
        return stopped

    def _start_prepositioning(self, session: Session) -> None:
        del self.idle[session.session_id]
        self.running = _Task(session, self._preposition(session), positioning=True)

    def _start_audit(self) -> bool:
        """Start the oldest audit whose session is still as the audited answer left it (others are void)."""
        while self.audits:
            audit = self.audits.popleft()
            session = audit.session
            if self._residency.store.get(session.session_id) is session and len(session.token_log) == audit.log_length \
                    and not session.pending and not session.serving:
                self.running = _Task(session, self._audit(audit), positioning=False)
                return True
            self._metrics.gate_audit_void()  # the session was served, closed or evicted since the answer
        return False

    def _audit(self, audit: Audit) -> Iterator[None]:
        """Prefill the full path of an audited gated answer in the session's own KV (a prefix of its new log)
        and compare its first decided token with the gated one."""
        session = audit.session
        # Positioned again first: the audit's prefill rewrites the KV, which drops that state; it is positioned
        # again after the audit.
        if session.positioned is not None:
            self._metrics.prepositioning_ended("invalidated")
            self.idle[session.session_id] = session
        num_cached = common_prefix_length(self._engine.cached_token_ids(session.session_id), audit.prompt_ids)
        logits = yield from self._engine.prefill_steps(session.session_id, list(audit.prompt_ids))
        self._metrics.prefilled("background", max(1, len(audit.prompt_ids) - num_cached))
        self._residency.note_kv(session, background=True)
        if not session.has_kv:
            return
        full = self._scan(logits, allowed_ids=audit.trie.allowed_ids(audit.forced_ids) if audit.trie else None)
        self._watch.record(audit, full.token_id)

    def _preposition(self, session: Session) -> Iterator[object]:
        """Make the KV hold log + entry + speculative delta (empty, or the configured placeholder) + cue +
        forced choice tokens; cache the distribution."""
        log_length = len(session.token_log)
        role = session.last_role
        trie = self._turns.trie(session.last_choices)
        forced = tuple(trie.leading_ids()) if trie else ()
        spec = (*self._turns.turn_ids(session, role, self._speculative_delta_ids, self._framing.cue_ids), *forced)
        target = [*session.token_log, *spec]
        if len(target) + 1 > self._max_context:
            return
        done = self._engine.share_prefix(session.session_id, target)  # what it, or another session, holds
        while True:
            end = min(len(target), done + self._config.chunk_tokens) if done < len(target) else len(target)
            # Yields between layers too: a foreground request waits at most one layer of one chunk.
            logits = yield from self._engine.prefill_steps(session.session_id, target[:end])
            self._metrics.prefilled("background", max(1, end - done))
            self._residency.note_kv(session, background=True)
            if not session.has_kv:  # the budget had no room for it
                self._metrics.prepositioning_ended("abandoned")
                return
            done = end
            if done == len(target):
                break
            yield _CHUNK_BOUNDARY
            if self._residency.store.get(session.session_id) is not session or len(session.token_log) != log_length:
                self._metrics.prepositioning_ended("invalidated")
                return
        greedy = self._scan(logits, allowed_ids=trie.allowed_ids(forced) if trie else None)
        session.positioned = Positioned(
            log_length=log_length, role=role, choices=session.last_choices, spec_ids=spec,
            forced_ids=forced, logits=logits.clone(), greedy_scan=greedy, delta_ids=self._speculative_delta_ids,
        )
        self._residency.note_kv(session, background=True)  # the cached distribution counts against the budget
        self._metrics.prepositioning_ended("completed")
        yield from self._reserve_ahead(session, len(target))

    def _reserve_ahead(self, session: Session, length: int) -> Iterator[None]:
        """Let the positioned session's KV hold a sixteenth more than its ``length`` tokens. Where the KV grows by
        a copy (the torch engine on CPU: the whole KV; a turn over 4,000 tokens of SmolLM2 took 1.6x as long
        here when it grew it), the copy is then paid in the idle window instead of by the next request. Only
        for sessions of ``RESERVE_MIN_TOKENS`` or more, and while the budget has room to spare: a quarter of what
        the session holds. The copy runs a layer per step, so a request that comes meanwhile waits no longer than
        for a layer of a chunk (a request of the session's own drops this task)."""
        ledger = self._residency.kv
        if session.has_kv and length >= RESERVE_MIN_TOKENS \
                and ledger.used_bytes + self._engine.kv_bytes(session.session_id) // 4 <= ledger.budget_bytes:
            yield from self._engine.reserve_steps(session.session_id,
                                                  min(length + length // RESERVE_FRACTION, self._max_context))
            self._residency.note_kv(session, background=True)
