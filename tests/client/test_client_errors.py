"""Server error messages -> PreposError and its field."""

from __future__ import annotations

import pytest
from prepos_client.errors import PreposError, PreposTimeout, PreposUnavailable, from_triton, parse_field
from tritonclient.utils import InferenceServerException


@pytest.mark.parametrize(
    "message, field",
    [
        ("max_tokens: must be >= 0, got -1", "max_tokens"),
        ("gate_threshold: must be in [0, 1], got 7.0", "gate_threshold"),
        ("input_ids : token id 99999 is outside the vocabulary", "input_ids"),
        ("[request id: 4] top_k: must be >= 0, got -3", "top_k"),
        ("START: session 's1' is already open", "START"),
        ("inference request for sequence 7 to model 'prepos' must specify the START flag", None),
        ("Request for unknown model: 'nope' is not found", None),
        ("Error: something broke", None),
        ("session 's1': not open", None),
        ("", None),
        ("no colon at all", None),
    ],
)
def test_parse_field(message, field):
    assert parse_field(message) == field


def test_a_model_error_keeps_its_message_and_field():
    error = from_triton(InferenceServerException(msg="[request id: 9] choices: must not be empty"))
    assert type(error) is PreposError
    assert error.message == "choices: must not be empty"
    assert str(error) == "choices: must not be empty"
    assert error.field == "choices"
    assert error.status is None


def test_an_unreachable_server_is_its_own_error():
    error = from_triton(InferenceServerException(msg="failed to connect", status="StatusCode.UNAVAILABLE"))
    assert isinstance(error, PreposUnavailable)
    assert error.status == "StatusCode.UNAVAILABLE"


def test_a_deadline_is_a_timeout():
    error = from_triton(InferenceServerException(msg="Deadline Exceeded", status="StatusCode.DEADLINE_EXCEEDED"))
    assert isinstance(error, PreposTimeout)
    assert isinstance(error, TimeoutError)


def test_the_servers_deadline_error_is_a_timeout_and_other_timeout_errors_are_not():
    message = "[request id: 3] timeout: the request's deadline passed before it finished; its turn was not accepted"
    error = from_triton(InferenceServerException(msg=message))
    assert isinstance(error, PreposTimeout) and error.field == "timeout" and error.message.startswith("timeout:")
    bad = from_triton(InferenceServerException(msg="timeout: must be >= 0 microseconds (0: none), got -1"))
    assert type(bad) is PreposError and bad.field == "timeout"


def test_other_stream_errors_keep_their_status():
    error = from_triton(InferenceServerException(msg="Locally cancelled", status="StatusCode.CANCELLED"))
    assert type(error) is PreposError
    assert error.status == "StatusCode.CANCELLED"


def test_a_missing_access_token_says_so_and_is_not_unreachable():
    message = "This protocol is restricted, expecting header 'triton-grpc-protocol-prepos-access-token'"
    error = from_triton(InferenceServerException(msg=message, status="StatusCode.UNAVAILABLE"))
    assert not isinstance(error, PreposUnavailable)
    assert error.field == "access token" and "--token" in str(error)
