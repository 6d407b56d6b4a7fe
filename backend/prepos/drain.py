"""Draining before a stop: every session is ended, its journal kept, so that Triton exits without waiting.

Triton counts each open session (a live sequence) as an in-flight request and, on SIGTERM, waits its whole exit
timeout for them; an idle session ends only at its idle timeout, far later, so that wait was spent for nothing.
A drain ends them first. It begins when the drain file (``scheduler.drain_file``) appears: the launcher writes it
on Ctrl-C or SIGTERM, and so does ``prepos.supervise`` (the image's entrypoint) on SIGTERM. Then:

- the model takes the file up (removes it), which tells the writer that a drain is under way;
- every START, a resume too, is refused with UNAVAILABLE (the client resumes the session elsewhere or later);
- every open session is ended by an END the model sends itself through Triton (so that the sequence ends there
  too), marked with the request parameter :data:`DRAIN_PARAMETER`: the END keeps the session's journal, and the
  requests its client sent before it are served first, in order;
- every START refused meanwhile gets such an END too (Triton holds a sequence slot for it);
- once the ENDs of the sessions open at the drain, and of the STARTs refused by the time those are all sent, are
  answered, ``<drain file>.drained`` is written (a :class:`DrainReport` as JSON); later refused STARTs, which
  changed nothing, do not hold it back. Whoever stops the server waits for it; Triton then finds no accepted
  turn in flight.

Without a journal (``journal.dir`` empty) a drained session is gone, as it would be after any stop.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Protocol

log = logging.getLogger("prepos.drain")

DRAIN_PARAMETER = "prepos_drain"
"""Request parameter of the END a drain sends: that END keeps the session's journal."""
DRAINED_SUFFIX = ".drained"
"""Appended to the drain file's name: the file written once the drain has ended every session."""
POLL_S = 0.1
"""How often the drain file is looked for (a stat), and the drain's progress checked."""


@dataclass(frozen=True)
class DrainReport:
    """What the ``.drained`` file says once every drain END is answered."""

    num_ended: int  # sessions ended by their drain END
    num_failed: int  # drain ENDs not served (Triton no longer held the sequence, say)
    num_open: int  # sessions still open when it was written (a failed END's)
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

    @property
    def open_sessions(self) -> int: ...


def drained_path(drain_file: Path) -> Path:
    return drain_file.with_name(drain_file.name + DRAINED_SUFFIX)


class Drainer:
    """Watches for the drain file and drains the scheduler when it appears.

    ``end_session(session_id)`` sends the session an END with :data:`DRAIN_PARAMETER` and returns once it is
    answered (or raises); up to ``workers`` run at a time, so that an END waiting behind a long answer holds up no
    other session's."""

    def __init__(self, drain_file: Path, scheduler: Drainable, end_session: Callable[[str | int], None], *,
                 poll_s: float = POLL_S, workers: int = 8, clock: Callable[[], float] = time.monotonic):
        self.drain_file = drain_file
        self.drained_file = drained_path(drain_file)
        self._scheduler = scheduler
        self._end_session = end_session
        self._poll_s = poll_s
        self._clock = clock
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prepos-drain")
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._count_lock = threading.Lock()
        self.num_ended = 0  # drain ENDs answered
        self.num_failed = 0  # drain ENDs refused (Triton no longer held the sequence) or failed

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
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._take_up():
            if self._stopped.wait(self._poll_s):
                return
        began = self._clock()
        log.info("drain file %s found: draining (STARTs are refused; every open session is ended, its journal "
                 "kept)", self.drain_file)
        self._scheduler.drain()
        under_way: set[Future] = set()
        awaited: set[Future] | None = None  # the ENDs the report waits for; None: not chosen yet
        reported = False
        while not self._stopped.is_set():
            listed = self._scheduler.drain_listed  # read first: then every listed id is in the queue already
            try:
                under_way.add(self._pool.submit(self._end, self._scheduler.drain_ids.get(timeout=self._poll_s)))
                while True:  # and every id queued by now
                    under_way.add(self._pool.submit(self._end, self._scheduler.drain_ids.get_nowait()))
            except queue.Empty:
                pass
            if self._take_up():  # asked again (a stop after a drain begun by hand, say): report again
                reported, awaited = False, None
            under_way = {future for future in under_way if not future.done()}
            if reported or not listed:
                continue
            # The report waits for the ENDs of the sessions open at the drain and of every START refused by the
            # time they are all queued, not for a moment with nothing queued: clients that keep trying to open
            # or resume sessions would put that off without end. A START refused later changed nothing; its END
            # (which frees Triton's sequence slot) is sent all the same.
            awaited = set(under_way) if awaited is None else {future for future in awaited if not future.done()}
            if not awaited:
                reported = True
                self._report(self._clock() - began)

    def _take_up(self) -> bool:
        """Remove the drain file if it is there (the writer then knows the drain is under way, and waits for the
        report); returns whether it was."""
        try:
            self.drain_file.unlink()
            return True
        except OSError:
            return False

    def _end(self, session_id: str | int) -> None:
        try:
            self._end_session(session_id)
            with self._count_lock:
                self.num_ended += 1
        except Exception as err:  # noqa: BLE001 - one session's END failing stops no other's
            with self._count_lock:
                self.num_failed += 1
            log.info("drain: the END of session %r was not served (%s)", session_id, err)

    def _report(self, took_s: float) -> None:
        report = DrainReport(num_ended=self.num_ended, num_failed=self.num_failed,
                             num_open=self._scheduler.open_sessions, seconds=round(took_s, 3))
        log.info("drained in %.2f s: %d sessions ended, %d ENDs not served, %d sessions still open", took_s,
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
            log.warning("the model did not take up the drain file %s within %.0f s (not loaded yet?); stopping "
                        "without a drain", drain_file, pickup_s)
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
