"""Serving one request of a session: choose the path of its first token, stream its answer, accept its turn.

A request is served by a generator the engine loop steps: it yields after
each engine call, so sessions interleave token by token. Engine calls are not
made here but yielded as a :class:`PrefillStep` or a :class:`DecodeStep`: the
loop runs the prefills, and the decodes, that sessions are waiting on as one
batch each. The path of the
first token is ``exact`` or ``gated`` (a scan of the positioned distribution,
no engine work), ``prepaid`` (positioned, then the delta is prefilled),
``prefix`` (prefill from the longest cached prefix) or ``rebuild`` (the KV
was evicted: prefill the whole log). A turn enters the session's log (and its
journal, before the final response acknowledges it) only when the request
finishes; a rejected, cancelled or expired request changes nothing.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Callable, Generator, Iterator, Sequence

import numpy as np
import torch

from prepos.config import SchedulerConfig
from prepos.engines.base import Engine, KVCapacityError
from prepos.gate import Gate
from prepos.gate_watch import Audit, GateWatch
from prepos.metrics import Metrics
from prepos.protocol import (START_REJECTED_REASON, ProtocolError, Request, ResponseSink, Status, closed_all_the_same,
                             end_reason, naming_request)
from prepos.residency import Residency
from prepos.scan import ScanFn, ScanResult
from prepos.session import Session
from prepos.template import ChoiceTrie, Framing, IncrementalDetokenizer, Tokenizer
from prepos.timing import RequestClock
from prepos.turns import TurnBuilder

log = logging.getLogger("prepos.serving")


class _Abandoned(Exception):
    """A request stopped before its end: the client went away or its deadline passed."""

    def __init__(self, reason: str, error: ProtocolError):
        super().__init__(str(error))
        self.reason = reason
        self.error = error


def _deadline_passed() -> _Abandoned:
    return _Abandoned("deadline", ProtocolError(
        "timeout", "the request's deadline passed before it finished; its turn was not accepted",
        Status.DEADLINE_EXCEEDED))


@dataclass(kw_only=True)
class EngineStep:
    """A request's next engine call, yielded to the engine loop, which runs it together with the other sessions'
    calls of its kind and fills in ``logits`` or ``error`` before resuming the request (neither when it was no
    longer ``wanted``); ``seconds`` is the engine time of the batch it ran in."""

    session_id: str | int
    wanted: Callable[[], bool] = lambda: True  # False once the client went away or the deadline passed: skipped
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    seconds: float = 0.0


@dataclass(kw_only=True)
class PrefillStep(EngineStep):
    """Make the session's KV hold ``token_ids`` (:meth:`prepos.engines.base.Engine.prefill_batch`); ``new_tokens``
    of them are past what it holds now. ``later_piece``: a piece after the first of a prefill too long for one step
    (``scheduler.max_prefill_batch_tokens``), which lets waiting decodes go first."""

    token_ids: Sequence[int]
    new_tokens: int
    later_piece: bool = False


@dataclass(kw_only=True)
class DecodeStep(EngineStep):
    """Append ``token_id`` to the session's KV (:meth:`prepos.engines.base.Engine.decode_batch`)."""

    token_id: int


def told_of_end(request: Request, err: ProtocolError) -> ProtocolError:
    """``err`` as a request that did not go through is told it: one carrying END (not START) on an open session
    closed it all the same (Triton ends the sequence at END), and says so (:func:`closed_all_the_same`)."""
    return closed_all_the_same(err) if request.end and not request.start else err


