"""The donor lookup of prefix sharing, alone: which holder a lookup finds, at toy sizes."""

from __future__ import annotations

from dataclasses import dataclass, field

from prepos.engines.prefix_index import SHARE_CANDIDATES, SHARED_MIN_TOKENS, PrefixIndex, listing_points, prefix_hashes


@dataclass
class _Holder:
    ids: list[int]
    listed: list[int] = field(default_factory=list)


def _index(**holders: list[int]) -> tuple[PrefixIndex, dict[str, _Holder]]:
    held = {key: _Holder(list(ids)) for key, ids in holders.items()}
    index = PrefixIndex(held)
    for key, holder in held.items():
        index.list(key, holder)
    return index, held


BASE = list(range(100, 300))  # 200 tokens every holder below opens with


def test_listing_points():
    assert len(prefix_hashes(BASE, 15)) == 0
    assert len(prefix_hashes(BASE, 16)) == 1  # 16
    assert len(prefix_hashes(BASE, 200)) == 4  # 16, 64, 128, 192
    assert prefix_hashes(BASE, 130)[:2] == prefix_hashes(BASE + [1, 2], 64)  # chained: a prefix's hashes lead
    long = list(range(5000))
    assert all(listing_points(n) == len(prefix_hashes(long, n)) for n in range(0, 5000, 7))


def test_the_longest_prefix_wins_and_no_holder_is_its_own_donor():
    index, held = _index(short=BASE[:70], long=BASE[:150] + [7], other=[5] * 200)
    asker = _Holder([])
    donor = index.longest(asker, BASE + [9], 0, 200)
    assert (donor.key, donor.num_tokens) == ("long", 150)
    assert donor.holder is held["long"]
    # the long holder asking for itself finds the short one
    donor = index.longest(held["long"], BASE, 0, 199)
    assert (donor.key, donor.num_tokens) == ("short", 70)


def test_keep_and_limit():
    index, _ = _index(a=BASE[:150])
    asker = _Holder([])
    assert index.longest(asker, BASE, 150, 199) is None  # holds no more than the asker keeps
    assert index.longest(asker, BASE, 149, 199).num_tokens == 150
    assert index.longest(asker, BASE, 0, 100).num_tokens == 100  # capped at the limit
    assert index.longest(asker, BASE, 0, SHARED_MIN_TOKENS - 1) is None  # shorter than a listing point


def test_a_relisted_holder_is_found_only_as_it_holds_now():
    index, held = _index(a=BASE[:150], b=BASE[:70])
    asker = _Holder([])
    del held["a"].ids[20:]
    index.list("a", held["a"])  # truncated to 20 tokens: listed at 16 only
    assert len(held["a"].listed) == 1
    donor = index.longest(asker, BASE, 0, 199)
    assert (donor.key, donor.num_tokens) == ("b", 70)
    index.unlist("b", held["b"])
    donor = index.longest(asker, BASE, 0, 199)
    assert (donor.key, donor.num_tokens) == ("a", 20)
    index.unlist("a", held["a"])
    assert index.longest(asker, BASE, 0, 199) is None and len(index) == 0


def test_stale_listings_are_dropped_on_the_way():
    index, held = _index(a=BASE[:150])
    asker = _Holder([])
    held["a"] = _Holder(BASE[:150])  # the key now names another holder: the listing is stale
    assert index.longest(asker, BASE, 0, 199) is None
    assert len(index) == 0


def test_ties_go_to_the_most_recently_listed_and_candidates_are_bounded():
    index, _ = _index(**{f"h{i}": BASE[:100] for i in range(SHARE_CANDIDATES + 1)})
    asker = _Holder([])
    donor = index.longest(asker, BASE, 0, 199)
    assert donor.key == f"h{SHARE_CANDIDATES}"
    # the first-listed holder, longer, is past the candidates compared at the deepest point
    index2, held2 = _index(first=BASE[:127], **{f"h{i}": BASE[:100] for i in range(SHARE_CANDIDATES)})
    assert index2.longest(asker, BASE, 0, 199).num_tokens == 100
    # one fewer same-length holder and it is compared
    index3, _ = _index(first=BASE[:127], **{f"h{i}": BASE[:100] for i in range(SHARE_CANDIDATES - 1)})
    donor = index3.longest(asker, BASE, 0, 199)
    assert (donor.key, donor.num_tokens) == ("first", 127)


def test_a_shallower_listing_is_found_when_no_deeper_one_is():
    # "wide" shares 127 tokens of BASE but is listed at 16 and 64 only (its tokens to 128 differ); "deep" holds
    # 130 and is listed at 128 too
    index, held = _index(deep=BASE[:130], wide=BASE[:127] + [0] * 10)
    asker = _Holder([])
    donor = index.longest(asker, BASE, 0, 199)
    assert (donor.key, donor.num_tokens) == ("deep", 130)
    index.unlist("deep", held["deep"])
    donor = index.longest(asker, BASE, 0, 199)
    assert (donor.key, donor.num_tokens) == ("wide", 127)
