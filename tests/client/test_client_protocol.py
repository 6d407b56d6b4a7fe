"""build_inputs, parse_chunk, Answer and Update."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from client_fakes import decode_input, make_result
from hypothesis import given
from hypothesis import strategies as st
from prepos_client.protocol import (
    INPUT_DATATYPES,
    Answer,
    Chunk,
    Update,
    build_inputs,
    is_final_response,
    new_text_decoder,
    parse_chunk,
)


def by_name(inputs):
    return {infer_input.name(): infer_input for infer_input in inputs}


def test_no_arguments_send_no_inputs():
    assert build_inputs() == []


def test_only_set_inputs_are_sent():
    inputs = by_name(build_inputs("hi", max_tokens=8))
    assert sorted(inputs) == ["max_tokens", "text_input"]


def test_every_input_has_the_contract_name_datatype_and_shape():
    inputs = by_name(
        build_inputs(
            "hi",
            role="tool",
            max_tokens=5,
            choices=["yes", "no", "maybe"],
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            seed=2**64 - 1,
            stop=["\n", "END"],
            speculate=True,
            gate_threshold=0.8,
        )
    )
    expected = {
        "text_input": ("BYTES", [1]),
        "role": ("BYTES", [1]),
        "max_tokens": ("INT32", [1]),
        "choices": ("BYTES", [3]),
        "temperature": ("FP32", [1]),
        "top_p": ("FP32", [1]),
        "top_k": ("INT32", [1]),
        "seed": ("UINT64", [1]),
        "stop": ("BYTES", [2]),
        "speculate": ("BOOL", [1]),
        "gate_threshold": ("FP32", [1]),
    }
    assert {name: (i.datatype(), list(i.shape())) for name, i in inputs.items()} == expected
    assert all(INPUT_DATATYPES[name] == datatype for name, (datatype, _) in expected.items())
    values = {name: decode_input(i) for name, i in inputs.items()}
    assert values["role"].tolist() == [b"tool"]
    assert values["max_tokens"].tolist() == [5]
    assert values["choices"].tolist() == [b"yes", b"no", b"maybe"]
    assert values["temperature"][0] == pytest.approx(0.7)
    assert values["top_k"].tolist() == [40]
    assert values["seed"].tolist() == [2**64 - 1]
    assert values["stop"].tolist() == [b"\n", b"END"]
    assert values["speculate"].tolist() == [True]


def test_input_ids_are_int32_of_any_length():
    inputs = by_name(build_inputs(ids=[1, 2, 49151]))
    assert inputs["input_ids"].datatype() == "INT32"
    assert list(inputs["input_ids"].shape()) == [3]
    assert decode_input(inputs["input_ids"]).tolist() == [1, 2, 49151]
    empty = by_name(build_inputs(ids=[]))["input_ids"]
    assert list(empty.shape()) == [0]
    assert decode_input(empty).tolist() == []


def test_numpy_ids_are_accepted():
    inputs = by_name(build_inputs(ids=np.array([5, 6], dtype=np.int64)))
    assert decode_input(inputs["input_ids"]).tolist() == [5, 6]


def test_unicode_text_is_sent_as_utf8():
    text = "héllo ✓ 日本 🙂"
    raw = decode_input(by_name(build_inputs(text))["text_input"])
    assert raw.tolist() == [text.encode("utf-8")]


def test_empty_text_is_an_explicit_empty_delta():
    raw = decode_input(by_name(build_inputs(""))["text_input"])
    assert raw.tolist() == [b""]


def test_text_and_ids_are_exclusive():
    with pytest.raises(ValueError, match="text_input, input_ids"):
        build_inputs("hi", ids=[1])


def test_server_side_ranges_are_left_to_the_server():
    inputs = by_name(build_inputs(max_tokens=-1, top_k=-3, temperature=-2.0, gate_threshold=7.0))
    assert decode_input(inputs["max_tokens"]).tolist() == [-1]
    assert decode_input(inputs["top_k"]).tolist() == [-3]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"ids": [2**31]}, "input_ids: values must fit INT32"),
        ({"ids": [1.5]}, "input_ids: expected integers"),
        ({"ids": [[1, 2]]}, "input_ids: expected a flat list"),
        ({"max_tokens": 2**40}, "max_tokens: values must fit INT32"),
        ({"seed": -1}, "seed: must fit UINT64"),
        ({"seed": 2**64}, "seed: must fit UINT64"),
    ],
)
def test_values_that_do_not_fit_their_datatype_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_inputs(**kwargs)


def test_choices_must_be_a_list_but_stop_may_be_one_string():
    with pytest.raises(TypeError, match="choices"):
        build_inputs(choices="yes,no")
    assert decode_input(by_name(build_inputs(stop="\n"))["stop"]).tolist() == [b"\n"]


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": "hot"}, "temperature"), ({"temperature": "0.5"}, "temperature"), ({"top_p": True}, "top_p"),
    ({"gate_threshold": "high"}, "gate_threshold"), ({"speculate": "no"}, "speculate"), ({"speculate": 1}, "speculate"),
])
def test_numbers_and_flags_of_the_wrong_kind_are_named(kwargs, name):
    with pytest.raises(TypeError, match=f"^{name}: expected"):
        build_inputs(**kwargs)
    ok = by_name(build_inputs(temperature=np.float64(0.5), top_p=1, gate_threshold=0.9, speculate=np.bool_(False)))
    assert decode_input(ok["top_p"]).tolist() == [1.0] and decode_input(ok["speculate"]).tolist() == [False]


def test_text_must_be_str():
    with pytest.raises(TypeError, match="text_input"):
        build_inputs(b"bytes")


def test_parse_chunk_reads_every_output():
    result = make_result(
        "3",
        text="Hi",
        ids=[10, 11],
        path="exact",
        confidence=0.25,
        finish_reason="stop",
        queue_ms=0.5,
        compute_ms=2.0,
        first_token_ms=1.5,
        final=True,
    )
    assert parse_chunk(result, elapsed_ms=4.0) == Chunk(
        text="Hi",
        token_ids=(10, 11),
        path="exact",
        confidence=0.25,
        finish_reason="stop",
        final=True,
        queue_ms=0.5,
        compute_ms=2.0,
        first_token_ms=1.5,
        elapsed_ms=4.0,
    )


def test_parse_chunk_maps_nan_and_empty_to_none():
    result = make_result(text="a", ids=[], path="append", confidence=float("nan"), finish_reason="", final=False)
    chunk = parse_chunk(result, elapsed_ms=1.0)
    assert chunk.confidence is None
    assert chunk.finish_reason is None
    assert chunk.token_ids == ()
    assert chunk.final is False


def test_flags_only_final_response_parses_as_an_empty_final_chunk():
    chunk = parse_chunk(make_result("2", final=True), elapsed_ms=1.0)
    assert chunk == Chunk("", (), None, None, None, True, None, None, None, 1.0)


def test_final_is_the_triton_flag_or_a_finish_reason():
    assert is_final_response(make_result(final=True))
    assert is_final_response(make_result(finish_reason="length"))
    assert not is_final_response(make_result(text="x", finish_reason="", final=False))
    assert not is_final_response(make_result(text="x"))


def test_a_character_split_across_chunks_decodes_whole():
    raw = "✓".encode("utf-8")
    decoder = new_text_decoder()
    first = parse_chunk(make_result(text=raw[:1], final=False), elapsed_ms=1.0, decoder=decoder)
    second = parse_chunk(make_result(text=raw[1:], finish_reason="stop", final=True), elapsed_ms=2.0, decoder=decoder)
    assert (first.text, second.text) == ("", "✓")


def test_invalid_utf8_becomes_replacement_characters():
    chunk = parse_chunk(make_result(text=b"a\xff", finish_reason="stop", final=True), elapsed_ms=1.0)
    assert chunk.text == "a\ufffd"


@given(st.text(), st.data())
def test_any_text_split_anywhere_reassembles(text, data):
    raw = text.encode("utf-8")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=4)))
    pieces = [raw[start:end] for start, end in zip([0, *cuts], [*cuts, len(raw)])]
    decoder = new_text_decoder()
    chunks = [
        parse_chunk(
            make_result(text=piece, final=index == len(pieces) - 1),
            elapsed_ms=float(index),
            decoder=decoder,
        )
        for index, piece in enumerate(pieces)
    ]
    assert Answer.from_chunks(chunks).text == text


def test_answer_collects_text_ids_and_timings():
    chunks = [
        parse_chunk(
            make_result(text="Hel", ids=[1], path="gated", confidence=0.9, queue_ms=0.1, compute_ms=0.2,
                        first_token_ms=0.3, final=False),
            elapsed_ms=1.0,
        ),
        parse_chunk(make_result(text="lo", ids=[2, 3], path="gated", compute_ms=0.7, final=False), elapsed_ms=3.0),
        parse_chunk(make_result(text="", ids=[], finish_reason="length", final=True), elapsed_ms=4.5),
    ]
    answer = Answer.from_chunks(chunks)
    assert answer.text == "Hello"
    assert answer.token_ids == (1, 2, 3)
    assert answer.path == "gated"
    assert answer.confidence == pytest.approx(0.9)
    assert answer.finish_reason == "length"
    assert answer.queue_ms == pytest.approx(0.1)
    assert answer.compute_ms == pytest.approx(0.7)
    assert answer.first_token_ms == pytest.approx(0.3)
    assert (answer.ttft_ms, answer.total_ms, answer.num_chunks) == (1.0, 4.5, 3)


def test_answer_is_json_serializable():
    chunk = parse_chunk(make_result(text="ok", ids=[4], path="exact", confidence=float("nan"),
                                    finish_reason="stop", final=True), elapsed_ms=2.0)
    data = json.loads(json.dumps(Answer.from_chunks([chunk]).to_dict()))
    assert data["text"] == "ok"
    assert data["token_ids"] == [4]
    assert data["confidence"] is None


def test_answer_is_frozen():
    chunk = parse_chunk(make_result(text="ok", final=True), elapsed_ms=2.0)
    answer = Answer.from_chunks([chunk])
    with pytest.raises(AttributeError):
        answer.text = "changed"


def test_update_from_an_ack():
    ack = parse_chunk(make_result(text="", ids=[], path="append", confidence=float("nan"),
                                  finish_reason="appended", queue_ms=0.2, compute_ms=0.0, final=True),
                      elapsed_ms=0.9)
    assert Update.from_chunks([ack]) == Update("append", "appended", pytest.approx(0.2), 0.0, 0.9)


def test_empty_chunk_lists_are_rejected():
    with pytest.raises(ValueError):
        Answer.from_chunks([])
    with pytest.raises(ValueError):
        Update.from_chunks([])


def test_timings_are_plain_floats():
    chunk = parse_chunk(make_result(text="x", queue_ms=1.25, final=True), elapsed_ms=1.0)
    assert type(chunk.queue_ms) is float and not math.isnan(chunk.queue_ms)


@pytest.mark.parametrize("given", [dict(text="bad \udcff bytes"), dict(text="ok", choices=["yes", "n\udcfe"]),
                                   dict(text="ok", stop=["\udcff"])])
def test_text_that_is_no_utf8_is_refused_naming_its_input(given):
    # What a command line or pipe holds when its bytes were not UTF-8 (read with surrogateescape).
    with pytest.raises(ValueError, match=r"not valid UTF-8 text \(surrogates not allowed: '\\udc"):
        build_inputs(**given)


@pytest.mark.parametrize("name", ["temperature", "top_p", "gate_threshold"])
def test_a_number_past_fp32s_range_is_refused_naming_its_input_not_sent_as_infinity(name):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NumPy's overflow warning was printed, and the server told of "inf"
        with pytest.raises(ValueError, match=rf"^{name}: 1e\+39 is past the range of FP32"):
            build_inputs("hi", **{name: 1e39})
        assert by_name(build_inputs("hi", **{name: float("inf")}))[name].datatype() == "FP32"  # the server's to refuse
