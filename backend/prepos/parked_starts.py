"""STARTs for an open session, held for a moment in case the END before them is still on its way.

Triton forgets a sequence's slot as soon as its END is queued, so a START sent right behind that END (the id
reused at once, on the same stream or another) gets a slot of its own; the two slots feed the model independently,
one request per slot at a time, so the START can reach prepos a few milliseconds before the END it followed. Taken
at once, it would find the session still open and be refused as already open, and the requests behind it would
then land on the old session. So a START (without ``resume``) for an open session waits here up to
:data:`REORDER_GRACE_S`: an END for the session admitted meanwhile takes it along (it then opens once that END is
served); otherwise it is admitted again when its grace ends, and refused as already open if the session still is.
Requests without START that come meanwhile are the old session's, as before: what Triton sends on the new slot
after the START can overtake the old slot's requests too, which nothing in a request tells apart.
"""

from __future__ import annotations

from collections import deque

from prepos.protocol import Request, ResponseSink

REORDER_GRACE_S = 0.5
"""How long a START for an open session waits for that session's END: Triton hands a slot's next request over
once the model has taken the previous one (about a millisecond apart here), so far less is needed; a START that
really duplicates an open session's is refused this much later."""


class ParkedStarts:
    """STARTs held for their session's END, by session id, each in arrival order."""

    def __init__(self) -> None:
        self._parked: dict[str | int, deque[tuple[float, Request, ResponseSink]]] = {}

    def park(self, request: Request, sink: ResponseSink, now: float) -> None:
        self._parked.setdefault(request.session_id, deque()).append((now + REORDER_GRACE_S, request, sink))

    def release(self, session_id: str | int) -> list[tuple[Request, ResponseSink]]:
        """Every START held for ``session_id``, in arrival order (an END for it was just admitted)."""
        return [(request, sink) for _, request, sink in self._parked.pop(session_id, ())]

    def next_due_s(self) -> float | None:
        """When the soonest grace ends; None when nothing is held."""
        return min((starts[0][0] for starts in self._parked.values()), default=None)

    def expired(self, now: float) -> list[tuple[Request, ResponseSink]]:
        """The STARTs whose grace ended before ``now``, each session's in arrival order (a later START of the same
        session waits for the earlier one)."""
        out = []
        for session_id in list(self._parked):
            starts = self._parked[session_id]
            while starts and starts[0][0] <= now:
                _, request, sink = starts.popleft()
                out.append((request, sink))
            if not starts:
                del self._parked[session_id]
        return out

    def take_all(self) -> list[tuple[Request, ResponseSink]]:
        """Every START held (the server stops)."""
        out = [(request, sink) for starts in self._parked.values() for _, request, sink in starts]
        self._parked.clear()
        return out
