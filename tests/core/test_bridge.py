"""The HTTP bridge's logic (prepos.bridge): which session a request goes to, and how a stream becomes one answer."""

from __future__ import annotations

import numpy as np
import pytest

from prepos.bridge import (ERROR_FIELDS, ONE_TURN_PREFIX, absent_outputs, bridge_target, forwarded_inputs,
                           merge_responses, narrowed_inputs, relayed_error, relayed_error_outputs,
                           request_parameters, triton_refusal)
from prepos.protocol import TRITON_ERROR_CODES, ProtocolError, Status, with_status


def _b(*values) -> np.ndarray:
    return np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)


def _bool(value) -> np.ndarray:
    return np.array([value], dtype=np.bool_)


def test_a_request_without_a_session_is_a_one_turn_session_of_its_own():
    first, second = bridge_target({}), bridge_target({"stream": _bool(True)})
    assert first.session_id.startswith(ONE_TURN_PREFIX) and first.session_id != second.session_id
    assert (first.start, first.end, first.stream) == (True, True, False) and second.stream


def test_a_named_session_gets_only_the_flags_the_request_sets():
    target = bridge_target({"session_id": _b("chat-7"), "start": _bool(True)})
    assert (target.session_id, target.start, target.end, target.stream) == ("chat-7", True, False, False)
    target = bridge_target({"session_id": _b("chat-7"), "end": _bool(True), "start": _bool(False)})
    assert (target.start, target.end) == (False, True)
    assert bridge_target({"session_id": _b("é")}).session_id == "é"


@pytest.mark.parametrize("inputs, field, problem", [
    ({"start": _bool(True)}, "start", "true needs session_id"),
    ({"end": _bool(False)}, "end", "false needs session_id .*: leave start and end out"),
    ({"resume": _bool(True), "text_input": _b("x")}, "resume", "needs session_id: the session to resume"),
    ({"session_id": _b("")}, "session_id", "empty"),
    ({"session_id": _b("a", "b")}, "session_id", "expected one value"),
    ({"session_id": np.array([5], np.int32)}, "session_id", "expected BYTES"),
    ({"session_id": _b(b"\xff")}, "session_id", "not valid UTF-8"),
    ({"session_id": _b("x" * 129)}, "session_id", "at most 128"),
    ({"session_id": _b("é" * 65)}, "session_id", "130 bytes; at most 128"),
    ({"session_id": _b(ONE_TURN_PREFIX + "abc")}, "session_id", "one-turn sessions"),
    ({"session_id": _b("nul1\0x")}, "session_id", r"contains a NUL character \(at byte 4\)"),
    ({"session_id": _b("\0abc")}, "session_id", r"contains a NUL character \(at byte 0\)"),
    ({"session_id": _b("s"), "stream": np.array([1], np.int32)}, "stream", "expected BOOL"),
    ({"session_id": _b("s"), "start": np.array([True, False])}, "start", "expected one value"),
])
def test_bad_bridge_inputs_are_named(inputs, field, problem):
    with pytest.raises(ProtocolError, match=problem) as err:
        bridge_target(inputs)
    assert err.value.field == field


def test_int32_inputs_arrive_whole_and_a_value_int32_cannot_hold_is_named():
    # The generate endpoints would store 4294967299 into an INT32 input as 3; the bridge takes INT64 and checks.
    inputs = {"max_tokens": np.array([7], np.int64), "input_ids": np.array([1, 2**31 - 1], np.int64),
              "top_k": np.array([-5], np.int64), "text_input": _b("hi")}
    narrowed = narrowed_inputs(inputs)
    assert sorted(narrowed) == ["input_ids", "max_tokens", "top_k"]  # the others pass through as they are
    assert all(v.dtype == np.int32 for v in narrowed.values())
    assert narrowed["input_ids"].tolist() == [1, 2**31 - 1] and narrowed["top_k"].tolist() == [-5]
    # -5 fits INT32: whether it is a valid top_k is prepos's to say, with prepos's own message.
    with pytest.raises(ProtocolError, match="4294967299 does not fit INT32") as err:
        narrowed_inputs({"max_tokens": np.array([4294967299], np.int64)})
    assert err.value.field == "max_tokens"
    with pytest.raises(ProtocolError, match=r"entry 2, -2147483649 does not fit") as err:
        narrowed_inputs({"input_ids": np.array([0, 1, -2**31 - 1, 2**40], np.int64)})
    assert err.value.field == "input_ids"
    with pytest.raises(ProtocolError, match="expected an integer type") as err:
        narrowed_inputs({"top_k": np.array([1.5], np.float32)})
    assert err.value.field == "top_k"


