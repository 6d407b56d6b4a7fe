"""Routing of one gRPC stream's callbacks to the requests waiting for them.

tritonclient calls one callback, on its own thread, for every response and
every error of a stream. `ResponseRouter` is that callback: it hands each
response to the queue of the request it belongs to, matched by request id.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tritonclient.grpc import InferResult
from tritonclient.utils import InferenceServerException

from .errors import PreposError, from_triton, request_id_of
from .protocol import is_final_response
from .refusals import refused_on_arrival

logger = logging.getLogger(__name__)

ARRIVAL_WINDOW_S = 1.0
"""How soon after its request Triton's refusal of a request as it arrives comes back, at most, as the client routes
it: a request sent longer ago with no response yet was taken (one queued behind a long answer, say)."""


@dataclass(frozen=True)
class Delivery:
    """One response (or error) for a request, stamped when it arrived."""

    result: InferResult | None
    error: PreposError | None
    received_at: float


class ResponseRouter:
    """Matches a stream's responses to its pending requests.

    A request is pending from `expect` until its final response or an error
    is delivered. Responses carry the request id, so responses of a request
    nobody waits for any more (its caller timed out, or it already failed)
    never reach another request. Errors of a single request carry no id in
    tritonclient; the model handles a session's requests in arrival order,
    so an error goes to the oldest pending request, unless its text names a
    pending request: Triton's own refusals of a request's inputs (``[request id: X] ...``, which
    come at once, ahead of earlier requests' answers) and the one error prepos
    sends out of order (a queued request's deadline, ``... (request "X")``). Triton's refusals of a request as it
    arrives that name none (:func:`refused_on_arrival`: a sequence it no longer holds, say) come at once too: they
    go to the oldest pending request that has had no response yet and was sent within :data:`ARRIVAL_WINDOW_S`
    (one that has had a response, or was sent longer ago, was taken: its refusal would have come), else to the
    oldest with no response yet. An error with a gRPC status ends the whole stream: every pending request receives
    it and `failure` is set.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._pending: dict[str, queue.SimpleQueue[Delivery]] = {}  # in send order
        self._sent_at: dict[str, float] = {}  # pending requests with no response yet: when each was expected
        self._failure: PreposError | None = None

    @property
    def failure(self) -> PreposError | None:
        """The error that ended the stream, or None while it is usable."""
        return self._failure

    @property
    def num_pending(self) -> int:
        """How many requests still wait for their final response."""
        with self._lock:
            return len(self._pending)

    def expect(self, request_id: str) -> queue.SimpleQueue[Delivery]:
        """Register a request about to be sent; return the queue its responses arrive on."""
        with self._lock:
            if request_id in self._pending:
                raise ValueError(f"request id {request_id!r} is already pending")
            deliveries: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
            if self._failure is not None:
                deliveries.put(Delivery(None, self._failure, time.perf_counter()))
            else:
                self._pending[request_id] = deliveries
                self._sent_at[request_id] = self._clock()
            return deliveries

    def forget(self, request_id: str) -> None:
        """Stop routing to a request (one that could not be sent)."""
        with self._lock:
            self._pending.pop(request_id, None)
            self._sent_at.pop(request_id, None)

    def on_response(self, result: InferResult | None, error: InferenceServerException | None) -> None:
        """The stream callback (runs on tritonclient's response thread)."""
        received_at = self._clock()
        try:
            if error is not None:
                self._route_error(from_triton(error), request_id_of(error.message() or str(error)),
                                  stream_ended=error.status() is not None, received_at=received_at)
            elif result is not None:
                self._route_result(result, received_at)
        except Exception:
            # An exception here would end tritonclient's response thread and
            # leave every waiting request hanging until its timeout.
            logger.exception("failed to route a stream response")

    def _route_error(self, failure: PreposError, named: str | None, *, stream_ended: bool,
                     received_at: float) -> None:
        with self._lock:
            if stream_ended:
                self._failure = failure
                targets = list(self._pending.values())
                self._pending.clear()
                self._sent_at.clear()
            elif self._pending:
                target_id = named if named in self._pending else next(iter(self._pending))
                if named not in self._pending and refused_on_arrival(failure):
                    target_id = self._refused_on_arrival(received_at) or target_id
                targets = [self._pending.pop(target_id)]
                self._sent_at.pop(target_id, None)
            else:
                targets = []
        if not targets and not stream_ended:
            logger.warning("error for no pending request: %s", failure)
        for deliveries in targets:
            deliveries.put(Delivery(None, failure, received_at))

    def _refused_on_arrival(self, received_at: float) -> str | None:
        """The request a refusal on arrival belongs to (see the class), or None when every pending one has had a
        response. Called under the lock."""
        unanswered = list(self._sent_at)  # in send order
        recent = [r for r in unanswered if received_at - self._sent_at[r] <= ARRIVAL_WINDOW_S]
        return (recent or unanswered or [None])[0]

    def _route_result(self, result: InferResult, received_at: float) -> None:
        request_id = result.get_response().id
        final = is_final_response(result)
        with self._lock:
            deliveries = self._pending.get(request_id)
            if deliveries is None and not request_id and self._pending:
                request_id = next(iter(self._pending))
                deliveries = self._pending[request_id]
            if deliveries is not None:
                self._sent_at.pop(request_id, None)  # answered: taken
                if final:
                    del self._pending[request_id]
        if deliveries is None:
            logger.debug("dropped a response for request %r, which nobody waits for", request_id)
            return
        deliveries.put(Delivery(result, None, received_at))
