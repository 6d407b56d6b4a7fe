"""A Locust user that replays prepos session traces over the gRPC streaming API.

Task files subclass `PreposUser` and say which traces to replay:

    class ChatUser(PreposUser):
        workload = "chat"

Each user owns its own `prepos_client.Client` and fires ``events.request``
itself (Locust's gRPC pattern). One task call sends one step of a trace; the
wait between tasks is the trace's think time, scaled by ``--think-scale`` and
jittered by ``--think-jitter``. A session opens with the first step of its
trace (START), ends after the last (END), and the user then takes the next
trace of the pool its class shares; a user that stops closes its open
session. A user's very first step goes out as it spawns (the spawn rate
spreads sessions out), every later one after its think time. Every request is reported under its served path as ``name``
(`exact`, `gated`, `prepaid`, `prefix`, `rebuild`, `append`, `close`), with
request types ``TTFT``, ``TOTAL`` and ``TPOT`` (milliseconds per token after
the first, for answers of two tokens or more) measured by the client and
``SRVTTFT`` reported by the server; a rejected request is one ``TOTAL`` failure carrying
the server's message, which names the field. ``--host`` is the gRPC
``host:port`` of Triton.

Importing this module patches gRPC for gevent, as Locust's users need; import
it only in Locust processes.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import random
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gevent
import grpc.experimental.gevent as grpc_gevent
import locust.stats
from locust import User, events, task
from locust.exception import LocustError
from locust.html import get_html_report
from locust.runners import STATE_INIT, STATE_RUNNING, STATE_SPAWNING

from prepos_client import Client, Tls
from prepos_client.cli import TOKEN_ENV

from .options import OPTION_CLASSES, WorkloadOptions, add_arguments, from_namespace
from .replay import Measurement, ReplayOptions, TraceReplayer, failure_kind, trace_pool
from .run import RUN_END_SUFFIX
from .workloads import SessionTrace, build_workload

# gRPC must cooperate with gevent before any channel exists.
grpc_gevent.init_gevent()

_GRPC_SCHEMES = ("grpc://", "http://")


@events.init_command_line_parser.add_listener
def _add_prepos_arguments(parser, **_kwargs) -> None:
    group = parser.add_argument_group("prepos", "options of the prepos session users")
    for options_class in OPTION_CLASSES:
        add_arguments(group, options_class)


@events.init.add_listener
def _check_prepos_arguments(environment, **_kwargs) -> None:
    # Fail at start with the field's name, rather than in every user that spawns.
    parsed = environment.parsed_options
    if parsed is None:
        return
    try:
        for options_class in OPTION_CLASSES:
            from_namespace(options_class, parsed)
        if parsed.headless:
            grpc_address(environment.host)
    except (ValueError, LocustError) as error:
        sys.exit(f"prepos: {error}")


_held_interrupts: list[Any] = []  # the SIGINT handler a stopping test set aside, while it stops


def _headless(environment: Any) -> bool:
    parsed = getattr(environment, "parsed_options", None)
    return parsed is not None and bool(getattr(parsed, "headless", False))


@events.test_stopping.add_listener
def _hold_interrupts(environment=None, **_kwargs) -> None:
    # The users are stopping, at the end of the run time, for an interrupt or at the web UI's Stop: a SIGINT now
    # (the load test passes one on) would cut short their ENDs, Locust's report and its last pass over the CSVs,
    # and leave the run unmeasured. A headless run has nothing left to stop (a second interrupt of the load test
    # kills Locust instead); the web UI gets Ctrl-C back once the users stopped (_release_interrupts).
    handler = signal.getsignal(signal.SIGINT)
    if handler is not signal.SIG_IGN:
        _held_interrupts[:] = [handler]
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@events.test_stop.add_listener
def _release_interrupts(environment=None, **_kwargs) -> None:
    # In the web UI a test stops at every Stop: Ctrl-C must quit Locust afterwards (it was ignored for good).
    if not _headless(environment) and _held_interrupts:
        signal.signal(signal.SIGINT, _held_interrupts.pop())


@events.quitting.add_listener
def _before_exit(environment, **_kwargs) -> None:
    # An interrupted run reaches here with its users still running: Locust stops them only after this event, so
    # the requests they finish while stopping (their sessions' ENDs) were left out of the CSVs and the HTML report
    # (which Locust saved already). Stop them first, and write the report again.
    try:
        _write_the_last_statistics(environment)
    except KeyboardInterrupt:  # interrupted again before the stopping test held interrupts
        print("prepos: interrupted again: stopping at once", file=sys.stderr, flush=True)
        os._exit(130)  # Locust's shutdown, cut short, left the process hanging on its greenlets


def _write_the_last_statistics(environment) -> None:
    runner = environment.runner
    interrupted = runner is not None and runner.state in (STATE_SPAWNING, STATE_RUNNING)
    csv_prefix = getattr(environment.parsed_options, "csv_prefix", None)
    marker = Path(f"{csv_prefix}{RUN_END_SUFFIX}") if csv_prefix else None
    if marker is not None and not marker.exists():  # the first quitting tells: a SIGTERM's second one comes stopped
        # before its users ran (still INIT), or with them still running: stopped before the end of the run time
        early = runner is None or runner.state in (STATE_INIT, STATE_SPAWNING, STATE_RUNNING)
        marker.write_text(json.dumps({"interrupted": early}))
    if interrupted:
        runner.stop()
        html_file = getattr(environment.parsed_options, "html_file", None)
        if html_file:
            Path(html_file).write_text(get_html_report(environment, show_download_link=False), encoding="utf-8")
    # Locust's CSV writer rewrites the files every CSV_STATS_INTERVAL_SEC and
    # closes them at exit without a last pass, so requests that finished while
    # users stopped (their END included) would be missing from the CSVs; give
    # it one more pass.
    if marker is not None:
        gevent.sleep(locust.stats.CSV_STATS_INTERVAL_SEC + 0.5)
    # A tritonclient client finalized during interpreter shutdown closes its
    # gRPC channel after gevent's hub is gone, and that close can hang the
    # exit: finalize unreachable ones while the hub still runs.
    gc.collect()


def grpc_address(host: str | None) -> str:
    """`host:port` from Locust's --host (a grpc:// or http:// prefix is dropped).

    Raises:
        LocustError: no host was given.
    """
    if not host:
        raise LocustError("--host: give the server's gRPC address, e.g. --host 127.0.0.1:8001")
    for scheme in _GRPC_SCHEMES:
        if host.startswith(scheme):
            host = host[len(scheme):]
    return host.rstrip("/")


class PreposUser(User):
    """Replays session traces against prepos; subclasses set `workload` or override `load_traces`."""

    abstract = True
    workload: str | None = None
    """Name of a built-in workload (`bfcl`, `monitor`, `chat`)."""

    # Per user class: the trace pool its users share, and a counter that seeds each user's jitter.
    _pools: dict[type, Iterator[SessionTrace]] = {}
    _user_counter = itertools.count()

    @classmethod
    def load_traces(cls, options: WorkloadOptions) -> list[SessionTrace]:
        """The session traces this class's users replay (built once per process)."""
        if cls.workload is None:
            raise LocustError(f"{cls.__name__}: set `workload` or override `load_traces`")
        return build_workload(cls.workload, options.workload_sessions, seed=options.workload_seed)

    def __init__(self, environment) -> None:
        super().__init__(environment)
        parsed = environment.parsed_options
        try:
            self.workload_options = from_namespace(WorkloadOptions, parsed)
            self.replay_options = from_namespace(ReplayOptions, parsed)
        except ValueError as error:
            raise LocustError(str(error)) from None
        replay = self.replay_options
        tls = Tls(root_certificates=replay.tls_ca) if replay.tls_ca else replay.tls  # tls_ca checked at start
        self.client = Client(grpc_address(self.host), self.workload_options.model, timeout_s=replay.request_timeout_s,
                             wait_for_ready=replay.wait_for_ready, tls=tls, token=os.environ.get(TOKEN_ENV) or None)
        user_index = next(PreposUser._user_counter)
        self._replayer = TraceReplayer(
            self.client.session,
            self._pool(),
            self.replay_options,
            random.Random(f"{self.workload_options.workload_seed}:{user_index}"),
        )

    def _pool(self) -> Iterator[SessionTrace]:
        cls = type(self)
        if cls not in PreposUser._pools:
            PreposUser._pools[cls] = trace_pool(cls.load_traces(self.workload_options))
        return PreposUser._pools[cls]

    def wait_time(self) -> float:
        return self._replayer.next_delay_s()

    @task
    def replay_step(self) -> None:
        self._report(self._replayer.run_step())

    def on_stop(self) -> None:
        try:
            self._report(self._replayer.close(last=True))
        finally:
            self.client.close()

    def _report(self, measurements: list[Measurement]) -> None:
        for measurement in measurements:
            self.environment.events.request.fire(
                request_type=measurement.kind,
                name=measurement.name,
                response_time=measurement.elapsed_ms,
                response_length=measurement.num_tokens,
                exception=failure_kind(measurement.error, measurement.session_id) if measurement.error else None,
                context={"session_id": measurement.session_id, "trace": measurement.trace},
            )
