"""Policies as one-method strategies, chosen by name from a registry."""

from __future__ import annotations

from typing import Sequence

from prepos.session import Session


class MostRecentFirst:
    """Pre-position the session that was active last: it is the likeliest to ask next."""

    def pick(self, candidates: Sequence[Session]) -> Session:
        return max(candidates, key=lambda s: s.last_active_s)


class LeastRecentFirst:
    """Pre-position the session that has waited longest."""

    def pick(self, candidates: Sequence[Session]) -> Session:
        return min(candidates, key=lambda s: s.last_active_s)


IDLE_POLICIES = {"most_recent": MostRecentFirst, "least_recent": LeastRecentFirst}
