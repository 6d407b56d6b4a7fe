"""Draining before a stop: every session is ended, its journal kept, so that a stop loses no accepted turn.

It begins when the drain file (``scheduler.drain_file``) appears: the launcher writes it on Ctrl-C or SIGTERM, and
so does ``prepos.supervise`` (the image's entrypoint) on SIGTERM. Then:

- the model takes the file up (removes it), which tells the writer that a drain is under way;
- every START, a resume too, is refused with UNAVAILABLE (the client resumes the session elsewhere or later);
- every open session is ended by a drain END the model queues itself (:func:`drain_end`), after the requests its
  client sent before it, which are served in full; that END closes the session keeping its journal;
- once every such END is answered, ``<drain file>.drained`` is written (a :class:`DrainReport` as JSON). Whoever
  stops the server waits for it; then no accepted turn is in flight, and every session is in its journal.

The drain END is queued within the model, not sent through Triton (Business Logic Scripting): a BLS request the
model sent itself while its engine loop streamed answers could block together with the loop's response sends
until the server was killed (seen under load, Triton 2.51). So Triton's sequences stay open after a drain; Triton,
which counts them as in flight, would wait its exit timeout for them, and whoever stops a drained server kills it
shortly after SIGTERM (``prepos.supervise``): nothing is in flight by then. A request a client sends later for a
drained session reaches the model, which answers that the session is not open; the client's START with
``resume`` is then refused as draining.

Without a journal (``journal.dir`` empty) a drained session is gone, as it would be after any stop.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:  # prepos.supervise imports this module, and runs on the standard library alone
    from prepos.protocol import ProtocolError, Request, ResponseChunk, ResponseSink

log = logging.getLogger("prepos.drain")

DRAINED_SUFFIX = ".drained"
"""Appended to the drain file's name: the file written once the drain has ended every session."""
POLL_S = 0.1
"""How often the drain file is looked for (a stat), and the drain's progress checked."""


@dataclass(frozen=True)
class DrainReport:
    """What the ``.drained`` file says once every drain END is answered."""

    num_ended: int  # sessions ended by their drain END
    num_failed: int  # drain ENDs refused (the session was closed meanwhile, say)
    num_open: int  # sessions still open when it was written
    seconds: float  # from the drain file's appearance

    def to_json(self) -> str:
        return json.dumps(asdict(self)) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "DrainReport":
        """Raises ValueError for anything but a report's JSON."""
        data = json.loads(text)
        if not isinstance(data, dict) or set(data) != {f.name for f in fields(cls)}:
            raise ValueError(f"not a drain report: {text[:200]!r}")
        return cls(**data)


class Drainable(Protocol):
    """What a drain needs of the scheduler (:class:`prepos.scheduler.Scheduler`)."""

    drain_ids: "queue.SimpleQueue[str | int]"
    drain_listed: bool

    def drain(self) -> None: ...

    def submit(self, request: Request, sink: ResponseSink) -> None: ...

    @property
    def open_sessions(self) -> int: ...


def drained_path(drain_file: Path) -> Path:
    return drain_file.with_name(drain_file.name + DRAINED_SUFFIX)


class DrainEnd:
    """Where the answer to a drain END queued within the model goes: the END is answered once this is set."""

    def __init__(self) -> None:
        self.error: ProtocolError | None = None
        self._answered = threading.Event()

    def send(self, chunk: ResponseChunk, final: bool) -> None:
        if final:
            self._answered.set()

    def send_error(self, error: ProtocolError) -> None:
        self.error = error
        self._answered.set()

    def cancelled(self) -> bool:
        return False

    def wait(self, timeout_s: float) -> bool:
        """Whether the END was answered within ``timeout_s``."""
        return self._answered.wait(timeout_s)


def drain_end(session_id: str | int) -> Request:
    """The END a drain queues for a session: served after the requests its client sent before it, it closes the
    session keeping its journal (``Request.drain``)."""
    from prepos.protocol import Request  # here: see the imports

    return Request(session_id=session_id, request_id=f"drain-{session_id}", start=False, end=True, role="user",
                   max_tokens=0, arrival_s=time.perf_counter(), drain=True)


