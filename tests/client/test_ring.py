"""HashRing: the same ring and lookups as Envoy's ring hash load balancer, balance, disruption, weights."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml
from prepos_client.ring import (
    DEFAULT_MAX_RING_SIZE,
    DEFAULT_MIN_RING_SIZE,
    HashRing,
    RingStats,
    header_hash,
    session_hash,
    xxhash64,
)

SESSIONS = [f"session-{i}" for i in range(6000)]


def hosts(count: int) -> list[str]:
    return [f"10.1.0.{i}:8001" for i in range(1, count + 1)]


def owners(ring: HashRing, session_ids=SESSIONS) -> dict[str, str]:
    return {session_id: ring.lookup(session_id) for session_id in session_ids}


def owning_entry(ring: HashRing, session_id: str) -> tuple[int, str]:
    """(position, host) of the ring entry that serves the session."""
    h = session_hash(session_id)
    entry = next((e for e in ring.entries if e.position >= h), ring.entries[0])
    return entry.position, entry.host


# --- hashing -----------------------------------------------------------------------------------

def test_xxhash64_reference_values():
    # The published XXH64 test vectors (seed 0), and a seed changes the hash.
    assert xxhash64(b"") == 0xEF46DB3751D8E999
    assert xxhash64("abc") == 0x44BC2CF5AD770999
    assert xxhash64("abc", seed=1) != xxhash64("abc")


def test_a_session_hashes_like_its_header_value():
    assert session_hash("s-1") == xxhash64("s-1") == header_hash("s-1")
    assert session_hash(42) == xxhash64("42")


def test_several_header_values_are_sorted_then_chained():
    chained = xxhash64("b", seed=xxhash64("a"))
    assert header_hash("a", "b") == header_hash("b", "a") == chained
    with pytest.raises(ValueError, match="values"):
        header_hash()


# --- the ring Envoy builds (positions and choices from Envoy's own ring hash tests) -------------

ENVOY_BASIC_RING = [  # hosts 127.0.0.1:90..95, minimum_ring_size 12, xxHash
    (833437586790550860, 94), (928266305478181108, 92), (1033482794131418490, 90),
    (3551244743356806947, 95), (3851675632748031481, 93), (5583722120771150861, 91),
    (6311230543546372928, 91), (7700377290971790572, 93), (13144177310400110813, 95),
    (13444792449719432967, 92), (15516499411664133160, 94), (16117243373044804889, 90),
]


def test_the_ring_is_envoys_ring():
    ring = HashRing([f"127.0.0.1:{port}" for port in range(90, 96)], min_ring_size=12)
    assert [(e.position, e.host) for e in ring.entries] == [(p, f"127.0.0.1:{port}") for p, port in
                                                            ENVOY_BASIC_RING]
    assert ring.stats == RingStats(size=12, min_hashes_per_host=2, max_hashes_per_host=2)
    # Envoy's lookups on that ring: at or after the hash, wrapping past the end.
    assert ring.lookup_hash(0) == "127.0.0.1:94"
    assert ring.lookup_hash(2**64 - 1) == "127.0.0.1:94"
    assert ring.lookup_hash(3551244743356806947) == "127.0.0.1:95"
    assert ring.lookup_hash(3551244743356806948) == "127.0.0.1:93"
    assert ring.lookup_hash(16117243373044804880) == "127.0.0.1:90"


def test_host_keys_other_than_addresses_hash_alike():
    # Envoy with use_hostname_for_hashing, hosts named "90".."95".
    ring = HashRing([str(port) for port in range(90, 96)], min_ring_size=12)
    assert ring.lookup_hash(0) == "95"
    assert ring.lookup_hash(7225015537174310577) == "92"
    assert ring.lookup_hash(6803900775736438537) == "93"
    assert ring.entries[0].position == 1975508444536362413


def test_uneven_minimum_ring_size_rounds_up_per_host():
    # Two hosts, minimum 3: each host gets 2 entries.
    ring = HashRing(["127.0.0.1:80", "127.0.0.1:81"], min_ring_size=3)
    assert [e.position for e in ring.entries] == [5454692015285649509, 7859399908942313493,
                                                  13838424394637650569, 16064866803292627174]
    assert ring.stats == RingStats(size=4, min_hashes_per_host=2, max_hashes_per_host=2)
    assert ring.lookup_hash(0) == "127.0.0.1:80"


def test_weights_set_the_number_of_entries():
    # Weights 1, 2, 3 on a ring of exactly 6: Envoy gives 1, 2 and 3 entries.
    ring = HashRing({"127.0.0.1:90": 1, "127.0.0.1:91": 2, "127.0.0.1:92": 3}, min_ring_size=6, max_ring_size=6)
    assert Counter(e.host for e in ring.entries) == {"127.0.0.1:90": 1, "127.0.0.1:91": 2, "127.0.0.1:92": 3}
    assert ring.stats == RingStats(size=6, min_hashes_per_host=1, max_hashes_per_host=3)
    expected = {928266305478181108: 92, 4443673547860492590: 92, 5583722120771150861: 91,
                6311230543546372928: 91, 13444792449719432967: 92, 16117243373044804889: 90}
    for request_hash, port in expected.items():
        assert ring.lookup_hash(request_hash) == f"127.0.0.1:{port}"


def test_maximum_ring_size_caps_the_ring():
    # Weights 1 and 1000 would need 1001 * 1024 entries; the maximum caps it.
    ring = HashRing({"a:1": 1, "b:1": 1000}, max_ring_size=2000)
    assert ring.stats == RingStats(size=2000, min_hashes_per_host=2, max_hashes_per_host=1999)
    # The running target ends at 2000.0000000000002 in doubles, so the heavy host gets one entry
    # past it, in Envoy too (the same operations in the same order).
    assert len(ring) == 2001


# --- properties ---------------------------------------------------------------------------------

def test_lookups_are_deterministic_and_independent_of_host_order():
    ring = HashRing(hosts(5))
    again = HashRing(list(reversed(hosts(5))))
    assert owners(ring) == owners(HashRing(hosts(5))) == owners(again)


def test_sessions_spread_evenly_over_equal_hosts():
    for count in (2, 3, 4, 8):
        shares = Counter(owners(HashRing(hosts(count))).values())
        fair = len(SESSIONS) / count
        assert set(shares) == set(hosts(count))
        assert all(abs(n - fair) <= 0.15 * fair for n in shares.values()), (count, shares)


def test_sessions_spread_in_proportion_to_weights():
    weights = {"a:1": 1, "b:1": 2, "c:1": 3}
    shares = Counter(owners(HashRing(weights, min_ring_size=6 * 1024)).values())
    for host, weight in weights.items():
        fair = len(SESSIONS) * weight / 6
        assert abs(shares[host] - fair) <= 0.15 * fair, shares


def test_removing_a_host_keeps_its_sessions_on_one_survivor_each_and_others_move_only_to_new_entries():
    # The ring stays at min_ring_size, so survivors gain entries: a survivor's session moves only
    # where one of those new entries now serves it.
    ring = HashRing(hosts(5))
    gone = hosts(5)[2]
    smaller = ring.without(gone)
    assert gone not in smaller.hosts and len(smaller.hosts) == 4
    old_entries = {(e.position, e.host) for e in ring.entries}
    before, after = owners(ring), owners(smaller)
    num_moved_between_survivors = 0
    for session_id in SESSIONS:
        if before[session_id] == gone:
            assert after[session_id] != gone
        elif after[session_id] != before[session_id]:
            num_moved_between_survivors += 1
            assert owning_entry(smaller, session_id) not in old_entries
        elif owning_entry(smaller, session_id) in old_entries:
            assert owning_entry(smaller, session_id) == owning_entry(ring, session_id)
    # Survivors went from 205 to 256 entries: a fifth of the ring is new, at most that share moves.
    assert num_moved_between_survivors <= 0.2 * len(SESSIONS)


def test_removing_a_host_moves_only_its_sessions_when_survivors_keep_their_entries():
    # 50 -> 49 hosts at the default ring size: 21 entries per host either way.
    ring = HashRing(hosts(50))
    smaller = ring.without(hosts(50)[17])
    assert ring.stats.max_hashes_per_host == smaller.stats.max_hashes_per_host == 21
    before, after = owners(ring), owners(smaller)
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved == {s for s in SESSIONS if before[s] == hosts(50)[17]}
    assert moved


def test_adding_a_host_moves_sessions_only_to_it_when_others_keep_their_entries():
    ring = HashRing(hosts(49))
    bigger = ring.with_host("10.1.0.50:8001")
    before, after = owners(ring), owners(bigger)
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved and all(after[s] == "10.1.0.50:8001" for s in moved)


def test_two_replicas_lose_one_and_the_survivor_keeps_all_its_sessions():
    ring = HashRing(["127.0.0.1:8001", "127.0.0.1:9001"])
    before = owners(ring)
    after = owners(ring.without("127.0.0.1:9001"))
    assert all(after[s] == "127.0.0.1:8001" for s in SESSIONS)
    assert 0 < sum(before[s] == "127.0.0.1:9001" for s in SESSIONS) < len(SESSIONS)


def test_a_ring_is_never_changed_in_place():
    ring = HashRing(hosts(3))
    entries = ring.entries
    ring.without(hosts(3)[0])
    ring.with_host("10.9.9.9:1")
    assert ring.entries == entries and ring.hosts == tuple(hosts(3))


# --- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"hosts": ["a:1", "a:1"]}, ValueError, "hosts"),
        ({"hosts": [""]}, ValueError, "hosts"),
        ({"hosts": {"a:1": 0}}, ValueError, "hosts"),
        ({"hosts": {"a:1": 1.5}}, TypeError, "hosts"),
        ({"hosts": [1]}, TypeError, "hosts"),
        ({"hosts": "a:1"}, TypeError, "hosts"),
        ({"hosts": ["a:1"], "min_ring_size": 0}, ValueError, "min_ring_size"),
        ({"hosts": ["a:1"], "max_ring_size": 2**24}, ValueError, "max_ring_size"),
        ({"hosts": ["a:1"], "min_ring_size": 20, "max_ring_size": 10}, ValueError, "min_ring_size"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, error, field):
    with pytest.raises(error, match=field):
        HashRing(**kwargs)


def test_empty_ring_and_bad_lookups():
    with pytest.raises(LookupError):
        HashRing([]).lookup("s")
    ring = HashRing(hosts(2))
    with pytest.raises(ValueError, match="request_hash"):
        ring.lookup_hash(-1)
    with pytest.raises(KeyError):
        ring.without("10.9.9.9:1")


def test_default_ring_sizes_are_the_charts():
    values = yaml.safe_load((Path(__file__).resolve().parents[2] / "helm/prepos/values.yaml").read_text())
    assert values["router"]["lbPolicy"] == "RING_HASH"
    assert values["router"]["ringHash"] == {"minimumRingSize": DEFAULT_MIN_RING_SIZE,
                                            "maximumRingSize": DEFAULT_MAX_RING_SIZE}
