"""Request validation: every bad input is rejected with an error naming it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prepos.config import LimitsConfig
from prepos.protocol import INPUT_NAMES, ProtocolError, parse_request

LIMITS = LimitsConfig(max_delta_bytes=64, max_choices=4, max_choice_bytes=16, max_stops=2, max_stop_bytes=8)


def parse(**inputs):
    return parse_request(inputs, session_id="s", request_id="r", limits=LIMITS, default_max_tokens=16)


def b(*values):
    return np.array([v if isinstance(v, bytes) else v.encode() for v in values], dtype=np.object_)


def test_defaults_and_values():
    r = parse(text_input=b("hi"), START=np.array([1.0], np.float32))
    assert (r.start, r.end, r.role, r.max_tokens, r.delta_text, r.sampling.greedy) == (True, False, "user", 16, "hi", True)
    r = parse(input_ids=np.array([1, 2], np.int32), role=b("tool"), max_tokens=np.array([0], np.int32),
              temperature=np.array([0.7], np.float32), seed=np.array([9], np.uint64), stop=b("\n"),
              speculate=np.array([False]), gate_threshold=np.array([0.5], np.float32))
    assert r.delta_ids == (1, 2) and r.role == "tool" and r.is_append and r.sampling.seed == 9
    assert r.stop == ("\n",) and r.speculate is False and r.gate_threshold == 0.5


@pytest.mark.parametrize("inputs, field", [
    (dict(text_input=b("a"), input_ids=np.array([1], np.int32)), "input_ids"),
    (dict(max_tokens=np.array([-1], np.int32)), "max_tokens"),
    (dict(max_tokens=np.array([10**6], np.int32)), "max_tokens"),
    (dict(temperature=np.array([np.nan], np.float32)), "temperature"),
    (dict(temperature=np.array([-1.0], np.float32)), "temperature"),
    (dict(top_p=np.array([0.0], np.float32)), "top_p"),
    (dict(top_k=np.array([-3], np.int32)), "top_k"),
    (dict(gate_threshold=np.array([np.inf], np.float32)), "gate_threshold"),
    (dict(choices=b("a", "")), "choices"),
    (dict(choices=b("a", "a")), "choices"),
    (dict(choices=b("a", "b", "c", "d", "e")), "choices"),
    (dict(choices=b("x" * 17)), "choices"),
    (dict(choices=b("a"), max_tokens=np.array([0], np.int32)), "choices"),
    (dict(text_input=b(b"\xff\xfe")), "text_input"),
    (dict(text_input=b("x" * 65)), "text_input"),
    (dict(role=b(b"\xc3")), "role"),
    (dict(stop=b("")), "stop"),
    (dict(input_ids=np.array([-1], np.int32)), "input_ids"),
    (dict(input_ids=np.array([1.5], np.float32)), "input_ids"),
    (dict(max_tokens=np.array([1, 2], np.int32)), "max_tokens"),
    (dict(bogus=np.array([1])), "bogus"),
])
def test_bad_inputs_name_the_field(inputs, field):
    with pytest.raises(ProtocolError) as err:
        parse(**inputs)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


def test_missing_session_id_is_rejected():
    with pytest.raises(ProtocolError, match="correlation_id"):
        parse_request({}, session_id=0, request_id="r", limits=LIMITS, default_max_tokens=1)


arrays = st.one_of(
    st.lists(st.binary(max_size=20), max_size=5).map(lambda v: np.array(v, dtype=np.object_)),
    st.lists(st.integers(-2**31, 2**31 - 1), max_size=5).map(lambda v: np.array(v, dtype=np.int32)),
    st.lists(st.floats(allow_nan=True, width=32), max_size=3).map(lambda v: np.array(v, dtype=np.float32)),
    st.lists(st.booleans(), max_size=2).map(np.array),
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(INPUT_NAMES + ("START", "END")), arrays, max_size=6))
def test_decoder_never_crashes(inputs):
    try:
        parse(**inputs)
    except ProtocolError as err:
        assert err.field in INPUT_NAMES + ("START", "END", "correlation_id")
