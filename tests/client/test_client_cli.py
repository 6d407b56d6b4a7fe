"""The `prepos` command line: arguments, subcommand registry, exit codes, chat loop."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from client_fakes import NO_JOURNAL, SessionRules, echo_responder, make_result
from prepos_client import cli
from tritonclient.utils import InferenceServerException


@pytest.fixture
def stdin(monkeypatch):
    def feed(text: str) -> None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(text))

    return feed


def parse(argv: list[str]):
    return cli.build_parser().parse_args(argv)


def test_ask_flags_become_generation_keywords():
    args = parse(
        ["ask", "is it?", "--max-tokens", "3", "--choices", "yes,no", "--temperature", "0.5", "--top-p", "0.9",
         "--top-k", "4", "--seed", "7", "--stop", "\n", "--stop", "END", "--no-speculate", "--gate-threshold", "0.8"]
    )
    assert args.text == "is it?"
    assert cli.generation_options(args) == {
        "max_tokens": 3,
        "choices": ["yes", "no"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 4,
        "seed": 7,
        "stop": ["\n", "END"],
        "speculate": False,
        "gate_threshold": 0.8,
    }


def test_unset_generation_flags_are_not_passed():
    assert cli.generation_options(parse(["ask", "hi"])) == {}


def test_session_flags():
    args = parse(["append", "x", "--session-id", "s9", "--continue", "--role", "tool"])
    assert (args.session_id, args.resume, args.role, args.end) == ("s9", True, "tool", False)
    args = parse(["ask", "x"])
    assert (args.session_id, args.resume, args.keep_open) == (None, False, False)


def test_url_defaults_to_the_environment(monkeypatch):
    monkeypatch.delenv(cli.URL_ENV, raising=False)
    assert parse(["ask", "x"]).url == "127.0.0.1:8001"
    monkeypatch.setenv(cli.URL_ENV, "prepos.internal:9001")
    assert parse(["ask", "x"]).url == "prepos.internal:9001"
    assert parse(["ask", "x", "--url", "h:1"]).url == "h:1"


@pytest.mark.parametrize(
    "argv",
    [["append", "x"], ["ask"], ["ask", "x", "--max-tokens", "many"], ["ask", "x", "--bogus"], ["bogus"], ["close"],
     ["ask", "x", "--timeout", "0"], ["ask", "x", "--timeout", "-1"], ["ask", "x", "--timeout", "nan"],
     ["ask", "x", "--choices", "a,,b"], ["ask", "x", "--choices", "a,"], ["ask", "x", "--choices", "a, ,b"]],
)
def test_usage_errors_exit_2(argv):
    with pytest.raises(SystemExit) as raised:
        cli.main(argv)
    assert raised.value.code == cli.EXIT_USAGE


def test_a_bad_timeout_is_named_and_infinity_means_no_limit(capsys):
    with pytest.raises(SystemExit):
        cli.main(["ask", "x", "--timeout", "-1"])
    assert "argument --timeout: expected seconds > 0 (inf for no limit), got '-1'" in capsys.readouterr().err
    assert parse(["ask", "x", "--timeout", "inf"]).timeout_s == float("inf")
    # longer limits are none: 9.3e9 s overflowed a queue's wait (a traceback), 1e15 s the server's input
    for value in ("9.3e9", "1e15", "1e300"):
        assert parse(["ask", "x", "--timeout", value]).timeout_s == float("inf")
    assert parse(["ask", "x", "--timeout", "1e9"]).timeout_s == 1e9


def test_no_command_exits_2(capsys):
    assert cli.main([]) == cli.EXIT_USAGE
    assert "COMMAND" in capsys.readouterr().err


def test_version_prints_the_installed_packages_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"prepos {metadata.version('prepos')}\n"


def test_an_unreachable_server_exits_3_with_a_clear_message(capsys):
    code = cli.main(["ask", "hello", "--url", "127.0.0.1:1", "--timeout", "5"])
    assert code == cli.EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert "cannot reach prepos at 127.0.0.1:1: is `make serve` running?" in err


@pytest.mark.parametrize(("message", "tls", "hint"), [
    ("ipv4:127.0.0.1:8001: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: WRONG_VERSION_NUMBER", True,
     "the TLS handshake failed: does the server use TLS?"),
    ("ipv4:127.0.0.1:8001: Tls handshake failed (TSI_PROTOCOL_FAILURE)", False, "the TLS handshake failed"),
    ("ipv4:127.0.0.1:8001: Failed to connect to remote host: Connection refused", True, "is `make serve` running?"),
])
def test_a_failed_tls_handshake_is_told_from_a_server_that_is_down(message, tls, hint):
    """A client with --tls against a server without TLS was asked whether `make serve` was running."""
    from prepos_client import PreposUnavailable

    args = parse(["ask", "hi"] + ["--tls"] * tls)
    assert cli.unreachable_hint(PreposUnavailable(message), args) == hint


@pytest.mark.parametrize(("message", "flags", "hint"), [
    # gRPC's own words (a TLS server on loopback with a self-signed certificate for another name)
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:8001: Custom verification check "
     "failed with error: UNAUTHENTICATED: Hostname Verification Check failed.", ["--tls-ca", "ca.pem"],
     "--tls-server-name"),
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:8001: Tls handshake failed "
     "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: "
     "self signed certificate: OK", ["--tls"], "not trusted: give the certificate that signed it with --tls-ca"),
    ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:8001: Socket closed", [],
     "A server with TLS closes a connection without it too: then add --tls"),
])
def test_a_certificate_or_tls_mismatch_names_the_flag_that_fixes_it(message, flags, hint):
    """A certificate for another name was told as a server that is down (`make serve`), an untrusted one as a
    server without TLS, and a TLS port reached in plain text only as Triton's HTTP or metrics port."""
    from prepos_client import PreposUnavailable

    told = cli.unreachable_hint(PreposUnavailable(message), parse(["ask", "hi", *flags]))
    assert hint in told and "make serve" not in told
    if not flags:
        assert "not its HTTP (8000) or metrics (8002) one?" in told
    else:  # with TLS on, a closed connection is no TLS advice
        closed = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:8001: Socket closed"
        assert "add --tls" not in cli.unreachable_hint(PreposUnavailable(closed), parse(["ask", "hi", *flags]))