@pytest.mark.parametrize("parameters, named", [
    ('{"maxtokens": 2}', '"maxtokens"'),
    ('{"timeout": 5000, "bogus": 1, "Max_Tokens": 3}', '"Max_Tokens", "bogus"'),
    ('{"prepos_bridge": true}', '"prepos_bridge"'),  # the bridge's mark for prepos, not the client's to set
])
def test_a_key_that_is_neither_an_input_nor_a_parameter_the_bridge_reads_is_refused_naming_it(parameters, named):
    with pytest.raises(ProtocolError) as err:
        bridge_target({"session_id": _b("s")}, parameters)
    assert err.value.field == "parameters" and f"unknown key {named}:" in str(err.value)
    assert "(timeout)" in str(err.value)  # what it does read


def test_parameters_the_stub_cannot_decode_are_refused_naming_them():
    def undecodable() -> str:
        return b'{"\xff\xfe": 1}'.decode()

    assert request_parameters(lambda: '{"timeout": 5}') == '{"timeout": 5}'
    with pytest.raises(ProtocolError) as err:
        request_parameters(undecodable)
    assert err.value.field == "parameters"
    assert str(err.value).startswith("parameters: not valid UTF-8 (byte 0xff at offset 2 of the parameters' JSON)")


def test_the_time_limit_is_the_smaller_of_the_timeout_parameter_and_the_request_timeout():
    sid = {"session_id": _b("s")}
    assert bridge_target(sid).timeout_us == 0  # none set
    assert bridge_target(sid, '{"timeout": 5000}').timeout_us == 5000
    assert bridge_target(sid, "{}", request_timeout_us=7000).timeout_us == 7000
    assert bridge_target(sid, '{"timeout": 5000}', request_timeout_us=3000).timeout_us == 3000
    assert bridge_target(sid, '{"timeout": 0}', request_timeout_us=3000).timeout_us == 3000  # 0: none
    for raw, problem in (('{"timeout": "5"}', "a JSON integer"), ('{"timeout": 1.5}', "a JSON integer"),
                         ('{"timeout": true}', "a JSON integer"), ('{"timeout": -1}', "must be >= 0"),
                         ('{"timeout": 1e+20}', r"at most 2\*\*63 - 1\), got 1e\+20")):
        with pytest.raises(ProtocolError, match=problem) as err:
            bridge_target(sid, raw)
        assert err.value.field == "timeout"
    # Time spent in the bridge counts; a limit already passed still goes on (prepos names it), never as "none".
    target = bridge_target(sid, '{"timeout": 5000}')
    assert target.timeout_us_left(0.002) == 3000 and target.timeout_us_left(1.0) == 1
    assert bridge_target(sid).timeout_us_left(10.0) == 0


def test_only_the_bridges_own_inputs_stay_behind():
    names = ["text_input", "session_id", "max_tokens", "start", "end", "stream", "choices"]
    assert forwarded_inputs(names) == ["text_input", "max_tokens", "choices"]


def _response(text: bytes, ids, path=b"prefix", confidence=0.5, finish=b"", compute=1.0, first=1.0,
              decode=0.0) -> dict:
    return {"text_output": _b(text), "output_ids": np.array(ids, np.int32), "path": _b(path),
            "confidence": np.array([confidence], np.float32), "finish_reason": _b(finish),
            "compute_ms": np.array([compute], np.float32), "first_token_ms": np.array([first], np.float32),
            "decode_ms": np.array([decode], np.float32)}


def test_a_stream_merges_into_one_answer_as_a_client_reads_it():
    euro = "€".encode()  # three bytes, split over two responses
    responses = [_response(b"Price: " + euro[:1], [5, 6], first=3.0, compute=3.0),
                 {},  # a final flag alone
                 _response(euro[1:], [7], path=b"", confidence=float("nan"), compute=5.0, first=float("nan"),
                           decode=2.0),
                 _response(b"", [], path=b"", confidence=float("nan"), finish=b"stop", compute=6.0,
                           first=float("nan"), decode=2.5)]
    merged = merge_responses(responses)
    assert merged["text_output"].tolist() == ["Price: €".encode()]
    assert merged["output_ids"].tolist() == [5, 6, 7] and merged["output_ids"].dtype == np.int32
    assert merged["path"].tolist() == [b"prefix"] and float(merged["confidence"][0]) == 0.5
    assert float(merged["first_token_ms"][0]) == 3.0  # the first token's anatomy: from the first response
    assert merged["finish_reason"].tolist() == [b"stop"] and float(merged["compute_ms"][0]) == 6.0  # from the last
    assert float(merged["decode_ms"][0]) == 2.5  # the whole request's, beside compute_ms (the first's was 0)
    assert merge_responses([{}, {}]) == {}


