"""gRPC over TLS: the launcher serves it (--tls-cert-file, --tls-key-file); the client, the CLI and the Locust user
speak it (tls=, --tls, --tls-ca), as they must to reach the Helm chart's router with router.tls.enabled."""

from __future__ import annotations

import datetime
import ipaddress
import json
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from prepos_client import Client, PreposUnavailable, Tls

from .conftest import start_server


def _certificate(subject: str, key, issuer: x509.Name | None = None, issuer_key=None, *, ca: bool):
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A CA of this test's own and a server certificate it signed for 127.0.0.1 and localhost."""
    folder = tmp_path_factory.mktemp("tls")
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("prepos test CA", ca_key, ca=True)
    server = _certificate("127.0.0.1", server_key, ca.subject, ca_key, ca=False)
    files = {"ca": folder / "ca.pem", "cert": folder / "server.pem", "key": folder / "server.key"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    return files


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, tls_files):
    server = start_server(tmp_path_factory.mktemp("tls-server"), tls_cert_file=str(tls_files["cert"]),
                          tls_key_file=str(tls_files["key"]))
    yield server
    server.stop()


def test_a_client_given_the_servers_roots_talks_over_tls(tls_server, tls_files):
    with Client(tls_server.grpc_url, tls=Tls(root_certificates=str(tls_files["ca"])), timeout_s=60) as client:
        assert client.is_ready()
        with client.session() as session:
            session.append("You answer in one word.", role="system")
            assert session.ask("Is water wet?", choices=["yes", "no"]).text in ("yes", "no")


@pytest.mark.parametrize("tls", [False, True], ids=["plain text", "system roots"])
def test_a_client_that_cannot_check_the_certificate_does_not_get_through(tls_server, tls):
    with Client(tls_server.grpc_url, tls=tls, timeout_s=3) as client:
        assert not client.is_ready()
        with pytest.raises(PreposUnavailable):
            client.session().ask("Hello", max_tokens=1)


def test_the_cli_talks_over_tls_with_tls_ca(tls_server, tls_files):
    ask = [sys.executable, "-m", "prepos_client", "ask", "--url", tls_server.grpc_url, "--max-tokens", "2", "Hi"]
    done = subprocess.run([*ask[:4], "--tls-ca", str(tls_files["ca"]), *ask[4:]], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    plain = subprocess.run([*ask[:4], "--timeout", "3", *ask[4:]], capture_output=True, text=True, timeout=120)
    assert plain.returncode != 0 and "cannot reach prepos" in plain.stderr


def test_the_name_checked_can_differ_from_the_address(tls_server, tls_files):
    """Through a port-forward the address is localhost's, the certificate the router's: --tls-server-name."""
    roots = str(tls_files["ca"])
    with Client(tls_server.grpc_url, tls=Tls(root_certificates=roots, server_name="localhost")) as client:
        assert client.is_ready()
    with Client(tls_server.grpc_url, tls=Tls(root_certificates=roots, server_name="prepos.example.com"),
                timeout_s=3) as client:
        assert not client.is_ready()


def test_the_locust_users_talk_over_tls_with_tls_ca(tls_server, tls_files, tmp_path):
    loadtest_dir = Path(__file__).resolve().parents[2] / "loadtest"
    command = [sys.executable, "-m", "prepos_loadtest.run", "--host", tls_server.grpc_url, "--workload", "monitor",
               "--users", "1", "--spawn-rate", "1", "--run-time", "4s", "--stop-timeout", "20"]
    done = subprocess.run([*command, "--tls-ca", str(tls_files["ca"]), "--out", str(tmp_path / "tls")],
                          cwd=loadtest_dir, capture_output=True, text=True, timeout=120)
    summary = json.loads((tmp_path / "tls" / "summary.json").read_text())
    assert done.returncode == 0 and summary["num_requests"] > 0 and summary["num_failed"] == 0, done.stdout
    plain = subprocess.run([*command, "--out", str(tmp_path / "plain")], cwd=loadtest_dir, capture_output=True,
                           text=True, timeout=120)
    assert plain.returncode == 1 and json.loads((tmp_path / "plain" / "summary.json").read_text())["passed"] is False
