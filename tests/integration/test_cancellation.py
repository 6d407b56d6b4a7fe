"""Against the real server: a cancelled stream stops its engine work and leaves the session's log as it was;
a request timeout is a deadline; a client that does not read its responses holds up no other session."""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from prepos_client import Client, PreposError, PreposTimeout

from .conftest import start_server
from .test_server import eventually, settled, wait_positioned

pytestmark = pytest.mark.integration

SYSTEM = "You are a storyteller. Tell long stories."


def inputs(text: str, max_tokens: int):
    tensors = []
    for name, array in (("text_input", np.array([text.encode()], dtype=np.object_)),
                        ("max_tokens", np.array([max_tokens], dtype=np.int32))):
        tensor = grpcclient.InferInput(name, list(array.shape), "BYTES" if array.dtype == object else "INT32")
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("cancel"))
    yield srv
    srv.stop()


def open_with_twin(server, session_id: str):
    """Open ``session_id`` with the system turn and leave it open; return what a twin session with the same
    system turn answers to "Say hello." (what the session answers as long as nothing else entered its log)."""
    with Client(server.grpc_url) as client:
        twin = client.session(f"{session_id}-twin")
        twin.append(SYSTEM, role="system")
        want = twin.ask("Say hello.", max_tokens=6, speculate=False)
        twin.close()
        session = client.session(session_id)
        session.append(SYSTEM, role="system")
        session.detach()
    return want


def test_a_cancelled_stream_stops_generation_and_leaves_the_log_unchanged(server):
    want = open_with_twin(server, "victim")

    cancelled_before = server.metric("prepos_requests_abandoned_total", reason="cancelled")
    results: queue.Queue = queue.Queue()
    raw = grpcclient.InferenceServerClient(server.grpc_url)
    raw.start_stream(lambda result, error: results.put((result, error)))
    raw.async_stream_infer("prepos", inputs("Tell me a very long story about a dragon.", 400), sequence_id="victim")
    first, error = results.get(timeout=60)
    assert error is None and first.as_numpy("path")[0] in (b"prepaid", b"prefix")
    raw.stop_stream(cancel_requests=True)  # the client goes away mid-answer
    raw.close()
    eventually(lambda: server.metric("prepos_requests_abandoned_total", reason="cancelled") > cancelled_before, 30)

    with Client(server.grpc_url) as client:
        session = client.session("victim", resume=True)
        again = session.ask("Say hello.", max_tokens=6, speculate=False)
        session.close()
    assert again.token_ids == want.token_ids  # the cancelled turn never entered the log


def test_an_update_queued_behind_a_cancelled_answer_is_cancelled_too(server):
    """An update needs no engine step: queued on the stream behind a generate, it was accepted after the client
    cancelled the stream, with its acknowledgement lost, so that a client sending it again had it twice."""
    want = open_with_twin(server, "queued")

    cancelled_before = server.metric("prepos_requests_abandoned_total", reason="cancelled")
    appended_before = settled(lambda: server.metric("prepos_requests_total", path="append"))  # the opening's too
    results: queue.Queue = queue.Queue()
    raw = grpcclient.InferenceServerClient(server.grpc_url)
    raw.start_stream(lambda result, error: results.put((result, error)))
    raw.async_stream_infer("prepos", inputs("Tell me a very long story about a dragon.", 400), sequence_id="queued")
    raw.async_stream_infer("prepos", inputs("The code word is KIWI.", 0), sequence_id="queued")
    first, error = results.get(timeout=60)
    assert error is None
    raw.stop_stream(cancel_requests=True)
    raw.close()
    eventually(lambda: server.metric("prepos_requests_abandoned_total", reason="cancelled") >= cancelled_before + 2, 30)
    assert server.metric("prepos_requests_total", path="append") == appended_before

    with Client(server.grpc_url) as client:
        session = client.session("queued", resume=True)
        again = session.ask("Say hello.", max_tokens=6, speculate=False)
        session.close()
    assert again.token_ids == want.token_ids  # neither the answer nor the update entered the log


def test_a_request_timeout_is_a_deadline(server):
    with Client(server.grpc_url) as client:
        session = client.session("deadline")
        session.append(SYSTEM, role="system")
        session.detach()
    results: queue.Queue = queue.Queue()
    raw = grpcclient.InferenceServerClient(server.grpc_url)
    raw.start_stream(lambda result, error: results.put((result, error)))
    raw.async_stream_infer("prepos", inputs("Tell me a very long story.", 400), sequence_id="deadline",
                           timeout=300_000)  # microseconds: 0.3 s for 400 tokens at tens of ms each
    num_chunks, error = 0, None
    while error is None:
        result, error = results.get(timeout=60)
        if error is None:
            num_chunks += 1
            assert not result.as_numpy("finish_reason")[0], "finished before its deadline"
    raw.stop_stream()
    raw.close()
    assert "timeout" in str(error) and "not accepted" in str(error)
    assert num_chunks < 400
    with Client(server.grpc_url) as client:
        client.session("deadline", resume=True).close()


