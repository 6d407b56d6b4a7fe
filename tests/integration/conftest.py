"""Fixtures that start the real Triton server with the real model."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import psutil
import pytest

from prepos.launcher import REPO_ROOT, ServerOptions, TritonServer
from prepos.ports import PortInUseError
from prepos_build.convert import dtype_argument
from prepos_loadtest.repository import free_loopback_ports

ENGINE_DIR = REPO_ROOT / "engines" / "smollm2-135m-instruct"


def start_server(tmp_dir: Path, env: dict[str, str] | None = None, repositories=None,
                 ports: tuple[int, int, int] | None = None, **options) -> TritonServer:
    """The real server on loopback ports (``ports``: HTTP, gRPC, metrics; None: free ones), ready; ``options`` are
    more ServerOptions fields."""
    if not (ENGINE_DIR / "prepos_engine.json").is_file():
        pytest.fail(f"{ENGINE_DIR} is missing: run `make engine` (make test builds it first)")
    for attempt in range(3):
        http, grpc, metrics = ports or free_loopback_ports(3)
        server_options = ServerOptions(
            model_repositories=tuple(repositories or (REPO_ROOT / "model_repository",)),
            http_port=http, grpc_port=grpc, metrics_port=metrics, run_dir=tmp_dir, ready_timeout_s=240, **options,
        )
        server = TritonServer(server_options, env={"PREPOS_ENGINE_DIR": str(ENGINE_DIR), **(env or {})})
        try:
            return server.__enter__()
        except PortInUseError:
            # Free ports are chosen from the ephemeral range, which every client connection draws from too: one
            # may be taken between the choice and the server's bind (seen once). Chosen ports get another choice.
            if ports is not None or attempt == 2:
                raise
    raise AssertionError("unreachable")


def repository_with(tmp_path: Path, field: str, value: int) -> Path:
    """A copy of the model repository's ``prepos`` model (under ``tmp_path``) whose config.pbtxt sets ``field``, a
    number it holds once, to ``value``."""
    repo = tmp_path / "repository"
    shutil.copytree(REPO_ROOT / "model_repository" / "prepos", repo / "prepos")
    config = repo / "prepos" / "config.pbtxt"
    text, count = re.subn(rf"{field}: \d+", f"{field}: {value}", config.read_text())
    assert count == 1
    config.write_text(text)
    return repo


def ports_of(server: TritonServer) -> tuple[int, int, int]:
    """A server's HTTP, gRPC and metrics ports, to start another on the same ones (``start_server(ports=...)``)."""
    return server.options.http_port, server.options.grpc_port, server.options.metrics_port


def kill_hard(server) -> None:
    """SIGKILL the server and its backend stub processes (ours: started by this test)."""
    parent = psutil.Process(server.process.pid)
    children = parent.children(recursive=True)
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait()
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=10)


@pytest.fixture(scope="session")
def engine_manifest() -> dict:
    return json.loads((ENGINE_DIR / "prepos_engine.json").read_text())


@pytest.fixture(scope="session")
def reference_model():
    """Hugging Face's own implementation of the model: the stateless reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ENGINE_DIR, **dtype_argument(torch.float32))
    model.eval()
    return model


@pytest.fixture(scope="session")
def tokenizer():
    from prepos.template import Tokenizer

    return Tokenizer(ENGINE_DIR / "tokenizer.json")
