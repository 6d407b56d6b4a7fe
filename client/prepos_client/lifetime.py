"""What becomes of sessions a program leaves open: closed at interpreter exit, or, when dropped without close
or detach, their connection closed on a thread of their own; and of an END a call stopped waiting for, which is
left to reach the server."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref

from .channel import stop_stream
from .errors import PreposError

logger = logging.getLogger(__name__)

# How long the END of a session still open at interpreter exit may take.
_EXIT_CLOSE_TIMEOUT_S = 2.0

streaming_sessions: weakref.WeakSet = weakref.WeakSet()  # sessions with a stream open: closed at exit

# For each (url, model, session id), the Session of this process that last opened it on the server (its START, or
# START and resume, answered): another one is a stale handle (its stream lost in a restart, say, and the session
# continued through a new handle with resume=True), whose END would end the session that handle goes on with.
_opened_by: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def handle_opened(session) -> None:
    """Note ``session`` as the handle that opened its session on the server last, in this process."""
    _opened_by[(session.url, session.model, session.session_id)] = session


def superseded(session) -> bool:
    """Whether another live handle of this process has opened ``session``'s session on the server since it did: the
    session is that handle's now (one made but refused as already open, or never used, takes nothing over)."""
    opener = _opened_by.get((session.url, session.model, session.session_id))
    return opener is not None and opener is not session


def left_as_superseded(session, handle=None, *, when: str = "") -> bool:
    """Where ``handle`` (default: ``session``, a Session; a RoutedSession's current one otherwise) is
    :func:`superseded`, detach ``session`` without END, saying why (``when``: " at exit", say), and return True:
    its END would end the session the other handle holds now."""
    if not superseded(session if handle is None else handle):
        return False
    logger.warning("session %s: an older handle of it is left%s without END: another one of this process has "
                   "opened the session since (resume=True, say) and holds it", session.session_id, when)
    session.detach()
    return True


def _threads_start() -> bool:
    """Whether a thread can still be started: from Python 3.12 on, not while the interpreter shuts down, where
    threading's exit hooks run."""
    probe = threading.Thread(target=lambda: None, name="prepos-exit-probe", daemon=True)
    try:
        probe.start()
    except RuntimeError:
        return False
    probe.join()
    return True


_no_new_streams = False  # set at exit where no thread can start any more


def check_new_stream(session_id) -> None:
    """Raise `PreposError` where a session may not open a new stream: at interpreter exit, where no thread can
    start (Python 3.12 on). gRPC starts one for a new call on a channel with none under way; refused, the call was
    left half made, and closing its channel then waited for it for ever, so that the program never exited."""
    if _no_new_streams:
        raise PreposError(f"session {session_id}: its stream is closed, and no new one can be opened while Python "
                          "shuts down; the server ends the session at its idle timeout")


def _close_sessions_at_exit() -> None:
    global _no_new_streams
    _no_new_streams = not _threads_start()
    for session in list(streaming_sessions):
        session.wait_for_ready = False  # a server that is down does not hold up the exit for every session
        if left_as_superseded(session, when=" at exit"):
            continue
        requests = session._requests  # noqa: SLF001 (this package's own)
        if _no_new_streams and not requests.stream_live:  # nothing to send its END on: not tried
            logger.warning("session %s left open at exit: its stream is closed, and no new one can be opened while "
                           "Python shuts down; the server ends it at its idle timeout", session.session_id)
            requests.release()
            continue
        try:
            session.close(timeout_s=min(session.timeout_s, _EXIT_CLOSE_TIMEOUT_S))
        except PreposError as error:
            logger.warning("closing session %s at exit failed: %s", session.session_id, error)


# tritonclient's stream thread is not a daemon thread, and atexit handlers run
# only after such threads are joined: a session left open would hang
# interpreter exit. threading._register_atexit runs before that join.
getattr(threading, "_register_atexit", atexit.register)(_close_sessions_at_exit)


# A Session dropped without close or detach is often in a reference cycle (an exception it raised holds its frames),
# so the garbage collector finalizes it, on whatever thread happens to allocate. tritonclient's own finalizer would
# then stop the stream by joining its thread: that blocks the collecting thread until the server ends the stream,
# and deadlocks it when it is starting a thread itself (the collection runs under threading's shutdown lock, which
# the join takes too). Such a connection goes to a thread of its own instead, which cancels the stream and closes
# it. The thread is started with the first Session: starting it from a finalizer could deadlock the same way.
_abandoned: queue.SimpleQueue = queue.SimpleQueue()
_closer_started = threading.Lock()
_closer: threading.Thread | None = None


def _close_abandoned() -> None:
    while True:
        triton = _abandoned.get()
        try:
            stop_stream(triton, cancel_requests=True)
            triton.close()
        except Exception:  # the connection is dropped either way
            logger.debug("closing the connection of a dropped session failed", exc_info=True)
        del triton  # its finalizer, now with nothing to join, runs here


END_FINISH_S = 30.0
"""How long an END whose call ran out of its time limit is left to be answered before its stream is cancelled."""


def finish_then_close(triton, router, wait_s: float = END_FINISH_S) -> None:
    """Stop ``triton``'s stream once ``router`` has no request pending (at most ``wait_s``; what is still pending
    then is cancelled) and close the connection, on a thread of its own. For an END its call stopped waiting for:
    cancelled, it would not reach the server, and Triton would keep the session's sequence open (its id refused as
    already open) until the idle timeout; sent, it ends the sequence whatever the server answers."""
    def finish() -> None:
        deadline = time.monotonic() + wait_s
        while router.num_pending and router.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            stop_stream(triton, cancel_requests=router.failure is None and router.num_pending > 0)
            triton.close()
        except Exception:  # the connection is dropped either way
            logger.debug("closing the connection of an ended session failed", exc_info=True)

    try:
        threading.Thread(target=finish, name="prepos-session-end", daemon=True).start()
    except RuntimeError:  # at interpreter exit (Python 3.12 on): no waiting for the END then
        stop_stream(triton, cancel_requests=True)
        triton.close()


def close_on_exit(session, exc_type) -> None:
    """A session's ``__exit__``: close it. Leaving on an error, END is tried once (not waited for, whatever
    ``wait_for_ready``) and a failure to close is logged, the error that is leaving raised instead."""
    if exc_type is not None:
        session.wait_for_ready = False
    try:
        session.close()
    except PreposError:
        if exc_type is None:
            raise
        logger.warning("closing session %s failed", session.session_id, exc_info=True)


def _start_closer() -> None:
    global _closer
    with _closer_started:
        if _closer is None:
            _closer = threading.Thread(target=_close_abandoned, name="prepos-dropped-sessions", daemon=True)
            _closer.start()


def close_when_dropped(session, triton) -> weakref.finalize:
    """Have ``triton`` (the session's connection) stopped and closed on the closer thread if ``session`` is
    collected while still open; the caller detaches the returned finalizer once it closed the connection itself."""
    _start_closer()
    dropped = weakref.finalize(session, _abandoned.put, triton)
    dropped.atexit = False  # at exit _close_sessions_at_exit ends what is still open
    return dropped
