"""KV memory accounting against the budget, and the order in which idle sessions give their KV back."""

from __future__ import annotations

from typing import Iterable, Sequence

from prepos.session import Session


class LeastRecentlyActive:
    """Evict the KV of the session that has been idle longest first."""

    def order(self, candidates: Sequence[Session]) -> list[Session]:
        return sorted(candidates, key=lambda s: s.last_active_s)


EVICTION_POLICIES = {"lru": LeastRecentlyActive}


class KvLedger:
    """KV bytes held per session, their running total, and which sessions may be evicted."""

    def __init__(self, budget_bytes: int, policy: str = "lru"):
        self.budget_bytes = budget_bytes
        self._policy = EVICTION_POLICIES[policy]()
        self._bytes: dict[str | int, int] = {}
        self.used_bytes = 0

    def record(self, session_id: str | int, num_bytes: int) -> None:
        self.used_bytes += num_bytes - self._bytes.get(session_id, 0)
        self._bytes[session_id] = num_bytes

    def forget(self, session_id: str | int) -> None:
        self.used_bytes -= self._bytes.pop(session_id, 0)

    @property
    def over_budget(self) -> bool:
        return self.used_bytes > self.budget_bytes

    def victims(self, sessions: Iterable[Session], *, protect: Session, older_than: float | None) -> list[Session]:
        """Idle sessions holding KV, in eviction order; ``older_than`` keeps more recently active ones out."""
        candidates = [
            s for s in sessions
            if s.has_kv and s is not protect and not s.serving and not s.pending
            and (older_than is None or s.last_active_s < older_than)
        ]
        return self._policy.order(candidates)
