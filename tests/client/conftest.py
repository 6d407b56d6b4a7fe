"""Fixtures for the client tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The client package and these tests' helpers, importable without installing.
for directory in (Path(__file__).resolve().parents[2] / "client", Path(__file__).resolve().parent):
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))

import tritonclient.grpc as grpcclient  # noqa: E402
from client_fakes import FakeTriton, echo_responder  # noqa: E402


class FakeClients(list):
    """The fake gRPC clients created so far, in order; `responder` answers for those created next."""

    responder = staticmethod(echo_responder)


@pytest.fixture
def fake_triton(monkeypatch) -> FakeClients:
    """Replace tritonclient's gRPC client with `FakeTriton`."""
    created = FakeClients()

    def factory(url, *args, **kwargs):
        fake = FakeTriton(url, responder=created.responder)
        created.append(fake)
        return fake

    monkeypatch.setattr(grpcclient, "InferenceServerClient", factory)
    return created
