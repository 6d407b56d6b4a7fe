"""Requests waiting behind their session's earlier ones, by deadline.

A session's requests are served in order, so a request sent while its session answers another waits for that
answer. Its deadline may pass meanwhile (a short time limit behind a long answer): the engine loop then answers
it at once, with the deadline error it would get when its turn came, instead of when its turn comes. The client,
which stops waiting at its own limit and then asks what became of the request, learns it on time.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from prepos.protocol import Request, ResponseSink
from prepos.session import Session

PRUNE_ABOVE = 64  # the heap is pruned of requests served before their deadline once it holds more than this


class QueuedDeadlines:
    """The deadlines of requests that wait behind their session's earlier ones, soonest first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Session, Request, ResponseSink]] = []
        self._order = itertools.count()  # ties in deadline: first queued, first out

    def __len__(self) -> int:
        return len(self._heap)

    def watch(self, session: Session, request: Request, sink: ResponseSink) -> None:
        """Watch a request just queued on ``session`` (one with a deadline)."""
        heapq.heappush(self._heap, (request.deadline_s, next(self._order), session, request, sink))

    def due(self, now: float) -> bool:
        return bool(self._heap) and self._heap[0][0] < now

    def expired(self, now: float) -> Iterator[tuple[Session, Request, ResponseSink]]:
        """Take each watched request whose deadline is before ``now`` and that still waits out of its session's
        queue, and yield it; requests already taken for serving are dropped from the watch."""
        while self.due(now):
            _, _, session, request, sink = heapq.heappop(self._heap)
            for index, (queued, _) in enumerate(session.pending):
                if queued is request:
                    del session.pending[index]
                    yield session, request, sink
                    break

    def prune(self) -> None:
        """Forget requests no longer queued (served before their deadline), once there are more than a few."""
        if len(self._heap) <= PRUNE_ABOVE:
            return
        self._heap = [entry for entry in self._heap if any(queued is entry[3] for queued, _ in entry[2].pending)]
        heapq.heapify(self._heap)
