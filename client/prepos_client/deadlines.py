"""A call's time limit, and the server's deadline made from it."""

from __future__ import annotations

import math

from .protocol import is_number


MAX_TIMEOUT_S = 1e9
"""A longer time limit (31 years) is none: it is taken as infinity. Past about 7.5e9 s gRPC takes a deadline as
expired already, past 9.2e9 s Python's waits on a queue raise OverflowError (a traceback), and past about 1.8e13 s
the server's timeout input, in microseconds, overflows its UINT64."""


def check_timeout(timeout_s: float, name: str = "timeout_s") -> float:
    """Return `timeout_s` if it is a time limit: seconds > 0, or infinity for none, which any limit past
    :data:`MAX_TIMEOUT_S` is taken for (`name`: the argument, for the error).

    Raises:
        ValueError: zero, negative or NaN (a call would time out before its request was sent, or never compare).
        TypeError: not a number.
    """
    if not is_number(timeout_s):
        raise TypeError(f"{name}: expected seconds as a number, got {type(timeout_s).__name__}")
    if not timeout_s > 0:  # NaN fails this too
        raise ValueError(f"{name}: expected seconds > 0 (inf for no limit), got {timeout_s!r}")
    return math.inf if timeout_s > MAX_TIMEOUT_S else float(timeout_s)


SERVER_DEADLINE_MARGIN = 0.1
"""The server's deadline for a call comes this share of its time limit (at most ``SERVER_DEADLINE_MARGIN_S``)
before the client's: the server accepts no turn past its deadline, and a final response it sends by then has that
long to travel back before the client gives up, so a call that raised PreposTimeout did not change the session."""
SERVER_DEADLINE_MARGIN_S = 0.05


def server_timeout_us(timeout_s: float) -> int | None:
    """Triton's request timeout (microseconds) for a call limited to ``timeout_s``: the limit less the margin for
    the final response's way back (:data:`SERVER_DEADLINE_MARGIN`); None (no limit) for an infinite or
    non-positive one."""
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        return None
    margin = min(timeout_s * SERVER_DEADLINE_MARGIN, SERVER_DEADLINE_MARGIN_S)
    return max(1, int((timeout_s - margin) * 1e6))
