"""TLS settings of the client: what is refused before anything connects."""

from __future__ import annotations

import pytest
from prepos_client import Client, Tls
from prepos_client.channel import tls_of


def test_tls_names_a_file_it_cannot_read(tmp_path):
    with pytest.raises(ValueError, match=r"tls.root_certificates: no readable file at '.*missing.pem'"):
        Tls(root_certificates=str(tmp_path / "missing.pem"))
    key = tmp_path / "client.key"
    key.write_text("key")
    with pytest.raises(ValueError, match="private_key and certificate_chain go together"):
        Tls(private_key=str(key))


@pytest.mark.parametrize(("given", "expected"), [(False, None), (None, None), (True, Tls()),
                                                  (Tls(), Tls())])
def test_tls_of_takes_a_switch_or_settings(given, expected):
    assert tls_of(given) == expected


def test_a_client_refuses_tls_settings_of_another_type():
    with pytest.raises(TypeError, match="tls: expected a bool or a Tls"):
        Client("127.0.0.1:1", tls="yes")
