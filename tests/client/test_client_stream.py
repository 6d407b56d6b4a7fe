"""ResponseRouter: which request each stream callback belongs to."""

from __future__ import annotations

import queue

import pytest
from client_fakes import make_result, unavailable
from prepos_client.errors import PreposUnavailable
from prepos_client.stream import ResponseRouter
from tritonclient.utils import InferenceServerException


def drain(deliveries: queue.SimpleQueue) -> list:
    items = []
    while True:
        try:
            items.append(deliveries.get_nowait())
        except queue.Empty:
            return items


def model_error(message: str) -> InferenceServerException:
    return InferenceServerException(msg=message)


def test_responses_go_to_their_request_by_id():
    router = ResponseRouter()
    first, second = router.expect("1"), router.expect("2")
    router.on_response(make_result("2", text="b", final=False), None)
    router.on_response(make_result("1", text="a", finish_reason="stop", final=True), None)
    assert [d.result.get_response().id for d in drain(first)] == ["1"]
    assert [d.result.get_response().id for d in drain(second)] == ["2"]
    assert router.num_pending == 1


def test_a_final_response_ends_the_request():
    router = ResponseRouter()
    router.expect("1")
    router.on_response(make_result("1", text="a", final=False), None)
    assert router.num_pending == 1
    router.on_response(make_result("1", finish_reason="stop", final=True), None)
    assert router.num_pending == 0


def test_responses_of_a_finished_request_are_dropped():
    router = ResponseRouter()
    first = router.expect("1")
    router.on_response(make_result("1", finish_reason="stop", final=False), None)
    second = router.expect("2")
    # A flags-only final sent after the finish_reason response.
    router.on_response(make_result("1", final=True), None)
    assert len(drain(first)) == 1
    assert drain(second) == []


def test_a_model_error_goes_to_the_oldest_pending_request():
    router = ResponseRouter()
    first, second = router.expect("1"), router.expect("2")
    router.on_response(None, model_error("max_tokens: must be >= 0, got -1"))
    (delivery,) = drain(first)
    assert delivery.result is None
    assert delivery.error.field == "max_tokens"
    assert drain(second) == []
    assert router.num_pending == 1
    assert router.failure is None


def test_an_error_naming_its_request_goes_to_that_request_not_the_oldest():
    """A queued request's deadline error comes while the request ahead of it still streams, and names its request."""
    router = ResponseRouter()
    long, short = router.expect("1"), router.expect("2")
    router.on_response(make_result("1", text="a", final=False), None)
    router.on_response(None, model_error('timeout: the request\'s deadline passed while it waited behind its '
                                         'session\'s earlier requests; its turn was not accepted (request "2") '
                                         '[DEADLINE_EXCEEDED]'))
    router.on_response(make_result("1", text="b", finish_reason="stop", final=True), None)
    (error,) = drain(short)
    assert error.error.field == "timeout" and error.error.code == "DEADLINE_EXCEEDED"
    assert [d.error for d in drain(long)] == [None, None] and router.num_pending == 0
    router.expect("3")
    router.on_response(None, model_error('role: unknown role (request "9") [INVALID_ARGUMENT]'))  # not pending
    assert router.num_pending == 0  # the oldest pending one takes it


def test_tritons_own_refusal_goes_to_the_request_it_names():
    """Triton refuses some requests at once, while an earlier one may still stream, with the request's id in front
    of its text (``[request id: 2] inference input 'text_input' data-type is ...``; its refusal of a sequence it
    does not hold names no request: see the next test)."""
    router = ResponseRouter()
    streaming, ending = router.expect("1"), router.expect("2")
    router.on_response(None, model_error("[request id: 2] inference input 'text_input' data-type is 'INT32', but "
                                         "model 'prepos' expects 'BYTES'"))
    router.on_response(make_result("1", text="a", finish_reason="length", final=True), None)
    (refused,) = drain(ending)
    assert "data-type" in str(refused.error) and not str(refused.error).startswith("[request id")
    assert [d.error for d in drain(streaming)] == [None] and router.num_pending == 0


