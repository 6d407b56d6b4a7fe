"""The real tritonclient transport against an in-process gRPC server: what goes on the wire."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from grpc_fake_server import FakePreposServer, request_inputs
from tritonclient.grpc import service_pb2
from prepos_client import Client, PreposError, cli


@pytest.fixture
def server():
    fake = FakePreposServer()
    yield fake
    fake.stop()


def parameters(request) -> dict:
    return {key: getattr(value, value.WhichOneof("parameter_choice")) for key, value in request.parameters.items()}


def test_session_id_header_and_sequence_parameters(server):
    with Client(server.url, headers={"x-tenant": "t1"}) as client, client.session("abc") as session:
        session.append("hi", role="system")
        session.ask("q", max_tokens=3, timeout_s=2.5)
    (metadata,) = server.servicer.stream_metadata
    assert metadata["prepos-session-id"] == "abc"
    assert metadata["x-tenant"] == "t1"
    first, second, end = server.servicer.requests
    assert parameters(first) == {
        "sequence_id": "abc",
        "sequence_start": True,
        "sequence_end": False,
        "triton_enable_empty_final_response": True,
        # the client's default call limit, 60 s, less 50 ms for the way back, as Triton's request timeout in µs
        "timeout": 59_950_000,
    }
    assert parameters(second)["sequence_start"] is False and parameters(second)["timeout"] == 2_450_000
    assert parameters(end)["sequence_end"] is True
    assert len({first.id, second.id, end.id}) == 3
    assert all(request.model_name == "prepos" for request in server.servicer.requests)
    assert sorted(request_inputs(end)) == ["max_tokens"]


def test_integer_session_ids_travel_as_int64(server):
    with Client(server.url).session(2**63 - 1) as session:
        session.ask("q")
    assert parameters(server.servicer.requests[0])["sequence_id"] == 2**63 - 1
    assert server.servicer.stream_metadata[0]["prepos-session-id"] == str(2**63 - 1)


def test_unicode_delta_round_trip(server):
    with Client(server.url).session() as session:
        answer = session.ask("héllo ✓ 🙂")
    assert answer.text == "héllo ✓ 🙂"
    assert (answer.path, answer.finish_reason, answer.token_ids) == ("prefix", "stop", (7,))
    assert answer.first_token_ms == pytest.approx(0.3)


def test_a_flags_only_final_response_ends_the_request(server):
    with Client(server.url, timeout_s=5).session() as session:
        answer = session.ask("EMPTY_FINAL")
        assert session.ask("after").text == "after"
    assert (answer.text, answer.num_chunks, answer.path) == ("a", 2, "exact")


def test_a_character_split_across_responses(server):
    with Client(server.url).session() as session:
        assert [chunk.text for chunk in session.generate("SPLIT")] == ["✓", "✓"]


def test_a_stream_error_names_the_field_and_the_stream_goes_on(server):
    with Client(server.url, timeout_s=5).session() as session:
        session.append("context")
        with pytest.raises(PreposError) as raised:
            session.ask("q", max_tokens=-1)
        # the status a gRPC stream cannot carry, read from the end of the message (as the server writes it)
        assert (raised.value.field, raised.value.code, raised.value.status) == ("max_tokens", "INVALID_ARGUMENT", None)
        assert str(raised.value) == "max_tokens: must be >= 0, got -1"
        assert session.ask("ok").text == "ok"
    assert len(server.servicer.stream_metadata) == 1


def test_an_answer_streamed_from_a_session_no_one_else_holds_is_read_to_its_end(server):
    """The iterator `generate` returns holds its session: without, a session only the iterator referred to was
    collected as `generate` returned, and its finalizer cancelled the stream under the reader."""
    import gc
    chunks = Client(server.url, timeout_s=5).session("held").generate("SLOW", max_tokens=5)
    gc.collect()
    assert "".join(chunk.text for chunk in chunks) == "SLOW"


def test_is_ready(server):
    assert Client(server.url).is_ready()
    assert not Client(server.url, model="nope").is_ready()
    # no limit is no deadline: gRPC took an infinite one as expired, and the server as unreachable
    for timeout_s in (float("inf"), 2e9):
        assert Client(server.url, timeout_s=timeout_s).is_ready()
        Client(server.url).ensure_ready(timeout_s=timeout_s)


def run_script(script: str) -> subprocess.CompletedProcess:
    """Run ``script`` in a Python of its own (what happens at its exit is part of the test), with the client
    package and these tests' helpers importable; at most 60 s."""
    paths = (str(cli.__file__).rsplit("/prepos_client/", 1)[0], str(Path(__file__).resolve().parent))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": ":".join(paths), "PATH": ""})