def test_a_call_the_client_timed_out_is_stopped_by_the_server_and_changes_nothing(server):
    """The client library sends its time limit as the request timeout: the server stops the request at the same
    deadline, so a call that raised PreposTimeout did not enter the session's log."""
    abandoned = server.metric("prepos_requests_abandoned_total", reason="deadline")
    with Client(server.grpc_url) as client, client.session() as session, client.session() as twin:
        for s in (session, twin):
            s.append(SYSTEM, role="system")
        with pytest.raises(PreposTimeout):
            session.ask("Tell me a very long story.", max_tokens=400, timeout_s=0.3)
        eventually(lambda: server.metric("prepos_requests_abandoned_total", reason="deadline") > abandoned)
        again = session.ask("Say hello.", max_tokens=8)
        assert again.token_ids == twin.ask("Say hello.", max_tokens=8).token_ids  # the timed-out turn is not in the log


def test_an_exact_answer_stopped_mid_stream_leaves_the_next_answer_right(server):
    """An answer from the positioned state writes its tokens into the KV past that state; stopped before its
    turn is accepted, it must not leave the state behind for the next request to decode on top of them."""
    abandoned = server.metric("prepos_requests_abandoned_total", reason="deadline")
    with Client(server.grpc_url) as client, client.session() as session, client.session() as twin:
        for s in (session, twin):
            completed = server.metric("prepos_prepositionings_total", result="completed")
            s.append(SYSTEM, role="system")
            wait_positioned(server, completed)
        with pytest.raises(PreposTimeout):
            session.ask("", max_tokens=400, timeout_s=0.3)  # exact: the positioned state's own answer
        eventually(lambda: server.metric("prepos_requests_abandoned_total", reason="deadline") > abandoned)
        again, want = session.ask("", max_tokens=12), twin.ask("", max_tokens=12)
        assert want.path == "exact" and again.token_ids == want.token_ids


def test_a_timed_out_call_that_carried_end_closes_the_session_on_both_sides(server):
    """Triton ends the sequence at its END request even when the request is stopped at its deadline: the client
    marks the session closed, and the id opens afresh at once (its START waits for the server to stop the
    request)."""
    abandoned = server.metric("prepos_requests_abandoned_total", reason="deadline")
    with Client(server.grpc_url) as client:
        session = client.session("timed-out-end")
        session.append(SYSTEM, role="system")
        with pytest.raises(PreposTimeout, match="carried END, so the session is closed"):
            session.ask("Tell me a very long story.", max_tokens=400, timeout_s=0.3, end=True)
        assert session.closed
        with pytest.raises(PreposError, match="is closed"):
            session.ask("Say hello.", max_tokens=8)
        assert session.close() is None
        with client.session("timed-out-end") as reopened, client.session() as fresh:
            # a new session: the storyteller's system turn is not in its log
            assert reopened.ask("Say hello.", max_tokens=8).token_ids == fresh.ask("Say hello.", max_tokens=8).token_ids
        eventually(lambda: server.metric("prepos_requests_abandoned_total", reason="deadline") > abandoned)


def test_a_client_that_does_not_read_holds_up_no_other_session(server):
    """The engine loop hands responses to Triton's queue and never waits for a client to read them."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    channel = grpc.insecure_channel(server.grpc_url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = service_pb2.ModelInferRequest(model_name="prepos", id="slow")
    request.parameters["sequence_id"].string_param = "slow-reader"
    request.parameters["sequence_start"].bool_param = True
    for name, datatype, value in (("text_input", "BYTES", None), ("max_tokens", "INT32", 60)):
        request.inputs.add(name=name, datatype=datatype, shape=[1])
        if value is None:
            text = "Count from one to sixty.".encode()
            request.raw_input_contents.append(len(text).to_bytes(4, "little") + text)
        else:
            request.raw_input_contents.append(np.array([value], np.int32).tobytes())
    stream = stub.ModelStreamInfer(iter([request]))  # never read while the other session is served
    try:
        with Client(server.grpc_url) as client, client.session() as other:
            other.append(SYSTEM, role="system")
            started = time.perf_counter()
            answers = [other.ask(f"Give me the number {i}.", max_tokens=4, speculate=False) for i in range(3)]
            elapsed = time.perf_counter() - started
        assert all(a.finish_reason in ("stop", "length") for a in answers)
        # the unread stream's request was being served meanwhile (both share the engine loop)
        first = next(stream)
        assert not first.error_message
    finally:
        stream.cancel()
        channel.close()
    assert elapsed < 60
    with Client(server.grpc_url) as client:
        try:
            client.session("slow-reader", resume=True).close()  # ends the sequence (fast server shutdown)
        except PreposError as err:  # the cancel came before the answer ended: no turn, so no session
            assert err.field == "resume"
