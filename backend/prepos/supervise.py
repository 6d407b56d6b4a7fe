"""Run tritonserver as a container's main process, and stop it as ``make serve`` does: drain, SIGTERM, then kill.

The production image's entrypoint and the Helm chart's command::

    python3 -m prepos.supervise -- tritonserver --model-repository=... --exit-timeout-secs=100

Run as tritonserver's parent, it stops it on SIGTERM or SIGINT (:func:`stop_server`): the model is drained when
``PREPOS_SCHEDULER_DRAIN_FILE`` names an absolute path (:mod:`prepos.drain`), then tritonserver gets SIGTERM and, if
it has not exited in time, SIGKILL, and so does every process left in its process group (its backend stubs). As a
container's PID 1 it also reaps the processes orphaned to it. It exits with 0 after a drained stop, else with
tritonserver's exit status (128 plus the signal's number when a signal ended it). Standard library only: the image
installs prepos without dependencies.

With ``PREPOS_HEALTH_PORT`` set it also serves the replica's health for a router (:mod:`prepos.replica_health`):
``GET /ready`` fails once ``PREPOS_LEAVING_FILE`` exists or the stop began, while Triton's own readiness still holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from prepos.drain import request_drain
from prepos.replica_health import HEALTH_PORT_ENV, LEAVING_FILE_ENV, ReplicaHealth, forget_leaving
from prepos.shm_regions import remove_left_regions
from prepos.triton_args import (BLS_THREADS, KEEPALIVE_PING_ARGUMENTS, RESTRICTION_FLAGS,  # noqa: F401 (API)
                                THREAD_POOL_OPTION, TRITON_EXIT_TIMEOUT_S, TRITON_GRPC_PORT, TRITON_HTTP_PORT,
                                bls_threads_argument, configured_prefix, exit_timeout_of, grpc_port_of,
                                http_port_of, keepalive_ping_arguments, with_bls_threads, with_keepalive_pings,
                                with_region_prefix, with_tokens_trimmed)

log = logging.getLogger("prepos.supervise")

SERVER_STACK_BYTES = 1 << 30
"""The stack limit tritonserver starts with, which sizes its threads' stacks. Triton 2.51's HTTP front end works on
a request's body on the stack of the thread serving it, before any check of its size or content: it copies a body
sent as form data (``Content-Type: application/x-www-form-urlencoded``, urllib's default for a POST) there, about
twice its size, and parses JSON recursively, a few hundred bytes of stack per level of nesting. With the usual 8 MiB,
one form POST of 4 MB crashed the server (SIGSEGV), an access token notwithstanding; at 64 MiB, a 500 KB body of
nested brackets did. At 1 GiB a 6 MB body nested 3 million levels deep is answered (an error naming the input), as
is any body of that size, some four times the largest a request within prepos's default limits takes (a 262,144-token
``input_ids``, about 1.6 MB). It reserves address space only (about 640 GB of virtual size for tritonserver, some 600
threads): a stack's memory is used as it is touched, and stays with its thread once touched (1 GB resident after the
6 MB nested body)."""

STOP_GRACE_S = 5.0
"""How long past its exit timeout a tritonserver that was not drained is given before it is killed."""
DRAINED_EXIT_S = 3.0
"""How long after SIGTERM a drained tritonserver (nothing in flight, every session ended) whose drain ended no
session is given to exit before it is killed."""
ENDED_EXIT_S = 0.5
"""How long after SIGTERM a drained tritonserver whose drain ended sessions is given before it is killed: Triton
still counts their sequences as in flight (the drain ends them within the model, see :mod:`prepos.drain`), so it
waits for them until their idle timeout or its exit timeout, and while a client still holds a stream, Triton 2.51
does not finish unloading the model: it never exits by itself sooner (it took the whole 3 s it was given in every
stop measured), and nothing is in flight."""
DRAIN_ENV = "PREPOS_SCHEDULER_DRAIN_FILE"


LOST_STUB_STOP_S = 15.0
"""How long a server that lost a backend stub is given to drain (a dead ``prepos`` stub never reports a drain); it
then gets SIGTERM and :data:`STOP_GRACE_S` more before it is killed (not the rest of these 15 s after a drain that
gave up sooner: nothing in flight on a dead ``prepos`` stub can finish, and its clients' streams wait for the exit;
a live ``prepos`` drains): 20 s in all at most."""
STUB_CHECK_S = 1.0
"""How often the backend stubs are looked for."""


STUB_EXECUTABLE = "triton_python_backend_stub"


@dataclass(frozen=True)
class LostStub:
    """A model instance's backend stub that exited while its tritonserver still ran: ``model`` can no longer
    serve."""

    pid: int
    model: str
    instance: str


class StubWatch:
    """The model instances' backend stubs of a running tritonserver (among the other processes of its process
    group, of which it is the leader): :meth:`lost` tells which of those seen before have exited.

    A stub that dies (a crash in the Python backend, say) is not restarted by Triton 2.51: its model refuses every
    request from then on ("Stub process ... is not healthy"), while the server still reports itself ready. Other
    processes of the group come and go while models load (the stub a model's configuration is completed by, a
    trial run of the stub, the shells that start them) and are not watched.
    """

    def __init__(self, server_pid: int):
        self._server_pid = server_pid
        self._seen: dict[int, LostStub | None] = {}  # pid -> the instance stub it is, None: another process

    def lost(self) -> list[LostStub]:
        live = set(_live_members(self._server_pid)) - {self._server_pid}
        for pid in live - set(self._seen):
            self._seen[pid] = instance_stub(pid)
        gone = [pid for pid in self._seen if pid not in live]
        return [stub for stub in (self._seen.pop(pid) for pid in gone) if stub is not None]


def instance_stub(pid: int) -> LostStub | None:
    """What process ``pid`` is, when it is a model instance's Python backend stub, else None (or gone). A stub's
    arguments are ``<repository>/<model>/<version>/model.py``, its region, sizes, parent, library, handle, and a
    name: the instance's (``<model>_0_0``), or the model's own for the stub that completes its configuration."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    start = next((i for i, arg in enumerate(argv[:2]) if Path(arg).name == STUB_EXECUTABLE), None)
    if start is None or len(argv) < start + 9:
        return None
    model_path, name = Path(argv[start + 1]), argv[start + 8]
    model = model_path.parts[-3] if len(model_path.parts) >= 3 else str(model_path)
    return None if name == model else LostStub(pid, model, name)


