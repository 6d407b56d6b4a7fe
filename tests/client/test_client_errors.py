"""Server error messages -> PreposError and its field."""

from __future__ import annotations

import pytest
from prepos_client.errors import CODES, PreposError, PreposTimeout, PreposUnavailable, from_triton, parse_field
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


def test_a_journal_refusal_is_a_refusal_by_a_reachable_server_not_an_unreachable_one():
    # UNAVAILABLE in the text is the server's status for a turn it could not journal: the server answered, the
    # turn was not accepted, and a RoutedClient must not take it for a replica gone and move the session
    sent = ("[request id: 5] journal: could not write the session journal (No space left on device); "
            "the turn was not accepted [UNAVAILABLE]")
    error = from_triton(InferenceServerException(msg=sent))
    assert type(error) is PreposError
    assert (error.field, error.code, error.status) == ("journal", "UNAVAILABLE", None)


@pytest.mark.parametrize("sent, message, code", [
    ("resume: session 'a' has no journal [NOT_FOUND]", "resume: session 'a' has no journal", "NOT_FOUND"),
    ("[request id: 2] START: past memory.max_sessions (8) [RESOURCE_EXHAUSTED]", "START: past memory.max_sessions (8)",
     "RESOURCE_EXHAUSTED"),
    ("max_tokens: must be in [0, 4096], got -1 [INVALID_ARGUMENT]", "max_tokens: must be in [0, 4096], got -1",
     "INVALID_ARGUMENT"),
    # only a known status at the very end is one
    ("max_tokens: must be in [0, 4096], got -1", "max_tokens: must be in [0, 4096], got -1", None),
    ("stop: got ['x'] [SOMETHING_ELSE]", "stop: got ['x'] [SOMETHING_ELSE]", None),
    ("role: unknown [NOT_FOUND] role 'y'", "role: unknown [NOT_FOUND] role 'y'", None),
    ("text_input: [NOT_FOUND]x", "text_input: [NOT_FOUND]x", None),
])
def test_the_status_a_refusal_ends_with_is_its_code_and_leaves_the_message(sent, message, code):
    error = from_triton(InferenceServerException(msg=sent))
    assert (error.message, str(error), error.code) == (message, message, code)
    assert error.status is None  # the stream's status: none for a refusal by the model
    assert error.field == message.split(":")[0]


def test_a_deadline_refusal_keeps_its_code_through_the_timeout_error_and_a_rewording():
    sent = "timeout: the request's deadline passed before it finished; its turn was not accepted [DEADLINE_EXCEEDED]"
    error = from_triton(InferenceServerException(msg=sent))
    assert isinstance(error, PreposTimeout) and error.code == "DEADLINE_EXCEEDED" and error.accepted is False
    again = error.reworded("said otherwise")
    assert isinstance(again, PreposTimeout)
    assert (again.message, again.field, again.code, again.accepted) == ("said otherwise", "timeout",
                                                                        "DEADLINE_EXCEEDED", False)


def test_the_clients_codes_are_the_servers_statuses():
    from prepos.protocol import Status, with_status

    assert CODES == {status.value for status in Status}
    for status in Status:  # what the server sends is what the client reads back
        error = from_triton(InferenceServerException(msg=with_status("top_k: must be >= 0", status)))
        assert (error.message, error.field, error.code) == ("top_k: must be >= 0", "top_k", status.value)