def prefill_piece_ends(held: int, total: int, max_new: int) -> list[int]:
    """Where each piece of a prefill of ``total`` tokens ends when the KV holds ``held`` of them: as few pieces as
    hold at most ``max_new`` new tokens each, of sizes within one token of each other (513 new tokens at 512 go
    as 257 and 256, not 512 and a step for one), the last at ``total``; one piece when they fit (or the KV holds
    them all: its last token is computed again for its logits)."""
    new = total - held
    count = max(1, -(-new // max_new))
    return [held + new * i // count for i in range(1, count + 1)]


class ServedPath(str, enum.Enum):
    """Which path served a request's first token (``append``/``close`` for requests with no answer)."""

    EXACT = "exact"
    GATED = "gated"
    PREPAID = "prepaid"
    PREFIX = "prefix"
    REBUILD = "rebuild"
    APPEND = "append"
    CLOSE = "close"


class RequestServer:
    """Serves requests of open sessions on the engine loop (see the module docstring)."""

    def __init__(self, *, engine: Engine, tokenizer: Tokenizer, framing: Framing, turns: TurnBuilder, gate: Gate,
                 scan: ScanFn, metrics: Metrics, residency: Residency, config: SchedulerConfig,
                 clock: Callable[[], float], journaled: bool,
                 close_session: Callable[[Session, str], None],
                 reject: Callable[[Request, ResponseSink, ProtocolError], None],
                 watch: GateWatch, request_audit: Callable[[Audit], None]):
        self._engine = engine
        self._tokenizer = tokenizer
        self._framing = framing
        self._turns = turns
        self._gate = gate
        self._scan = scan
        self._metrics = metrics
        self._residency = residency
        self._config = config
        self._clock = clock
        self._journaled = journaled
        self._close_session = close_session
        self._reject = reject
        self._watch = watch
        self._request_audit = request_audit

    def serve(self, session: Session, request: Request, sink: ResponseSink, *, queued: bool = False) -> Iterator[None]:
        """Serve one request: every request gets exactly one final response (or error) on ``sink``; an END
        closes the session whatever happened, and a rejected START leaves no session behind. ``queued``: it
        waited behind an earlier request of its session (its client may have gone meanwhile)."""
        clock = RequestClock(self._clock, request.arrival_s or self._clock())
        clock.start()
        served = False
        try:
            self._check_alive(request, sink, cancel_check=False)
            self._turns.check(request)
            if request.is_append:
                self._append(session, request, self._turns.delta_ids(request), clock, sink, queued)
            else:
                yield from self._generate(session, request, clock, sink)
            served = True
        except ProtocolError as err:
            self._refuse(request, sink, err)
        except _Abandoned as abandoned:
            self._abandon(session, request, sink, abandoned)
        except KVCapacityError as err:
            log.error("session %r request %r: %s", session.session_id, request.request_id, err)
            self._refuse(request, sink, ProtocolError("model", f"no KV memory left for this session ({err})",
                                                      Status.RESOURCE_EXHAUSTED))
        except Exception:
            log.exception("session %r request %r failed", session.session_id, request.request_id)
            self._refuse(request, sink, ProtocolError("request", "internal error; see the server log", Status.INTERNAL))
        # Triton ends the sequence on END whatever happened; a rejected START leaves no session behind (counted as
        # such when it carried END too: a refused one-turn request).
        held = self._residency.store.get(session.session_id) is session
        if not served and request.start and not session.token_log and (held or not request.end):
            self._close_session(session, START_REJECTED_REASON)
        elif request.end and held:
            self._close_session(session, end_reason(request))

    def expire_queued(self, session: Session, request: Request, sink: ResponseSink) -> None:
        """Answer a request whose deadline passed while it waited behind its session's earlier requests (taken out
        of the queue by the caller) as one reached after its deadline: the deadline error, nothing changed. The
        error goes out ahead of the earlier requests' answers, so it names its request."""
        self._abandon(session, request, sink, _Abandoned("deadline", ProtocolError(
            "timeout", naming_request("the request's deadline passed while it waited behind its session's earlier "
                                      "requests; its turn was not accepted", request.request_id),
            Status.DEADLINE_EXCEEDED)))

    def _refuse(self, request: Request, sink: ResponseSink, err: ProtocolError) -> None:
        """Answer a request with ``err``; one carrying END (not START) closes its session all the same, and says so."""
        self._reject(request, sink, told_of_end(request, err))

    def _abandon(self, session: Session, request: Request, sink: ResponseSink, abandoned: _Abandoned) -> None:
        """Answer a request stopped by its deadline or its client with that error; one carrying END (not START)
        closes its session all the same (:meth:`serve`), and says so: "its turn was not accepted" alone read as
        "nothing changed", and an END sent again found no session."""
        self._metrics.request_abandoned(abandoned.reason)
        log.info("session %r request %r stopped: %s", session.session_id, request.request_id, abandoned)
        sink.send_error(told_of_end(request, abandoned.error))

    def _check_alive(self, request: Request, sink: ResponseSink, cancel_check: bool = True) -> None:
        """Raise _Abandoned when the request's deadline has passed or (``cancel_check``) its client went away."""
        if request.deadline_s is not None and self._clock() > request.deadline_s:
            raise _deadline_passed()
        if cancel_check and sink.cancelled():
            raise _Abandoned("cancelled", ProtocolError(
                "request", "cancelled by the client; its turn was not accepted", Status.CANCELLED))

    def _alive(self, request: Request, sink: ResponseSink) -> bool:
        """Whether the request still wants its next token (see :meth:`_check_alive`)."""
        try:
            self._check_alive(request, sink)
        except _Abandoned:
            return False
        return True

    def _append(self, session: Session, request: Request, delta_ids: list[int], clock: RequestClock,
                sink: ResponseSink, queued: bool) -> None:
        path = ServedPath.CLOSE if request.end and not delta_ids else ServedPath.APPEND
        if delta_ids:  # an empty update changes nothing (a bare START or END)
            # An update queued behind a generate on a stream the client then cancelled is cancelled too: accepted,
            # its acknowledgement would go nowhere, and a client sending it again would put it in the log twice.
            # (Asked only after such a wait: the question is a round trip to the server.)
            self._check_alive(request, sink, cancel_check=queued)
            turn = self._turns.turn_ids(session, request.role, delta_ids, self._framing.close_ids)
            kept = self._turns.fit_turns(session, request, len(turn), 0)  # the opening turn stays as is
            if session.positioned_valid():
                self._metrics.prepositioning_ended("invalidated")
            self._residency.accept(session, turn, session.last_role, session.last_choices, kept=kept)
        chunk = clock.chunk("", (), path.value, float("nan"), "closed" if path is ServedPath.CLOSE else "appended")
        if request.end:  # closed (journal deleted) before the response acknowledges the END
            self._close_session(session, end_reason(request))
        sink.send(chunk, final=True)
        if not request.drain:  # the drain's own ENDs are counted as drained sessions, not as requests
            self._metrics.request_served(path.value, None)

    def _scan_at(self, logits, trie: ChoiceTrie | None, answer: Sequence[int], request: Request, rng) -> ScanResult:
        sampling = request.sampling
        return self._scan(
            logits,
            allowed_ids=trie.allowed_ids(answer) if trie else None,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            uniform=None if sampling.greedy else float(rng.random()),
        )

    def _generate(self, session: Session, request: Request, clock: RequestClock, sink: ResponseSink) -> Iterator[None]:
        sid = session.session_id
        trie = self._turns.trie(request.choices)
        forced = tuple(trie.leading_ids()) if trie else ()
        framing_length = len(self._turns.turn_ids(session, request.role, (), self._framing.cue_ids)) + len(forced)
        # A text delta is tokenized only where its tokens are needed: a gated answer reads none of them.
        delta_ids = list(request.delta_ids) if request.delta_ids is not None else None
        answer_room = self._turns.answer_room(request, trie)
        if delta_ids is None and self._turns.may_overflow(session, request, framing_length, answer_room):
            delta_ids = self._turns.delta_ids(request)
        # The turns the log keeps to make room (None: all of them); dropped when the turn is accepted, so that a
        # request stopped before then changes nothing. The prompt is built on them.
        kept = None if delta_ids is None else \
            self._turns.fit_turns(session, request, framing_length + len(delta_ids), answer_room, len(forced))
        base = session.token_log if kept is None else [t for turn in kept for t in turn]
        has_delta = request.has_delta

        def turn_ids() -> list[int]:  # opening + entry + delta + cue, tokenizing the delta on first use
            nonlocal delta_ids
            if delta_ids is None:
                delta_ids = self._turns.delta_ids(request)
            return self._turns.turn_ids(session, request.role, delta_ids, self._framing.cue_ids)

        audit: list[int] | None = None  # a sampled gated answer: the full-path prompt to check it against

        def accept() -> None:
            nonlocal audit
            turn = turn_ids()
            if path is ServedPath.GATED and self._watch.sample():
                audit = [*base, *turn, *forced]
            self._residency.accept(session, [*turn, *answer, *self._framing.closing_ids(answer)], request.role,
                                   request.choices, kept=kept)

        rng = None if request.sampling.greedy else np.random.default_rng(request.sampling.seed)

        # Choose the path that serves the first token.
        pos = session.positioned if session.positioned_valid() and kept is None else None
        prepaid_only = False
        if pos is not None and (pos.role != request.role or pos.forced_ids != forced):
            # Positioned for this role, but for other forced leading choice tokens: its distribution is not at this
            # request's decision point, while its KV (the log's updates and the entry) serves the prompt as prepaid's.
            prepaid_only = pos.role == request.role
            self._metrics.prepositioning_ended("invalidated")
            pos = None
        first: ScanResult | None = None
        prompt: list[int] | None = None  # log + turn, built once the delta's tokens are known
        kv_len = -1  # tokens of prompt + answer the KV is known to hold exactly
        gate_outcome = ""  # a fired gate is counted once its first token is out: nothing else goes before it
        if pos is not None:
            if request.sampling.greedy and pos.choices == request.choices and pos.greedy_scan is not None:
                first = pos.greedy_scan  # scanned when it was positioned
            else:
                drawn = rng.bit_generator.state if rng is not None else None
                with clock.measure("scan"):
                    first = self._scan_at(pos.logits, trie, forced, request, rng)
            if not has_delta and not pos.delta_ids:  # the request's turn is exactly the positioned one
                path, logits, kv_len = ServedPath.EXACT, pos.logits, len(session.token_log) + len(pos.spec_ids)
            else:
                speculate = False if self._watch.suspended else request.speculate
                decision = self._gate.decide(first, speculate=speculate, threshold=request.gate_threshold)
                path = ServedPath.GATED if decision.fired else ServedPath.PREPAID
                if decision.fired:  # its first token goes out next, in this step
                    gate_outcome = decision.outcome
                else:
                    self._metrics.gate_decided(decision.outcome)
                    if rng is not None:  # the first token comes from the prefill's scan: it takes the first draw,
                        rng.bit_generator.state = drawn  # as on every other path, so a seed gives one answer
        else:
            path = ServedPath.PREPAID if prepaid_only else ServedPath.REBUILD if session.evicted else ServedPath.PREFIX
        if path not in (ServedPath.EXACT, ServedPath.GATED):
            self._check_alive(request, sink)
            prompt = [*base, *turn_ids()]
            logits = yield from self._prefill(session, [*prompt, *forced], request, sink, clock)
            kv_len = len(prompt) + len(forced)
            with clock.measure("scan"):
                first = self._scan_at(logits, trie, forced, request, rng)
        confidence = self._gate.score(first)

        answer: list[int] = list(forced)
        unsent: list[int] = list(forced)  # forced leading choice tokens go out with the first decision
        detok = IncrementalDetokenizer(self._tokenizer, () if trie else request.stop)  # stop never cuts a choice
        # the prompt's length where it is known; else a lower bound, and the bound is taken again once it is
        max_new = self._turns.max_answer_tokens(
            request, len(prompt) if prompt is not None else len(base) + framing_length - len(forced))
        scan = first
        held_text, held_ids = "", []  # streamed in responses of ``stream_interval`` tokens after the first
        while True:
            token = scan.token_id
            answer.append(token)
            if trie and token == self._turns.terminator_id:  # a choice ends where a longer one goes on
                emit, done, finish = [], True, "stop"
            elif trie:
                tail = trie.forced_ids(answer)
                answer.extend(tail)
                emit, done, finish = [token, *tail], trie.finished(answer) is not None, "stop"
            else:
                emit = [] if token in self._framing.stop_token_ids else [token]
                done = not emit or len(answer) >= max_new
                finish = "stop" if not emit else "length"
            emit, unsent = unsent + emit, []
            text = held_text + detok.push(emit)
            emit, held_text, held_ids = held_ids + emit, "", []
            if detok.stopped:
                done, finish = True, "stop"
            if done:
                # A deadline that passed during the last step: the turn is not accepted either (the client, whose
                # limit the deadline is, has given up or is about to), so a timed-out call never took effect.
                self._check_alive(request, sink, cancel_check=False)
                text += detok.flush()
                if self._journaled:  # durable before the final response acknowledges the turn
                    if clock.first_token_ms is None and (text or emit):
                        # An answer complete in one step goes out now; only its acknowledgement (the final,
                        # empty response) waits for the journal write and the delta's tokenizing.
                        sink.send(clock.chunk(text, emit, path.value, confidence, ""), final=False)
                        text, emit = "", []
                    accept()
                    if request.end:  # and an END deletes the journal before it is acknowledged
                        self._close_session(session, end_reason(request))
            if done or clock.first_token_ms is None or len(emit) >= self._config.stream_interval:
                sink.send(clock.chunk(text, emit, path.value, confidence, finish if done else ""), final=done)
            else:
                held_text, held_ids = text, emit
            if gate_outcome:
                self._metrics.gate_decided(gate_outcome)
                gate_outcome = ""
            if done:
                break
            if prompt is None:
                prompt = [*base, *turn_ids()]
                max_new = self._turns.max_answer_tokens(request, len(prompt))
            sequence = [*prompt, *answer]
            if kv_len == len(sequence) - 1:  # the loop decodes it, with the other sessions' decodes
                step = DecodeStep(session_id=sid, token_id=sequence[-1], wanted=lambda: self._alive(request, sink))
                logits = yield from self._engine_step(step, "decode", request, sink, clock)
                self._residency.note_kv(session)
            else:
                logits = yield from self._prefill(session, sequence, request, sink, clock)
            kv_len = len(sequence)
            with clock.measure("scan"):
                scan = self._scan_at(logits, trie, answer, request, rng)

        self._metrics.request_served(path.value, clock.first_token_ms)
        if not self._journaled:  # without a journal the answer leaves first (a gated delta is tokenized after it)
            accept()
        if audit is not None:
            self._request_audit(Audit(session, len(session.token_log), tuple(audit), trie, forced,
                                      answer[len(forced)]))
        if not self._config.retain_kv:
            self._residency.release_kv(session)
            session.evicted = True

    def _prefill(self, session: Session, token_ids: Sequence[int], request: Request, sink: ResponseSink,
                 clock: RequestClock) -> Generator[PrefillStep, None, torch.Tensor]:
        # A prefix another session holds (a system prompt they share) is copied now: only the rest is prefilled,
        # in pieces of at most max_prefill_batch_tokens new tokens, each an engine step of its own: other sessions'
        # steps run between them, and the request's deadline and cancellation are checked before each.
        held = self._engine.share_prefix(session.session_id, token_ids)
        for piece, end in enumerate(prefill_piece_ends(held, len(token_ids), self._config.max_prefill_batch_tokens)):
            step = PrefillStep(session_id=session.session_id, token_ids=token_ids[:end], new_tokens=max(1, end - held),
                               later_piece=piece > 0, wanted=lambda: self._alive(request, sink))
            logits = yield from self._engine_step(step, "prefill", request, sink, clock)
            self._metrics.prefilled("foreground", step.new_tokens)
            self._residency.note_kv(session)
            held = end
        return logits

    def _engine_step(self, step: EngineStep, phase: str, request: Request, sink: ResponseSink,
                     clock: RequestClock) -> Generator[EngineStep, None, torch.Tensor]:
        """Hand ``step`` to the engine loop and return its logits; its error raised, and after a decode, the
        request's end meanwhile (a prefill's first token goes out even so). The batch's engine time counts as
        the request's ``phase``."""
        clock.pause()
        yield step
        clock.resume()
        if phase == "decode" or (step.logits is None and step.error is None):  # a prefill left out: not wanted
            self._check_alive(request, sink)
        if step.error is not None:
            raise step.error
        if step.logits is None:
            raise RuntimeError(f"session {step.session_id!r}: the engine loop resumed a {phase} it did not run")
        clock.add(phase, step.seconds)
        return step.logits
