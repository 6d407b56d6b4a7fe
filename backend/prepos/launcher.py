"""Start the real Triton Inference Server on the prepos model repository.

Uses the Triton binary, Python backend and backend stub shipped in the
``nvidia-pytriton`` wheel. Prepares a backend directory, starts
``tritonserver``, waits until the models are ready, prints the addresses and,
on Ctrl-C or SIGTERM, drains the model (every session ended, its journal kept;
see ``prepos.drain``) and stops the server.

    python -m prepos.launcher [--model-repository DIR] [--grpc-port 8001] ...

Ports: the launcher refuses to start Triton when another process already
listens on its HTTP, gRPC or metrics port, naming the port and the flag that
moves it (``--http-port``, ``--grpc-port``, ``--metrics-port``). It reports the
server ready only once its own ``tritonserver`` process listens on all three, so
a health probe answered by another server on the same port never counts.

Access token (``--access-token-file FILE`` or ``PREPOS_ACCESS_TOKEN``): see
``prepos.access_token``. The launcher masks it in everything it logs and keeps
it out of the server's environment.
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
import threading
import time
import urllib.request
from pathlib import Path

from prepos.access_token import (ACCESS_TOKEN_ENV, ACCESS_TOKEN_HEADER, GRPC_ACCESS_TOKEN_HEADER,
                                 RESTRICTED_PROTOCOLS, masked, resolve_access_token, restriction_arguments)
from prepos.launch_checks import (bind_address, check_host, check_repositories, check_tls_pair, journal_environment,
                                  stop_with_parent, usable_dir)
from prepos.ports import ENDPOINT_FIELDS, Endpoint, PortInUseError, endpoints, taken_endpoints
from prepos.shm_regions import backend_config_argument, region_prefix, remove_left_regions
from prepos.supervise import (DRAIN_ENV, LOST_STUB_STOP_S, STOP_GRACE_S, STUB_CHECK_S, StubWatch, bls_threads_argument,
                              continue_if_stopped, describe_exit, describe_lost, drain_file_from,
                              keepalive_ping_arguments, server_stack_limit, stop_server)
from prepos.triton_install import prepare_backend_dir, pytriton_dir

log = logging.getLogger("prepos.launcher")

REPO_ROOT = Path(__file__).resolve().parents[2]



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
    exit_timeout_s: int = 10
    """On stop, how long the drain may take (answers under way finish first; see :mod:`prepos.drain`), and
    Triton's own ``--exit-timeout-secs``: without a drain it waits this long for open sessions."""
    journal_dir: str = dataclasses.field(default="", metadata={
        "help": "session journal directory, over PREPOS_JOURNAL_DIR; off: none (default: PREPOS_JOURNAL_DIR, else "
                "<run-dir>/journal)"})
    """Session journal directory for ``prepos serve`` (``off``: none), which wins over PREPOS_JOURNAL_DIR; empty:
    PREPOS_JOURNAL_DIR where set, else ``<run_dir>/journal``."""
    access_token_file: str = dataclasses.field(default="", metadata={
        "help": "file holding the access token (default: none; then PREPOS_ACCESS_TOKEN, or open endpoints)"})
    """File holding the access token (surrounding whitespace ignored); empty: env PREPOS_ACCESS_TOKEN, and
    no token at all leaves the endpoints open."""
    access_token: str = dataclasses.field(default="", repr=False)
    """The token itself (for embedding the launcher; never a flag). Wins over the file and the environment."""
    tls_cert_file: str = dataclasses.field(default="", metadata={
        "help": "PEM certificate chain: serve gRPC over TLS (with --tls-key-file; HTTP stays plain text)"})
    """The server's certificate chain (PEM): with ``tls_key_file``, gRPC is served over TLS."""
    tls_key_file: str = dataclasses.field(default="", metadata={
        "help": "PEM private key of --tls-cert-file"})
    """The private key (PEM) of ``tls_cert_file``."""

    def __post_init__(self) -> None:
        """Raise ValueError naming the flag of a value tritonserver would refuse or misread."""
        ports = {field: getattr(self, field) for _, field in ENDPOINT_FIELDS}
        for field, port in ports.items():
            if not 1 <= port <= 65535:
                raise ValueError(f"--{field.replace('_', '-')}: expected a port in 1-65535, got {port}")
        if len(set(ports.values())) < len(ports):
            raise ValueError("--http-port, --grpc-port and --metrics-port must differ, got "
                             + ", ".join(str(port) for port in ports.values()))
        if not self.ready_timeout_s > 0:
            raise ValueError(f"--ready-timeout-s: expected seconds > 0, got {self.ready_timeout_s}")
        if self.exit_timeout_s < 0 or self.log_verbose < 0:
            raise ValueError(f"--exit-timeout-s and --log-verbose must be >= 0, got {self.exit_timeout_s} "
                             f"and {self.log_verbose}")
        if not self.host:
            raise ValueError("--host: expected an address to bind, e.g. 127.0.0.1")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("--tls-cert-file and --tls-key-file go together, got "
                             f"{self.tls_cert_file or 'none'} and {self.tls_key_file or 'none'}")
        for flag, path in (("--tls-cert-file", self.tls_cert_file), ("--tls-key-file", self.tls_key_file)):
            if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
                raise ValueError(f"{flag}: no readable file at {path}")
        if self.tls_cert_file:
            check_tls_pair(self.tls_cert_file, self.tls_key_file)
        check_host(self.host)


