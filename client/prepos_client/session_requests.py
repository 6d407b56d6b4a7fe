"""The requests of one Session on its gRPC stream: sending them, reading their responses, sending again those
refused in a way that changed nothing, and recording each one's outcome in the session's state (opened, closed,
timed out with the outcome still to come). `Session` (session.py) is the public face of it."""

from __future__ import annotations

import logging
import queue
import time
import weakref
from collections.abc import Callable, Iterator, Mapping

from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

from .channel import Tls, stop_stream, triton_client, wait_until_ready
from .deadlines import server_timeout_us
from .errors import PreposError, PreposTimeout, from_triton
from .inflight import (Inflight, final_delivery, next_delivery, read_ahead_to_final, record_delivered_outcome,
                       record_late_outcome)
from .lifetime import check_new_stream, close_when_dropped, finish_then_close, handle_opened, streaming_sessions
from .opening import Opening
from .protocol import Chunk, new_text_decoder, parse_chunk, resume_input
from .refusals import (REOPEN, WHEN_READY, gone_error, may_send_again, not_open_error, refused_as_not_open,
                       send_again_as, server_away)
from .stream import ResponseRouter

logger = logging.getLogger(__name__)

ENDED_ANYWAY = "the request carried END, so the session is closed"  # Triton ends the sequence whatever happens
UNKNOWN_OUTCOME = "; whether its turn was accepted is not known yet (settle() finds out)"


