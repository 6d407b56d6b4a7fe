"""Which held KV starts with the longest prefix of a token sequence: the donor lookup of prefix sharing.

The torch engines share a prefix by taking the KV of another session (or of a
closed session's kept opening) instead of computing it. This index finds that
donor without comparing against every session: a holder of KV is listed under
chained hashes of its tokens' prefixes at a few listing points (16 tokens, then
every 64, up to 4,096), and a lookup compares only the holders listed at the
deepest point of the new tokens that has any.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, Protocol, Sequence

from prepos.engines.base import common_prefix_length

SHARED_MIN_TOKENS = 16
"""The shortest prefix looked for in other sessions' KV (and the first point sessions are listed at)."""
SHARE_STRIDE = 64
"""Past the first ``SHARED_MIN_TOKENS``, sessions are listed at every multiple of this many tokens: under a hash of
their tokens up to there (chained, so one hash per point)."""
SHARE_LISTED_TOKENS = 4096
"""Sessions are listed up to this many tokens; a longer shared prefix is still copied whole once found."""
SHARE_CANDIDATES = 8
"""Donors compared per lookup (the most recently listed first), among those listed at the deepest point."""


def prefix_hashes(ids: Sequence[int], n: int) -> list[int]:
    """Chained hashes of ``ids[:b]`` for each listing point ``b <= min(n, SHARE_LISTED_TOKENS)``: 16, 64, 128, ..."""
    hashes, h, start = [], 0, 0
    end = min(n, SHARE_LISTED_TOKENS)
    b = SHARED_MIN_TOKENS
    while b <= end:
        h = hash((h, tuple(ids[start:b])))
        hashes.append(h)
        start, b = b, (b // SHARE_STRIDE + 1) * SHARE_STRIDE
    return hashes


def listing_points(n: int) -> int:
    """How many listing points lie within the first ``n`` tokens: ``len(prefix_hashes(ids, n))``, without hashing."""
    n = min(n, SHARE_LISTED_TOKENS)
    return 0 if n < SHARED_MIN_TOKENS else 1 + n // SHARE_STRIDE


class Holder(Protocol):
    """What the index reads and keeps of an engine's per-session state."""

    ids: list[int]  # the tokens its KV holds, in order
    listed: list[int]  # the prefix hashes it is listed under; the index's own bookkeeping


@dataclass(frozen=True)
class Donor:
    """The holder whose KV shares the longest prefix found, and that prefix's length in tokens."""

    key: Hashable
    holder: Holder
    num_tokens: int


class PrefixIndex:
    """Holders of KV listed under hashes of their prefixes, for :meth:`longest` to find a donor among.

    ``holders`` is the engine's own mapping of keys to holders (sessions and kept prefixes), read, never
    changed: a listing whose key no longer maps to the same holder (released, replaced) is stale, and a lookup
    that meets it drops it. :meth:`list` must follow every change to a holder's tokens that a lookup should
    see, and :meth:`unlist` its release.
    """

    def __init__(self, holders: Mapping[Hashable, Holder]) -> None:
        self._holders = holders
        self._listed: dict[int, dict[Hashable, Holder]] = {}  # prefix hash -> the holders listed under it, by key

    def __len__(self) -> int:
        """Listing points with a holder listed."""
        return len(self._listed)

    def list(self, key: Hashable, holder: Holder) -> None:
        """List the holder under the hashes of its prefixes, as its KV holds them now (and only those)."""
        hashes = prefix_hashes(holder.ids, len(holder.ids))
        same = common_prefix_length(holder.listed, hashes)
        self.unlist(key, holder, same)
        for h in hashes[same:]:
            self._listed.setdefault(h, {})[key] = holder
        holder.listed = hashes

    def unlist(self, key: Hashable, holder: Holder, keep: int = 0) -> None:
        """Take the holder off its listings past its first ``keep``."""
        for h in holder.listed[keep:]:
            listed = self._listed.get(h)
            if listed is not None and listed.get(key) is holder:
                del listed[key]
                if not listed:
                    del self._listed[h]
        del holder.listed[keep:]

    def longest(self, holder: Holder, ids: Sequence[int], keep: int, limit: int) -> Donor | None:
        """The listed holder other than ``holder`` whose KV holds the longest prefix of ``ids``, at most ``limit``
        tokens, when that prefix is longer than ``keep``; else None. Candidates are the holders listed at the
        deepest listing point of ``ids`` that has any other (at most ``SHARE_CANDIDATES`` of them, the most
        recently listed first): no shallower point lists one that holds more."""
        if limit <= keep or limit < SHARED_MIN_TOKENS:
            return None
        for h in reversed(prefix_hashes(ids, limit)):
            listed = self._listed.get(h)
            if not listed:
                continue
            best, compared = None, 0
            for key, other in reversed(list(listed.items())):
                if self._holders.get(key) is not other:
                    del listed[key]
                    continue
                if other is holder:
                    continue
                length = min(common_prefix_length(other.ids, ids), limit)
                if length > (keep if best is None else best.num_tokens):
                    best = Donor(key, other, length)
                compared += 1
                if length == limit or compared == SHARE_CANDIDATES:
                    break
            if not listed:
                del self._listed[h]
            if compared:
                return best
        return None
