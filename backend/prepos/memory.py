"""KV memory accounting against the budget, and the order in which idle sessions give their KV back."""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from prepos.session import Session


class LeastRecentlyActive:
    """Evict the KV of the session that has been idle longest first."""

    def order(self, candidates: Sequence[Session], now_s: float) -> list[Session]:
        return sorted(candidates, key=lambda s: s.last_active_s)


class FarthestNextUse:
    """Evict first the KV whose next use is predicted farthest away.

    A session's next request is expected one idle gap after its last one ended: its own typical gap
    (``Session.gap_s``) or, for a session with none yet, the median of the others'. A session late by less than
    that gap is due any moment and stays; one late by more has probably stopped asking and goes first (least
    recently active first among those). Sessions that ask at a steady pace (monitors, agents taking turns) then
    keep the ones due soonest resident, where least-recently-active order, once more of them are open than the
    budget holds, evicts each just before it asks again. With no gap known at all, the order is least recently
    active.
    """

    def order(self, candidates: Sequence[Session], now_s: float) -> list[Session]:
        known = sorted(s.gap_s for s in candidates if s.gap_s is not None)
        if not known:
            return sorted(candidates, key=lambda s: s.last_active_s)
        typical = known[len(known) // 2]

        def key(s: Session) -> tuple[int, float]:
            gap = typical if s.gap_s is None else s.gap_s
            if now_s - s.last_active_s > 2 * gap:  # late by more than a whole gap
                return 0, s.last_active_s
            return 1, -(s.last_active_s + gap)

        return sorted(candidates, key=key)


EVICTION_POLICIES = {"lru": LeastRecentlyActive, "next_use": FarthestNextUse}


class KvLedger:
    """KV bytes held per session, their running total, and which sessions may be evicted.

    A session's entry has two parts: its KV and other bytes it holds (a positioned distribution). Where the
    engine can tell the KV it holds in all (``kv_total``: KV that several sessions share by reference counted
    once), that is the KV part of the total instead of the sum of the sessions' KV, so that evicting a session
    whose KV others still hold frees nothing, and sharing leaves room for more sessions.
    """

    def __init__(self, budget_bytes: int, policy: str = "lru", kv_total: Callable[[], int | None] = lambda: None):
        self.budget_bytes = budget_bytes
        self._policy = EVICTION_POLICIES[policy]()
        self._kv_total = kv_total
        self._bytes: dict[str | int, tuple[int, int]] = {}
        self._kv_bytes = self._other_bytes = 0

    def record(self, session_id: str | int, kv_bytes: int, other_bytes: int = 0) -> None:
        old_kv, old_other = self._bytes.get(session_id, (0, 0))
        self._kv_bytes += kv_bytes - old_kv
        self._other_bytes += other_bytes - old_other
        self._bytes[session_id] = (kv_bytes, other_bytes)

    def forget(self, session_id: str | int) -> None:
        old_kv, old_other = self._bytes.pop(session_id, (0, 0))
        self._kv_bytes -= old_kv
        self._other_bytes -= old_other

    @property
    def used_bytes(self) -> int:
        total = self._kv_total()
        return (self._kv_bytes if total is None else total) + self._other_bytes

    @property
    def over_budget(self) -> bool:
        return self.used_bytes > self.budget_bytes

    def victims(self, sessions: Iterable[Session], *, protect: Session | None, older_than: float | None,
                now_s: float) -> list[Session]:
        """Idle sessions holding KV, in eviction order; ``older_than`` keeps more recently active ones out."""
        candidates = [
            s for s in sessions
            if s.has_kv and s is not protect and not s.serving and not s.pending
            and (older_than is None or s.last_active_s < older_than)
        ]
        return self._policy.order(candidates, now_s)