class Drainer:
    """Watches for the drain file and drains the scheduler when it appears: each session open then gets a drain END
    (:func:`drain_end`), and the report is written once every one is answered."""

    def __init__(self, drain_file: Path, scheduler: Drainable, *, poll_s: float = POLL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.drain_file = drain_file
        self.drained_file = drained_path(drain_file)
        self._scheduler = scheduler
        self._poll_s = poll_s
        self._clock = clock
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_ended = 0  # drain ENDs answered
        self.num_failed = 0  # drain ENDs refused (the session closed by its client's own END meanwhile, say)

    def start(self) -> None:
        """Remove a drain file left by an earlier server (it would drain this one at once), then watch."""
        for path in (self.drain_file, self.drained_file):
            try:
                path.unlink()
                log.warning("removed %s, left by an earlier server", path)
            except FileNotFoundError:
                pass
            except OSError as err:
                log.error("could not remove %s (%s); the drain file may not work", path, err)
        self._thread = threading.Thread(target=self._run, name="prepos-drain-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def _run(self) -> None:
        while not self._take_up():
            if self._stopped.wait(self._poll_s):
                return
        began = self._clock()
        log.info("drain file %s found: draining (STARTs are refused; every open session is ended, its journal "
                 "kept)", self.drain_file)
        self._scheduler.drain()
        under_way: dict[str | int, DrainEnd] = {}
        reported = False
        while not self._stopped.is_set():
            listed = self._scheduler.drain_listed  # read first: then every listed id is in the queue already
            try:
                self._send_end(under_way, self._scheduler.drain_ids.get(timeout=self._poll_s))
                while True:  # and every id queued by now
                    self._send_end(under_way, self._scheduler.drain_ids.get_nowait())
            except queue.Empty:
                pass
            if self._take_up():  # asked again (a stop after a drain begun by hand, say): report again
                reported = False
            self._count_answered(under_way)
            if listed and not under_way and not reported:
                reported = True
                self._report(self._clock() - began)

    def _send_end(self, under_way: dict[str | int, DrainEnd], session_id: str | int) -> None:
        under_way[session_id] = answered = DrainEnd()
        self._scheduler.submit(drain_end(session_id), answered)

    def _count_answered(self, under_way: dict[str | int, DrainEnd]) -> None:
        for session_id, answered in list(under_way.items()):
            if not answered.wait(0):
                continue
            del under_way[session_id]
            if answered.error is None:
                self.num_ended += 1
            else:
                self.num_failed += 1
                log.info("drain: the END of session %r was refused (%s)", session_id, answered.error)

    def _take_up(self) -> bool:
        """Remove the drain file if it is there (the writer then knows the drain is under way, and waits for the
        report); returns whether it was."""
        try:
            self.drain_file.unlink()
            return True
        except OSError:
            return False

    def _report(self, took_s: float) -> None:
        report = DrainReport(num_ended=self.num_ended, num_failed=self.num_failed,
                             num_open=self._scheduler.open_sessions, seconds=round(took_s, 3))
        log.info("drained in %.2f s: %d sessions ended, %d ENDs refused, %d sessions still open", took_s,
                 report.num_ended, report.num_failed, report.num_open)
        tmp = self.drained_file.with_name(self.drained_file.name + ".tmp")
        try:
            tmp.write_text(report.to_json())
            os.replace(tmp, self.drained_file)
        except OSError as err:
            log.error("could not write %s (%s); a stop waits the exit timeout", self.drained_file, err)


def request_drain(drain_file: Path, timeout_s: float, alive: Callable[[], bool], *, pickup_s: float = 1.0,
                  poll_s: float = 0.05, clock: Callable[[], float] = time.monotonic) -> DrainReport | None:
    """Drain a running server (the launcher's and the supervisor's stop): write ``drain_file`` and wait up to
    ``timeout_s`` for the model's report (the ``.drained`` file). None when there is no drain: the model did
    not take the file up within ``pickup_s`` (not loaded yet, or run without this drain file), the server stopped
    (``alive`` turned False), or the drain was not done in time (a request still running)."""
    report_file = drained_path(drain_file)
    began = clock()
    try:
        report_file.unlink(missing_ok=True)
        drain_file.touch()
    except OSError as err:
        log.warning("could not write the drain file %s (%s); stopping without a drain", drain_file, err)
        return None
    log.info("draining: sessions are ended, their journals kept, once their requests in flight are served")
    while alive():
        waited = clock() - began
        if report_file.exists():
            try:
                report = DrainReport.from_json(report_file.read_text())
            except (OSError, ValueError) as err:  # written means done; what it says is only reported
                log.warning("could not read the drain report %s (%s)", report_file, err)
                report = DrainReport(num_ended=0, num_failed=0, num_open=0, seconds=round(waited, 3))
            log.info("drained in %.1f s: %d sessions ended", waited, report.num_ended)
            return report
        if waited > pickup_s and drain_file.exists():
            log.warning("the model did not take up the drain file %s within %.0f s (not loaded yet, or its backend "
                        "stub gone?); stopping without a drain", drain_file, pickup_s)
            break
        if waited > timeout_s:
            log.warning("the drain was not done within %.0f s (a request still running?); stopping without it",
                        timeout_s)
            break
        time.sleep(poll_s)
    try:
        drain_file.unlink(missing_ok=True)
    except OSError:
        pass
    return None
