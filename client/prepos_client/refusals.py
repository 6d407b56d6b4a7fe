"""What a server's refusal says (the session is not open there, the server is draining, stopping or away), and
which refused requests a session sends again."""

from __future__ import annotations

import typing

from .errors import PreposError

if typing.TYPE_CHECKING:
    from .inflight import Inflight

# How a refused request is sent again (send_again_as).
REOPEN = "reopen"  # with START and `resume`, on the same stream
NEW_STREAM = "new stream"  # on a new stream, which a router may take to another replica
WHEN_READY = "when ready"  # on a new stream, once the server reports the model ready

NOT_CONNECTED = ("failed to connect", "no healthy upstream", "reset reason: connection failure")
"""What gRPC, or a router in front, says when it found no server to send a request to."""


def says_not_open(error: PreposError) -> bool:
    """Whether a refusal says the session is not open: Triton's, for a sequence it does not hold, or prepos's."""
    return "must specify the START flag" in error.message or (error.field == "START" and "is not open" in error.message)


REFUSED_ON_ARRIVAL = ("must specify the START flag", "has no available versions",
                      "stopped accepting new inference requests")
"""Triton's refusals of a request as it arrives, before any model sees it, whose text names no request: a sequence
it does not hold (its idle timer counts from the sequence's last request, so it may end a session one long answer
still streams), a model it does not serve (now), a server stopping."""


def refused_on_arrival(error: PreposError) -> bool:
    """Whether an error is one of Triton's refusals of a request as it arrives (:data:`REFUSED_ON_ARRIVAL`): it
    belongs to a request that had no response yet."""
    return error.status is None and any(words in error.message for words in REFUSED_ON_ARRIVAL)


def says_draining(error: PreposError) -> bool:
    """Whether a refusal of a START says the server is draining before it stops (see prepos.drain)."""
    return error.field == "START" and "is draining" in error.message


def server_away(error: PreposError) -> str | None:
    """Why a refusal shows that the server is stopping, restarting or down, such that the request changed nothing:
    None when it does not show that.

    - the server is draining before a stop (prepos refused the START);
    - Triton has unloaded the model, as it does once it is told to stop ("unknown model ... has no available
      versions"; not "... is not found", the answer for a model name it does not serve, which waiting would not
      mend), or is stopping and takes no new request ("stopped accepting new inference requests", when it was
      stopped without a drain): the request was refused before any model saw it;
    - gRPC found no server to connect to ("failed to connect to all addresses"): the request never left the
      client; or a router in front (the chart's Envoy) found none to send it to ("no healthy upstream", or
      "reset reason: connection failure": its connection to the replica failed). A stream that broke after it
      connected says something else, and what became of its requests cannot be known.
    """
    if error.status is None:
        if says_draining(error):
            return "draining before a stop"
        if "has no available versions" in error.message or "stopped accepting new inference requests" in error.message:
            return "not serving the model (stopping or starting)"
    elif error.status == "StatusCode.UNAVAILABLE" and any(words in error.message for words in NOT_CONNECTED):
        return "not reachable"
    return None


def refused_as_not_open(error: PreposError, inflight: Inflight) -> bool:
    """Whether a request that had not opened the session was refused because the server does not hold it."""
    return error.status is None and not inflight.opens_session and says_not_open(error)


def send_again_as(error: PreposError, inflight: Inflight, *, wait_for_ready: bool) -> str | None:
    """How a request refused with ``error`` is sent again, for refusals that changed nothing; None: not at all.

    - :data:`REOPEN`: the server does not hold the session (its sequence was ended: by the server's drain before a
      stop, which keeps the session's journal, by its idle timeout, or by an END sent from elsewhere); sent again
      with START and `resume`, once; the server reopens the session from its journal, or answers that it has none,
      or that it is draining;
    - :data:`NEW_STREAM`: the server refused a START because it is draining before a stop; sent again on a new
      stream, once (the old one is pinned to that server, and holding it delays its stop), which a router in front
      of several replicas takes to another; with a journal they share, the session resumes there;
    - :data:`WHEN_READY`: with ``wait_for_ready``, the server is stopping, restarting or not reachable
      (:func:`server_away`); sent again on a new stream once the server reports the model ready, as often as that
      happens within the call's time limit; a request that had not opened the session goes with START and `resume`.

    Whether it may be sent again at all is :func:`may_send_again`."""
    if refused_as_not_open(error, inflight):
        return REOPEN
    away = server_away(error)
    if away == "draining before a stop" and inflight.opens_session and NEW_STREAM not in inflight.sent_again:
        return NEW_STREAM
    if away is not None and wait_for_ready:
        return WHEN_READY
    return None


def may_send_again(kind: str, inflight: Inflight, latest_request_id: str, now: float) -> bool:
    """Whether ``inflight`` may be sent again as ``kind``: only a request sent alone, and the session's latest
    (pipelined requests are refused the same way, and sending one again could put it before another), within its
    own time limit (``now`` on the perf_counter clock), and each kind but :data:`WHEN_READY` once."""
    if kind != WHEN_READY and kind in inflight.sent_again:
        return False
    return inflight.alone and inflight.request_id == latest_request_id and inflight.deadline > now


def not_open_error(session_id: str | int, error: PreposError) -> PreposError:
    """The error for a request refused because the server does not hold the session, and not sent again."""
    return error.reworded(f"session {session_id} is not open on the server (ended by a drain before a stop, by its "
                          "idle timeout, or by an END from elsewhere); this request changed nothing, and the next "
                          f"call asks the server to reopen the session from its journal. The server said: "
                          f"{error.message}")


def gone_error(session_id: str | int, error: PreposError) -> PreposError:
    """The error for a reopening refused because the server has no journal of the session: its log is gone."""
    return error.reworded(f"session {session_id} is no longer open on the server (closed by its idle timeout or by "
                          "an END from elsewhere, or ended by a server that keeps no journals); open a new session. "
                          f"The server said: {error.message}")
