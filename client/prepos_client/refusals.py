"""What a server's refusal says: the session is not open there, the server is draining, stopping or away."""

from __future__ import annotations

from .errors import PreposError

NOT_CONNECTED = ("failed to connect", "no healthy upstream", "reset reason: connection failure")
"""What gRPC, or a router in front, says when it found no server to send a request to."""


def says_not_open(error: PreposError) -> bool:
    """Whether a refusal says the session is not open: Triton's, for a sequence it does not hold, or prepos's."""
    return "must specify the START flag" in error.message or (error.field == "START" and "is not open" in error.message)


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

