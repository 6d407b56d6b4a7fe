"""Servers for measurements: model repositories of prepos variants side by side, the server of one, its engine
folder and output folder checked, free loopback ports, a trial's server, and the tables written at the end."""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import socket
from pathlib import Path
from typing import Mapping

from prepos.launcher import REPO_ROOT, ServerOptions, TritonServer

FLOOR = "floor"


def variant_repository(run_dir: Path, folder: str, variants: Mapping[str, Mapping[str, str]]) -> Path:
    """Write ``run_dir/folder``: one model per variant (prepos's own ``model.py`` and ``config.pbtxt`` with the
    variant's parameters set, as model name -> {key: value}) plus the ``floor`` no-op model; returns its path.
    The parameters go last, as whole ``parameters`` fields: of a key set twice, Triton takes the later entry (the
    launcher warns), so a variant's value replaces the shipped one."""
    repo = run_dir / folder
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir(parents=True)
    source = (REPO_ROOT / "model_repository" / "prepos" / "config.pbtxt").read_text()
    for name, params in variants.items():
        (repo / name).mkdir()
        (repo / name / "1").symlink_to(REPO_ROOT / "model_repository" / "prepos" / "1")
        config = re.sub(r'^name: "prepos"', f'name: "{name}"', source, flags=re.M)
        extra = "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params.items())
        (repo / name / "config.pbtxt").write_text(config.rstrip("\n") + "\n" + extra)
    (repo / FLOOR).symlink_to(REPO_ROOT / "loadtest" / "floor_repository" / FLOOR)
    return repo


def variant_server(run_dir: Path, folder: str, variants: Mapping[str, Mapping[str, str]], grpc_port: int,
                   engine_dir: Path) -> TritonServer:
    """A server, not started yet, of the repository ``variant_repository`` writes: gRPC on ``grpc_port``, HTTP
    and metrics on the two ports after it, every model on the engine in ``engine_dir``."""
    repo = variant_repository(run_dir, folder, variants)
    options = ServerOptions(model_repositories=(repo,), grpc_port=grpc_port, http_port=grpc_port + 1,
                            metrics_port=grpc_port + 2, run_dir=run_dir)
    return TritonServer(options, env={"PREPOS_ENGINE_DIR": str(engine_dir.resolve())})


def trial_server(run_dir: Path, engine_dir: Path, journal_dir: Path | None = None,
                 exit_timeout_s: int = 10) -> TritonServer:
    """A server, not started yet, of the project's own repository on free loopback ports, on the engine in
    ``engine_dir``, with session journals in ``journal_dir`` (None: none, whatever the environment says; a trial
    starts from nothing)."""
    http, grpc, metrics = free_loopback_ports(3)
    options = ServerOptions(http_port=http, grpc_port=grpc, metrics_port=metrics, run_dir=run_dir,
                            exit_timeout_s=exit_timeout_s)
    return TritonServer(options, env={"PREPOS_ENGINE_DIR": str(engine_dir),
                                      "PREPOS_JOURNAL_DIR": str(journal_dir) if journal_dir else ""})


def machine() -> str:
    """The machine, as the benchmark tables name where they were measured."""
    return f"{platform.machine()}, {os.cpu_count()} cores"


def write_table(table_file: Path, table: str) -> None:
    """Write a benchmark's Markdown table to ``table_file`` (its folder made if need be) and print it, then where
    it went."""
    table_file.parent.mkdir(parents=True, exist_ok=True)
    table_file.write_text(table + "\n")
    print(table)
    print(f"\nwritten: {table_file}")


def check_engine_dir(parser: argparse.ArgumentParser, engine_dir: Path) -> None:
    """Exit through ``parser.error`` naming ``--engine-dir`` when ``engine_dir`` holds no prepos engine."""
    if not (engine_dir / "prepos_engine.json").is_file():
        parser.error(f"--engine-dir: no engine in {engine_dir} (make engine builds the default)")


def check_grpc_port(parser: argparse.ArgumentParser, grpc_port: int) -> None:
    """Exit through ``parser.error`` naming ``--grpc-port`` when the server :func:`variant_server` starts cannot take
    it and the two ports after it (HTTP, metrics) on loopback: out of range, or held by another process (the
    launcher's own message named its flags, which a benchmark does not have)."""
    from prepos.ports import taken_endpoints

    if not 1 <= grpc_port <= 65533:
        parser.error(f"--grpc-port: the server takes it and the next two ports; expected 1-65533, got {grpc_port}")
    taken = taken_endpoints(ServerOptions(grpc_port=grpc_port, http_port=grpc_port + 1, metrics_port=grpc_port + 2))
    if taken:
        held = ", ".join(f"{endpoint.port} ({endpoint.name})" for endpoint in taken)
        parser.error(f"--grpc-port {grpc_port}: the server takes it and the next two ports, and {held} "
                     f"{'are' if len(taken) > 1 else 'is'} in use by another process; give another --grpc-port")


def check_out_dir(parser: argparse.ArgumentParser, out: Path) -> None:
    """Exit through ``parser.error`` naming ``--out`` when ``out`` cannot be used as a folder: it exists and is
    not one, or it cannot be made or written in (under a file, in /proc, no permission). Nothing is changed."""
    from prepos.launch_checks import unusable_folder

    problem = unusable_folder(out)
    if problem:
        parser.error(f"--out: {problem}")


def free_loopback_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 at the time of the call."""
    sockets, ports = [], []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports
