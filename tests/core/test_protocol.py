"""Request validation: every bad input is rejected with an error naming it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prepos.config import LimitsConfig
from prepos.protocol import (INPUT_NAMES, TRITON_ERROR_CODES, CancelPoll, ProtocolError, Status, parse_request,
                             sent_status, triton_error)

LIMITS = LimitsConfig(max_delta_bytes=64, max_delta_tokens=4, max_role_bytes=8, max_choices=4, max_choice_bytes=16,
                      max_stops=2, max_stop_bytes=8, max_top_k=100)


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


def test_a_request_with_nothing_to_answer_is_an_update_unless_it_asks_for_tokens():
    start = np.array([1.0], np.float32)
    assert parse(START=start).is_append and parse(END=start).max_tokens == 0  # a bare START or END
    assert parse(text_input=b("")).max_tokens == 16  # an empty delta asks: the answer at the decision point
    assert parse(choices=b("yes", "no")).max_tokens == 16
    assert parse(START=start, max_tokens=np.array([5], np.int32)).max_tokens == 5


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
    (dict(input_ids=np.arange(5, dtype=np.int32)), "input_ids"),
    (dict(input_ids=np.array([True])), "input_ids"),
    (dict(role=b("x" * 9)), "role"),
    (dict(role=b("a", "b")), "role"),
    (dict(role=np.array([1], np.int32)), "role"),
    (dict(text_input=np.array([7], dtype=np.object_)), "text_input"),
    (dict(text_input=np.array(["é" * 33])), "text_input"),  # 33 characters, 66 bytes
    (dict(text_input=b("a", "b")), "text_input"),
    (dict(choices=np.array(["a", 3], dtype=np.object_)), "choices"),
    (dict(choices=np.array([1, 2], np.int32)), "choices"),
    (dict(choices=b(b"ok", b"\xe2\x82")), "choices"),
    (dict(stop=b("a", "b", "c")), "stop"),
    (dict(stop=b("123456789")), "stop"),
    (dict(stop=b(b"\x80")), "stop"),
    (dict(top_k=np.array([101], np.int32)), "top_k"),
    (dict(top_k=np.array([2**64 - 1], np.uint64)), "top_k"),
    (dict(top_k=np.array([1.0], np.float32)), "top_k"),
    (dict(seed=np.array([-1], np.int64)), "seed"),
    (dict(seed=np.array([1.5], np.float32)), "seed"),
    (dict(seed=np.array([True])), "seed"),
    (dict(speculate=np.array([1], np.int32)), "speculate"),
    (dict(gate_threshold=np.array([1.5], np.float32)), "gate_threshold"),
    (dict(top_p=np.array([1.5], np.float32)), "top_p"),
    (dict(max_tokens=np.array([1.0], np.float32)), "max_tokens"),
    (dict(START=np.array([1, 1], np.int32)), "START"),
])
def test_bad_inputs_name_the_field(inputs, field):
    with pytest.raises(ProtocolError) as err:
        parse(**inputs)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


@pytest.mark.parametrize("value, message", [
    (0.0, "top_p: must be a finite number in (0.0, 1.0], got 0.0"),  # the range said is the range checked
    (1.5, "top_p: must be a finite number in (0.0, 1.0], got 1.5"),
])
def test_top_p_refusals_state_one_range(value, message):
    with pytest.raises(ProtocolError) as err:
        parse(top_p=np.array([value], np.float32))
    assert str(err.value).startswith(message)
    assert parse(top_p=np.array([1e-6], np.float32)).sampling.top_p == pytest.approx(1e-6)


def test_missing_session_id_is_rejected():
    with pytest.raises(ProtocolError, match="correlation_id"):
        parse_request({}, session_id=0, request_id="r", limits=LIMITS, default_max_tokens=1)


arrays = st.one_of(
    st.lists(st.binary(max_size=20), max_size=5).map(lambda v: np.array(v, dtype=np.object_)),
    st.lists(st.integers(-2**31, 2**31 - 1), max_size=6).map(lambda v: np.array(v, dtype=np.int32)),
    st.lists(st.integers(0, 2**64 - 1), max_size=2).map(lambda v: np.array(v, dtype=np.uint64)),
    st.lists(st.integers(-2**63, 2**63 - 1), max_size=2).map(lambda v: np.array(v, dtype=np.int64)),
    st.lists(st.floats(allow_nan=True, width=32), max_size=3).map(lambda v: np.array(v, dtype=np.float32)),
    st.lists(st.booleans(), max_size=2).map(np.array),
    st.lists(st.text(max_size=12), max_size=3).map(lambda v: np.array(v, dtype=np.str_)),
    st.lists(st.one_of(st.binary(max_size=4), st.integers(), st.none()), max_size=3).map(
        lambda v: np.array(v + [None], dtype=np.object_)[:len(v)]),
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(INPUT_NAMES + ("START", "END")), arrays, max_size=6))
def test_decoder_never_crashes(inputs):
    try:
        r = parse(**inputs)
    except ProtocolError as err:
        assert err.field in INPUT_NAMES + ("START", "END", "correlation_id")
        assert str(err).startswith(f"{err.field}: ")
        return
    # whatever is accepted is within the limits
    assert r.delta_ids is None or len(r.delta_ids) <= LIMITS.max_delta_tokens
    assert r.delta_text is None or len(r.delta_text.encode()) <= LIMITS.max_delta_bytes
    assert len(r.role.encode()) <= LIMITS.max_role_bytes and 0 <= r.sampling.top_k <= LIMITS.max_top_k
    assert len(r.choices or ()) <= LIMITS.max_choices and len(r.stop) <= LIMITS.max_stops
    assert all(len(c.encode()) <= LIMITS.max_choice_bytes for c in r.choices or ())
    assert all(len(c.encode()) <= LIMITS.max_stop_bytes for c in r.stop)
    assert r.sampling.seed is None or 0 <= r.sampling.seed < 2**64


def test_limits_at_the_bound_are_accepted():
    r = parse(input_ids=np.arange(4, dtype=np.int32), role=b("x" * 8), top_k=np.array([100], np.int32),
              seed=np.array([2**64 - 1], np.uint64), stop=b("12345678", "b"), choices=b("y" * 16, "b", "c", "d"))
    assert len(r.delta_ids) == 4 and r.role == "x" * 8 and r.sampling.top_k == 100 and r.sampling.seed == 2**64 - 1
    assert parse(text_input=b("é" * 32)).delta_text == "é" * 32  # 64 bytes


def test_oversize_errors_say_the_size_and_the_limit():
    with pytest.raises(ProtocolError, match=r"input_ids: 5 token ids; at most 4 allowed"):
        parse(input_ids=np.arange(5, dtype=np.int32))
    with pytest.raises(ProtocolError, match=r"stop: entry 0: 9 bytes; at most 8 allowed"):
        parse(stop=b("123456789"))
    with pytest.raises(ProtocolError, match=r"choices: 5 entries; at most 4 allowed"):
        parse(choices=b("a", "b", "c", "d", "e"))


@pytest.mark.parametrize("field", ["max_delta_tokens", "max_role_bytes", "max_top_k"])
def test_new_limits_are_validated(field):
    with pytest.raises(ValueError, match=f"limits.{field}"):
        LimitsConfig(**{field: 0})


def test_a_list_sent_again_parses_the_same_under_the_limits_in_force():
    first = parse(choices=b("get_weather", "é" * 8), max_tokens=np.array([4], np.int32))
    again = parse(choices=b("get_weather", "é" * 8), max_tokens=np.array([4], np.int32))
    assert first.choices == again.choices == ("get_weather", "é" * 8)
    # the same list is checked against another server's smaller limit, not answered from the first one's
    tight = LimitsConfig(max_choice_bytes=15)
    with pytest.raises(ProtocolError, match=r"choices: entry 1: 16 bytes; at most 15 allowed"):
        parse_request({"choices": b("get_weather", "é" * 8)}, session_id="s", request_id="r", limits=tight,
                      default_max_tokens=4)
    # one entry changed to invalid UTF-8 is named, whatever was accepted before
    with pytest.raises(ProtocolError, match=r"choices: entry 1: not valid UTF-8"):
        parse(choices=b("get_weather", b"\xc3" * 8), max_tokens=np.array([4], np.int32))


def test_an_unhashable_list_entry_is_named_not_a_crash():
    choices = np.empty(2, dtype=np.object_)
    choices[0], choices[1] = b"a", [1, 2]
    with pytest.raises(ProtocolError, match=r"choices: entry 1: expected bytes, got list"):
        parse(choices=choices)


def test_a_cancel_poll_asks_at_once_then_at_most_once_per_interval_and_keeps_a_yes():
    now = [100.0]
    answers = iter([False, False, True])
    asked = []

    def is_cancelled():
        asked.append(now[0])
        return next(answers)

    poll = CancelPoll(is_cancelled, interval_s=0.05, clock=lambda: now[0])
    assert poll() is False and asked == [100.0]  # the first check asks at once
    now[0] += 0.03
    assert poll() is False and len(asked) == 1  # within the interval: not asked again
    now[0] += 0.03
    assert poll() is False and len(asked) == 2
    now[0] += 0.05
    assert poll() is True and len(asked) == 3
    now[0] += 10
    assert poll() is True and len(asked) == 3  # a cancelled request stays cancelled without asking


def test_a_refusal_is_sent_with_its_status_in_the_text_and_as_the_matching_triton_code():
    class FakeTritonError:  # the Python backend's TritonError: a message, a code, and the codes as attributes
        INVALID_ARG, NOT_FOUND, ALREADY_EXISTS, UNAVAILABLE, INTERNAL, CANCELLED = range(6)

        def __init__(self, message, code):
            self.message, self.code = message, code

    for status in Status:
        error = triton_error(FakeTritonError, "resume: no journal", status)
        assert error.message == f"resume: no journal [{status.value}]"
        assert error.code == getattr(FakeTritonError, TRITON_ERROR_CODES[status])
        assert sent_status(error.message) is status  # read back from the text, as the HTTP bridge does
    for message in ("must specify the START flag", "resume: no journal [SOMETHING]", "[NOT_FOUND] first"):
        assert sent_status(message) is None