def test_wait_for_ready_waits_out_the_time_limit_for_a_server_that_is_down(capsys, caplog):
    assert cli.connect(parse(["ask", "x", "--wait-for-ready"])).wait_for_ready
    assert not cli.connect(parse(["ask", "x"])).wait_for_ready
    began = time.monotonic()
    code = cli.main(["ask", "hello", "--url", "127.0.0.1:1", "--timeout", "1", "--wait-for-ready"])
    assert code == cli.EXIT_UNREACHABLE and 1 <= time.monotonic() - began < 10
    assert "cannot reach prepos at 127.0.0.1:1" in capsys.readouterr().err
    waits = [r for r in caplog.records if "waiting for it to be ready" in r.getMessage()]
    assert len(waits) == 1  # the END on the way out is tried once, not waited for


def test_the_console_entry_point_exits_3_when_unreachable():
    completed = subprocess.run(
        [sys.executable, "-m", "prepos_client", "append", "x", "--session-id", "s", "--url", "127.0.0.1:1",
         "--timeout", "5"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PYTHONPATH": str(cli.__file__).rsplit("/prepos_client/", 1)[0], "PATH": ""},
    )
    assert completed.returncode == cli.EXIT_UNREACHABLE
    assert "cannot reach prepos at 127.0.0.1:1" in completed.stderr


def _plain_listener():
    """A loopback socket that accepts and answers nothing a TLS client can read: a server without TLS."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def answer_plainly():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    threading.Thread(target=answer_plainly, daemon=True).start()
    return listener


@pytest.mark.parametrize("verbosity, shown", [(None, False), ("INFO", True)])
def test_the_prepos_command_quiets_grpcs_own_log_line_unless_told(verbosity, shown):
    """--tls against a server without TLS printed gRPC's ``I...`` handshake line above the command's own message;
    a GRPC_VERBOSITY the user sets is kept (and shows that the line is there to quiet)."""
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="prepos")
    assert script.value == "prepos.console:main"
    env = {key: value for key, value in os.environ.items() if key != "GRPC_VERBOSITY"}
    if verbosity:
        env["GRPC_VERBOSITY"] = verbosity
    with contextlib.closing(_plain_listener()) as listener:
        port = listener.getsockname()[1]
        completed = subprocess.run(
            [sys.executable, "-m", "prepos.console", "ask", "hi", "--url", f"127.0.0.1:{port}", "--tls",
             "--timeout", "10"], capture_output=True, text=True, timeout=60, env=env)
    assert completed.returncode == cli.EXIT_UNREACHABLE
    assert "the TLS handshake failed: does the server use TLS?" in completed.stderr
    grpc_lines = [line for line in completed.stderr.splitlines() if "ssl_transport_security" in line]
    assert bool(grpc_lines) == shown, completed.stderr
    # what the command starts (prepos serve's tritonserver) sees the user's environment, not the quieting
    left = subprocess.run(
        [sys.executable, "-c", "import os, sys\nfrom prepos.console import main\nsys.argv = ['prepos', '--version']\n"
         "try:\n    main()\nexcept SystemExit:\n    print(os.environ.get('GRPC_VERBOSITY'))"],
        capture_output=True, text=True, timeout=60, env=env)
    assert left.stdout.splitlines()[-1] == str(verbosity), left.stderr


def test_a_server_error_exits_1_naming_the_field(fake_triton, capsys):
    def reject(request):
        return [InferenceServerException(msg="max_tokens: must be >= 0, got -1")]

    fake_triton.responder = reject
    code = cli.main(["ask", "hi", "--max-tokens", "-1"])
    assert code == cli.EXIT_SERVER_ERROR
    assert "max_tokens: must be >= 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize("accepted, outcome", [
    (True, "[settled: the server accepted it after all; its turn is in the session's log]"),
    (False, "[settled: the server stopped it; its turn was not accepted]"),
])
def test_a_call_out_of_time_says_what_the_server_did_with_it(fake_triton, capsys, accepted, outcome):
    rules = fake_triton.responder = SessionRules()
    # The server's answer to the held request comes after the client gave up, while the command settles it.
    threading.Timer(0.4, lambda: rules.finish_held(fake_triton[0], accepted=accepted)).start()
    code = cli.main(["ask", "SLOW", "--session-id", "s1", "--keep-open", "--timeout", "0.2"])
    assert code == cli.EXIT_SERVER_ERROR
    error = capsys.readouterr().err
    assert "no complete response to request 1 within 0.2 s" in error and error.rstrip().endswith(outcome)
    assert len(fake_triton[0].requests) == 1  # settling sent nothing


def test_leaving_a_call_out_of_time_takes_one_more_time_limit_not_two(fake_triton, capsys):
    """Against a server that never answers, learning the outcome and the END share one more limit (each took a whole
    one of its own: 3 limits in all)."""
    fake_triton.responder = lambda request: []  # never answered
    started = time.perf_counter()
    code = cli.main(["ask", "hi", "--session-id", "s1", "--timeout", "1"])
    elapsed = time.perf_counter() - started
    assert code == cli.EXIT_SERVER_ERROR
    assert "no complete response to request 1 within 1 s" in capsys.readouterr().err
    assert elapsed < 2.7, elapsed  # 2 limits and slack; 3 before
    assert elapsed >= 1.9, elapsed  # the outcome was waited for, within the second limit


def test_an_answer_cut_short_ends_its_line_before_the_error(fake_triton, capsys):
    def cut_short(request):
        return [make_result(request.request_id, text="The story", ids=[7], final=False),
                InferenceServerException(msg="timeout: the request's deadline passed before it finished")]

    fake_triton.responder = cut_short
    assert cli.main(["ask", "tell me a story"]) == cli.EXIT_SERVER_ERROR
    captured = capsys.readouterr()
    assert captured.out == "The story\n"
    assert captured.err.startswith("prepos: error: timeout: the request's deadline passed")


def test_a_bad_session_id_exits_2(capsys):
    assert cli.main(["ask", "hi", "--session-id", "sé"]) == cli.EXIT_USAGE
    assert "session_id" in capsys.readouterr().err


def test_ask_prints_the_answer_and_closes_with_it(fake_triton, capsys):
    assert cli.main(["ask", "héllo", "--session-id", "s1"]) == cli.EXIT_OK
    assert capsys.readouterr().out == "héllo\n"
    (request,) = fake_triton[0].requests
    assert (request.sequence_id, request.sequence_start, request.sequence_end) == ("s1", True, True)


def test_ask_json_keep_open_continue(fake_triton, capsys):
    code = cli.main(["ask", "q", "--session-id", "s1", "--continue", "--keep-open", "--json", "--choices", "a,b"])
    assert code == cli.EXIT_OK
    answer = json.loads(capsys.readouterr().out)
    assert (answer["text"], answer["path"], answer["token_ids"]) == ("q", "prefix", [7])
    assert answer["session_id"] == "s1"  # a script goes on with it
    (request,) = fake_triton[0].requests
    # continuing a session: START with resume (the server continues it, or reopens it from its journal)
    assert (request.sequence_start, request.sequence_end) == (True, False)
    assert request.inputs["resume"].tolist() == [True]
    assert request.inputs["choices"].tolist() == [b"a", b"b"]


def test_a_session_left_open_under_a_made_up_id_is_named(fake_triton, capsys):
    assert cli.main(["ask", "q", "--keep-open"]) == cli.EXIT_OK
    (request,) = fake_triton[0].requests
    assert f"[session {request.sequence_id} is left open: go on with --session-id {request.sequence_id} --continue]" \
        in capsys.readouterr().err
    assert cli.main(["ask", "q", "--keep-open", "--session-id", "s1"]) == cli.EXIT_OK
    assert "is left open" not in capsys.readouterr().err  # the caller knows it


@pytest.mark.parametrize("argv", [["ask", "q", "--continue"], ["chat", "--continue"]])
def test_continue_without_a_session_id_is_a_usage_error_sent_nowhere(fake_triton, capsys, stdin, argv):
    stdin("")
    assert cli.main(argv) == cli.EXIT_USAGE
    assert "--continue needs --session-id" in capsys.readouterr().err
    assert not [request for fake in fake_triton for request in fake.requests]
    assert sum(fake.num_ready_checks for fake in fake_triton) == 0


class ClosedPipe:
    """A stdout whose reader went away (`| head`)."""

    def __init__(self, devnull):
        self._devnull = devnull

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self):
        return self._devnull.fileno()


def test_an_answer_piped_into_a_reader_that_goes_away_stops_quietly(fake_triton, capsys, monkeypatch):
    with open(os.devnull, "w") as devnull:
        monkeypatch.setattr(sys, "stdout", ClosedPipe(devnull))
        assert cli.main(["ask", "tell me a story", "--session-id", "s1"]) == cli.EXIT_BROKEN_PIPE
    assert capsys.readouterr().err == ""  # no traceback
    assert fake_triton[0].requests[-1].sequence_end  # the session was closed with the question


@pytest.mark.parametrize("keep_open", [False, True])
def test_a_reader_that_goes_away_mid_answer_cancels_it_rather_than_wait_for_its_end(fake_triton, capsys,
                                                                                    monkeypatch, keep_open):
    """`prepos ask ... | head`: the closing END waited, the whole --timeout, for the answer no one read any more."""
    def endless(request):  # one chunk of an answer that runs on
        if "text_input" in request.inputs:
            return [make_result(request.request_id, text="Once", ids=[1], path="prefix", final=False)]
        return echo_responder(request)

    fake_triton.responder = endless
    started = time.monotonic()
    with open(os.devnull, "w") as devnull:
        monkeypatch.setattr(sys, "stdout", ClosedPipe(devnull))
        argv = ["ask", "tell me a long story", "--session-id", "s1", "--timeout", "30"]
        assert cli.main(argv + ["--keep-open"] * keep_open) == cli.EXIT_BROKEN_PIPE
    assert time.monotonic() - started < 10  # not the 30 s time limit
    assert fake_triton[0].stop_calls == [True]  # cancelled
    assert len(fake_triton[0].requests) == 1  # the question carried END (or --keep-open): nothing more sent


def test_an_answer_written_to_a_full_disk_is_an_error_message_not_a_traceback(fake_triton, capsys, monkeypatch):
    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")

        def fileno(self):
            return devnull.fileno()

    with open(os.devnull, "w") as devnull:
        monkeypatch.setattr(sys, "stdout", FullDisk())
        assert cli.main(["ask", "tell me a story", "--session-id", "s1"]) == cli.EXIT_SERVER_ERROR
    err = capsys.readouterr().err
    assert err == "prepos: cannot write the output: No space left on device\n"
    assert fake_triton[0].requests[-1].sequence_end  # the session was closed with the question


def test_append_keeps_the_session_open_unless_end(fake_triton):
    assert cli.main(["append", "ctx", "--session-id", "s1", "--role", "tool"]) == cli.EXIT_OK
    assert cli.main(["append", "more", "--session-id", "s1", "--continue", "--end"]) == cli.EXIT_OK
    first, second = fake_triton[0].requests[0], fake_triton[1].requests[0]
    assert (first.sequence_start, first.sequence_end) == (True, False)
    assert first.inputs["role"].tolist() == [b"tool"]
    assert (second.sequence_start, second.sequence_end) == (True, True)  # START + resume: continue, then END
    assert second.inputs["resume"].tolist() == [True]
    assert len(fake_triton[0].requests) == 1


def test_close_command_sends_end_to_an_existing_session(fake_triton, capsys):
    assert cli.main(["close", "--session-id", "s1", "--json"]) == cli.EXIT_OK
    (request,) = fake_triton[0].requests
    assert (request.sequence_start, request.sequence_end) == (True, True)
    assert request.inputs["resume"].tolist() == [True]
    closed = json.loads(capsys.readouterr().out)
    assert closed["finish_reason"] == "closed" and closed["session_id"] == "s1"


def test_a_close_that_ran_out_of_time_says_the_session_may_still_be_open(fake_triton, capsys):
    fake_triton.responder = lambda request: []  # no answer within the time limit
    assert cli.main(["close", "--session-id", "s1", "--timeout", "0.2"]) == cli.EXIT_SERVER_ERROR
    err = capsys.readouterr().err
    assert "session s1: the close was not answered within the time limit; the session may still be open: run " \
        "close again" in err
    assert "turn" not in err  # a close has none


def test_chat_continuing_a_session_the_server_has_no_journal_of_says_so_once_and_stops(fake_triton, stdin, capsys):
    fake_triton.responder = lambda request: [InferenceServerException(msg=NO_JOURNAL + " [NOT_FOUND]")]
    stdin("hello\nagain\n")
    assert cli.main(["chat", "--session-id", "s", "--continue"]) == cli.EXIT_SERVER_ERROR
    err = capsys.readouterr().err
    assert err.count("no journal to reopen it from") == 1 and "Traceback" not in err
    requests = [request for fake in fake_triton for request in fake.requests]
    texts = [r.inputs["text_input"][0] for r in requests if "text_input" in r.inputs]
    assert texts == [b"hello"]  # no later line is sent to a session that cannot go on
    assert requests[-1].sequence_end  # the sequence its START began is ended


def test_closing_a_session_that_is_not_open_says_there_is_nothing_to_close(fake_triton, capsys):
    fake_triton.responder = lambda request: [InferenceServerException(msg=NO_JOURNAL)]
    assert cli.main(["close", "--session-id", "s"]) == cli.EXIT_SERVER_ERROR
    err = capsys.readouterr().err
    assert "session s is not open on the server" in err and "nothing to close" in err
    assert "send START" not in err  # the server's advice is for opening a session


def test_chat_loop(fake_triton, stdin, capsys):
    stdin("hello\n/role tool\n/append result=3\n\nnext\n/nope\n/quit\nnever sent\n")
    # the unknown command is a refused line: not sent, and a piped chat exits 1 at its end (it exited 0, so a
    # script could not tell that a mistyped /append's text was never sent)
    assert cli.main(["chat", "--system", "be brief", "--session-id", "c1", "--max-tokens", "5"]) == \
        cli.EXIT_SERVER_ERROR
    requests = fake_triton[-1].requests
    sent = [
        (
            request.inputs["text_input"][0].decode() if "text_input" in request.inputs else None,
            request.inputs["role"][0].decode() if "role" in request.inputs else None,
            int(request.inputs["max_tokens"][0]),
        )
        for request in requests
    ]
    assert sent == [
        ("be brief", "system", 0),
        ("hello", None, 5),
        ("result=3", "tool", 0),
        ("next", None, 5),
        (None, None, 0),
    ]
    assert requests[0].sequence_start and requests[-1].sequence_end
    captured = capsys.readouterr()
    assert captured.out == "hello\nnext\n"
    assert "[path=prefix confidence=0.50 ttft=" in captured.err
    assert "server_first_token=-]" in captured.err
    assert "[path=append total=" in captured.err
    assert "error: line 6: unknown command '/nope'; /help for commands; not sent" in captured.err


def refusing(name: str, value: bytes, message: str):
    """A responder that refuses requests whose input ``name`` is ``value`` with ``message`` and echoes the others."""
    def responder(request):
        if name in request.inputs and request.inputs[name][0] == value:
            return [InferenceServerException(msg=message)]
        return echo_responder(request)

    return responder


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("interactive", [False, True])
def test_chat_reports_a_server_error_and_goes_on(fake_triton, capsys, monkeypatch, interactive):
    fake_triton.responder = refusing("text_input", b"bad", "text_input: too long")
    monkeypatch.setattr(sys, "stdin", (Terminal if interactive else io.StringIO)("bad\ngood\n"))
    # lines from a pipe or file: the refused one shows in the exit status too, once every line was sent
    assert cli.main(["chat"]) == (cli.EXIT_OK if interactive else cli.EXIT_SERVER_ERROR)
    captured = capsys.readouterr()
    assert "error: text_input: too long" in captured.err
    assert captured.out.endswith("good\n")
    assert fake_triton[-1].requests[-1].sequence_end


def test_chat_drops_a_role_the_server_refused(fake_triton, stdin, capsys):
    fake_triton.responder = refusing("role", b"wizard", "role: unknown role 'wizard'; expected one of system, user, tool")
    stdin("/role wizard\nhi\nagain\n")
    assert cli.main(["chat"]) == cli.EXIT_SERVER_ERROR
    captured = capsys.readouterr()
    assert captured.err.count("unknown role 'wizard'") == 1 and "/role wizard dropped" in captured.err
    assert captured.out.endswith("again\n")


def test_chat_drops_a_role_whose_line_was_refused_for_any_reason(fake_triton, stdin, capsys):
    """The role went on to the next line, written for the default role, without a word."""
    fake_triton.responder = refusing("text_input", b"too long", "text_input: too long")
    stdin("/role tool\ntoo long\nWhat is 2+2?\n")
    assert cli.main(["chat"]) == cli.EXIT_SERVER_ERROR
    assert "/role tool dropped" in capsys.readouterr().err
    last = fake_triton[-1].requests[-2]  # before the closing END
    assert last.inputs["text_input"][0] == b"What is 2+2?" and "role" not in last.inputs


def test_chat_says_what_became_of_a_question_that_ran_out_of_time_and_goes_on(fake_triton, stdin, capsys):
    rules = fake_triton.responder = SessionRules()
    threading.Timer(0.4, lambda: rules.finish_held(fake_triton[-1], accepted=False)).start()
    stdin("SLOW\ngood\n")
    assert cli.main(["chat", "--timeout", "0.2"]) == cli.EXIT_SERVER_ERROR
    captured = capsys.readouterr()
    assert "no complete response to request 1 within 0.2 s" in captured.err
    assert "[settled: the server stopped it; its turn was not accepted]" in captured.err
    assert "not known" not in captured.err and "settle()" not in captured.err  # it said both, and a Python call
    assert captured.out.endswith("good\n") and rules.accepted[0] == "good"


@pytest.mark.parametrize("typed", ["", "hi\n"])
def test_chat_says_at_once_that_the_server_cannot_be_reached(stdin, capsys, typed):
    # Sessions open at their first request; an empty stdin used to leave with status 0 and not a word.
    stdin(typed)
    assert cli.main(["chat", "--url", "127.0.0.1:1", "--timeout", "5"]) == cli.EXIT_UNREACHABLE
    assert "cannot reach prepos at 127.0.0.1:1" in capsys.readouterr().err


def test_chat_with_wait_for_ready_does_not_check_the_server_before_its_first_request(fake_triton, stdin):
    stdin("")
    assert cli.main(["chat", "--wait-for-ready"]) == cli.EXIT_OK
    assert sum(fake.num_ready_checks for fake in fake_triton) == 0
    stdin("")
    assert cli.main(["chat"]) == cli.EXIT_OK
    assert sum(fake.num_ready_checks for fake in fake_triton) == 1


@pytest.mark.parametrize("at_a_terminal", [True, False])
def test_chat_closes_the_session_on_ctrl_c(fake_triton, monkeypatch, capsys, at_a_terminal):
    """At a terminal Ctrl-C is how a chat ends (exit 0); fed from a pipe, an interrupt is one (exit 130)."""
    class Interrupting(io.StringIO):
        def readline(self, *args):
            raise KeyboardInterrupt

        def isatty(self):
            return at_a_terminal

    monkeypatch.setattr(sys, "stdin", Interrupting())
    assert cli.main(["chat", "--system", "s"]) == (cli.EXIT_OK if at_a_terminal else cli.EXIT_INTERRUPTED)
    assert fake_triton[-1].requests[-1].sequence_end


def test_chat_interrupted_mid_answer_cancels_it_and_closes_the_session_at_once(fake_triton, monkeypatch, stdin):
    """Ctrl-C during an answer: the chat's closing END went out behind it and waited for it to run to its end."""
    class Interrupting(io.StringIO):
        def write(self, text):
            if "Once" in text:
                raise KeyboardInterrupt
            return len(text)

    def endless(request):  # one chunk of an answer that runs on
        if "text_input" in request.inputs and "max_tokens" not in request.inputs:
            return [make_result(request.request_id, text="Once", ids=[1], path="prefix", final=False)]
        return echo_responder(request)

    fake_triton.responder = endless
    stdin("tell me a long story\n")
    monkeypatch.setattr(sys, "stdout", Interrupting())
    started = time.monotonic()
    assert cli.main(["chat", "--system", "s", "--timeout", "30"]) == cli.EXIT_INTERRUPTED
    assert time.monotonic() - started < 10  # not the 30 s time limit
    requests = fake_triton[-1].requests
    assert fake_triton[-1].stop_calls[:1] == [True]  # the answer cancelled
    assert (requests[-1].sequence_start, requests[-1].sequence_end) == (False, True)  # then END ...
    assert len(fake_triton[-1].stream_headers) == 2  # ... on a stream of its own, not behind the answer


def test_piped_chat_refuses_a_line_that_is_not_utf8_and_goes_on(fake_triton, monkeypatch, capsys):
    # stdin strict, as Python opens it under a UTF-8 locale such as en_US.UTF-8 (C.UTF-8 or POSIX: surrogateescape)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Say hi\n\xff\xfe bad bytes\nSay bye\n"),
                                                       encoding="utf-8", errors="strict"))
    assert cli.main(["chat"]) == cli.EXIT_SERVER_ERROR
    out, err = capsys.readouterr()
    assert out.split() == ["Say", "hi", "Say", "bye"]  # the echo of each line sent
    assert "error: line 2: not UTF-8 text (byte 0xff at character 0); not sent" in err


