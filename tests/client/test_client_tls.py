"""TLS settings of the client: what is refused before anything connects."""

from __future__ import annotations

import pytest
from prepos_client import Client, Tls
from prepos_client.channel import tls_of


def test_tls_names_a_file_it_cannot_read(tmp_path):
    with pytest.raises(ValueError, match=r"tls.root_certificates: no readable file at '.*missing.pem'"):
        Tls(root_certificates=str(tmp_path / "missing.pem"))
    key = tmp_path / "client.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\nMII=\n-----END PRIVATE KEY-----\n")
    with pytest.raises(ValueError, match="private_key and certificate_chain go together"):
        Tls(private_key=str(key))


@pytest.mark.parametrize(("field", "text"), [
    ("root_certificates", "not a certificate at all\n"),
    ("root_certificates", "-----BEGIN PRIVATE KEY-----\nMII=\n-----END PRIVATE KEY-----\n"),  # a key, not roots
    ("private_key", "-----BEGIN CERTIFICATE-----\nMII=\n-----END CERTIFICATE-----\n"),
    ("certificate_chain", "-----BEGIN CERTIFICATE REQUEST-----\nMII=\n-----END CERTIFICATE REQUEST-----\n"),
    ("private_key", "-----BEGIN OPENSSH PRIVATE KEY-----\nb3Bl\n-----END OPENSSH PRIVATE KEY-----\n"),
    ("private_key", "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMII=\n-----END ENCRYPTED PRIVATE KEY-----\n"),
])
def test_tls_names_a_file_that_holds_no_pem_of_its_kind(tmp_path, field, text):
    # gRPC itself would only fail to connect ("cannot reach prepos"), blaming the server.
    path = tmp_path / "file.pem"
    path.write_text(text)
    other = tmp_path / "other.pem"
    other.write_text("-----BEGIN CERTIFICATE-----\nMII=\n-----END CERTIFICATE-----\n"
                     "-----BEGIN EC PRIVATE KEY-----\nMII=\n-----END EC PRIVATE KEY-----\n")
    given = {field: str(path)}
    if field == "private_key":
        given["certificate_chain"] = str(other)
    with pytest.raises(ValueError, match=f"tls.{field}: .* holds no PEM"):
        Tls(**given)
    assert Tls(root_certificates=str(other), private_key=str(other), certificate_chain=str(other))  # both kinds


@pytest.mark.parametrize("name", ["", "  "])
def test_tls_refuses_an_empty_server_name(name):
    with pytest.raises(ValueError, match="tls.server_name: empty"):
        Tls(server_name=name)


@pytest.mark.parametrize(("url", "problem"), [("", "empty"), ("   ", "empty"), ("127.0.0.1:84237", "not in 1-65535"),
                                              ("host:0", "not in 1-65535"), ("[::1]:65536", "not in 1-65535")])
def test_a_client_refuses_an_address_gRPC_would_not_or_would_wrongly_connect_to(url, problem):
    with pytest.raises(ValueError, match=f"url: .*{problem}"):
        Client(url)


@pytest.mark.parametrize("url", ["127.0.0.1:8001", "[::1]:65535", "prepos.example.com:1", "unix:/tmp/prepos.sock"])
def test_a_client_takes_an_address_with_a_port_in_range_or_none(url):
    assert Client(url).url == url


@pytest.mark.parametrize(("given", "expected"), [(False, None), (None, None), (True, Tls()),
                                                  (Tls(), Tls())])
def test_tls_of_takes_a_switch_or_settings(given, expected):
    assert tls_of(given) == expected


def test_a_client_refuses_tls_settings_of_another_type():
    with pytest.raises(TypeError, match="tls: expected a bool or a Tls"):
        Client("127.0.0.1:1", tls="yes")