def describe_lost(lost: list[LostStub]) -> str:
    return ", ".join(f"the backend stub of model {stub.model} (instance {stub.instance}, pid {stub.pid})"
                     for stub in lost) + (
        " exited while tritonserver runs: that model refuses every request from now on, though the server still "
        "reports itself ready")


def describe_exit(code: int) -> str:
    """How a process ended, from its Popen return code: ``status 1``, or ``killed by SIGSEGV (signal 11)`` with
    what such an end usually means."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        said = f"was killed by {signal.Signals(-code).name} (signal {-code})"
    except ValueError:
        said = f"was killed by signal {-code}"
    if -code in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE, signal.SIGILL):
        said += (": it crashed (one known cause: an HTTP body past what its stack holds, see the README's "
                 "\"HTTP\" limits)")
    elif -code == signal.SIGKILL:
        said += ": the kernel's out-of-memory killer, or someone, killed it"
    return said


@contextlib.contextmanager
def server_stack_limit():
    """Within it, processes started get a stack limit of :data:`SERVER_STACK_BYTES` (or the hard limit, when lower)
    where theirs would be lower or unlimited (threads then get 2 MiB); this process's own threads keep theirs (their
    size was fixed when it started). Restored on the way out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    wanted = SERVER_STACK_BYTES if hard == resource.RLIM_INFINITY else min(hard, SERVER_STACK_BYTES)
    if soft != resource.RLIM_INFINITY and soft >= wanted:
        yield
        return
    resource.setrlimit(resource.RLIMIT_STACK, (wanted, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_STACK, (soft, hard))


@dataclass(frozen=True)
class ServerStop:
    """How :func:`stop_server` went."""

    drained: bool  # the drain ended every session: nothing was in flight
    killed: bool  # tritonserver had not exited in its time and was sent SIGKILL


def stop_server(process: subprocess.Popen, *, drain_file: Path | None, exit_timeout_s: float,
                timeout_s: float | None = None, then_s: float | None = None) -> ServerStop:
    """Stop a running tritonserver within ``timeout_s`` (default: ``exit_timeout_s`` and :data:`STOP_GRACE_S`
    more), or, where the drain took ``timeout_s`` whole (at most the exit timeout), that and :data:`STOP_GRACE_S`
    more (``then_s`` where given and the drain did not finish). Returns whether it was drained.

    Triton counts every open session (a live sequence) as an in-flight request: with any session open it would
    wait its whole exit timeout, and while a client still holds a stream to it, Triton 2.51 then does not finish
    exiting (it hangs after "Exit timeout expired"). So the model is drained first (``drain_file`` None: no
    drain): it ends every session, its journal kept, once the requests its client sent are served, and refuses
    new ones. Drained (the report names no session left open), nothing is in flight: Triton gets
    :data:`DRAINED_EXIT_S` to exit (:data:`ENDED_EXIT_S` when the drain ended sessions: it waits for their
    sequences) and is killed after that.
    A drain not done within the exit timeout (a long answer still running) leaves Triton the rest of
    ``timeout_s``, or ``then_s`` where given (a server that lost a backend stub, whose drain gave up: nothing in
    flight on a dead ``prepos`` stub can finish, and its clients' streams wait for the exit)."""
    if timeout_s is None:
        timeout_s = exit_timeout_s + STOP_GRACE_S
    deadline = time.monotonic() + timeout_s
    report = None if drain_file is None else request_drain(
        drain_file, min(exit_timeout_s, timeout_s), alive=lambda: process.poll() is None)
    drained = report is not None and report.num_open == 0
    if report is not None and not drained:  # an END not served says nothing of that session's requests in flight
        log.warning("the drain left %d sessions open (%d ENDs refused); stopping as without a drain",
                    report.num_open, report.num_failed)
    if process.poll() is not None:
        return ServerStop(drained, killed=False)
    if drained:
        wait_s = ENDED_EXIT_S if report.num_ended else DRAINED_EXIT_S
    else:
        wait_s = then_s if then_s is not None else max(STOP_GRACE_S, deadline - time.monotonic())
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(wait_s)
    except subprocess.TimeoutExpired:
        if drained:
            log.info("tritonserver had not exited %g s after SIGTERM, drained (it still counts the drained "
                     "sessions' sequences); killing it: nothing was in flight", wait_s)
        else:
            log.warning("tritonserver had not exited %.0f s after SIGTERM (its exit timeout is %g s: Triton waits for "
                        "open sessions, and hangs past it while a client holds a stream); killing it, open sessions "
                        "stay in their journals", wait_s, exit_timeout_s)
        process.kill()
        process.wait()
        return ServerStop(drained, killed=True)
    return ServerStop(drained, killed=False)


def replica_health_from(environ: Mapping[str, str], args: list[str]) -> ReplicaHealth | None:
    """The replica health server the environment asks for (``PREPOS_HEALTH_PORT``; None when unset), not started.

    Raises:
        ValueError: the port is not one, or cannot be listened on; the leaving file is not an absolute path.
    """
    value = environ.get(HEALTH_PORT_ENV, "")
    if not value:
        return None
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ValueError(f"{HEALTH_PORT_ENV}={value!r}: expected a port number in [1, 65535]")
    leaving = environ.get(LEAVING_FILE_ENV, "")
    if leaving and not Path(leaving).is_absolute():
        raise ValueError(f"{LEAVING_FILE_ENV}={leaving!r}: expected an absolute path")
    try:
        return ReplicaHealth(port, http_port_of(args), Path(leaving) if leaving else None)
    except OSError as err:
        raise ValueError(f"{HEALTH_PORT_ENV}={value}: cannot listen on it ({err.strerror or err})") from None


def check_files(environ: Mapping[str, str]) -> None:
    """Raise ValueError naming the variable when the drain file or the leaving file could not serve a stop: the
    drain file relative (to the model's folder, which only the model knows) or in a folder this process cannot
    write in, the leaving file in a folder that does not exist (the preStop hook's touch would fail, and the
    health port would not fail first). Found only at the stop, they made it go without a drain, the whole exit
    timeout and more. An empty drain file means no drain, as documented."""
    drain = environ.get(DRAIN_ENV, "")
    if drain and not Path(drain).is_absolute():
        raise ValueError(f"{DRAIN_ENV}={drain!r}: this supervisor writes the drain file, so it must be an absolute "
                         "path (a relative one is the model folder's, which only the model knows); empty: no drain")
    for variable, path in ((DRAIN_ENV, drain), (LEAVING_FILE_ENV, environ.get(LEAVING_FILE_ENV, ""))):
        folder = Path(path).parent
        if path and Path(path).is_absolute() and not (folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)):
            raise ValueError(f"{variable}={path!r}: cannot write in {folder} (not a folder this process can write "
                             "in)")


