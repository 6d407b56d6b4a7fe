"""Replaying session traces step by step over prepos sessions, as timed measurements.

`TraceReplayer` is what one simulated user does: take a trace from a shared
pool, open a session (its first request carries START), send one step per
`run_step` call, close the session (END) after the last step, then take the
next trace. Between steps the caller waits `next_delay_s()`: the trace's
think time, scaled and jittered. Every request yields `Measurement`s; nothing
here knows about Locust, so the same replayer can drive any harness.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from prepos_client import Answer, PreposError, PreposUnavailable, Session, Update
from prepos_client.channel import is_readable_file

from .workloads import SessionTrace, Step

log = logging.getLogger("prepos.loadtest")

# Measurement kinds: one TOTAL per request (success or failure), so failures
# over TOTAL measurements is the request error rate.
TTFT = "TTFT"  # client: request sent -> first response
TOTAL = "TOTAL"  # client: request sent -> last response
SERVER_TTFT = "SRVTTFT"  # server: request arrival -> first response (7 characters: Locust's type column)
TPOT = "TPOT"  # client: time per output token after the first, (TOTAL - TTFT) / (tokens - 1); answers of 2+ tokens

# Measurement names of requests that have no served path: rejected ones.
REJECTED_GENERATE = "generate"
REJECTED_APPEND = "append"
REJECTED_CLOSE = "close"

# After the server could not be reached, wait at least this long before the next session.
UNAVAILABLE_BACKOFF_S = 1.0
END_SETTLE_S = 10.0
"""Before a session's END, how long the outcome of its requests that timed out is waited for (at least; the request
time limit where longer): the END waits for it first, and sends nothing if it does not come within its own limit,
which left the session open on the server until its idle timeout."""
_REQUEST_NUMBER = re.compile(r'\brequest (\d+|"(?:[^"\\]|\\.)*")')


@dataclass(frozen=True)
class Measurement:
    """One timed figure of one request.

    Attributes:
        kind: `TTFT`, `TOTAL`, `SRVTTFT` or `TPOT` (milliseconds per token after
            the first; only for answers of two tokens or more).
        name: the served path (`exact`, `gated`, `prepaid`, `prefix`,
            `rebuild`, `append`, `close`); for a rejected request, what was
            asked (`generate`, `append`, `close`).
        elapsed_ms: the time measured.
        num_tokens: tokens answered (0 for updates and failures).
        error: the server's error for a rejected request (its message names
            the field); None on success.
        session_id, trace: which session and which trace the request belongs to.
    """

    kind: str
    name: str
    elapsed_ms: float
    num_tokens: int
    error: PreposError | None
    session_id: str
    trace: str


@dataclass(frozen=True)
class ReplayOptions:
    """How traces are replayed (one value per load test, for every user)."""

    think_scale: float = field(default=1.0, metadata={
        "help": "multiplies every think time of the traces (0: back to back)"})
    think_jitter: float = field(default=0.1, metadata={
        "help": "each think time is multiplied by a uniform factor in [1 - jitter, 1 + jitter]"})
    request_timeout_s: float = field(default=60.0, metadata={"help": "seconds one request may take before it fails"})
    wait_for_ready: bool = field(default=False, metadata={
        "help": "a request that finds the server stopping, restarting or down waits for it, within "
                "--request-timeout-s, instead of failing (its wait counts in its response time)"})
    tls: bool = field(default=False, metadata={
        "help": "gRPC over TLS, the server's certificate checked against the system's roots (the Helm chart's "
                "router with router.tls.enabled; the access token, if any, from env PREPOS_ACCESS_TOKEN)"})
    tls_ca: str = field(default="", metadata={
        "help": "gRPC over TLS, the server's certificate checked against the PEM roots in this file (implies --tls)"})

    def __post_init__(self) -> None:
        if not (math.isfinite(self.think_scale) and self.think_scale >= 0):
            raise ValueError(f"think_scale: must be a finite number >= 0, got {self.think_scale}")
        if not 0 <= self.think_jitter <= 1:
            raise ValueError(f"think_jitter: must be in [0, 1], got {self.think_jitter}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s: must be > 0, got {self.request_timeout_s}")
        if self.tls_ca and not is_readable_file(self.tls_ca):
            raise ValueError(f"tls_ca: no readable file at {self.tls_ca}")


def failure_kind(error: BaseException, session_id: str) -> BaseException:
    """``error`` as Locust's failure table should group it: with the session id and request numbers in its message
    (``session 3f2a...: request 7 timed out``) every failure was a row of its own; they are left out here
    (``<session>``, ``request <n>``), the log keeping them."""
    if not isinstance(error, PreposError):
        return error
    text = error.message
    if session_id:  # where a message names it ("session 3f2a", Triton's "sequence 3f2a"), not inside other words
        text = re.sub(rf"(\b(?:session|sequence) ['\"]?){re.escape(session_id)}(?![\w-])", r"\1<session>", text)
    text = _REQUEST_NUMBER.sub("request <n>", text)
    grouped = copy.copy(error)
    grouped.message, grouped.args = text, (text,)
    return grouped


def trace_pool(traces: Sequence[SessionTrace]) -> Iterator[SessionTrace]:
    """Cycle through the traces that have steps, forever; users sharing the pool take turns.

    Raises:
        ValueError: no trace has a step.
    """
    usable = [trace for trace in traces if trace.steps]
    if not usable:
        raise ValueError("traces: no session trace has a step")
    while True:
        yield from usable


class TraceReplayer:
    """Replays traces from `pool` over sessions opened by `open_session`, one step per call.

    Meant for one simulated user (one thread or greenlet). `close` ends the
    open session, if any; call it when the user stops.
    """

    def __init__(self, open_session: Callable[[], Session], pool: Iterator[SessionTrace], options: ReplayOptions,
                 rng: random.Random):
        self._open_session = open_session
        self._pool = pool
        self._options = options
        self._rng = rng
        self._session: Session | None = None
        self._trace = next(pool)
        self._cursor = 0
        self._backoff_s = 0.0

    @property
    def trace(self) -> SessionTrace:
        """The trace being replayed (or about to start)."""
        return self._trace

    @property
    def next_step(self) -> Step:
        return self._trace.steps[self._cursor]

    def next_delay_s(self) -> float:
        """Seconds to wait before the next `run_step`: its think time, scaled and jittered."""
        jitter = self._options.think_jitter
        factor = self._rng.uniform(1 - jitter, 1 + jitter) if jitter else 1.0
        delay_s = self.next_step.delay_s * self._options.think_scale * factor
        backoff_s, self._backoff_s = self._backoff_s, 0.0
        return max(delay_s, backoff_s)

    def run_step(self) -> list[Measurement]:
        """Send the next step (opening a session first if none is open); after a trace's last step, close it.

        A rejected request is measured as a failure and the trace goes on (a
        rejected request changes nothing on the server). When the server
        cannot be reached, the session is abandoned and the next trace starts
        after a back-off.
        """
        if self._session is None:
            self._session = self._open_session()
            log.debug("session %s replays trace %s", self._session.session_id, self._trace.name)
        step = self.next_step
        self._cursor += 1
        measurements = self._send(step)
        if self._session is not None and self._cursor == len(self._trace.steps):
            measurements += self.close()
        return measurements

    def close(self, *, last: bool = False) -> list[Measurement]:
        """End the open session (END) and move on to the next trace; no-op when none is open. ``last``: the user is
        stopping, so the END is tried once and does not wait for a server that is down (`wait_for_ready`), as
        `Client.close` does: with the server gone for good, each user's END waited its whole time limit."""
        session = self._session
        if session is None:
            return []
        if last:
            session.wait_for_ready = False
        measurements = [] if session.closed else self._end(session)
        self._session = None
        self._trace, self._cursor = next(self._pool), 0
        return measurements

    def _end(self, session: Session) -> list[Measurement]:
        started = time.perf_counter()
        with contextlib.suppress(PreposError):  # what goes wrong here, the END below reports
            session.settle(timeout_s=max(END_SETTLE_S, self._options.request_timeout_s))
        try:
            update = session.close()
        except PreposError as error:
            log.warning("session %s: END failed: %s", session.session_id, error)
            return [self._failure(REJECTED_CLOSE, started, error, session)]
        if update is None:
            return []
        return [self._measure(TOTAL, update.path or REJECTED_CLOSE, update.total_ms, 0, session)]

    def _send(self, step: Step) -> list[Measurement]:
        session = self._session
        started = time.perf_counter()
        try:
            if step.max_tokens == 0:
                return self._update_measurements(session.append(step.delta, role=step.role))
            answer = session.ask(step.delta, role=step.role, max_tokens=step.max_tokens,
                                 choices=list(step.choices) if step.choices is not None else None)
            return self._answer_measurements(answer, chosen=step.choices is not None)
        except PreposUnavailable as error:
            log.warning("session %s: server unavailable: %s", session.session_id, error)
            self._backoff_s = UNAVAILABLE_BACKOFF_S
            measurement = self._failure(self._request_name(step), started, error, session)
            with contextlib.suppress(PreposError):  # END, in case the server is back; releases the stream anyway
                session.close(timeout_s=UNAVAILABLE_BACKOFF_S)
            self._session = None
            self._trace, self._cursor = next(self._pool), 0
            return [measurement]
        except PreposError as error:
            log.info("session %s: request rejected: %s", session.session_id, error)
            return [self._failure(self._request_name(step), started, error, session)]

    @staticmethod
    def _request_name(step: Step) -> str:
        return REJECTED_APPEND if step.max_tokens == 0 else REJECTED_GENERATE

    def _answer_measurements(self, answer: Answer, *, chosen: bool = False) -> list[Measurement]:
        """TTFT, TOTAL and the server's first-token time of an answer; TPOT too for an answer of two tokens or more
        that was decoded (``chosen``: among ``choices``, whose tokens after the first are forced, not decoded, and
        arrive together: no time per output token)."""
        path, num_tokens = answer.path or REJECTED_GENERATE, len(answer.token_ids)
        measurements = [
            self._measure(TTFT, path, answer.ttft_ms, num_tokens, self._session),
            self._measure(TOTAL, path, answer.total_ms, num_tokens, self._session),
        ]
        if answer.first_token_ms is not None:
            measurements.append(self._measure(SERVER_TTFT, path, answer.first_token_ms, num_tokens, self._session))
        if num_tokens >= 2 and not chosen:
            per_token_ms = (answer.total_ms - answer.ttft_ms) / (num_tokens - 1)
            measurements.append(self._measure(TPOT, path, per_token_ms, num_tokens, self._session))
        return measurements

    def _update_measurements(self, update: Update) -> list[Measurement]:
        return [self._measure(TOTAL, update.path or REJECTED_APPEND, update.total_ms, 0, self._session)]

    def _measure(self, kind: str, name: str, elapsed_ms: float, num_tokens: int, session: Session) -> Measurement:
        return Measurement(kind, name, elapsed_ms, num_tokens, None, str(session.session_id), self._trace.name)

    def _failure(self, name: str, started: float, error: PreposError, session: Session) -> Measurement:
        elapsed_ms = (time.perf_counter() - started) * 1e3
        # The traceback's frames hold the session: without it, a rejected
        # request's session is freed when its replay ends, not by a later
        # cyclic garbage collection.
        error.__traceback__ = None
        return Measurement(TOTAL, name, elapsed_ms, 0, error, str(session.session_id), self._trace.name)
