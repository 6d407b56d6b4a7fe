"""A session that lives on its ring-hash replica and moves when that replica is lost (see :mod:`.routing`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, TypeVar

from .errors import PreposError, PreposTimeout, PreposUnavailable
from .protocol import Answer, Chunk, Update
from .refusals import says_draining, server_away
from .lifetime import close_on_exit
from .session import Session
from .session_ids import check_session_id

if TYPE_CHECKING:
    from .routing import RoutedClient

logger = logging.getLogger("prepos_client.routing")

_T = TypeVar("_T")


@dataclass(frozen=True)
class Failover:
    """A session moved because its replica could not be reached or was stopping (`reason`: the error it gave)."""

    session_id: str | int
    from_replica: str
    to_replica: str
    reason: str


def _why_moves(error: PreposError, answers: Callable[[], bool]) -> tuple[str, bool] | None:
    """Why an error moves a session off its replica, and whether its request is sent again to the new owner;
    None when it does not move. Sent again: the replica cannot be reached, or refused the request because it is
    stopping (draining before the stop, then no longer serving the model: Triton unloads it once told to stop),
    which changed nothing there. Not sent again: the stream broke while the request was under way, or the call
    timed out and the replica does not answer a readiness check (`answers`, asked for timeouts only) either;
    such a request may have been accepted (its turn is in the journal the new owner reopens the session from)."""
    away = server_away(error)
    if away is not None:
        return away, True
    if isinstance(error, PreposTimeout):
        if error.field == "timeout":  # the server's own deadline error: it answers
            return None
        return None if answers() else ("answers nothing, not even a readiness check", False)
    if isinstance(error, PreposUnavailable):
        return "lost while the request was under way", False
    return None


class RoutedSession:
    """A `Session` that lives on its ring-hash replica and moves when that replica is lost.

    Same calls as `Session` (`append`, `generate`, `ask`, `settle`, `close`, `detach`).
    A call whose replica cannot be reached (`PreposUnavailable`: no server to
    connect to), or is stopping (draining: it ended the session, its journal
    kept, and refuses to reopen it; or no longer serving the model), removes
    that replica from the client's ring, moves the session to its new owner and
    is sent again there (resuming the session if it was opened), once per
    replica lost; it raises that error when no replica is left (the session
    then stays where it is, to resume there once the replica is back). A call
    whose stream broke while its request was under way moves the session too,
    but raises its `PreposUnavailable` (the request may have been accepted; see
    the module docstring); so does a call that timed out on a replica that then
    answers no readiness check (a hung replica), raising its `PreposTimeout`.
    Every other error is raised as `Session` raises it.
    `replica` is where the session is now; `failovers` lists its moves.
    With `wait_for_ready` (the client's), a call to a replica with no other on
    the ring waits for it instead of raising (see `RoutedClient`).
    """

    def __init__(self, client: RoutedClient, session_id: str | int, *, resume: bool):
        self.session_id = check_session_id(session_id)
        self.failovers: list[Failover] = []
        self.wait_for_ready = client.wait_for_ready
        self._client = client
        # Whether the session is open on the server side (a request that opened it succeeded):
        # a moved session is then resumed on its new owner, else opened there.
        self._opened = resume
        self._session = self._open(client.replica_for(self.session_id))

    @property
    def replica(self) -> str:
        """The address of the replica the session is on."""
        return self._session.url

    @property
    def closed(self) -> bool:
        """True once the session was closed or detached."""
        return self._session.closed

    def append(self, text: str | None = None, **kwargs) -> Update:
        """`Session.append` on the session's replica, moving it first if that replica is lost."""
        return self._call(lambda session: session.append(text, **kwargs))

    def ask(self, text: str | None = None, **kwargs) -> Answer:
        """`Session.ask` on the session's replica, moving it first if that replica is lost."""
        return Answer.from_chunks(list(self.generate(text, **kwargs)))

    def generate(self, text: str | None = None, **kwargs) -> Iterator[Chunk]:
        """`Session.generate`: the request is sent before this returns.

        A failure before the first chunk moves the session and sends the
        request again; once a chunk was yielded, errors are raised as they are.
        """
        def send(session: Session) -> Iterator[Chunk]:
            return session.generate(text, **kwargs)

        # Sent is not accepted: the session counts as opened only once a chunk arrives.
        session, chunks = self._call_with_session(send, accepted=False)
        return self._stream(session, chunks, send)

    def close(self, *, timeout_s: float | None = None) -> Update | None:
        """`Session.close` (END) on the session's replica, its new owner if that replica is lost.

        A moved session is ended on its new owner even when no other request
        reached it there, so that its journal is deleted.
        """
        if self._session.closed:
            return None
        return self._call(lambda session: session.close(timeout_s=timeout_s))

    def settle(self, *, timeout_s: float | None = None) -> None:
        """`Session.settle` on the session's replica: learn what became of the calls that timed out there (a call
        that timed out on a replica since lost keeps ``accepted`` None)."""
        self._session.settle(timeout_s=timeout_s)

    def cancel(self) -> None:
        """`Session.cancel` on the session's replica: stop its requests still being answered."""
        self._session.cancel()

    def detach(self) -> None:
        """Release the connection and leave the session open on its replica."""
        self._session.detach()

    def __enter__(self) -> RoutedSession:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        close_on_exit(self, exc_type)

    def __repr__(self) -> str:
        return f"RoutedSession({self.session_id!r}, replica={self.replica!r}, failovers={len(self.failovers)})"

    def _open(self, replica: str) -> Session:
        client = self._client
        return Session(replica, client.model, self.session_id, timeout_s=client.timeout_s,
                       headers=client.headers, resume=self._opened, tls=client.tls)

    def _call(self, send: Callable[[Session], _T]) -> _T:
        return self._call_with_session(send)[1]

    def _call_with_session(self, send: Callable[[Session], _T], *, accepted: bool = True) -> tuple[Session, _T]:
        while True:
            session = self._session
            # Waiting for a replica that is down is for when there is no other to move to (one that left the ring
            # and is ready again counts: it is asked first, and again while the call waits, which ends once there
            # is one, for the session to move there).
            session.wait_for_ready = self.wait_for_ready and self._client.is_alone(session.url, readmit=True)
            session.keep_waiting = partial(self._client.keeps_waiting_for, session.url)
            try:
                result = send(session)
            except PreposError as error:
                self._move_or_raise(session, error)
                continue
            self._opened = self._opened or accepted
            return session, result

    def _stream(self, session: Session, chunks: Iterator[Chunk],
                send: Callable[[Session], Iterator[Chunk]]) -> Iterator[Chunk]:
        while True:
            try:
                first = next(chunks)
            except PreposError as error:
                self._move_or_raise(session, error)
                session, chunks = self._call_with_session(send, accepted=False)
                continue
            break
        self._opened = True
        yield first
        yield from chunks

    def _move_or_raise(self, session: Session, error: PreposError) -> None:
        """Move the session off `session`'s replica for `error` (see `_why_moves`), or raise `error` when it does not
        move the session; returns when the request is to be sent again on the new owner."""
        moves = _why_moves(error, lambda: self._client.is_ready(session.url))
        if moves is None:
            raise error
        self._fail_over(session, error, moves)

    def _fail_over(self, session: Session, error: PreposError, moves: tuple[str, bool]) -> None:
        """Move the session off `session`'s replica; raise `error` when its request is not to be sent again, or
        when no replica is left (the session then stays on its replica, to resume there once it is back)."""
        why, send_again = moves
        if self._session is not session:  # a request sent before this one's failure moved the session already
            if not send_again:
                raise error
            return
        lost = session.url
        self._client.lose_replica(lost, draining=says_draining(error))
        try:
            replica = self._client.owner(self.session_id)
        except LookupError:
            if send_again and self.wait_for_ready and not session.wait_for_ready:
                # Its replica was not the last on the ring when the call went out, and is now (another session's
                # call took the others off it meanwhile): sent again, the call waits for it, as it would have.
                return
            raise error from None
        try:
            session.detach()
        except PreposError:
            logger.debug("releasing the stream to %s failed", lost, exc_info=True)
        self.failovers.append(Failover(self.session_id, lost, replica, str(error)))
        logger.warning("session %s: replica %s %s (%s); moved to %s", self.session_id, lost, why, error, replica)
        self._session = self._open(replica)
        if not send_again:
            raise error