def drain_file_from(environ: Mapping[str, str]) -> Path | None:
    """The drain file the model watches, when the environment names an absolute one (a relative one is relative
    to the model's folder, which only the model knows)."""
    value = environ.get(DRAIN_ENV, "")
    if not value:
        return None
    if not Path(value).is_absolute():
        log.warning("%s=%s is relative; stopping without a drain", DRAIN_ENV, value)
        return None
    return Path(value)


def _reap_orphans(child_pid: int) -> None:
    """Reap exited processes other than ``child_pid`` (left to Popen), as a container's init must."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == child_pid:
            return
        try:
            os.waitpid(info.si_pid, 0)
        except ChildProcessError:
            return


def _live_members(pgid: int, states: str | None = None) -> list[int]:
    """The processes of group ``pgid`` that have not exited (zombies left out), from /proc; only those in one of
    ``states`` (``ps``'s letters: ``"Tt"``, stopped) where given."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        state, _ppid, pgrp = stat[stat.rindex(")") + 2:].split()[:3]  # after "pid (comm) "
        if int(pgrp) == pgid and state not in "ZX" and (states is None or state in states):
            members.append(int(entry))
    return members


def continue_if_stopped(pgid: int) -> list[int]:
    """Send SIGCONT to the group ``pgid`` where any of its processes is stopped (SIGSTOP, ^Z), and return those:
    stopped, tritonserver could neither drain nor exit, and its stop took the exit timeout and a SIGKILL."""
    stopped = _live_members(pgid, states="Tt")
    if stopped:
        log.warning("tritonserver's processes %s are stopped (SIGSTOP, or a debugger holds them); continuing them "
                    "so that they can drain and exit", ", ".join(map(str, stopped)))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGCONT)
    return stopped


