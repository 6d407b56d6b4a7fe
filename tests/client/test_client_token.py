"""The access token: the Client sends it as a gRPC header on streams and health calls; the CLI takes it from env."""

from __future__ import annotations

from prepos_client import Client, cli
from prepos_client.client import ACCESS_TOKEN_HEADER, GRPC_ACCESS_TOKEN_HEADER
from prepos_client.session import SESSION_HEADER

TOKEN = "s3cr3t-token-0123456789abcdef"


def test_the_token_travels_as_a_header(fake_triton):
    client = Client("127.0.0.1:9", token=TOKEN, headers={"x-tenant": "a"})
    client.session("s").ask("hi")
    assert fake_triton[0].stream_headers == [{"x-tenant": "a", GRPC_ACCESS_TOKEN_HEADER: TOKEN, SESSION_HEADER: "s"}]


def test_no_token_no_header(fake_triton):
    Client("127.0.0.1:9").session("s").ask("hi")
    assert GRPC_ACCESS_TOKEN_HEADER not in fake_triton[0].stream_headers[0]


def test_cli_reads_the_token_from_the_environment_or_the_flag(monkeypatch):
    monkeypatch.setenv(cli.TOKEN_ENV, TOKEN)
    args = cli.build_parser().parse_args(["ask", "hi"])
    assert cli.connect(args).headers[GRPC_ACCESS_TOKEN_HEADER] == TOKEN
    args = cli.build_parser().parse_args(["ask", "hi", "--token", "other-token-0123456789"])
    assert cli.connect(args).headers[GRPC_ACCESS_TOKEN_HEADER] == "other-token-0123456789"
    monkeypatch.delenv(cli.TOKEN_ENV)
    assert GRPC_ACCESS_TOKEN_HEADER not in cli.connect(cli.build_parser().parse_args(["ask", "hi"])).headers


def test_the_header_name_matches_the_servers():
    from prepos import access_token

    assert (ACCESS_TOKEN_HEADER, GRPC_ACCESS_TOKEN_HEADER) == (access_token.ACCESS_TOKEN_HEADER,
                                                               access_token.GRPC_ACCESS_TOKEN_HEADER)
    assert GRPC_ACCESS_TOKEN_HEADER == "triton-grpc-protocol-prepos-access-token"  # what Triton 2.51 checks