def server_environment() -> dict[str, str]:
    """PATH and LD_LIBRARY_PATH for tritonserver and the backend stub.

    The stub must load this interpreter's libpython (not the system copy, whose
    standard library does not match) and find this virtual environment's
    packages, which it does when the environment's bin/ comes first on PATH.
    """
    env = dict(os.environ)
    libs = [sysconfig.get_config_var("LIBDIR"), str(pytriton_dir().parent / "nvidia_pytriton.libs")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    paths = [str(REPO_ROOT / "backend"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def server_command(options: ServerOptions, backend_dir: Path, access_token: str | None = None,
                   address: str | None = None) -> list[str]:
    """tritonserver's command line; ``address``: ``options.host`` as :func:`bind_address` resolves it, where the
    caller has it already (a name is looked up otherwise)."""
    address = address or bind_address(options.host)
    command = [str(pytriton_dir() / "tritonserver" / "bin" / "tritonserver")]
    command += [f"--model-repository={repo}" for repo in options.model_repositories]
    command += [
        f"--backend-directory={backend_dir}",
        f"--http-port={options.http_port}",
        f"--grpc-port={options.grpc_port}",
        f"--metrics-port={options.metrics_port}",
        f"--http-address={address}",
        f"--grpc-address={address}",
        "--allow-metrics=true",
        "--exit-on-error=true",
        f"--log-verbose={options.log_verbose}",
        f"--exit-timeout-secs={options.exit_timeout_s}",
        backend_config_argument(region_prefix(options.grpc_port)),
        bls_threads_argument(),
        *keepalive_ping_arguments(),
    ]
    if access_token:
        command += restriction_arguments(access_token)
    if options.tls_cert_file:
        command += ["--grpc-use-ssl=true", f"--grpc-server-cert={Path(options.tls_cert_file).resolve()}",
                    f"--grpc-server-key={Path(options.tls_key_file).resolve()}"]
    return command


class TritonServer:
    """A running tritonserver process; a context manager that stops it on exit."""

    def __init__(self, options: ServerOptions, log_file: Path | None = None, env: dict[str, str] | None = None):
        self.options = options
        self.env = dict(env or {})  # extra environment, e.g. PREPOS_* configuration overrides
        self.log_file = log_file or options.run_dir / f"tritonserver-{options.grpc_port}.log"
        self.process: subprocess.Popen | None = None
        self._stubs: list = []  # its backend stubs once ready, reaped by stop() even if the server died first
        self._ready = False
        # The drain (prepos.drain) the model runs when this file appears; stop() writes it. Kept if given, here or
        # in this process's environment (empty there, as in `PREPOS_SCHEDULER_DRAIN_FILE= make serve`: no drain).
        if DRAIN_ENV in os.environ:
            self.env.setdefault(DRAIN_ENV, os.environ[DRAIN_ENV])
        self.env.setdefault(DRAIN_ENV, str(Path(options.run_dir).resolve() / f"drain-{options.grpc_port}"))
        self.drain_file = drain_file_from(self.env)
        self.access_token = resolve_access_token(options)
        for repository in options.model_repositories:
            if not Path(repository).is_dir():
                raise ValueError(f"--model-repository: {repository} is not a folder")
        check_repositories(options.model_repositories, {**os.environ, **self.env})
        usable_dir(options.run_dir, "--run-dir")
        self.address = bind_address(options.host)  # the address tritonserver binds

    @property
    def grpc_url(self) -> str:
        return f"{self.options.host}:{self.options.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.options.host}:{self.options.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.options.host}:{self.options.metrics_port}/metrics"

    def metric(self, name: str, **labels: str) -> float:
        """A metric's current value on the metrics port, summed over the samples whose labels include ``labels``.

        Requests record metrics in memory; the engine loop publishes them when it goes idle and at least every
        half second, so a value read right after a response may not count that response yet.
        """
        from prepos.metrics import metric_sum

        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            return metric_sum(response.read().decode(), name, **labels)

    def start(self) -> "TritonServer":
        """Start tritonserver. Raises PortInUseError, starting nothing, when another process holds one of its
        ports: the readiness probe would then talk to that process."""
        taken = taken_endpoints(self.options)
        if taken:
            raise PortInUseError(self.options.host, taken)
        # The port is free: a server that named its regions after it is gone (killed, as it left them).
        remove_left_regions(region_prefix(self.options.grpc_port), "an earlier server on this port")
        backend_dir = prepare_backend_dir(self.options.run_dir)
        command = server_command(self.options, backend_dir, self.access_token, self.address)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting %s (log: %s)", masked(" ".join(command), self.access_token), self.log_file)
        if self.access_token:
            log.info("access token required on %s (gRPC header %s, HTTP header %s)", ", ".join(RESTRICTED_PROTOCOLS),
                     GRPC_ACCESS_TOKEN_HEADER, ACCESS_TOKEN_HEADER)
        env = {**server_environment(), **self.env}
        env.pop(ACCESS_TOKEN_ENV, None)  # the server has it in its arguments; its backends need not see it
        handle = open(self.log_file, "wb")
        # Its own session: a terminal's Ctrl-C goes to this process alone, which drains the model before it stops
        # tritonserver (one that got SIGINT itself would begin its exit before the drain, and refuse every request
        # its clients send from then on).
        with server_stack_limit():
            self.process = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                            start_new_session=True, preexec_fn=stop_with_parent())
        handle.close()
        return self

    def wait_ready(self) -> None:
        """Block until this server reports ready: its own process listens on every endpoint's port and the
        health and metrics endpoints answer. Raise RuntimeError (with the log tail) if it exits or times out;
        PortInUseError when it exited and another process holds one of its ports."""
        deadline = time.monotonic() + self.options.ready_timeout_s
        last_report = time.monotonic()
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                failures = self.load_failures()
                exited = f"tritonserver {describe_exit(self.process.returncode)}; its log ends:\n{self.log_tail()}" + (
                    "\nmodels that failed to load:\n" + "\n".join(failures) if failures else "")
                taken = taken_endpoints(self.options)  # ours is gone: whoever listens there now is another process
                if taken:
                    raise PortInUseError(self.options.host, taken, exited)
                raise RuntimeError(exited)
            if self._reports_ready():
                try:  # the metrics endpoint too: scrapers and tests read it right away
                    with urllib.request.urlopen(self.metrics_url, timeout=1):
                        self._stubs = self._descendants()
                        self._ready = True
                        return
                except OSError:
                    pass
            if time.monotonic() - last_report > 10:
                last_report = time.monotonic()
                log.info("waiting for models to load ... (%s)", self.log_tail(1).strip())
            time.sleep(0.2)
        unbound = ", ".join(f"{e.port} ({e.name})" for e in self.unbound_endpoints())
        self.stop()
        raise RuntimeError(f"tritonserver not ready after {self.options.ready_timeout_s:.0f} s"
                           + (f" (not listening on {unbound})" if unbound else "") + f":\n{self.log_tail()}")

    def unbound_endpoints(self) -> tuple[Endpoint, ...]:
        """The endpoints whose port this server's own process does not listen on (all of them when it is not
        running)."""
        import psutil

        try:
            connections = psutil.Process(self.process.pid).net_connections(kind="inet") if self.process else []
        except psutil.Error:
            connections = []
        listening = {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}
        return tuple(e for e in endpoints(self.options) if e.port not in listening)

    def load_failures(self) -> list[str]:
        """The log's "failed to load" lines, each naming a model and why (a ConfigError naming its key, say):
        they come early in the log, before the tail of a server that then exits."""
        return self._log_lines("failed to load '", "failed to poll model")

    def prepos_warnings(self) -> list[str]:
        """The models' own warnings in the log so far (an idle timeout that is not Triton's, a setting the machine
        cannot honour): the launcher shows them, which Triton's log alone would leave unseen."""
        return self._log_lines(" WARNING prepos")

    def _log_lines(self, *markers: str) -> list[str]:
        """The log's lines holding any of ``markers``, the access token masked."""
        try:
            lines = self.log_file.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [masked(line, self.access_token) for line in lines if any(marker in line for marker in markers)]

    def log_tail(self, lines: int = 30) -> str:
        try:
            return masked("\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:]), self.access_token)
        except OSError:
            return ""

    def _descendants(self) -> list:
        """tritonserver's backend stub processes (psutil handles, which know a reused pid for another process)."""
        import psutil

        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def _reports_ready(self) -> bool:
        """Whether this server's own process listens on every endpoint's port (until then, whatever answers there
        is another server) and its health endpoint says ready."""
        if self.unbound_endpoints():
            return False
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self, timeout_s: float | None = None, then_s: float | None = None) -> bool:
        """Drain, SIGTERM, then SIGKILL if it has not exited within ``timeout_s`` in all (default: its exit timeout
        and ``prepos.supervise.STOP_GRACE_S`` more; ``then_s`` after SIGTERM where the drain did not finish, see
        :func:`prepos.supervise.stop_server`); a stopped (SIGSTOP) tritonserver is continued first, as it could
        neither drain nor exit: :func:`prepos.supervise.stop_server`, with a drain once the
        server got ready. Backend stub processes still alive afterwards are killed too, also when tritonserver had
        already exited (killed or crashed): a stub can hang rather than follow a server that died under it, holding
        the model and its KV. Returns whether this stop drained the server. A server not yet seen ready
        (``wait_ready``) is drained too when it reports ready now: a stop right after it got ready (a SIGTERM
        between two looks) would otherwise wait Triton's exit timeout for any session opened meanwhile."""
        if self.process is None:
            return False
        import psutil

        stubs = {stub.pid: stub for stub in self._stubs}
        drained = False
        if self.process.poll() is None:
            stubs.update((stub.pid, stub) for stub in self._descendants())
            try:
                continue_if_stopped(self.process.pid)  # its own process group (start_new_session)
                ready = self._ready or self._reports_ready()
                drained = stop_server(self.process, drain_file=self.drain_file if ready else None,
                                      exit_timeout_s=self.options.exit_timeout_s, timeout_s=timeout_s,
                                      then_s=then_s).drained
            except BaseException:  # a second Ctrl-C, say: stop now, stubs too, rather than leave them running
                self.process.kill()
                _kill(stubs.values())
                self.process.wait()
                _wait_dead(list(stubs.values()), timeout_s=5.0)
                remove_left_regions(region_prefix(self.options.grpc_port), "this server (stopped by a second signal)")
                raise
        if self.drain_file is not None:  # a later server on this run folder must not find them
            from prepos.drain import drained_path

            for path in (self.drain_file, drained_path(self.drain_file)):
                path.unlink(missing_ok=True)
        try:
            # Drained, a stub holds nothing that is not in the journals: it need not be given time to leave.
            _, alive = psutil.wait_procs(list(stubs.values()), timeout=0.5 if drained else 5)
            for stub in alive:
                (log.info if drained else log.warning)("backend stub %d outlived tritonserver; killing it", stub.pid)
        except BaseException:  # a signal meanwhile: the stubs go now, not left holding the model and its KV
            alive = list(stubs.values())
            raise
        finally:
            _kill(alive)
            _wait_dead(alive, timeout_s=5.0)  # a killed stub is gone (or a zombie) when stop returns
            self._stubs = []
        remove_left_regions(region_prefix(self.options.grpc_port), "this server (killed, or its stubs were)")
        return drained

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


def _kill(processes) -> None:
    """SIGKILL each process (psutil handles) that is still there."""
    import psutil

    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def _wait_dead(processes, timeout_s: float) -> None:
    """Wait, at most ``timeout_s``, until every process has exited: gone, or a zombie its parent has not reaped
    (processes that are not our children cannot be reaped here)."""
    import psutil

    def running(process) -> bool:
        try:
            return process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    while any(running(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.02)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServerOptions()
    parser.add_argument("--model-repository", action="append", type=Path, dest="model_repositories",
                        help=f"model repository (repeatable; default {defaults.model_repositories[0]})")
    for field in dataclasses.fields(ServerOptions):
        if field.name in ("model_repositories", "access_token"):
            continue
        flag = "--" + field.name.replace("_", "-")
        help_text = (field.metadata or {}).get("help")  # says its own default
        parser.add_argument(flag, type=type(getattr(defaults, field.name)), default=getattr(defaults, field.name),
                            help=help_text or "(default: %(default)s)")


def options_from_args(args: argparse.Namespace) -> ServerOptions:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerOptions)
              if f.name not in ("model_repositories", "access_token")}
    if args.model_repositories:
        values["model_repositories"] = tuple(p.resolve() for p in args.model_repositories)
    values["run_dir"] = Path(values["run_dir"]).resolve()  # tritonserver runs from the repository root
    return ServerOptions(**values)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the server the way Ctrl-C does


def interrupt_on_sigterm() -> None:
    """Make SIGTERM raise KeyboardInterrupt in the main thread, as Ctrl-C does, so that a program holding a
    :class:`TritonServer` (a benchmark, a soak) stops it on the way out instead of leaving it running. Does
    nothing outside the main thread, where Python cannot set a handler."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def stopping_message(drain_file: Path | None, exit_timeout_s: float) -> str:
    """What the launcher says as it stops the server: a drain, or (the drain file set empty) Triton's own stop."""
    if drain_file is None:
        return (f"stopping prepos: no drain ({DRAIN_ENV} is empty or relative): tritonserver stops, waiting up to "
                f"{exit_timeout_s} s, --exit-timeout-s, for requests in flight; open sessions stay in their journals, "
                "where journals are on ...")
    return (f"stopping prepos: draining (requests in flight are served, up to {exit_timeout_s} s, --exit-timeout-s; "
            "then every session is ended, its journal kept) ...")


def serve(options: ServerOptions) -> int:
    """Start the server, print its addresses, and run until Ctrl-C/SIGTERM."""
    env = {}
    try:
        env.update(journal_environment(options.journal_dir, options.run_dir, os.environ))
        server = TritonServer(options, env=env)
    except ValueError as err:
        print(f"prepos failed to start: {err}", file=sys.stderr)
        return 2
    interrupt_on_sigterm()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Started as a background job of a script, which ignores SIGINT for its children: Ctrl-C and `kill -INT`
        # stop the server all the same, as they do tritonserver.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    lost_stub = False
    try:
        with server:
            bridge = any((Path(repo) / "prepos_http").is_dir() for repo in options.model_repositories)
            print(f"prepos is ready\n  gRPC     {server.grpc_url}{' (TLS)' if options.tls_cert_file else ''}\n"
                  f"  HTTP     {server.http_url}"
                  + (" (POST /v2/models/prepos_http/generate or generate_stream)" if bridge else "") + "\n"
                  f"  metrics  {server.metrics_url}\n  log      {server.log_file}\n"
                  f"  journal  {env.get('PREPOS_JOURNAL_DIR') or 'off'}\n"
                  + (f"  access   token required: gRPC header {GRPC_ACCESS_TOKEN_HEADER}, HTTP header {ACCESS_TOKEN_HEADER}\n"
                     if server.access_token else "")
                  + "Press Ctrl-C to stop.", flush=True)
            for warning in server.prepos_warnings():
                print(f"  warning  {warning}", flush=True)
            stubs = StubWatch(server.process.pid)
            try:
                while server.process.poll() is None:
                    time.sleep(STUB_CHECK_S)
                    lost = stubs.lost()
                    if lost and server.process.poll() is None:
                        lost_stub = True  # a signal from here on still exits 1
                        print(f"prepos: {describe_lost(lost)}; stopping (start it again: sessions resume from their "
                              "journals)", file=sys.stderr, flush=True)
                        server.stop(timeout_s=LOST_STUB_STOP_S, then_s=STOP_GRACE_S)
                        return 1
            except KeyboardInterrupt:
                if lost_stub:  # during that stop: tritonserver and its stubs were killed at once
                    print("prepos: stopped at once, with no drain (a signal during the stop)", file=sys.stderr,
                          flush=True)
                else:
                    print(stopping_message(server.drain_file, options.exit_timeout_s), flush=True)
                raise
            print(f"tritonserver {describe_exit(server.process.returncode)}; its log ends ({server.log_file}):\n"
                  f"{server.log_tail()}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print("prepos stopped", flush=True)
        return 1 if lost_stub else 0
    except RuntimeError as err:
        print(f"prepos failed to start: {err}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="prepos serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        options = options_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    return serve(options)


if __name__ == "__main__":
    sys.exit(main())
