"""A consistent-hash ring that picks the same replica for a session as Envoy's ring hash.

The chart's router (`helm/prepos`, `router.lbPolicy: RING_HASH`) is Envoy's
ring hash load balancer with `hash_function: XX_HASH` and a header hash policy
on the `prepos-session-id` header. `HashRing` builds the same ring from the same
hosts and sizes and answers the same lookups, so a client that routes by itself
(loopback tests, a deployment without the router tier) sends every session
where the router would.

The rule, as Envoy implements it:
- Each host gets a share of `scale` ring entries, its normalized weight
  (weight / sum of weights) times `scale`, where
  `scale = min(ceil(w_min * min_ring_size) / w_min, max_ring_size)` and
  `w_min` is the smallest normalized weight: the lightest host gets a whole
  number of entries, at least `min_ring_size` entries in all, at most
  `max_ring_size`. Shares need not be whole numbers: entries are handed out
  host by host against running totals (a host gets entries while the count
  so far is below the running target), so the hosts' order matters only
  for those fractions.
- Entry `i` of a host with key `k` sits at `xxHash64("{k}_{i}", seed 0)`; the
  key is the host's hash key: by default its address as `ip:port`
  (`[ip]:port` for IPv6).
- A request hash `h` picks the first entry whose position is >= `h`, wrapping
  to the first entry past the end.
- A header hash policy hashes the header's value with xxHash64 (seed 0);
  several values of one header are sorted and chained, each hashed with the
  previous hash as its seed.

Where this differs from Envoy (none of it changes which host a session gets
with the chart's configuration):
- Hosts are the strings given. Envoy hashes an endpoint's `envoy.lb`
  `hash_key` metadata value where it has one, else its resolved `ip:port` (or
  its hostname with `use_hostname_for_hashing`): give the same strings to
  agree. The chart gives each replica the hash key `<pod DNS name>:<gRPC
  port>`, which outlives the pod's IP, so a client given those addresses
  agrees with it.
- Two entries at the same position (a 64-bit collision) keep build order here;
  Envoy's sort leaves their order unspecified.
- No priorities, localities, panic mode, bounded load (`hash_balance_factor`)
  or retry offsets: a host that fails is taken out of the ring (`without`),
  which is what Envoy does when health checks or DNS drop it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import xxhash

DEFAULT_MIN_RING_SIZE = 1024
DEFAULT_MAX_RING_SIZE = 8 * 1024 * 1024
"""Envoy's defaults (and its upper bound for both sizes)."""

_MAX_UINT32 = 2**32 - 1


def xxhash64(data: str | bytes, seed: int = 0) -> int:
    """XXH64 of `data` (a str is hashed as UTF-8) with `seed`, as an unsigned 64-bit int."""
    return xxhash.xxh64_intdigest(data.encode() if isinstance(data, str) else data, seed)


def header_hash(*values: str | bytes) -> int:
    """The request hash Envoy's header hash policy computes from a header's values.

    One value (what the prepos client sends) hashes to `xxhash64(value)`.
    Several values are sorted and chained: each is hashed with the previous
    hash as seed, starting from 0, so their order does not matter.

    Raises:
        ValueError: no value (Envoy computes no hash and picks a random host).
    """
    if not values:
        raise ValueError("values: a header hash needs at least one header value")
    encoded = sorted(value.encode() if isinstance(value, str) else value for value in values)
    seed = 0
    for value in encoded:
        seed = xxhash64(value, seed)
    return seed


def session_hash(session_id: str | int) -> int:
    """The request hash of a session: its `prepos-session-id` header value, `str(session_id)`."""
    return header_hash(str(session_id))


@dataclass(frozen=True)
class RingEntry:
    """One point of the ring: requests hashing up to `position` go to `host`."""

    position: int
    host: str


@dataclass(frozen=True)
class RingStats:
    """What Envoy reports as `ring_hash_lb.size`, `min_hashes_per_host`, `max_hashes_per_host`."""

    size: int
    min_hashes_per_host: int
    max_hashes_per_host: int


