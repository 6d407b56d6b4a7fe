"""Start the real Triton Inference Server on the prepos model repository.

Uses the Triton binary, Python backend and backend stub shipped in the
``nvidia-pytriton`` wheel. Prepares a backend directory, starts
``tritonserver``, waits until the models are ready, prints the addresses and
stops the server cleanly on Ctrl-C or SIGTERM.

    python -m prepos.launcher [--model-repository DIR] [--grpc-port 8001] ...
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

log = logging.getLogger("prepos.launcher")

REPO_ROOT = Path(__file__).resolve().parents[2]
PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    model_repositories: tuple[Path, ...] = (REPO_ROOT / "model_repository",)
    """Model repository folders (repeat the flag for more than one)."""
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "127.0.0.1"
    """Address the HTTP and gRPC endpoints bind to."""
    run_dir: Path = REPO_ROOT / ".run"
    """Where the backend directory and the server log go."""
    ready_timeout_s: float = 300.0
    """How long to wait for every model to load."""
    log_verbose: int = 0


def _pytriton_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise SystemExit("nvidia-pytriton is not installed: run `make serve` (it installs everything into .venv)")
    return Path(spec.origin).parent


def prepare_backend_dir(run_dir: Path) -> Path:
    """Lay out ``run_dir/backends/python`` with the Python backend and the stub for this interpreter."""
    triton = _pytriton_dir() / "tritonserver"
    stub = triton / "python_backend_stubs" / PY_VERSION / "triton_python_backend_stub"
    if not stub.is_file():
        raise SystemExit(f"no Triton Python backend stub for Python {PY_VERSION} in {stub.parent.parent}")
    python_dir = run_dir / "backends" / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for source in [*(triton / "backends" / "python").glob("*.*"), stub]:
        target = python_dir / source.name
        # Symlinks keep the stub's $ORIGIN-relative library path pointing into the wheel.
        if target.is_symlink() or target.exists():
            if target.is_symlink() and target.resolve() == source.resolve():
                continue
            target.unlink()
        target.symlink_to(source)
    return run_dir / "backends"


def server_environment() -> dict[str, str]:
    """PATH and LD_LIBRARY_PATH for tritonserver and the backend stub.

    The stub must load this interpreter's libpython (not the system copy, whose
    standard library does not match) and find this virtual environment's
    packages, which it does when the environment's bin/ comes first on PATH.
    """
    env = dict(os.environ)
    libs = [sysconfig.get_config_var("LIBDIR"), str(_pytriton_dir().parent / "nvidia_pytriton.libs")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    paths = [str(REPO_ROOT / "backend"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def server_command(options: ServerOptions, backend_dir: Path) -> list[str]:
    command = [str(_pytriton_dir() / "tritonserver" / "bin" / "tritonserver")]
    command += [f"--model-repository={repo}" for repo in options.model_repositories]
    command += [
        f"--backend-directory={backend_dir}",
        f"--http-port={options.http_port}",
        f"--grpc-port={options.grpc_port}",
        f"--metrics-port={options.metrics_port}",
        f"--http-address={options.host}",
        f"--grpc-address={options.host}",
        "--allow-metrics=true",
        "--exit-on-error=true",
        f"--log-verbose={options.log_verbose}",
    ]
    return command


class TritonServer:
    """A running tritonserver process; a context manager that stops it on exit."""

    def __init__(self, options: ServerOptions, log_file: Path | None = None, env: dict[str, str] | None = None):
        self.options = options
        self.env = env or {}  # extra environment, e.g. PREPOS_* configuration overrides
        self.log_file = log_file or options.run_dir / f"tritonserver-{options.grpc_port}.log"
        self.process: subprocess.Popen | None = None

    @property
    def grpc_url(self) -> str:
        return f"{self.options.host}:{self.options.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.options.host}:{self.options.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.options.host}:{self.options.metrics_port}/metrics"

    def start(self) -> "TritonServer":
        backend_dir = prepare_backend_dir(self.options.run_dir)
        command = server_command(self.options, backend_dir)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting %s (log: %s)", " ".join(command), self.log_file)
        handle = open(self.log_file, "wb")
        self.process = subprocess.Popen(
            command, env={**server_environment(), **self.env}, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO_ROOT
        )
        handle.close()
        return self

    def wait_ready(self) -> None:
        """Block until the server reports ready; raise RuntimeError (with the log tail) if it exits or times out."""
        deadline = time.monotonic() + self.options.ready_timeout_s
        last_report = time.monotonic()
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() - last_report > 10:
                last_report = time.monotonic()
                log.info("waiting for models to load ... (%s)", self.log_tail(1).strip())
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"tritonserver not ready after {self.options.ready_timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then wait (Triton drains in-flight requests), then SIGKILL if it hangs."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("tritonserver did not stop in %.0f s; killing it", timeout_s)
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServerOptions()
    parser.add_argument("--model-repository", action="append", type=Path, dest="model_repositories",
                        help=f"model repository (repeatable; default {defaults.model_repositories[0]})")
    for field in dataclasses.fields(ServerOptions):
        if field.name == "model_repositories":
            continue
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=type(getattr(defaults, field.name)), default=getattr(defaults, field.name),
                            help=f"{(field.metadata or {}).get('help', '')}(default: %(default)s)")


def options_from_args(args: argparse.Namespace) -> ServerOptions:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerOptions) if f.name != "model_repositories"}
    if args.model_repositories:
        values["model_repositories"] = tuple(p.resolve() for p in args.model_repositories)
    return ServerOptions(**values)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the server the way Ctrl-C does


def serve(options: ServerOptions) -> int:
    """Start the server, print its addresses, and run until Ctrl-C/SIGTERM."""
    server = TritonServer(options)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with server:
            print(f"prepos is ready\n  gRPC     {server.grpc_url}\n  HTTP     {server.http_url}\n"
                  f"  metrics  {server.metrics_url}\n  log      {server.log_file}\nPress Ctrl-C to stop.", flush=True)
            while server.process.poll() is None:
                time.sleep(0.5)
            print(f"tritonserver exited with {server.process.returncode}:\n{server.log_tail()}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print("stopping prepos ...", flush=True)
        return 0
    except RuntimeError as err:
        print(f"prepos failed to start: {err}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="prepos serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return serve(options_from_args(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