def test_a_session_left_open_is_closed_at_exit(server):
    script = textwrap.dedent(
        f"""
        from prepos_client import Client
        session = Client({server.url!r}).session("left-open")
        print(session.ask("hi").text)
        """
    )
    completed = run_script(script)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout == "hi\n"
    assert parameters(server.servicer.requests[-1])["sequence_end"] is True


def test_sessions_left_open_do_not_wait_for_a_server_that_is_down_at_exit():
    """At exit each session still open is closed (END), each within 2 s; with wait_for_ready a server that is
    down would have held the exit up that long for every session."""
    script = textwrap.dedent(
        """
        import time
        from grpc_fake_server import FakePreposServer
        from prepos_client import Client
        server = FakePreposServer()
        client = Client(server.url, timeout_s=30, wait_for_ready=True)
        sessions = [client.session() for _ in range(6)]  # the server serves 8 streams at a time
        for session in sessions:
            session.ask("hi")
        server.stop()
        print(time.monotonic(), flush=True)
        """
    )
    completed = run_script(script)
    exited = time.monotonic()
    assert completed.returncode == 0, completed.stderr
    assert exited - float(completed.stdout) < 6, completed.stderr  # six sessions waiting 2 s each: 12 s
    # each close failed, and said so; or (Python 3.12 on, where no new stream can open at exit) was not tried
    assert completed.stderr.count("closing session") + completed.stderr.count("left open at exit") == 6


def test_at_exit_where_no_thread_can_start_a_session_whose_stream_ended_is_left_open_and_said_so(server, caplog,
                                                                                                monkeypatch):
    """From Python 3.12 no thread starts while the interpreter shuts down, and gRPC starts one for a new call: the
    END of a session whose stream had ended (its server went down) left that call half made, and closing its
    channel then waited for it for ever, so that the program never exited. A session whose stream is open still
    sends its END on it."""
    from prepos_client import lifetime

    down = FakePreposServer()
    live, ended = Client(server.url).session("live"), Client(down.url).session("ended")
    assert live.ask("hi").text == ended.ask("hi").text == "hi"
    down.stop()
    deadline = time.monotonic() + 10
    while ended._requests.stream_live and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ended._requests.stream_live
    _no_thread_starts_at_exit(monkeypatch)
    with caplog.at_level("WARNING", logger="prepos_client.lifetime"):
        lifetime._close_sessions_at_exit()
    assert live.closed and parameters(server.servicer.requests[-1])["sequence_end"] is True
    assert ended.closed
    assert "session ended left open at exit: its stream is closed" in caplog.text
    assert "closing session" not in caplog.text  # no END was tried on a new stream