class HashRing:
    """An immutable consistent-hash ring over weighted hosts (see the module docstring).

    Args:
        hosts: host keys (`ip:port`), in the order Envoy lists them, each with
            weight 1; or a mapping of host key to integer weight >= 1.
        min_ring_size, max_ring_size: Envoy's `minimum_ring_size` and
            `maximum_ring_size`, 1 <= min <= max <= 8388608.

    Raises:
        ValueError: an empty or repeated host key, a weight below 1, weights
            summing past 2**32 - 1, or ring sizes out of bounds; the message
            names the argument.
        TypeError: a host key that is not a str, a weight that is not an int.

    Building costs one xxHash64 per entry, about `min_ring_size` of them
    unless the weights are very uneven. Rings are never changed in place:
    `without` and `with_host` return new rings.
    """

    def __init__(
        self,
        hosts: Sequence[str] | Mapping[str, int],
        *,
        min_ring_size: int = DEFAULT_MIN_RING_SIZE,
        max_ring_size: int = DEFAULT_MAX_RING_SIZE,
    ):
        self._weights = _check_weights(hosts)
        _check_ring_sizes(min_ring_size, max_ring_size)
        self.min_ring_size = min_ring_size
        self.max_ring_size = max_ring_size
        self._entries, self.stats = _build(self._weights, min_ring_size, max_ring_size)
        self._positions = [entry.position for entry in self._entries]

    @property
    def hosts(self) -> tuple[str, ...]:
        """The host keys, in the order given."""
        return tuple(self._weights)

    @property
    def weights(self) -> dict[str, int]:
        """Host key -> weight, in the order given (a copy)."""
        return dict(self._weights)

    @property
    def entries(self) -> tuple[RingEntry, ...]:
        """The ring, sorted by position."""
        return self._entries

    def lookup_hash(self, request_hash: int) -> str:
        """The host of the first entry at or after `request_hash`, wrapping past the end.

        Raises:
            LookupError: the ring has no hosts.
            ValueError: `request_hash` outside [0, 2**64 - 1].
        """
        if not 0 <= request_hash < 2**64:
            raise ValueError(f"request_hash: expected an unsigned 64-bit int, got {request_hash}")
        if not self._entries:
            raise LookupError("the ring has no hosts")
        index = bisect.bisect_left(self._positions, request_hash)
        return self._entries[index % len(self._entries)].host

    def lookup(self, session_id: str | int) -> str:
        """The host that serves `session_id`: `lookup_hash(session_hash(session_id))`.

        Raises:
            LookupError: the ring has no hosts.
        """
        return self.lookup_hash(session_hash(session_id))

    def without(self, host: str) -> HashRing:
        """A ring over the other hosts, same sizes: Envoy's ring once `host` left the host set.

        Raises:
            KeyError: `host` is not on this ring.
        """
        if host not in self._weights:
            raise KeyError(f"host {host!r} is not on the ring")
        rest = {key: weight for key, weight in self._weights.items() if key != host}
        return HashRing(rest, min_ring_size=self.min_ring_size, max_ring_size=self.max_ring_size)

    def with_host(self, host: str, weight: int = 1) -> HashRing:
        """A ring with `host` added last (or its weight replaced), same sizes."""
        return HashRing({**self._weights, host: weight}, min_ring_size=self.min_ring_size,
                        max_ring_size=self.max_ring_size)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"HashRing({self._weights!r}, size={len(self._entries)})"


def _check_weights(hosts: Sequence[str] | Mapping[str, int]) -> dict[str, int]:
    if isinstance(hosts, str):
        raise TypeError("hosts: expected a sequence of host keys or a mapping to weights, got one str")
    pairs: Iterable = hosts.items() if isinstance(hosts, Mapping) else ((host, 1) for host in hosts)
    weights: dict[str, int] = {}
    for host, weight in pairs:
        if not isinstance(host, str):
            raise TypeError(f"hosts: expected str host keys, got {type(host).__name__}")
        if not host:
            raise ValueError("hosts: a host key must not be empty")
        if host in weights:
            raise ValueError(f"hosts: {host!r} is listed twice")
        if isinstance(weight, bool) or not isinstance(weight, int):
            raise TypeError(f"hosts: the weight of {host!r} must be an int, got {type(weight).__name__}")
        if weight < 1:
            raise ValueError(f"hosts: the weight of {host!r} must be >= 1, got {weight}")
        weights[host] = weight
    if sum(weights.values()) > _MAX_UINT32:
        raise ValueError(f"hosts: the weights must sum to at most {_MAX_UINT32}")
    return weights


def _check_ring_sizes(min_ring_size: int, max_ring_size: int) -> None:
    for name, value in (("min_ring_size", min_ring_size), ("max_ring_size", max_ring_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if not 1 <= value <= DEFAULT_MAX_RING_SIZE:
            raise ValueError(f"{name}: must be in [1, {DEFAULT_MAX_RING_SIZE}], got {value}")
    if min_ring_size > max_ring_size:
        raise ValueError(f"min_ring_size: ({min_ring_size}) > max_ring_size ({max_ring_size})")


def _build(weights: dict[str, int], min_ring_size: int, max_ring_size: int) -> tuple[tuple[RingEntry, ...], RingStats]:
    if not weights:
        return (), RingStats(0, 0, 0)
    total = sum(weights.values())
    # The same float operations, in the same order, as Envoy: the running
    # totals below then round the same way.
    normalized = [(host, weight * 1.0 / total) for host, weight in weights.items()]
    min_weight = min(1.0, *(weight for _, weight in normalized))
    scale = min(math.ceil(min_weight * min_ring_size) / min_weight, float(max_ring_size))
    entries: list[RingEntry] = []
    current_hashes = 0.0
    target_hashes = 0.0
    counts = []
    for host, weight in normalized:
        target_hashes += scale * weight
        count = 0
        while current_hashes < target_hashes:
            entries.append(RingEntry(xxhash64(f"{host}_{count}"), host))
            count += 1
            current_hashes += 1
        counts.append(count)
    entries.sort(key=lambda entry: entry.position)  # stable: equal positions keep build order
    return tuple(entries), RingStats(math.ceil(scale), min(counts), max(counts))