def _kill_group(pgid: int, timeout_s: float = 5.0) -> None:
    """SIGKILL what is left of the group and wait until it has exited: a stub still running when this returns would
    hold the model and its KV past the container's stop."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + timeout_s
    while _live_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)
    log.info("killed what was left of tritonserver's process group (its backend stubs)")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m prepos.supervise -- tritonserver [ARGS...]"
    if args[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\n{__doc__.strip()}")
        return 0
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print(usage, file=sys.stderr)
        return 2
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    try:
        args, prefix = with_region_prefix(with_keepalive_pings(with_bls_threads(with_tokens_trimmed(args))))
        check_files(os.environ)
        health = replica_health_from(os.environ, args)
    except ValueError as err:
        print(f"prepos.supervise: {err}", file=sys.stderr)
        return 2
    if health is not None:
        forget_leaving(health.leaving_file)
        health.start()
    # One server runs in a container: regions under its prefix now are an earlier one's, killed before it could
    # remove them (the container restarted; an in-memory /dev/shm outlives it).
    remove_left_regions(prefix, "an earlier tritonserver")
    try:
        with server_stack_limit():
            child = subprocess.Popen(args, start_new_session=True)  # its own group: the stubs are killed with it
    except OSError as err:
        print(f"prepos.supervise: cannot run {args[0]}: {err.strerror or err}", file=sys.stderr)
        if health is not None:
            health.close()
        return 127 if isinstance(err, FileNotFoundError) else 126  # as a shell: not found, or found and not run
    init = os.getpid() == 1
    stubs, lost, next_check = StubWatch(child.pid), [], time.monotonic() + STUB_CHECK_S
    while child.poll() is None and not stopping.wait(0.2):
        if init:
            _reap_orphans(child.pid)
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + STUB_CHECK_S
            lost = stubs.lost()
            if lost:
                log.error("%s; stopping it, to be restarted (sessions resume from their journals)", describe_lost(lost))
                break
    stop = ServerStop(drained=False, killed=False)
    if health is not None:
        health.leave()  # before the drain: a router stops placing sessions here
    if child.poll() is None:
        continue_if_stopped(child.pid)
        drain_file = drain_file_from(os.environ)
        log.info("stopping tritonserver (pid %d)%s", child.pid, " after a drain" if drain_file else "")
        stop = stop_server(child, drain_file=drain_file, exit_timeout_s=exit_timeout_of(args),
                           timeout_s=LOST_STUB_STOP_S if lost else None, then_s=STOP_GRACE_S if lost else None)
    _kill_group(child.pid)  # returns once they have exited: zombies, for init to reap
    if health is not None:
        health.close()
    remove_left_regions(prefix, "tritonserver (killed, or its stubs were)")
    if init:
        _reap_orphans(child.pid)
    code = child.returncode
    if not (lost or stopping.is_set()):
        log.log(logging.ERROR if code else logging.WARNING, "tritonserver %s", describe_exit(code))
    elif not stop.killed:  # stop_server's own SIGKILL it logged; another (the OOM killer, in the drain) is told
        log.log(logging.WARNING if code else logging.INFO, "tritonserver %s, once asked to stop", describe_exit(code))
    if lost:
        return 1  # not asked to stop: restart it
    if stop.drained:
        return 0  # stopped as asked, nothing in flight lost, even if it had to be killed
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