def test_chat_continue_with_a_system_message_is_a_usage_error(fake_triton, stdin, capsys):
    stdin("hello\n")
    assert cli.main(["chat", "--session-id", "s", "--continue", "--system", "again"]) == cli.EXIT_USAGE
    assert "--system: a session chat continues (--continue) has its system message already" in capsys.readouterr().err
    assert not any(fake.requests for fake in fake_triton)


def test_chat_with_stdin_closed_reads_no_line(fake_triton, monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)
    assert cli.main(["chat"]) == cli.EXIT_OK
    assert not any(fake.requests for fake in fake_triton)  # nothing was opened: nothing to close


@pytest.mark.parametrize("argv", [["ask", "hi"], ["ask", "hi", "--json"], ["append", "x", "--session-id", "s"]])
def test_a_command_with_stdout_closed_says_so_and_fails(fake_triton, monkeypatch, capsys, argv):
    monkeypatch.setattr(sys, "stdout", None)
    assert cli.main(argv) == cli.EXIT_SERVER_ERROR
    assert "cannot write the output: stdout is closed" in capsys.readouterr().err
    assert not any(fake.requests for fake in fake_triton)


@pytest.mark.parametrize(("argv", "env", "problem"), [
    (["ask", "hi", "--url", ""], {}, "empty"),
    (["ask", "hi"], {"PREPOS_URL": ""}, "empty"),
    (["ask", "hi", "--url", "127.0.0.1:84237"], {}, "port 84237 of '127.0.0.1:84237' is not in 1-65535"),
    (["ask", "hi"], {"PREPOS_URL": "127.0.0.1:84237"}, "port 84237 of '127.0.0.1:84237' is not in 1-65535 "
                                                       "(from PREPOS_URL)"),
    (["ask", "hi"], {"PREPOS_URL": "bad:port"},
     "port 'port' of 'bad:port' is neither a number nor a service name (from PREPOS_URL)"),
    (["ask", "hi", "--url", "grpc://127.0.0.1:8001"], {},
     "'grpc://127.0.0.1:8001' is a URL; expected a gRPC address, host:port (the server's gRPC port, 127.0.0.1:8001 "
     "say)"),
    (["ask", "hi", "--url", "http://127.0.0.1:8001"], {}, "'http://127.0.0.1:8001' is a URL; expected a gRPC address"),
    (["ask", "hi", "--url", "http://127.0.0.1:8000/v2"], {},  # the hint named the HTTP port it was given
     "'http://127.0.0.1:8000/v2' is a URL; expected a gRPC address, host:port (the server's gRPC port, "
     "127.0.0.1:8001 by default, not its HTTP port)"),
])
def test_an_address_that_is_none_is_a_usage_error(fake_triton, monkeypatch, capsys, argv, env, problem):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"argument --url: {problem}" in err and "Traceback" not in err
    assert ("PREPOS_URL" in err) == bool(env)  # the address's source named only where it was the variable


