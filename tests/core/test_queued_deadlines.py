"""The watch over requests queued behind their session's earlier ones: which it gives back, and which it forgets."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from prepos.queued_deadlines import PRUNE_ABOVE, QueuedDeadlines


def queued(session, deadline_s: float, watch: QueuedDeadlines):
    request = SimpleNamespace(deadline_s=deadline_s)
    sink = object()
    session.pending.append((request, sink))
    watch.watch(session, request, sink)
    return request


def test_expired_takes_only_requests_past_their_deadline_that_still_wait_soonest_first():
    watch = QueuedDeadlines()
    a, b = SimpleNamespace(pending=deque()), SimpleNamespace(pending=deque())
    late = queued(a, 3.0, watch)
    soon = queued(b, 1.0, watch)
    served = queued(a, 2.0, watch)
    a.pending.remove(next(item for item in a.pending if item[0] is served))  # taken for serving before its deadline
    assert not watch.due(1.0) and watch.due(1.5)
    assert [request for _, request, _ in watch.expired(2.5)] == [soon]
    assert list(b.pending) == [] and [r for r, _ in a.pending] == [late]
    assert [request for _, request, _ in watch.expired(4.0)] == [late] and len(watch) == 0


def test_prune_forgets_requests_served_before_their_deadline():
    watch = QueuedDeadlines()
    session = SimpleNamespace(pending=deque())
    requests = [queued(session, 100.0 + i, watch) for i in range(PRUNE_ABOVE + 10)]
    watch.prune()
    assert len(watch) == PRUNE_ABOVE + 10  # all still wait
    for _ in range(20):
        session.pending.popleft()  # served
    watch.prune()
    assert len(watch) == PRUNE_ABOVE - 10
    assert [request for _, request, _ in watch.expired(1000.0)] == requests[20:]