def test_an_older_handle_of_a_session_another_handle_opened_since_sends_no_end_at_exit_or_close(server, caplog):
    """After a server restart the README continues a session through a new handle (resume=True): the old handle,
    still referenced at exit (or closed with its Client), sent its END (with START and resume) on a new stream, and
    ended the session the new handle had left open (detached), deleting its journal and the turns taken through it.
    A handle that never opened the session (unused, or its opening refused) takes nothing over."""
    from prepos_client import PreposError, lifetime

    client = Client(server.url)
    old = client.session("restarted")
    assert old.ask("hi").text == "hi"
    client.session("restarted")  # made, never used
    refused = client.session("restarted", resume=True)
    with pytest.raises(PreposError):
        refused.ask("bad", max_tokens=-1)  # its opening refused
    assert not lifetime.superseded(old)
    newer = client.session("restarted", resume=True)
    assert newer.ask("again").text == "again"
    newer.detach()
    assert lifetime.superseded(old)
    sent = len(server.servicer.requests)
    with caplog.at_level("WARNING", logger="prepos_client.lifetime"):
        lifetime._close_sessions_at_exit()
    assert len(server.servicer.requests) == sent  # no END from the older handle
    assert old.closed and "an older handle of it is left at exit without END" in caplog.text

    again = Client(server.url)
    stale, current = again.session("moved"), again.session("moved", resume=True)
    assert stale.ask("hi").text == current.ask("hi").text == "hi"
    sent = len(server.servicer.requests)
    again.close()  # the current handle's END only
    assert len(server.servicer.requests) == sent + 1 and stale.closed and current.closed
    assert parameters(server.servicer.requests[-1])["sequence_end"] is True

    other = client.session("another")
    assert other.ask("hi").text == "hi"
    lifetime._close_sessions_at_exit()  # the handle that opened its session is closed at exit as before
    assert parameters(server.servicer.requests[-1])["sequence_end"] is True and other.closed


def _no_thread_starts_at_exit(monkeypatch) -> list:
    """Python 3.12's interpreter exit, for the client: no thread starts (``Thread.start`` raises), so neither does
    a gRPC stream; returns the streams the client went on to start anyway."""
    import threading
    import types

    import tritonclient.grpc as grpcclient

    from prepos_client import lifetime

    class Refused(threading.Thread):
        def start(self):
            raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(lifetime, "_threads_start", lambda: False)
    monkeypatch.setattr(lifetime, "threading", types.SimpleNamespace(Thread=Refused))
    monkeypatch.setattr(lifetime, "_no_new_streams", False)  # set by the exit hook; put back after the test
    started = []
    start_stream = grpcclient.InferenceServerClient.start_stream
    monkeypatch.setattr(grpcclient.InferenceServerClient, "start_stream",
                        lambda self, *a, **k: (started.append(1), start_stream(self, *a, **k))[1])
    return started


def test_at_exit_where_no_thread_can_start_a_draining_server_gets_no_end_on_a_new_stream(server, caplog,
                                                                                          monkeypatch):
    """A drain ends a session while its stream stays open: its END at exit is refused as not open and sent again
    with START, which the draining server refuses; the client then opened a new stream to try again, which at a
    Python 3.12 exit hung the program as above."""
    from prepos_client import lifetime

    session = Client(server.url).session("drained")
    assert session.ask("hi").text == "hi"
    respond = server.servicer._respond

    def draining(request):
        if parameters(request)["sequence_start"]:
            return [service_pb2.ModelStreamInferResponse(error_message=(
                "START: the server is draining before it stops: no session opens or resumes here now [UNAVAILABLE]"))]
        if parameters(request)["sequence_end"]:
            return [service_pb2.ModelStreamInferResponse(error_message=(
                "inference request for sequence 1 to model 'prepos' must specify the START flag on the first "
                "inference request of the sequence"))]
        return respond(request)

    monkeypatch.setattr(server.servicer, "_respond", draining)
    started = _no_thread_starts_at_exit(monkeypatch)
    with caplog.at_level("WARNING", logger="prepos_client.lifetime"):
        lifetime._close_sessions_at_exit()
    assert started == [] and session.closed
    assert "closing session drained at exit failed" in caplog.text