class SessionRequests:
    """The request side of one `Session` (its ``owner``, held weakly: a dropped session is still collected, its
    connection then closed by ``lifetime.close_when_dropped``). The state it keeps:

    - ``closed``: the session was closed (END acknowledged, or it is gone) or detached;
    - ``opening``: whether the next request carries START, and with `resume` (:class:`~prepos_client.opening.Opening`);
    - ``unsettled``: requests whose call raised `PreposTimeout`, their outcome still to come, in the order sent;
    - ``ending``: a request carrying END whose outcome is still to be recorded;
    - ``opening_sent``: a request carrying START whose outcome is still to be recorded.
    """

    def __init__(
        self,
        owner,
        url: str,
        model: str,
        session_id: str | int,
        *,
        headers: Mapping[str, str],
        resume: bool,
        wait_for_ready: bool,
        tls: Tls | None,
    ):
        self.session_id = session_id
        self.model = model
        self.url = url
        self.wait_for_ready = wait_for_ready
        self.keep_waiting: Callable[[float], bool] | None = None  # asked while a call waits (see wait_until_ready)
        self._headers = dict(headers)
        self.opening = Opening(resume=resume)
        self.unsettled: list[Inflight] = []
        self.ending: Inflight | None = None
        self.opening_sent: Inflight | None = None
        self.closed = False
        self.num_requests = 0
        self._router: ResponseRouter | None = None
        self._triton = triton_client(url, tls)
        self._owner = weakref.ref(owner)
        self._dropped = close_when_dropped(owner, self._triton)

    def send(self, inputs: list[InferInput], *, end: bool, timeout_s: float, deadline: float) -> Inflight:
        """Queue a request on the session's stream. Its time limit goes with it as Triton's request timeout: the
        server stops the request a little before the client gives up (:func:`server_timeout_us`), so one the
        client gave up on does not take effect. A request that timed out on the client is settled first, within the
        same time limit (see the class docstring)."""
        if self.closed:
            raise PreposError(f"session {self.session_id} is closed")
        settled = self.settle_timed_out(timeout_s, deadline)
        if self.closed:  # the timed-out request carried END and was accepted after all
            raise PreposError(f"session {self.session_id} is closed")
        if self.ending is not None:  # Triton ended the sequence at that END: it would refuse this request
            raise PreposError(f"session {self.session_id} is closing: request {self.ending.request_id} carried END "
                              "and its answer is still to come; nothing was sent")
        if self.opening_sent is not None and self.opening_sent.timed_out is None:
            refused = self._await_opening(self.opening_sent, timeout_s, deadline)
            if self.closed:  # the opening's answer closed it (a resume that found no journal)
                raise PreposError(f"session {self.session_id} is closed: the request that was to open it was "
                                  f"refused ({refused}); nothing was sent")
        if settled and time.perf_counter() >= deadline:
            raise PreposTimeout(f"session {self.session_id}: no time left within {timeout_s:g} s after waiting for "
                                "the outcome of a request that timed out; nothing was sent", accepted=False)
        waits = 0
        while True:
            router = self._ensure_stream()
            self.num_requests += 1
            request_id = str(self.num_requests)
            alone = router.num_pending == 0 and not self.unsettled
            deliveries = router.expect(request_id)
            opens_session = self.opening.needs_start
            sent = [*inputs, resume_input()] if opens_session and self.opening.resume else inputs
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
            self.opening.sent()
            inflight = Inflight(request_id, deliveries, sent_at, deadline, opens_session, end, inputs=inputs,
                                alone=alone, waits=waits)
            if end:
                self.ending = inflight
            if opens_session:
                self.opening_sent = inflight
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

    def receive(self, inflight: Inflight, timeout_s: float) -> Iterator[Chunk]:
        decoder = new_text_decoder()
        while True:
            try:
                delivery = next_delivery(inflight, inflight.deadline)
            except queue.Empty:
                if inflight.opens_session or not inflight.closes_session:
                    # Its outcome (the server's deadline error, or a final response already on its way) is still
                    # to come; the next call waits for it, which also tells whether an opening opened the session.
                    self.unsettled.append(inflight)
                    self.unsettled.sort(key=lambda unsettled: unsettled.sent_at)  # settled in the order sent
                    outcome = UNKNOWN_OUTCOME
                else:
                    # Triton ends the sequence at an END request whatever becomes of the request: the session is
                    # over on the server once the END reaches it (not cancelled: left to finish), and a later
                    # request without START would be refused.
                    self.release(finish_pending=True)
                    outcome = f"; {ENDED_ANYWAY} (whether its turn was accepted is unknown)"
                inflight.timed_out = PreposTimeout(
                    f"session {self.session_id}: no complete response to request "
                    f"{inflight.request_id} within {timeout_s:g} s{outcome}"
                )
                raise inflight.timed_out from None
            if delivery.error is not None:
                if inflight is self.opening_sent:  # its caller has its answer: this call deals with it
                    self.opening_sent = None
                again = self._send_again(inflight, delivery.error) if inflight.settled_as is None else None
                if again is not None:
                    inflight = again
                    continue
                error = self._settle(inflight, delivery.error) or delivery.error
                if isinstance(error, PreposTimeout) and inflight.closes_session and ENDED_ANYWAY not in error.message:
                    # stopped at the server's deadline (where its error does not say so itself); accepted: False
                    raise error.reworded(f"{error.message}; {ENDED_ANYWAY}")
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
            self.opening.reopen()
        if kind is None or not may_send_again(kind, inflight, str(self.num_requests), time.perf_counter()):
            return None
        if kind != REOPEN:
            self._stop_stream()
            self.opening.send_again(inflight.opens_session)
        if inflight is self.ending:  # answered (refused): sent again in its place, or its refusal raised
            self.ending = None  # before the wait: a Ctrl-C there left close() waiting for its answer to the limit
        if kind == WHEN_READY and not self._wait_until_ready(inflight.deadline, inflight.waits, server_away(error)):
            return None
        left_s = inflight.deadline - time.perf_counter()
        if left_s <= 0:
            return None
        try:
            again = self.send(inflight.inputs, end=inflight.closes_session, timeout_s=left_s,
                               deadline=inflight.deadline)
        except PreposError:  # the stream failed: the refusal is what this call reports
            self.opening.needs_start = True
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
        return wait_until_ready(self._triton, self.model, self._headers, deadline, waits, self.keep_waiting)

    def _settle(self, inflight: Inflight, error: PreposError | None) -> PreposError | None:
        """Update the session's state for the outcome of a request: its final response (``error`` None) or error.
        Returns the error to raise in place of ``error``, if another. Once only: a request whose outcome was
        recorded ahead of its caller (``_await_opening``) gets what was returned then."""
        if inflight.settled_as is not None:
            return inflight.settled_as[0]
        if inflight is self.opening_sent:
            self.opening_sent = None
        if inflight is self.ending:
            self.ending = None
        if error is None:
            if inflight.opens_session:
                self.opening.opened()
                owner = self._owner()
                if owner is not None:
                    handle_opened(owner)  # another handle of this process that held it is stale now
            if inflight.closes_session:
                self.release()
            return None
        if refused_as_not_open(error, inflight):
            # Not sent again (see _send_again): the next request carries START and `resume`.
            return not_open_error(self.session_id, error)
        if inflight.opens_session and self.opening.reopening and error.status is None and error.field == "resume":
            # The server has no journal of it: the session was closed (its idle timeout, or an END sent by another
            # client), or the server keeps no journals; its log is gone.
            self.release()
            return gone_error(self.session_id, error)
        replaced = self.opening.refused(error) if inflight.opens_session else None
        if inflight.closes_session and error.status is None:
            # Triton ends the sequence on END whatever the model
            # answered: a later request without START would be refused.
            self.release()
        return replaced

    def end_in_flight(self, timeout_s: float, deadline: float) -> bool:
        """Wait until ``deadline`` for the outcome of the request carrying END that is still to be answered (its
        caller stopped reading it) and record it: another END would be refused, Triton having ended the sequence
        at that one. Returns whether the session is over; raises PreposTimeout when the outcome did not come."""
        ending = self.ending
        try:
            delivery = final_delivery(ending, deadline)
        except queue.Empty:
            raise PreposTimeout(f"session {self.session_id}: request {ending.request_id} carried END and has not "
                                f"been answered within {timeout_s:g} s; {ENDED_ANYWAY}") from None
        self._settle(ending, delivery.error)
        return self.closed

    def settle_timed_out(self, timeout_s: float, deadline: float) -> bool:
        """Wait until ``deadline`` for the outcome of each request the caller gave up on, in the order sent, and
        settle it. Returns whether there was one; raises PreposTimeout (leaving the rest unsettled) if an outcome
        did not come."""
        settled = False
        while self.unsettled and not self.closed:
            inflight = self.unsettled[0]
            try:
                delivery = final_delivery(inflight, deadline)
            except queue.Empty:
                opening = ", which was to open the session," if inflight.opens_session else ""
                raise PreposTimeout(
                    f"session {self.session_id}: request {inflight.request_id}{opening} timed out and the "
                    f"server has not reported its outcome within {timeout_s:g} s; nothing was sent",
                    accepted=False,
                ) from None
            self.unsettled.pop(0)
            settled = True
            self._settle(inflight, delivery.error)
            record_late_outcome(inflight, delivery.error, self.session_id)
        return settled

    def cancel_in_flight(self) -> None:
        """Cancel the requests still being answered on this session's stream (their caller is leaving; from the
        session's own thread): the server stops those still running at its next engine step and accepts none of
        them (one already answered may have been). A request carrying END ends the session all the same (Triton
        ends the sequence at it), so the session is then closed here; otherwise the next request (an END, say)
        goes on a new stream, without waiting behind them."""
        if self.closed or self._router is None:
            return
        if self._router.failure is not None:  # the stream had ended already: as _ensure_stream would find it
            self._stop_stream()
            self.opening.stream_lost()
            return
        ending, self.ending = self.ending, None
        opening, self.opening_sent = self.opening_sent, None
        if opening is not None and opening not in self.unsettled:  # one that timed out is settled as before
            self.opening.cancelled()
        self._stop_stream()
        if ending is not None:
            self.release()

    @property
    def stream_live(self) -> bool:
        """Whether the session's stream is open and has not failed: a request goes out on it without a new call."""
        return self._router is not None and self._router.failure is None

    def _ensure_stream(self) -> ResponseRouter:
        if self.stream_live:
            return self._router
        if self._router is not None:
            # The old stream ended (the server restarted, say, or a router moved us to another replica): the
            # next request resumes the session, which the server still holds or reopens from its journal.
            self._stop_stream()
            self.opening.stream_lost()
        check_new_stream(self.session_id)
        router = ResponseRouter()
        try:
            self._triton.start_stream(callback=router.on_response, headers=self._headers)
        except InferenceServerException as error:
            if "cannot start another stream" in (error.message() or ""):  # two threads opened it at once
                raise PreposError(f"session {self.session_id}: used from two threads at once; a Session is for "
                                  "one thread at a time (another call is opening its stream)") from None
            raise from_triton(error) from None
        self._router = router
        owner = self._owner()
        if owner is not None:
            streaming_sessions.add(owner)
        return router

    def _stop_stream(self) -> None:
        router, self._router = self._router, None
        if router is None:
            return
        # Waiting for pending requests would block on a request that timed
        # out; cancel those instead.
        stop_stream(self._triton, cancel_requests=router.failure is None and router.num_pending > 0)

    def release(self, *, finish_pending: bool = False) -> None:
        """Close the session here. ``finish_pending``: the stream's pending requests (an END the call stopped
        waiting for) are left to be answered, on a thread of their own (``lifetime.finish_then_close``), rather than
        cancelled."""
        self.closed = True
        for inflight in self.unsettled:
            record_delivered_outcome(inflight, self.session_id)
        self.unsettled = []
        owner = self._owner()
        if owner is not None:
            streaming_sessions.discard(owner)
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
