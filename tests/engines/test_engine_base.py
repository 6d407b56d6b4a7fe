"""Helpers of the engine contract."""

from __future__ import annotations

from hypothesis import given, strategies as st

from prepos.engines.base import common_prefix_length


def _naive(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# Long shared runs (past the 64-token comparison block) with a difference anywhere, in lists and tuples.
_runs = st.integers(0, 300)


@given(shared=_runs, tail_a=st.lists(st.integers(0, 3), max_size=80), tail_b=st.lists(st.integers(0, 3), max_size=80),
       kinds=st.tuples(st.sampled_from([list, tuple]), st.sampled_from([list, tuple])))
def test_common_prefix_length_matches_a_token_by_token_count(shared, tail_a, tail_b, kinds):
    head = [t % 7 for t in range(shared)]
    a, b = kinds[0](head + tail_a), kinds[1](head + tail_b)
    assert common_prefix_length(a, b) == _naive(a, b) >= shared
