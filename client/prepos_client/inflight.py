"""A request on its way: what the session keeps of it until its outcome is known."""

from __future__ import annotations

import logging
import math
import queue
import time
from collections import deque
from dataclasses import dataclass, field

from .errors import PreposError, PreposTimeout
from .protocol import is_final_response

logger = logging.getLogger("prepos_client.session")  # the session logs what became of its requests


@dataclass
class Inflight:
    """A request a session sent whose outcome (final response or error) it has not recorded yet."""

    request_id: str
    deliveries: queue.SimpleQueue
    sent_at: float
    deadline: float  # perf_counter time after which the caller stops waiting
    opens_session: bool
    closes_session: bool
    timed_out: PreposTimeout | None = None  # what the caller got when its own time limit ran out first
    inputs: list = field(default_factory=list)  # as sent (but START and `resume`), to send again (_send_again)
    sent_again: tuple[str, ...] = ()  # why it (as an earlier request) was sent again already (see _send_again)
    waits: int = 0  # how many times its call waited for the server to be ready again (see _send_again)
    alone: bool = False  # no other request of the session was in flight when it was sent
    read_ahead: deque = field(default_factory=deque)  # deliveries taken early (Session._await_opening), in order
    settled_as: tuple | None = None  # (error to raise) once its outcome was recorded ahead of its caller


def next_delivery(inflight: Inflight, deadline: float):
    """The request's next delivery (one read ahead first), waiting until `deadline` (perf_counter time); raises
    queue.Empty after it."""
    if inflight.read_ahead:
        return inflight.read_ahead.popleft()
    return _next_queued(inflight.deliveries, deadline)


def read_ahead_to_final(inflight: Inflight, deadline: float):
    """The request's final delivery (its final response or error), keeping every delivery taken for its caller to
    read in order; waits until `deadline`, raising queue.Empty after it (what was taken is kept)."""
    for delivery in inflight.read_ahead:
        if _decides(delivery):
            return delivery
    while True:
        delivery = _next_queued(inflight.deliveries, deadline)
        inflight.read_ahead.append(delivery)
        if _decides(delivery):
            return delivery


def _next_queued(deliveries: queue.SimpleQueue, deadline: float):
    if deadline == math.inf:
        return deliveries.get()  # an infinite timeout overflows the queue's clock
    return deliveries.get(timeout=max(0.0, deadline - time.perf_counter()))


def final_delivery(inflight: Inflight, deadline: float):
    """The delivery that decides a request, its final response or its error, waiting until `deadline`
    (perf_counter time); raises queue.Empty after it. Chunks before the last one decide nothing: only the final
    response accepts the turn."""
    while True:
        delivery = next_delivery(inflight, deadline)
        if _decides(delivery):
            return delivery


def _decides(delivery) -> bool:
    """Whether a delivery decides its request: an error, or the final response."""
    return delivery.error is not None or is_final_response(delivery.result)


def record_late_outcome(inflight: Inflight, error: PreposError | None, session_id: str) -> None:
    """Record on the :class:`PreposTimeout` its caller got what became of a request that timed out on the client."""
    if error is None:
        inflight.timed_out.accepted = True
        logger.warning("session %s: request %s timed out on the client but was accepted after all; its turn is "
                       "in the session's log", session_id, inflight.request_id)
    elif error.status is None:  # the model answered with an error: the request changed nothing
        inflight.timed_out.accepted = False
    # An error with a gRPC status ended the stream: what became of the request cannot be known.


def record_delivered_outcome(inflight: Inflight, session_id: str) -> None:
    """Record the outcome of a request the caller gave up on if it has already arrived (the session is being
    released: a request that ends it is answered after every earlier one)."""
    try:
        delivery = final_delivery(inflight, time.perf_counter())
    except queue.Empty:
        return
    record_late_outcome(inflight, delivery.error, session_id)