@pytest.mark.parametrize("argv", [["ask", "bad \udcff"], ["ask", "hi", "--choices", "yes,n\udcfe"],
                                  ["append", "\udcff", "--session-id", "s"]])
def test_text_that_is_not_utf8_is_a_usage_error_naming_its_input(fake_triton, capsys, argv):
    assert cli.main(argv) == cli.EXIT_USAGE
    assert "not valid UTF-8 text" in capsys.readouterr().err
    assert not any(fake.requests for fake in fake_triton)


def test_an_unknown_argument_is_named_with_the_subcommands_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["ask", "hi", "extra"])
    assert exit_.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("usage: prepos ask") and "unrecognized arguments: extra" in err


def test_keep_open_says_the_session_is_left_open_only_once_it_opened(fake_triton, capsys):
    assert cli.main(["ask", "hi", "--keep-open"]) == cli.EXIT_OK
    assert "is left open: go on with --session-id" in capsys.readouterr().err
    fake_triton.responder = lambda request: [InferenceServerException(msg="max_tokens: must be >= 0, got -1")]
    assert cli.main(["ask", "hi", "--keep-open", "--max-tokens", "-1"]) == cli.EXIT_SERVER_ERROR
    err = capsys.readouterr().err
    assert "was not opened on the server: nothing to go on with" in err and "left open" not in err