@pytest.mark.parametrize("message", [
    "inference request for sequence s to model 'prepos' must specify the START flag on the first request of the "
    "sequence",
    "Request for unknown model: 'prepos' has no available versions",
])
def test_a_refusal_on_arrival_naming_no_request_goes_to_the_oldest_one_not_answered_yet(message):
    """Triton's idle timer counts from a sequence's last request, so it can end a session while one long answer
    still streams: the request sent next is refused at once, with no request id. It went to the streaming request
    (told "changed nothing" although its turn was then accepted), and the refused one waited for ever."""
    router = ResponseRouter()
    streaming, next_one, last = router.expect("1"), router.expect("2"), router.expect("3")
    router.on_response(make_result("1", text="a", final=False), None)
    router.on_response(None, model_error(message))
    (refused,) = drain(next_one)
    assert refused.error is not None and message in str(refused.error)
    assert [d.error for d in drain(streaming)] == [None] and drain(last) == []
    router.on_response(make_result("1", text="b", finish_reason="stop", final=True), None)
    assert [d.error for d in drain(streaming)] == [None] and router.num_pending == 1
    router.on_response(None, model_error(message))  # with no request answered yet, the oldest one takes it
    assert len(drain(last)) == 1 and router.num_pending == 0


def test_a_refusal_on_arrival_passes_over_a_request_queued_long_before_it():
    """Triton's idle timer counts from the last request's arrival: with one request streaming and another queued
    behind it (taken, no response yet), the timer may pass, and the request sent next is the one refused."""
    now = [100.0]
    router = ResponseRouter(clock=lambda: now[0])
    streaming, queued = router.expect("1"), router.expect("2")
    router.on_response(make_result("1", text="a", final=False), None)
    now[0] += 30  # Triton's timer passes
    refused = router.expect("3")
    now[0] += 0.05
    router.on_response(None, model_error("inference request for sequence s to model 'prepos' must specify the "
                                         "START flag on the first request of the sequence"))
    assert len(drain(refused)) == 1 and drain(queued) == []
    router.on_response(make_result("1", text="b", finish_reason="stop", final=True), None)
    router.on_response(make_result("2", text="c", finish_reason="stop", final=True), None)
    assert [d.error for d in drain(streaming)] == [None, None]
    assert [d.error for d in drain(queued)] == [None] and router.num_pending == 0


def test_a_model_error_still_goes_to_the_oldest_request_even_while_it_streams():
    """prepos's own errors come in order: a deadline passing mid-answer belongs to the answer streaming."""
    router = ResponseRouter()
    streaming, queued = router.expect("1"), router.expect("2")
    router.on_response(make_result("1", text="a", final=False), None)
    router.on_response(None, model_error("timeout: the request's deadline passed [DEADLINE_EXCEEDED]"))
    assert [d.error is None for d in drain(streaming)] == [True, False] and drain(queued) == []


@pytest.mark.parametrize("request_id", ["4", "", 'say "hi" \\ é', "(request \"1\")"])
def test_the_request_an_error_names_reads_back_as_the_server_writes_it(request_id):
    from prepos.protocol import Status, naming_request, with_status  # the server's side of the format
    from prepos_client.errors import named_request

    sent = with_status(naming_request("timeout: the request's deadline passed", request_id), Status.DEADLINE_EXCEEDED)
    assert named_request(sent) == request_id
    assert named_request("timeout: the request's deadline passed [DEADLINE_EXCEEDED]") is None
    assert named_request('choices: entry "(request \\"1\\")" is too long [INVALID_ARGUMENT]') is None


def test_a_stream_error_fails_every_pending_request_and_the_stream():
    router = ResponseRouter()
    first, second = router.expect("1"), router.expect("2")
    router.on_response(None, unavailable())
    assert isinstance(drain(first)[0].error, PreposUnavailable)
    assert isinstance(drain(second)[0].error, PreposUnavailable)
    assert isinstance(router.failure, PreposUnavailable)
    later = router.expect("3")
    assert isinstance(drain(later)[0].error, PreposUnavailable)


def test_a_response_without_id_goes_to_the_oldest_request():
    router = ResponseRouter()
    first = router.expect("1")
    router.on_response(make_result("", text="x", finish_reason="stop", final=True), None)
    assert len(drain(first)) == 1
    assert router.num_pending == 0


def test_forget_stops_routing():
    router = ResponseRouter()
    first = router.expect("1")
    router.forget("1")
    router.on_response(make_result("1", text="x", final=True), None)
    assert drain(first) == []


def test_duplicate_request_ids_are_refused():
    router = ResponseRouter()
    router.expect("1")
    with pytest.raises(ValueError):
        router.expect("1")


def test_a_broken_response_does_not_escape_the_callback():
    router = ResponseRouter()
    router.expect("1")

    class Broken:
        def get_response(self):
            raise RuntimeError("malformed")

    router.on_response(Broken(), None)
    assert router.num_pending == 1


def test_deliveries_are_stamped_in_arrival_order():
    router = ResponseRouter()
    first = router.expect("1")
    router.on_response(make_result("1", text="a", final=False), None)
    router.on_response(make_result("1", text="b", final=True), None)
    stamps = [delivery.received_at for delivery in drain(first)]
    assert stamps == sorted(stamps)
