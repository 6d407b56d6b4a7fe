"""Session: one stateful conversation with the `prepos` model over its own gRPC stream."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterator, Mapping, Sequence

from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

from .channel import Tls, stop_stream, triton_client, wait_until_ready
from .deadlines import check_timeout, server_timeout_us
from .errors import PreposError, PreposTimeout, from_triton
from .inflight import (Inflight, final_delivery, next_delivery, read_ahead_to_final, record_delivered_outcome,
                       record_late_outcome)
from .lifetime import close_on_exit, close_when_dropped, finish_then_close, streaming_sessions
from .opening import Opening
from .protocol import (Answer, Chunk, Update, build_inputs, new_text_decoder, parse_chunk,
                       resume_input)
from .refusals import (REOPEN, WHEN_READY, gone_error, may_send_again, not_open_error, refused_as_not_open,
                       send_again_as, server_away)
from .session_ids import check_session_id
from .stream import ResponseRouter

logger = logging.getLogger(__name__)

SESSION_HEADER = "prepos-session-id"

_ENDED_ANYWAY = "the request carried END, so the session is closed"  # Triton ends the sequence whatever happens


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
    done; one still open when the interpreter exits is closed then (one
    dropped before, garbage-collected, stays open on the server until its idle
    timeout, as a detached one).

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
        self.wait_for_ready = bool(wait_for_ready)
        self._headers = {**(headers or {}), SESSION_HEADER: str(self.session_id)}
        self._opening = Opening(resume=resume)
        self._unsettled: list[Inflight] = []  # requests the caller gave up on, whose outcome is still to come
        self._ending: Inflight | None = None  # a request carrying END whose outcome is still to be recorded
        self._opening_sent: Inflight | None = None  # a request carrying START whose outcome is still to be recorded
        self._closed = False
        self._num_requests = 0
        self._router: ResponseRouter | None = None
        self._triton = triton_client(url, tls)
        self._dropped = close_when_dropped(self, self._triton)

    @property
    def closed(self) -> bool:
        """True once the session was closed (END acknowledged) or detached."""
        return self._closed

    @property
    def opened(self) -> bool:
        """True once the server has answered a request of this session that opened it (or reopened it), until it
        was closed or detached (the server may have ended it since, a drain keeping its journal to resume it from).
        False for a session whose first request was refused, cut short or not sent yet: nothing of it may be open
        on the server."""
        return self._opening.confirmed and not self._closed

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
        inflight = self._send(inputs, end=end, timeout_s=timeout_s, deadline=deadline)
        return Update.from_chunks(list(self._receive(inflight, timeout_s)))

    def generate(
        self,
        text: str | None = None,
        *,
        ids: Sequence[int] | None = None,
        role: str | None = None,
        max_tokens: int | None = 64,
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
        sent, so the server's defaults apply (`max_tokens=None` included).
        Iteration raises `PreposError` when the server rejects the request and
        `PreposTimeout` when the whole answer takes longer than the timeout.
        """
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
        inflight = self._send(inputs, end=end, timeout_s=timeout_s, deadline=deadline)
        return self._receive(inflight, timeout_s)

    def ask(
        self,
        text: str | None = None,
        *,
        ids: Sequence[int] | None = None,
        role: str | None = None,
        max_tokens: int | None = 64,
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
        even when END fails; the error is raised after that.
        """
        if self._closed:
            return None
        try:
            timeout_s, deadline = self._time_limit(timeout_s)
            self._settle_timed_out(timeout_s, deadline)
            if self._closed:
                return None  # the timed-out request carried END and was accepted after all
            if self._opening.nothing_to_end(self._num_requests):
                return None  # nothing was opened here (END with START would end the sequence of another client)
            if self._ending is not None and self._end_in_flight(timeout_s, deadline):
                return None  # a request carrying END, whose answer its caller stopped reading, ended the session
            inflight = self._send(build_inputs(max_tokens=0), end=True, timeout_s=timeout_s, deadline=deadline)
            try:
                return Update.from_chunks(list(self._receive(inflight, timeout_s)))
            except PreposError as error:
                if inflight.opens_session and error.status is None and (
                        error.field in ("resume", "journal") or error.code in ("RESOURCE_EXHAUSTED", "UNAVAILABLE")):
                    # Nothing open to end (no such session and no journal, or one the server cannot read or use;
                    # the session limit; a draining server),
                    # and Triton ended the sequence at this END: done.
                    return None
                raise
        finally:
            self._release()

    def settle(self, *, timeout_s: float | None = None) -> None:
        """Wait for the server's answer to every request of this session whose call raised `PreposTimeout` on
        the client's own time limit, and record it in that error's ``accepted`` (True: the turn is in the
        session's log; False: it is not; None: the stream ended first). Every call does this first; `settle`
        lets a caller learn it before deciding whether to send the turn again. Sends nothing.

        Raises:
            PreposTimeout: an answer did not come within the time limit (the rest stay to be settled).
        """
        if self._closed:
            return
        timeout_s, deadline = self._time_limit(timeout_s)
        self._settle_timed_out(timeout_s, deadline)

    def detach(self) -> None:
        """Release the connection and leave the session open on the server. Idempotent.

        A later `Client.session(session_id, resume=True)` continues it.
        """
        if not self._closed:
            self._release()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        close_on_exit(self, exc_type)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Session({self.session_id!r}, url={self.url!r}, {state})"

    def _time_limit(self, timeout_s: float | None) -> tuple[float, float]:
        timeout_s = self.timeout_s if timeout_s is None else check_timeout(timeout_s)
        return timeout_s, time.perf_counter() + timeout_s

    def _send(self, inputs: list[InferInput], *, end: bool, timeout_s: float, deadline: float) -> Inflight:
        """Queue a request on the session's stream. Its time limit goes with it as Triton's request timeout: the
        server stops the request a little before the client gives up (:func:`server_timeout_us`), so one the
        client gave up on does not take effect. A request that timed out on the client is settled first, within the
        same time limit (see the class docstring)."""
        if self._closed:
            raise PreposError(f"session {self.session_id} is closed")
        settled = self._settle_timed_out(timeout_s, deadline)
        if self._closed:  # the timed-out request carried END and was accepted after all
            raise PreposError(f"session {self.session_id} is closed")
        if self._ending is not None:  # Triton ended the sequence at that END: it would refuse this request
            raise PreposError(f"session {self.session_id} is closing: request {self._ending.request_id} carried END "
                              "and its answer is still to come; nothing was sent")
        if self._opening_sent is not None and self._opening_sent.timed_out is None:
            refused = self._await_opening(self._opening_sent, timeout_s, deadline)
            if self._closed:  # the opening's answer closed it (a resume that found no journal)
                raise PreposError(f"session {self.session_id} is closed: the request that was to open it was "
                                  f"refused ({refused}); nothing was sent")
        if settled and time.perf_counter() >= deadline:
            raise PreposTimeout(f"session {self.session_id}: no time left within {timeout_s:g} s after waiting for "
                                "the outcome of a request that timed out; nothing was sent", accepted=False)
        waits = 0
        while True:
            router = self._ensure_stream()
            self._num_requests += 1
            request_id = str(self._num_requests)
            alone = router.num_pending == 0 and not self._unsettled
            deliveries = router.expect(request_id)
            opens_session = self._opening.needs_start
            sent = [*inputs, resume_input()] if opens_session and self._opening.resume else inputs
            sent_at = time.perf_counter()
            try:
                self._triton.async_stream_infer(
                    self.model,
                    sent,
                    request_id=request_id,
                    sequence_id=self.session_id,
                    sequence_start=opens_session,
                    sequence_end=end,
                    enable_empty_final_response=True,
                    timeout=server_timeout_us(timeout_s if not (settled or waits)
                                              else max(deadline - sent_at, 1e-6)),
                )
            except InferenceServerException as error:
                # The stream died before the request could be queued on it;
                # stopping it joins the response thread, so `failure` is final.
                router.forget(request_id)
                self._stop_stream()
                failure = router.failure or from_triton(error)
                why = server_away(failure) if self.wait_for_ready else None
                if why is None or not self._wait_until_ready(deadline, waits, why):
                    raise failure from None
                waits += 1  # nothing was sent: send it on a new stream now that the server is ready
                continue
            self._opening.sent()
            inflight = Inflight(request_id, deliveries, sent_at, deadline, opens_session, end, inputs=inputs,
                                alone=alone, waits=waits)
            if end:
                self._ending = inflight
            if opens_session:
                self._opening_sent = inflight
            return inflight

    def _await_opening(self, opening: Inflight, timeout_s: float, deadline: float) -> PreposError | None:
        """Before a request goes out behind the one that was to open the session, whose caller has not read its
        answer yet: wait, until ``deadline``, for that answer (kept for its caller) and record it, so that this
        request carries START again if the opening was refused (without, it would be refused as not open, and
        reopening a session that never opened finds no journal). A refusal the opening's own call sends again
        (a draining or restarting server) is left to it, as before. Returns the opening's error, if any."""
        try:
            delivery = read_ahead_to_final(opening, deadline)
        except queue.Empty:
            raise PreposTimeout(f"session {self.session_id}: request {opening.request_id}, which was to open the "
                                f"session, has not been answered within {timeout_s:g} s; nothing was sent",
                                accepted=False) from None
        if delivery.error is not None and send_again_as(delivery.error, opening,
                                                        wait_for_ready=self.wait_for_ready) is not None:
            return None
        opening.settled_as = (self._settle(opening, delivery.error),)
        return opening.settled_as[0] or delivery.error

    def _receive(self, inflight: Inflight, timeout_s: float) -> Iterator[Chunk]:
        decoder = new_text_decoder()
        while True:
            try:
                delivery = next_delivery(inflight, inflight.deadline)
            except queue.Empty:
                if inflight.opens_session or not inflight.closes_session:
                    # Its outcome (the server's deadline error, or a final response already on its way) is still
                    # to come; the next call waits for it, which also tells whether an opening opened the session.
                    self._unsettled.append(inflight)
                    self._unsettled.sort(key=lambda unsettled: unsettled.sent_at)  # settled in the order sent
                    outcome = "; whether its turn was accepted is not known yet (settle() finds out)"
                else:
                    # Triton ends the sequence at an END request whatever becomes of the request: the session is
                    # over on the server once the END reaches it (not cancelled: left to finish), and a later
                    # request without START would be refused.
                    self._release(finish_pending=True)
                    outcome = f"; {_ENDED_ANYWAY} (whether its turn was accepted is unknown)"
                inflight.timed_out = PreposTimeout(
                    f"session {self.session_id}: no complete response to request "
                    f"{inflight.request_id} within {timeout_s:g} s{outcome}"
                )
                raise inflight.timed_out from None
            if delivery.error is not None:
                if inflight is self._opening_sent:  # its caller has its answer: this call deals with it
                    self._opening_sent = None
                again = self._send_again(inflight, delivery.error) if inflight.settled_as is None else None
                if again is not None:
                    inflight = again
                    continue
                error = self._settle(inflight, delivery.error) or delivery.error
                if isinstance(error, PreposTimeout) and inflight.closes_session:  # stopped at the server's deadline
                    raise error.reworded(f"{error.message}; {_ENDED_ANYWAY}")  # accepted: False, as the server said
                raise error
            chunk = parse_chunk(
                delivery.result,
                elapsed_ms=(delivery.received_at - inflight.sent_at) * 1e3,
                decoder=decoder,
            )
            if chunk.final:  # recorded before the caller sees it, who may stop reading there
                self._settle(inflight, None)
                yield chunk
                return
            yield chunk

    def _send_again(self, inflight: Inflight, error: PreposError) -> Inflight | None:
        """Send a refused request again, for refusals that changed nothing (:func:`~prepos_client.refusals.
        send_again_as`), within its own time limit. Returns the request sent again, or None; after the first
        refusal for a session the server does not hold, the next call reopens the session either way."""
        kind = send_again_as(error, inflight, wait_for_ready=self.wait_for_ready)
        if kind == REOPEN:
            self._opening.reopen()
        if kind is None or not may_send_again(kind, inflight, str(self._num_requests), time.perf_counter()):
            return None
        if kind != REOPEN:
            self._stop_stream()
            self._opening.send_again(inflight.opens_session)
        if kind == WHEN_READY and not self._wait_until_ready(inflight.deadline, inflight.waits, server_away(error)):
            return None
        left_s = inflight.deadline - time.perf_counter()
        if left_s <= 0:
            return None
        if inflight is self._ending:  # sent again in its place
            self._ending = None
        try:
            again = self._send(inflight.inputs, end=inflight.closes_session, timeout_s=left_s,
                               deadline=inflight.deadline)
        except PreposError:  # the stream failed: the refusal is what this call reports
            self._opening.needs_start = True
            return None
        again.sent_again = (*inflight.sent_again, kind)
        again.waits += inflight.waits + (kind == WHEN_READY)
        logger.info("session %s: request %s sent again as %s (%s): %s", self.session_id, inflight.request_id,
                    again.request_id, kind, error.message)
        return again

    def _wait_until_ready(self, deadline: float, waits: int, why: str) -> bool:
        """Wait, until ``deadline`` (perf_counter time), for the server to report the model ready: the ``waits``-th
        time for this call (:func:`~prepos_client.channel.wait_until_ready`). Returns whether it did."""
        if waits == 0:
            logger.warning("session %s: the server at %s is %s; waiting for it to be ready (at most %.3g s)",
                           self.session_id, self.url, why, max(0.0, deadline - time.perf_counter()))
        return wait_until_ready(self._triton, self.model, self._headers, deadline, waits)

    def _settle(self, inflight: Inflight, error: PreposError | None) -> PreposError | None:
        """Update the session's state for the outcome of a request: its final response (``error`` None) or error.
        Returns the error to raise in place of ``error``, if another. Once only: a request whose outcome was
        recorded ahead of its caller (``_await_opening``) gets what was returned then."""
        if inflight.settled_as is not None:
            return inflight.settled_as[0]
        if inflight is self._opening_sent:
            self._opening_sent = None
        if inflight is self._ending:
            self._ending = None
        if error is None:
            if inflight.opens_session:
                self._opening.opened()
            if inflight.closes_session:
                self._release()
            return None
        if refused_as_not_open(error, inflight):
            # Not sent again (see _send_again): the next request carries START and `resume`.
            return not_open_error(self.session_id, error)
        if inflight.opens_session and self._opening.reopening and error.status is None and error.field == "resume":
            # The server has no journal of it: the session was closed (its idle timeout, or an END sent by another
            # client), or the server keeps no journals; its log is gone.
            self._release()
            return gone_error(self.session_id, error)
        replaced = self._opening.refused(error) if inflight.opens_session else None
        if inflight.closes_session and error.status is None:
            # Triton ends the sequence on END whatever the model
            # answered: a later request without START would be refused.
            self._release()
        return replaced

    def _end_in_flight(self, timeout_s: float, deadline: float) -> bool:
        """Wait until ``deadline`` for the outcome of the request carrying END that is still to be answered (its
        caller stopped reading it) and record it: another END would be refused, Triton having ended the sequence
        at that one. Returns whether the session is over; raises PreposTimeout when the outcome did not come."""
        ending = self._ending
        try:
            delivery = final_delivery(ending, deadline)
        except queue.Empty:
            raise PreposTimeout(f"session {self.session_id}: request {ending.request_id} carried END and has not "
                                f"been answered within {timeout_s:g} s; {_ENDED_ANYWAY}") from None
        self._settle(ending, delivery.error)
        return self._closed

    def _settle_timed_out(self, timeout_s: float, deadline: float) -> bool:
        """Wait until ``deadline`` for the outcome of each request the caller gave up on, in the order sent, and
        settle it. Returns whether there was one; raises PreposTimeout (leaving the rest unsettled) if an outcome
        did not come."""
        settled = False
        while self._unsettled and not self._closed:
            inflight = self._unsettled[0]
            try:
                delivery = final_delivery(inflight, deadline)
            except queue.Empty:
                opening = ", which was to open the session," if inflight.opens_session else ""
                raise PreposTimeout(
                    f"session {self.session_id}: request {inflight.request_id}{opening} timed out and the "
                    f"server has not reported its outcome within {timeout_s:g} s; nothing was sent",
                    accepted=False,
                ) from None
            self._unsettled.pop(0)
            settled = True
            self._settle(inflight, delivery.error)
            record_late_outcome(inflight, delivery.error, self.session_id)
        return settled

    def _ensure_stream(self) -> ResponseRouter:
        if self._router is not None and self._router.failure is None:
            return self._router
        if self._router is not None:
            # The old stream ended (the server restarted, say, or a router moved us to another replica): the
            # next request resumes the session, which the server still holds or reopens from its journal.
            self._stop_stream()
            self._opening.stream_lost()
        router = ResponseRouter()
        try:
            self._triton.start_stream(callback=router.on_response, headers=self._headers)
        except InferenceServerException as error:
            if "cannot start another stream" in (error.message() or ""):  # two threads opened it at once
                raise PreposError(f"session {self.session_id}: used from two threads at once; a Session is for "
                                  "one thread at a time (another call is opening its stream)") from None
            raise from_triton(error) from None
        self._router = router
        streaming_sessions.add(self)
        return router

    def _stop_stream(self) -> None:
        router, self._router = self._router, None
        if router is None:
            return
        # Waiting for pending requests would block on a request that timed
        # out; cancel those instead.
        stop_stream(self._triton, cancel_requests=router.failure is None and router.num_pending > 0)

    def _release(self, *, finish_pending: bool = False) -> None:
        """Close the session here. ``finish_pending``: the stream's pending requests (an END the call stopped
        waiting for) are left to be answered, on a thread of their own (``lifetime.finish_then_close``), rather than
        cancelled."""
        self._closed = True
        for inflight in self._unsettled:
            record_delivered_outcome(inflight, self.session_id)
        self._unsettled = []
        streaming_sessions.discard(self)
        if finish_pending and self._router is not None:
            router, self._router = self._router, None
            self._dropped.detach()
            finish_then_close(self._triton, router)
            return
        try:
            self._stop_stream()
        finally:
            self._triton.close()
            self._dropped.detach()
