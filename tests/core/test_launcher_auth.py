"""The launcher's access token: where it comes from, the Triton flags it becomes, and that it is never shown."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from prepos.access_token import ACCESS_TOKEN_ENV, ACCESS_TOKEN_HEADER, RESTRICTED_PROTOCOLS, masked, resolve_access_token
from prepos.launcher import ServerOptions, TritonServer, add_arguments, options_from_args, server_command
from prepos_loadtest.repository import free_loopback_ports

TOKEN = "s3cr3t-token-0123456789abcdef"


def test_no_token_leaves_the_endpoints_open():
    assert resolve_access_token(ServerOptions(), environ={}) is None
    command = server_command(ServerOptions(), Path("/b"), None)
    assert not any("restricted" in arg for arg in command)


def test_token_sources_in_order(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    env = {ACCESS_TOKEN_ENV: "from-the-environment-0123456789"}
    assert resolve_access_token(ServerOptions(), environ=env) == "from-the-environment-0123456789"
    assert resolve_access_token(ServerOptions(access_token_file=str(token_file)), environ=env) == TOKEN
    assert resolve_access_token(ServerOptions(access_token="direct-token-0123456789", access_token_file=str(token_file)),
                                environ=env) == "direct-token-0123456789"


def test_restricted_protocols_on_grpc_and_http():
    command = server_command(ServerOptions(), Path("/b"), TOKEN)
    restriction = f"{','.join(RESTRICTED_PROTOCOLS)}:{ACCESS_TOKEN_HEADER}={TOKEN}"
    assert [a for a in command if "restricted" in a] == [f"--grpc-restricted-protocol={restriction}",
                                                          f"--http-restricted-api={restriction}"]
    assert {"inference", "model-repository"} <= set(RESTRICTED_PROTOCOLS)
    assert "health" not in RESTRICTED_PROTOCOLS  # probes stay open


@pytest.mark.parametrize("options, env, problem", [
    (dict(access_token="short"), {}, "at least 16"),
    (dict(access_token="has space 0123456789abc"), {}, "use only"),
    (dict(access_token="colon:0123456789abcdefgh"), {}, "use only"),
    (dict(access_token_file="/nonexistent/token"), {}, "access token file"),
    (dict(), {ACCESS_TOKEN_ENV: "x" * 8}, ACCESS_TOKEN_ENV),
])
def test_unusable_tokens_are_refused_without_showing_them(options, env, problem):
    with pytest.raises(ValueError, match=problem) as err:
        resolve_access_token(ServerOptions(**options), environ=env)
    token = options.get("access_token") or env.get(ACCESS_TOKEN_ENV)
    if token:
        assert token not in str(err.value)


def test_an_empty_token_variable_leaves_the_endpoints_open_and_says_so(caplog):
    """Set to nothing (a Kubernetes secret that did not arrive, say): no token, as before, but no longer silently.
    Blanks only are a token of 0 characters, refused."""
    with pytest.raises(ValueError, match="0 characters"):
        resolve_access_token(ServerOptions(), environ={ACCESS_TOKEN_ENV: " \n"})
    with caplog.at_level("WARNING", logger="prepos.launcher"):
        assert resolve_access_token(ServerOptions(), environ={ACCESS_TOKEN_ENV: ""}) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"{ACCESS_TOKEN_ENV} is set but empty: no access token, the endpoints are open"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="prepos.launcher"):
        assert resolve_access_token(ServerOptions(), environ={}) is None
    assert caplog.records == []


def test_empty_token_file_is_refused(tmp_path):
    (tmp_path / "token").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        resolve_access_token(ServerOptions(access_token_file=str(tmp_path / "token")), environ={})


def test_the_token_is_a_file_flag_never_a_value_flag(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {flag for action in parser._actions for flag in action.option_strings}
    assert "--access-token-file" in flags and "--access-token" not in flags
    args = parser.parse_args(["--access-token-file", str(tmp_path / "t")])
    assert options_from_args(args).access_token_file == str(tmp_path / "t")
    assert TOKEN not in repr(ServerOptions(access_token=TOKEN))


def test_start_masks_the_token_and_keeps_it_out_of_the_server_environment(tmp_path, monkeypatch, caplog):
    launched = {}

    class FakePopen:
        def __init__(self, command, env, **kwargs):
            launched.update(command=command, env=env, **kwargs)

    monkeypatch.setenv(ACCESS_TOKEN_ENV, TOKEN)
    monkeypatch.setattr("prepos.launcher.prepare_backend_dir", lambda run_dir: run_dir / "backends")
    monkeypatch.setattr("prepos.launcher.subprocess.Popen", FakePopen)
    http, grpc, metrics = free_loopback_ports(3)  # start() refuses ports in use (a `make serve` running, say)
    server = TritonServer(ServerOptions(run_dir=tmp_path, http_port=http, grpc_port=grpc, metrics_port=metrics))
    with caplog.at_level(logging.INFO, logger="prepos.launcher"):
        server.start()
    assert any(TOKEN in arg for arg in launched["command"])  # Triton gets it
    # its own session (Ctrl-C is the launcher's), and stopped should the launcher die (launch_checks.stop_with_parent)
    assert launched["start_new_session"] is True and callable(launched["preexec_fn"])
    assert ACCESS_TOKEN_ENV not in launched["env"]
    assert TOKEN not in caplog.text and "***" in caplog.text
    server.log_file.write_text(f"E0101 echo of {TOKEN}\n")
    assert TOKEN not in server.log_tail()
    assert masked(f"a{TOKEN}b", TOKEN) == "a***b" and masked("text", None) == "text"