def test_registered_commands_join_the_parser(monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", dict(cli.COMMANDS))
    seen = {}

    def add_arguments(parser):
        parser.add_argument("--port", type=int, default=8001)

    def run(args):
        seen["port"] = args.port
        return 4

    cli.register_command("probe", help="a test command", add_arguments=add_arguments, run=run)
    assert cli.main(["probe", "--port", "9"]) == 4
    assert seen == {"port": 9}


def test_module_commands_get_their_arguments_unparsed(monkeypatch, tmp_path):
    (tmp_path / "prepos_probe_module.py").write_text(
        "received = []\n"
        "def main(argv):\n"
        "    received.append(list(argv))\n"
        "    return 5\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "COMMANDS", dict(cli.COMMANDS))
    cli.register_module_command("probe", "prepos_probe_module", help="a test command")
    assert "prepos_probe_module" not in sys.modules
    assert cli.main(["probe", "--grpc-port", "9", "-h", "x"]) == 5
    assert sys.modules["prepos_probe_module"].received == [["--grpc-port", "9", "-h", "x"]]
    monkeypatch.delitem(sys.modules, "prepos_probe_module")


def test_a_module_command_that_is_not_installed_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(cli, "COMMANDS", dict(cli.COMMANDS))
    cli.register_module_command("probe", "no_such_prepos_module", help="a test command")
    assert cli.main(["probe"]) == cli.EXIT_USAGE
    assert "prepos probe is unavailable here" in capsys.readouterr().err


def test_serve_and_build_are_registered():
    assert cli.COMMANDS["serve"].forwards_argv and cli.COMMANDS["build"].forwards_argv


def test_an_opening_refused_says_which_flag_would_do(fake_triton, capsys):
    """The server's advice names START and resume, which a shell user does not send."""
    fake_triton.responder = lambda request: [InferenceServerException(
        msg="START: session 's' is already open [ALREADY_EXISTS]")]
    assert cli.main(["ask", "hi", "--session-id", "s"]) == cli.EXIT_SERVER_ERROR
    assert "(to go on with that session, add --continue)" in capsys.readouterr().err
    fake_triton.responder = lambda request: [InferenceServerException(msg=NO_JOURNAL + " [NOT_FOUND]")]
    assert cli.main(["ask", "hi", "--session-id", "s", "--continue"]) == cli.EXIT_SERVER_ERROR
    assert "(without --continue, a new session opens under that id)" in capsys.readouterr().err


def test_an_address_without_a_port_is_said_to_have_been_dialled_on_443():
    from prepos_client import PreposUnavailable

    error = PreposUnavailable("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:443: "
                              "Failed to connect to remote host: Connection refused")
    assert "--url names no port, so gRPC tried 443" in cli.unreachable_hint(error, parse(["ask", "x", "--url",
                                                                                          "127.0.0.1"]))
    assert cli.unreachable_hint(error, parse(["ask", "x", "--url", "127.0.0.1:443"])) == "is `make serve` running?"
    other = PreposUnavailable("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:4430: "
                              "Failed to connect to remote host: Connection refused")
    assert cli.unreachable_hint(other, parse(["ask", "x", "--url", "127.0.0.1:4430"])) == "is `make serve` running?"


def test_spaces_around_choices_are_dropped():
    # "yes, no" sent " no", a token of its own that was all but never chosen
    assert parse(["ask", "x", "--choices", "yes, no ,maybe so"]).choices == ["yes", "no", "maybe so"]


def test_chat_says_which_flag_would_do_and_sends_a_line_with_a_leading_space_as_text(fake_triton, stdin, capsys):
    stdin(" /etc/hosts is a file\n")
    assert cli.main(["chat", "--max-tokens", "3"]) == cli.EXIT_OK
    assert fake_triton[-1].requests[0].inputs["text_input"][0] == b" /etc/hosts is a file"
    fake_triton.responder = lambda request: [InferenceServerException(
        msg="START: session 's' is already open [ALREADY_EXISTS]")]
    stdin("hi\n")
    assert cli.main(["chat", "--session-id", "s"]) == cli.EXIT_SERVER_ERROR
    assert "(to go on with that session, add --continue)" in capsys.readouterr().err


def test_an_http_port_given_as_the_grpc_address_is_said_to_be_one():
    from prepos_client import PreposUnavailable

    error = PreposUnavailable("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:8000: "
                              "Failed parsing HTTP/2 (Expected SETTINGS frame as the first frame, got frame type 72)")
    hint = cli.unreachable_hint(error, parse(["ask", "x", "--url", "127.0.0.1:8000"]))
    assert "does not speak gRPC" in hint and "8001" in hint
    # Triton's own HTTP and metrics ports close a gRPC connection at once
    closed = PreposUnavailable("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:8000: "
                               "Socket closed")
    assert "not its HTTP (8000) or metrics (8002) one?" in cli.unreachable_hint(closed, parse(["ask", "x"]))