def test_numbers_no_response_set_are_left_out_rather_than_sent_as_nan():
    update = _response(b"", [], path=b"append", confidence=float("nan"), finish=b"appended")
    assert absent_outputs(update) == ["confidence"]
    merged = merge_responses([update])
    assert "confidence" not in merged and merged["path"].tolist() == [b"append"]
    assert absent_outputs(_response(b"x", [1])) == []


@pytest.mark.parametrize("status", list(Status))
def test_an_error_relayed_as_outputs_comes_back_as_the_same_error(status):
    error = ProtocolError("timeout", "the deadline passed — its turn was not accepted", status)
    outputs = relayed_error_outputs(error)
    assert relayed_error(outputs) == (str(error), status)
    assert status in TRITON_ERROR_CODES  # every status has a Triton error code to be sent as


def test_answers_are_not_taken_for_relayed_errors():
    assert relayed_error(_response(b"error", [1])) is None  # the word as an answer's text is no error
    for path in (b"prefix", b"append", b"close", b""):
        assert relayed_error(_response(b"x", [], path=path)) is None
    assert relayed_error({}) is None


def test_the_bridge_settings_come_from_its_parameters_and_the_environment_wins():
    from prepos.bridge import BridgeConfig, read_bridge_config
    assert read_bridge_config({}, {}) == BridgeConfig("prepos", 256)
    parameters = {"bridge.target_model": "prepos", "bridge.max_streams": "64"}
    assert read_bridge_config(parameters, {}) == BridgeConfig("prepos", 64)
    assert read_bridge_config(parameters, {"PREPOS_BRIDGE_MAX_STREAMS": "8",
                                           "PREPOS_BRIDGE_TARGET_MODEL": "other"}) == BridgeConfig("other", 8)


@pytest.mark.parametrize(("parameters", "environ", "message"), [
    ({"bridge.max_streams": "many"}, {}, "bridge.max_streams: cannot read 'many' as int"),
    ({"bridge.max_stream": "8"}, {},
     "bridge.max_stream: unknown parameter; known: bridge.max_streams, bridge.target_model"),
    ({}, {"PREPOS_BRIDGE_MAX_STREAMS": "0"},
     "bridge.max_streams: must be at least 1, got 0 (set by the environment variable PREPOS_BRIDGE_MAX_STREAMS)"),
    ({"bridge.target_model": " "}, {}, "bridge.target_model: empty"),
])
def test_a_bad_bridge_setting_is_named(parameters, environ, message):
    from prepos.bridge import read_bridge_config
    with pytest.raises(ValueError) as err:
        read_bridge_config(parameters, environ)
    assert str(err.value) == message


def test_an_error_prepos_sent_is_told_from_tritons_own_refusal_of_a_relayed_request():
    for status in Status:  # prepos's own, every status: prepos counts it, and the bridge passes it on unchanged
        assert triton_refusal(with_status("START: session 's' is not open", status)) is None
    # Triton 2.51's words for a request without START to a sequence it does not hold
    not_open = ("inference request for sequence s1 to model 'prepos' must specify the START flag on the first "
                "request of the sequence")
    assert triton_refusal(not_open) == ("START", Status.NOT_FOUND)
    assert triton_refusal("Request for unknown model: 'prepos' is not found") == ("request", None)
    assert triton_refusal(f"{not_open} [SOMETHING]") == ("START", Status.NOT_FOUND)  # no status of ours
    for message in (not_open, "anything else"):
        assert triton_refusal(message)[0] in ERROR_FIELDS  # published at 0 from the start


def test_the_bridge_tells_whether_its_repository_holds_its_target(tmp_path):
    from prepos.bridge import target_in_repository

    for name in ("prepos", "prepos_http"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text("")
    assert target_in_repository(str(tmp_path / "prepos_http"), "prepos")
    assert target_in_repository(str(tmp_path / "prepos_http") + "/", "prepos")
    assert not target_in_repository(str(tmp_path / "prepos_http"), "nosuch")
