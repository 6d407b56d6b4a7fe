"""Bad input against the real server: every input of the protocol, malformed every way a raw gRPC client can.

Each bad request must be answered with an error naming the field; afterwards the
server still serves, and sessions opened before the barrage (one never touched,
one that received every bad request) answer exactly as the same conversation
does on a fresh session: their logs are intact. A second server started with an
access token serves only calls that carry it.
"""

from __future__ import annotations

import queue
import re
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from prepos.access_token import ACCESS_TOKEN_HEADER, GRPC_ACCESS_TOKEN_HEADER
from prepos.launcher import ServerOptions, TritonServer
from prepos_client import Client, PreposError
from prepos_loadtest.repository import free_loopback_ports

from .conftest import ENGINE_DIR, start_server

pytestmark = pytest.mark.integration

SYSTEM = "You are a concise assistant."
QUESTION = "Name a colour."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("triton"))
    yield srv
    srv.stop()


def _b(*values):
    return np.array([v if isinstance(v, bytes) else v.encode() for v in values], dtype=np.object_)


def _i32(*values):
    return np.array(values, dtype=np.int32)


def _f32(*values):
    return np.array(values, dtype=np.float32)


def send(url, session_id, inputs, *, start=False, end=False, headers=None):
    """One request on its own stream: (output ids of all responses, error text or None)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(lambda result, error: results.put((result, error)), headers=headers)
    tensors = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    ids, error = [], None
    try:
        try:
            client.async_stream_infer("prepos", tensors, sequence_id=session_id, sequence_start=start,
                                      sequence_end=end)
        except InferenceServerException:
            pass  # the stream was refused at once; the callback got the reason
        while True:
            result, err = results.get(timeout=120)
            if err is not None:
                error = str(err)
                break
            ids += [int(i) for i in result.as_numpy("output_ids")]
            if result.as_numpy("finish_reason")[0]:
                break
    finally:
        client.stop_stream()
        client.close()
    return ids, error


def ask(url, session_id, text, max_tokens=3, **kw):
    ids, error = send(url, session_id, dict(text_input=_b(text), max_tokens=_i32(max_tokens),
                                            speculate=np.array([False])), **kw)
    assert error is None, error
    return ids


def open_raw(url, session_id):
    _, error = send(url, session_id, dict(text_input=_b(SYSTEM), role=_b("system"), max_tokens=_i32(0)), start=True)
    assert error is None, error


# (field the error must name, inputs); all sent to an open session without START/END
BAD_INPUTS = [
    # wrong type (Triton checks the datatype against config.pbtxt, or the decoder does)
    ("text_input", dict(text_input=_i32(5))),
    ("input_ids", dict(input_ids=_f32(1.0, 2.0))),
    ("input_ids", dict(input_ids=np.array([1, 2], np.int64))),
    ("role", dict(text_input=_b("hi"), role=_i32(1))),
    ("max_tokens", dict(text_input=_b("hi"), max_tokens=_f32(2.0))),
    ("choices", dict(text_input=_b("hi"), choices=_i32(1, 2))),
    ("temperature", dict(text_input=_b("hi"), temperature=_i32(1))),
    ("top_p", dict(text_input=_b("hi"), top_p=np.array([0.5], np.float64))),
    ("top_k", dict(text_input=_b("hi"), top_k=_f32(3.0))),
    ("seed", dict(text_input=_b("hi"), seed=_f32(1.0))),
    ("stop", dict(text_input=_b("hi"), stop=_i32(1))),
    ("speculate", dict(text_input=_b("hi"), speculate=_i32(1))),
    ("gate_threshold", dict(text_input=_b("hi"), gate_threshold=_b("0.5"))),
    ("bogus", dict(text_input=_b("hi"), bogus=_i32(1))),
    # wrong shape
    ("text_input", dict(text_input=_b("a", "b"))),
    ("max_tokens", dict(text_input=_b("hi"), max_tokens=_i32(1, 2))),
    ("role", dict(text_input=_b("hi"), role=np.array([[b"user"]], dtype=np.object_))),
    ("input_ids", dict(input_ids=np.ones((2, 2), np.int32))),
    ("temperature", dict(text_input=_b("hi"), temperature=_f32())),
    # out of range
    ("max_tokens", dict(text_input=_b("hi"), max_tokens=_i32(-1))),
    ("max_tokens", dict(text_input=_b("hi"), max_tokens=_i32(10**6))),
    ("temperature", dict(text_input=_b("hi"), temperature=_f32(np.nan))),
    ("temperature", dict(text_input=_b("hi"), temperature=_f32(-1.0))),
    ("top_p", dict(text_input=_b("hi"), top_p=_f32(0.0))),
    ("top_p", dict(text_input=_b("hi"), top_p=_f32(1.5))),
    ("top_k", dict(text_input=_b("hi"), top_k=_i32(-3))),
    ("gate_threshold", dict(text_input=_b("hi"), gate_threshold=_f32(np.inf))),
    ("input_ids", dict(input_ids=_i32(1, -5))),
    ("input_ids", dict(input_ids=_i32(10**6))),  # past the vocabulary
    ("choices", dict(text_input=_b("hi"), choices=_b("yes", ""))),
    ("choices", dict(text_input=_b("hi"), choices=_b("yes", "yes"))),
    ("choices", dict(text_input=_b("hi"), choices=_b("yes"), max_tokens=_i32(0))),
    ("stop", dict(text_input=_b("hi"), stop=_b(""))),
    ("resume", dict(text_input=_b("hi"), resume=np.array([True]))),  # resume without START
    # oversize
    ("text_input", dict(text_input=_b("x" * ((1 << 20) + 1)))),
    ("text_input", dict(text_input=_b("hello " * 9000))),  # fits the bytes limit, not the context
    ("input_ids", dict(input_ids=np.ones((1 << 18) + 1, np.int32))),
    ("role", dict(text_input=_b("hi"), role=_b("r" * 65))),
    ("choices", dict(text_input=_b("hi"), choices=_b(*[f"c{i}" for i in range(257)]))),
    ("choices", dict(text_input=_b("hi"), choices=_b("c" * 257))),
    ("stop", dict(text_input=_b("hi"), stop=_b(*[f"s{i}" for i in range(17)]))),
    ("stop", dict(text_input=_b("hi"), stop=_b("s" * 257))),
    # invalid UTF-8
    ("text_input", dict(text_input=_b(b"caf\xc3("))),
    ("role", dict(text_input=_b("hi"), role=_b(b"\xffuser"))),
    ("choices", dict(text_input=_b("hi"), choices=_b(b"yes", b"n\xe2\x82"))),
    ("stop", dict(text_input=_b("hi"), stop=_b(b"\x80"))),
    # unknown role
    ("role", dict(text_input=_b("hi"), role=_b("wizard"))),
    ("role", dict(text_input=_b("hi"), role=_b(""))),  # not the default: an absent role is `user`
]


def names_field(error: str | None, field: str) -> bool:
    return error is not None and re.search(rf"(?<![\w-]){re.escape(field)}(?![\w-])", error) is not None


def test_every_bad_input_names_its_field_and_changes_nothing(server):
    url = server.grpc_url
    with Client(url) as client, client.session("victim") as victim:
        victim.append(SYSTEM, role="system")
        victim_first = victim.ask(QUESTION, max_tokens=3, speculate=False).token_ids
        open_raw(url, "target")
        target_first = ask(url, "target", QUESTION)

        failures = []
        for field, inputs in BAD_INPUTS:
            _, error = send(url, "target", inputs)
            if not names_field(error, field):
                failures.append((field, sorted(inputs), error and error[:300]))
        assert failures == []

        # lifecycle errors
        _, error = send(url, "target", dict(text_input=_b("again")), start=True)  # duplicate START
        assert names_field(error, "START") and "already open" in error, error
        assert error.endswith(" [ALREADY_EXISTS]"), error  # the status a stream cannot carry, at the end
        _, error = send(url, "never-started", dict(text_input=_b("hi")))
        assert names_field(error, "START"), error
        _, error = send(url, "never-started-end", dict(max_tokens=_i32(0)), end=True)  # END of an unknown session
        assert names_field(error, "START"), error
        open_raw(url, "ended")
        _, error = send(url, "ended", dict(max_tokens=_i32(0)), end=True)
        assert error is None, error
        _, error = send(url, "ended", dict(text_input=_b("still there?")))  # request after END
        assert names_field(error, "START"), error
        _, error = send(url, "", dict(text_input=_b("hi")), start=True)  # no session id
        assert error is not None

        assert server.process.poll() is None  # still running
        # both sessions answer from their untouched logs, exactly as a fresh session with the same conversation
        victim_next = victim.ask("And another?", max_tokens=4, speculate=False).token_ids
        target_next = ask(url, "target", "And another?", max_tokens=4)
        open_raw(url, "twin")
        assert tuple(ask(url, "twin", QUESTION)) == tuple(target_first) == tuple(victim_first)
        twin_next = ask(url, "twin", "And another?", max_tokens=4)
        assert tuple(target_next) == tuple(twin_next) == tuple(victim_next)
        for session_id in ("target", "twin"):
            assert send(url, session_id, dict(max_tokens=_i32(0)), end=True)[1] is None


def test_an_error_never_ends_another_stream_or_session(server):
    """A session whose request fails in the middle of a burst of bad ones on other sessions keeps serving."""
    url = server.grpc_url
    open_raw(url, "steady")
    first = ask(url, "steady", QUESTION)
    for i in range(5):
        assert send(url, f"ghost-{i}", dict(text_input=_b(b"\xff")), start=True)[1] is not None
        # Triton holds a sequence slot from its START whatever the model answered; END releases it
        assert names_field(send(url, f"ghost-{i}", dict(max_tokens=_i32(0)), end=True)[1], "START")
    open_raw(url, "steady-twin")
    assert ask(url, "steady-twin", QUESTION) == first
    assert ask(url, "steady", "Again?", max_tokens=2) == ask(url, "steady-twin", "Again?", max_tokens=2)
    for session_id in ("steady", "steady-twin"):
        assert send(url, session_id, dict(max_tokens=_i32(0)), end=True)[1] is None


def test_a_session_ended_by_another_client_is_closed_for_its_owner_with_a_clear_error(server):
    with Client(server.grpc_url) as client:
        owner = client.session("shared-id")
        owner.append(SYSTEM, role="system")
        client.session("shared-id", resume=True).close()  # another client continues it and sends END
        with pytest.raises(PreposError, match="session shared-id is no longer open on the server") as gone:
            owner.ask(QUESTION, max_tokens=2)
        assert gone.value.code == "NOT_FOUND" and "[NOT_FOUND]" not in str(gone.value)  # the reopening's refusal
        assert owner.closed
        with pytest.raises(PreposError, match="session shared-id is closed"):
            owner.ask(QUESTION, max_tokens=2)  # refused before anything is sent


TOKEN = "integration-token-0123456789abcdef"


def http_status(url, path, headers=None, data=None) -> int:
    request = urllib.request.Request(url + path, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_access_token_gates_inference_and_repository_control(tmp_path):
    http, grpc, metrics = free_loopback_ports(3)
    run_dir = tmp_path
    token_file = run_dir / "token"
    token_file.write_text(TOKEN + "\n")
    options = ServerOptions(http_port=http, grpc_port=grpc, metrics_port=metrics, run_dir=run_dir,
                            ready_timeout_s=240, access_token_file=str(token_file))
    with TritonServer(options, env={"PREPOS_ENGINE_DIR": str(ENGINE_DIR)}) as srv:
        url = srv.grpc_url
        for headers in (None, {GRPC_ACCESS_TOKEN_HEADER: "wrong-token-0123456789abcdef"}):
            _, error = send(url, "locked", dict(text_input=_b(SYSTEM), max_tokens=_i32(0)), start=True,
                            headers=headers)
            assert error is not None and "restricted" in error, error
        with Client(url) as anonymous:
            assert anonymous.is_ready()  # health stays open (probes), inference does not
            with pytest.raises(PreposError):
                anonymous.session("nope").ask("hi", max_tokens=1)
        with Client(url, token=TOKEN) as client, client.session("open") as session:
            assert len(session.ask(QUESTION, max_tokens=2).token_ids) >= 1
        # HTTP: repository control needs the header (without Triton's gRPC prefix); health stays open
        assert http_status(srv.http_url, "/v2/repository/index", data=b"{}") == 403
        assert http_status(srv.http_url, "/v2/repository/index", {ACCESS_TOKEN_HEADER: "wrong"}, b"{}") == 403
        assert http_status(srv.http_url, "/v2/repository/index", {ACCESS_TOKEN_HEADER: TOKEN}, b"{}") == 200
        assert http_status(srv.http_url, "/v2/health/ready") == 200
        assert TOKEN not in srv.log_file.read_text()