def test_at_exit_where_no_thread_can_start_an_end_left_unanswered_does_not_hold_up_the_exit(server, monkeypatch):
    """An END the server does not answer within the exit's 2 s is left to be answered on a thread of its own; where
    none can start, the RuntimeError escaped the exit hook and closing the connection waited for the answer (for
    ever, from a server that never gives it)."""
    from prepos_client import lifetime

    session = Client(server.url).session("slow-end")
    assert session.ask("hi").text == "hi"
    respond = server.servicer._respond
    monkeypatch.setattr(server.servicer, "_respond", lambda request: (
        time.sleep(15) if parameters(request)["sequence_end"] else None, respond(request))[1])
    _no_thread_starts_at_exit(monkeypatch)
    began = time.monotonic()
    lifetime._close_sessions_at_exit()
    assert time.monotonic() - began < 10  # the exit's 2 s, not the server's 15
    assert session.closed


def test_sessions_dropped_without_close_neither_block_nor_deadlock_the_threads_that_collect_them():
    """A session whose call raised and that is then dropped sits in a reference cycle, finalized by the garbage
    collector on any thread: tritonclient's own finalizer joined its stream's thread there, which deadlocked (here
    in a few hundred sessions, in the server's thread or a thread being started). Its stream is closed all the
    same."""
    script = textwrap.dedent(
        """
        import gc, time
        from grpc_fake_server import FakePreposServer
        from prepos_client import Client, PreposError
        server = FakePreposServer()
        client = Client(server.url, timeout_s=5)
        gc.set_threshold(50, 1, 1)  # collections every few allocations, on every thread
        for _ in range(300):
            try:
                client.session().ask("hi", max_tokens=-1)  # refused; the session is dropped
            except PreposError:
                pass
        gc.collect()
        deadline = time.monotonic() + 10
        while server.servicer.num_open_streams and time.monotonic() < deadline:
            time.sleep(0.05)
        print(len(server.servicer.stream_metadata), server.servicer.num_open_streams)
        """
    )
    completed = run_script(script)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["300", "0"]  # every stream was opened and is closed


def test_a_cancelled_stream_leaves_no_thread_behind():
    """tritonclient cancels a stream without ending its request iterator, and gRPC's thread that reads it waited
    forever: one thread per session dropped, or detached with a request in flight."""
    script = textwrap.dedent(
        """
        import gc, threading, time
        from grpc_fake_server import FakePreposServer
        from prepos_client import Client, PreposError
        server = FakePreposServer()
        client = Client(server.url, timeout_s=5)
        with client.session() as session:  # the client's own threads, started once
            session.ask("warm up")
        try:
            client.session().ask("hi", max_tokens=-1)
        except PreposError:
            pass
        gc.collect()
        time.sleep(0.5)

        def client_threads():  # the fake server's own workers (a pool that grows to 8) left out
            return sum(not thread.name.startswith("ThreadPoolExecutor") for thread in threading.enumerate())

        before = client_threads()
        for _ in range(20):
            try:
                client.session().ask("hi", max_tokens=-1)  # refused; the session is dropped: its stream cancelled
            except PreposError:
                pass
        for _ in range(5):
            session = client.session()
            try:
                session.ask("SLOW", timeout_s=0.1)
            except PreposError:  # timed out: its request is still in flight, and detach cancels the stream
                session.detach()
        gc.collect()
        deadline = time.monotonic() + 10
        while (server.servicer.num_open_streams or client_threads() > before) and time.monotonic() < deadline:
            time.sleep(0.05)
        print(server.servicer.num_open_streams, client_threads() - before)
        """
    )
    completed = run_script(script)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["0", "0"]  # every stream closed, no thread left


def test_cli_ask_and_server_error_exit_codes(server, capsys):
    assert cli.main(["ask", "héllo", "--url", server.url]) == cli.EXIT_OK
    assert capsys.readouterr().out == "héllo\n"
    assert cli.main(["ask", "x", "--url", server.url, "--max-tokens", "-1"]) == cli.EXIT_SERVER_ERROR
    assert "max_tokens: must be >= 0, got -1\n" in capsys.readouterr().err
