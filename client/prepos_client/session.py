"""Session: one stateful conversation with the `prepos` model over its own gRPC stream."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from .channel import Tls
from .deadlines import check_timeout
from .errors import PreposError
from .lifetime import close_on_exit
from .protocol import Answer, Chunk, Update, build_inputs
from .session_ids import check_session_id
from .session_requests import SessionRequests

SESSION_HEADER = "prepos-session-id"
NO_DELTA_MAX_TOKENS = 64
"""``max_tokens`` of an answer with an empty delta and no choices when none is given: the server takes a request
without a delta, choices or ``max_tokens`` for an update, so its own default cannot apply there."""


class Session:
    """One prepos session: a Triton sequence over its own gRPC stream.

    The first request carries START; for a resumed session (opened earlier,
    by another process or on another replica) it carries START with the
    `resume` input, which makes the server continue the session it holds or
    reopen it from its journal rather than start a new one. A request that opened the
    session and was rejected leaves it unopened, so the next request carries
    START again. A request that carries END ends the session even when it is
    rejected or times out (Triton ends the sequence regardless); one refused because the server no longer holds
    the session (its idle timeout passed, or another client ended it) closes it too. `close` sends END;
    `detach` leaves the session open on the server. Each call waits at most `timeout_s` for its last response and
    raises `PreposTimeout` after that; a failed request leaves the session
    usable.

    With `wait_for_ready`, a call whose request the server refused because it
    is stopping or restarting (draining, the model unloaded), or that found no
    server to connect to, waits, within its own time limit, until the server
    reports the model ready, and sends the request again then (resuming the
    session from its journal): a restart of the server costs the calls made
    meanwhile only time. Such a refusal changed nothing, so the turn is never
    sent twice. Without it (the default) the call raises the refusal at once.

    A request sent behind the one that was to open the session, before that
    one's answer was read (a `generate` not iterated yet), first waits, within
    its own time limit, for that answer (kept for its caller), so that it
    carries START again if the opening was refused.

    A Session is meant for one thread at a time. Close or detach it when
    done; one still open when the interpreter exits is closed then, unless
    another Session of this process has opened the same session since (with
    ``resume=True`` after a restart, say), which holds it now; `Client.close`
    leaves such a one alike (one dropped before, garbage-collected, stays open
    on the server until its idle timeout, as a detached one).

    When a call's own time limit runs out before the server's answer comes,
    the client cannot know yet whether the request's turn was accepted: the
    server stops it at its deadline, just before, and answers with a timeout
    error (not accepted), unless its last response was already on its way
    (accepted). The next call (`close` included), or `settle`, first waits,
    within its own time limit, for that answer and records it in the
    `PreposTimeout`'s ``accepted``, so a caller can tell whether to send the
    turn again. For the request that was to open the session, the answer also
    tells whether it opened it: after the error the next request carries
    START again, after a final response it does not (sending before the
    answer would put a second START next to one the server is still
    finishing, which it refuses as already open). If no answer comes within
    the call's time limit, the call raises `PreposTimeout` and sends nothing.
    """

    def __init__(
        self,
        url: str,
        model: str,
        session_id: str | int,
        *,
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
        resume: bool = False,
        wait_for_ready: bool = False,
        tls: Tls | None = None,
    ):
        self.session_id = check_session_id(session_id)
        self.model = model
        self.url = url
        self.timeout_s = check_timeout(timeout_s)
        self._requests = SessionRequests(self, url, model, self.session_id,
                                         headers={**(headers or {}), SESSION_HEADER: str(self.session_id)},
                                         resume=resume, wait_for_ready=bool(wait_for_ready), tls=tls)

    @property
    def wait_for_ready(self) -> bool:
        """Whether a call that finds the server stopping, restarting or unreachable waits for it (see the class
        docstring)."""
        return self._requests.wait_for_ready

    @wait_for_ready.setter
    def wait_for_ready(self, value: bool) -> None:
        self._requests.wait_for_ready = bool(value)

    @property
    def keep_waiting(self) -> Callable[[float], bool] | None:
        """Asked, while a call waits for its server (`wait_for_ready`), after each pause, with the seconds the call
        has left; False ends the wait, and the call raises as it would without `wait_for_ready` (a `RoutedSession`
        whose client has another replica ready, for the session to move there). None: wait the call's whole time
        limit."""
        return self._requests.keep_waiting

    @keep_waiting.setter
    def keep_waiting(self, value: Callable[[float], bool] | None) -> None:
        self._requests.keep_waiting = value

    @property
    def closed(self) -> bool:
        """True once the session was closed (END acknowledged), detached, or its `close` raised (released here,
        whatever became of the END)."""
        return self._requests.closed

    @property
    def opened(self) -> bool:
        """True once the server has answered a request of this session that opened it (or reopened it), until it
        was closed or detached (the server may have ended it since, a drain keeping its journal to resume it from).
        False for a session whose first request was refused, cut short or not sent yet: nothing of it may be open
        on the server."""
        return self._requests.opening.confirmed and not self._requests.closed

    def append(
        self,
        text: str | None = None,
        *,
        ids: Sequence[int] | None = None,
        role: str | None = None,
        end: bool = False,
        timeout_s: float | None = None,
    ) -> Update:
        """Append a delta to the session's token log without asking for an answer.

        Sends max_tokens=0 and waits for the acknowledgement, which the
        server sends once the delta is in the token log. `role` None means
        the server's default (`user`); `end=True` closes the session with
        this request.

        Raises:
            PreposError: the server rejected the request (`.field` names the input).
            PreposTimeout: no acknowledgement within the timeout.
        """
        inputs = build_inputs(text, ids=ids, role=role, max_tokens=0)
        timeout_s, deadline = self._time_limit(timeout_s)
        inflight = self._requests.send(inputs, end=end, timeout_s=timeout_s, deadline=deadline)
        return Update.from_chunks(list(self._requests.receive(inflight, timeout_s)))

    def generate(
        self,
        text: str | None = None,
        *,
        ids: Sequence[int] | None = None,
        role: str | None = None,
        max_tokens: int | None = None,
        choices: Sequence[str] | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        speculate: bool | None = None,
        gate_threshold: float | None = None,
        end: bool = False,
        timeout_s: float | None = None,
    ) -> Iterator[Chunk]:
        """Send a delta and stream the answer.

        The request is sent before this returns; the iterator yields each
        `Chunk` as it arrives, the last one with `final=True`. With no
        `text` and no `ids` the delta is empty. Arguments left None are not
        sent, so the server's defaults apply: `max_tokens` is then the
        server's `scheduler.default_max_tokens` (64 unless configured), except
        for an answer with an empty delta and no `choices` (the answer from
        the positioned state, path `exact`), which the server would take for
        an update: that one asks for `NO_DELTA_MAX_TOKENS` (64).
        Iteration raises `PreposError` when the server rejects the request and
        `PreposTimeout` when the whole answer takes longer than the timeout.
        """
        if max_tokens is None and text is None and ids is None and not choices:
            max_tokens = NO_DELTA_MAX_TOKENS
        inputs = build_inputs(
            text,
            ids=ids,
            role=role,
            max_tokens=max_tokens,
            choices=choices,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            speculate=speculate,
            gate_threshold=gate_threshold,
        )
        timeout_s, deadline = self._time_limit(timeout_s)
        inflight = self._requests.send(inputs, end=end, timeout_s=timeout_s, deadline=deadline)
        return self._chunks(inflight, timeout_s)

    def ask(
        self,
        text: str | None = None,
        *,
        ids: Sequence[int] | None = None,
        role: str | None = None,
        max_tokens: int | None = None,
        choices: Sequence[str] | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        speculate: bool | None = None,
        gate_threshold: float | None = None,
        end: bool = False,
        timeout_s: float | None = None,
    ) -> Answer:
        """Like `generate`, but wait for the last chunk and return the whole `Answer`.

        Raises:
            PreposError: the server rejected the request (`.field` names the input).
            PreposTimeout: the answer did not complete within the timeout.
        """
        chunks = self.generate(
            text,
            ids=ids,
            role=role,
            max_tokens=max_tokens,
            choices=choices,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            speculate=speculate,
            gate_threshold=gate_threshold,
            end=end,
            timeout_s=timeout_s,
        )
        return Answer.from_chunks(list(chunks))

    def close(self, *, timeout_s: float | None = None) -> Update | None:
        """End the session on the server and release the connection. Idempotent.

        Sends END (no delta, max_tokens=0) and waits for its acknowledgement,
        then stops the stream. Returns the acknowledgement, or None when no
        request was ever sent on a session that was not resumed (nothing to end), or when the server holds
        neither the session to be resumed nor a journal of it, or refuses the END's START for its session limit or a
        drain (nothing to end; Triton ends the sequence at this END),
        or when the opening was refused because the session is already open, held by another client (an END would
        end that client's sequence in Triton).
        If the request that was to
        open the session was rejected, or timed out and the server answered that
        it stopped it, END goes out together with START, so that no half-opened
        sequence is left behind (the server opens and closes the session at once).
        If that timed-out request carried END itself and the server accepted it,
        nothing more is sent and None is returned. The connection is released
        even when END fails; the error is raised after that, and this object
        counts as closed (a second `close` sends nothing). Where the END did not
        reach the server, a server that still holds the session ends it at its
        idle timeout, its journal with it; where the server was down (its drain
        ended the session, keeping the journal) or restarted, the journal stays
        until `journal.expire_s`; to end it sooner, open it again
        (`Client.session(session_id, resume=True)`) and close that.
        """
        requests = self._requests
        if requests.closed:
            return None
        try:
            timeout_s, deadline = self._time_limit(timeout_s)
            requests.settle_timed_out(timeout_s, deadline)
            if requests.closed:
                return None  # the timed-out request carried END and was accepted after all
            if requests.opening.nothing_to_end(requests.num_requests):
                return None  # nothing was opened here (END with START would end the sequence of another client)
            if requests.ending is not None and requests.end_in_flight(timeout_s, deadline):
                return None  # a request carrying END, whose answer its caller stopped reading, ended the session
            if requests.opening.cut:
                requests.opening.sent()  # END alone: see Opening.cancelled
            inflight = requests.send(build_inputs(max_tokens=0), end=True, timeout_s=timeout_s, deadline=deadline)
            try:
                return Update.from_chunks(list(requests.receive(inflight, timeout_s)))
            except PreposError as error:
                nothing_open = error.field in ("resume", "journal")
                if error.status is None and (inflight.opens_session and (
                        nothing_open or error.code in ("RESOURCE_EXHAUSTED", "UNAVAILABLE"))
                        or requests.opening.reopening and nothing_open):
                    # Nothing open to end (no such session and no journal, or one the server cannot read or use;
                    # the session limit; a draining server), and Triton ended the sequence at this END, or at the
                    # END sent again with START to reopen a session the server no longer held (its idle timeout
                    # ended it, say): done.
                    return None
                raise
        finally:
            requests.release()

    def settle(self, *, timeout_s: float | None = None) -> None:
        """Wait for the server's answer to every request of this session whose call raised `PreposTimeout` on
        the client's own time limit, and record it in that error's ``accepted`` (True: the turn is in the
        session's log; False: it is not; None: the stream ended first). Every call does this first; `settle`
        lets a caller learn it before deciding whether to send the turn again. Sends nothing.

        Raises:
            PreposTimeout: an answer did not come within the time limit (the rest stay to be settled).
        """
        if self.closed:
            return
        timeout_s, deadline = self._time_limit(timeout_s)
        self._requests.settle_timed_out(timeout_s, deadline)

    def cancel(self) -> None:
        """Cancel this session's requests still being answered (a generate whose caller stops reading, say; from
        the thread that uses the session): the server stops those still running at its next engine step, and
        accepts none of them (one already answered may have been). A request that carried END ends the session all
        the same, and the session is then closed; otherwise it stays open, and its next request (`close`, say) is
        not held up behind them."""
        self._requests.cancel_in_flight()

    def detach(self) -> None:
        """Release the connection and leave the session open on the server. Idempotent.

        A later `Client.session(session_id, resume=True)` continues it.
        """
        if not self.closed:
            self._requests.release()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        close_on_exit(self, exc_type)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Session({self.session_id!r}, url={self.url!r}, {state})"

    def _chunks(self, inflight, timeout_s: float) -> Iterator[Chunk]:
        """The answer's chunks, from a generator that holds the session: a session no one else holds
        (``client.session().generate(...)``) stays alive, and its stream open, while its answer is read."""
        yield from self._requests.receive(inflight, timeout_s)

    def _time_limit(self, timeout_s: float | None) -> tuple[float, float]:
        timeout_s = self.timeout_s if timeout_s is None else check_timeout(timeout_s)
        return timeout_s, time.perf_counter() + timeout_s
