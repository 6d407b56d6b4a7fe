"""Session-affine routing in the client: each session on the replica Envoy's ring hash picks for it.

    from prepos_client.routing import RoutedClient

    replicas = ["10.0.0.5:8001", "10.0.0.6:8001"]
    with RoutedClient(replicas) as client, client.session() as session:
        answer = session.ask("Is water wet?", choices=["yes", "no"])
        print(answer.text, answer.path, session.replica)

The chart's router hashes the `prepos-session-id` header onto the replicas
with Envoy's ring hash; `RoutedClient` applies the same rule (`HashRing`)
itself, for a deployment without the router tier and for the loopback test
of routing. A session is placed when it is opened and stays on its replica,
as a session's gRPC stream stays on the upstream Envoy routed it to.

When a session's replica cannot be reached, the replica leaves the ring (for
every session of this client) and the session moves to its owner on the
smaller ring: the call is sent again there, with START and the `resume` input
(Triton routes a sequence's first request on a replica only with START;
`resume` asks the server to continue the session rather than begin a new
one). The new owner holds no KV for the session. With a session journal
shared by the replicas (`journal.dir` on one volume) it reopens the session
from the journal and rebuilds the KV from the token log (path `rebuild`);
without one it refuses the request (`PreposError` naming `resume`): the
session's state was lost with its replica.

A replica draining before a stop (see the README, "Stopping the server") ends
its sessions, keeping their journals, and refuses to reopen them; once the
drain is done Triton unloads the model and refuses every request for it
("... has no available versions"). Neither refusal changed anything there:
the session moves the same way, and resumes on its new owner from the shared
journal.

A replica that left the ring so rejoins it once it reports the model ready
again (a restart, a rolling update), as Envoy's health checks bring an
endpoint back: when a session is placed, each replica that left is asked at
most every `readmit_interval_s`. A draining replica still reports the model
ready until its stop begins, so one that left because it was draining rejoins
only once it was seen not ready since (stopping, or restarting), or
`drain_readmit_after_s` (5 s) after it left: a drain and stop take a second or
two unless a long answer is under way, and a restart with its model load
about as long as the allowance or longer (8 s for the default model on a
2-core CPU), so a replica that restarted between two placements is kept off
for a few seconds at most. A drain longer than the allowance may still see the
replica taken back for a moment; a session placed there is refused as
draining and moves again. Sessions that moved stay where they are; sessions
opened from then on are placed on the whole ring again.

A request whose stream broke after it connected (its replica died while it
was under way) may have been accepted there before the connection broke: it
is not sent again (the new owner, reopening the session from the shared
journal, may hold its turn already). The session moves all the same, and the
call raises the `PreposUnavailable`, as `Session` does; the next call goes on
on the new owner. (A stream that broke after the answer's first chunk raises
as it is, and the session moves at its next call, which finds the replica
gone.) Only refusals that changed nothing (no server to connect
to, a drain, a model no longer served) are sent again, so a turn is taken
once across a failover too.

A replica that accepts connections but answers nothing (a frozen process, a
node cut off behind a proxy that still accepts) shows only as calls that time
out. When a call times out on the client's time limit (not the server's own
deadline error, which shows the replica answers), its replica is asked whether
it is ready, each of the check's two calls (server live, model ready) with
`health_timeout_s` to answer: one that does not answer, or is not ready,
leaves the ring as an unreachable one does, and the session moves; the call
raises its `PreposTimeout` all the same (the request may have been accepted
there, as with a broken stream). A replica that answers ready is only slow:
the session stays. So a hung replica costs each session placed on it one
timed-out call, and is no longer given new sessions after the first.

When the last replica on the ring is lost, the call raises and the session
stays on that replica: its next call goes there again, and resumes the
session once the replica is back. With `wait_for_ready`, a call to a replica
with no other on the ring (a single replica restarting, or the last one left)
waits for it instead, within its time limit, as `Client(wait_for_ready=True)`
does, and is sent again once it reports the model ready.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .channel import Tls, check_headers, check_url, tls_of
from .client import DEFAULT_MODEL, GRPC_ACCESS_TOKEN_HEADER, Client
from .deadlines import MAX_TIMEOUT_S, check_timeout
from .errors import PreposError
from .lifetime import left_as_superseded
from .protocol import is_number
from .ring import DEFAULT_MAX_RING_SIZE, DEFAULT_MIN_RING_SIZE, HashRing
from .routed_session import Failover, RoutedSession  # noqa: F401 - Failover: part of this module's API
from .session_ids import check_session_id, new_session_id

logger = logging.getLogger(__name__)


READMIT_INTERVAL_S = 2.0
"""How often, at most, a replica that left the ring is asked whether it is ready again."""

HEALTH_TIMEOUT_S = 1.0
"""How long a replica has to answer a readiness check: one that left the ring, or one a call timed out on."""

DRAIN_READMIT_AFTER_S = 5.0
"""How long after a replica left the ring because it was draining it may rejoin, ready, though it was never seen
not ready since: longer than most drains, shorter than a restart."""


@dataclass
class _Left:
    """A replica that left the ring and may rejoin it: when it left and was last asked (monotonic), and whether it
    was seen not ready (or unreachable) since it left."""

    since: float
    asked: float
    seen_down: bool


class RoutedClient:
    """Opens sessions on the replica the ring hash assigns to each session id.

    Args:
        replicas: gRPC addresses (`host:port`) of the replicas, each weight 1,
            or a mapping of address to integer weight. Give the addresses the
            router hashes (the Helm chart's: each replica's pod DNS name and gRPC
            port) to route exactly as the router.
        model, timeout_s, headers, token, tls: as for `Client` (the same on every replica).
        min_ring_size, max_ring_size: as the chart's `router.ringHash`.
        readmit_interval_s: how often, at most, a replica that left the ring because it could not be reached or
            was stopping is asked whether it is ready again (when a session is placed); once it is, it rejoins.
        health_timeout_s: how long a replica has to answer each of the two calls of such a check (server live,
            model ready), and of the check made when a call times out on it (one that does not answer in time
            leaves the ring). The placement that asks waits for it.
        wait_for_ready: a call whose replica is stopping, restarting or unreachable while no other replica is on
            the ring waits, within its time limit, until that replica is ready again and is sent again then,
            instead of raising (see `Client`); with other replicas on the ring the session moves, as without it.
        drain_readmit_after_s: a replica that left because it was draining rejoins once ready only after it was
            seen not ready since, or after this long (it reports the model ready while it drains).

    Raises:
        ValueError, TypeError: bad replicas or ring sizes (see `HashRing`).

    Safe to share between threads; each `RoutedSession` is for one thread at a time.
    """

    def __init__(
        self,
        replicas: Sequence[str] | Mapping[str, int],
        model: str = DEFAULT_MODEL,
        *,
        timeout_s: float = 60.0,
        headers: Mapping[str, str] | None = None,
        token: str | None = None,
        min_ring_size: int = DEFAULT_MIN_RING_SIZE,
        max_ring_size: int = DEFAULT_MAX_RING_SIZE,
        readmit_interval_s: float = READMIT_INTERVAL_S,
        drain_readmit_after_s: float = DRAIN_READMIT_AFTER_S,
        health_timeout_s: float = HEALTH_TIMEOUT_S,
        wait_for_ready: bool = False,
        tls: bool | Tls = False,
    ):
        self.model = model
        self.wait_for_ready = bool(wait_for_ready)
        self.tls = tls_of(tls)
        self.timeout_s = check_timeout(timeout_s)
        self.headers = check_headers(headers)
        if token:
            self.headers[GRPC_ACCESS_TOKEN_HEADER] = token
        for replica in replicas:
            if isinstance(replica, str):  # gRPC would wrap a port past 65535 onto another one
                check_url(replica)
        self._ring = HashRing(replicas, min_ring_size=min_ring_size, max_ring_size=max_ring_size)
        if not self._ring.hosts:
            raise ValueError("replicas: at least one replica is needed")
        self._readmit_interval_s = check_timeout(readmit_interval_s, "readmit_interval_s")
        if not is_number(drain_readmit_after_s):
            raise TypeError(f"drain_readmit_after_s: expected seconds as a number, got {drain_readmit_after_s!r}")
        if not drain_readmit_after_s >= 0:
            raise ValueError(f"drain_readmit_after_s: expected seconds >= 0, got {drain_readmit_after_s!r}")
        self._drain_readmit_after_s = float(drain_readmit_after_s)
        self._health_timeout_s = check_timeout(health_timeout_s, "health_timeout_s")
        if not math.isfinite(self._health_timeout_s):  # a hung replica would hold up every placement for good
            raise ValueError(f"health_timeout_s: expected finite seconds, at most {MAX_TIMEOUT_S:g}, got "
                             f"{health_timeout_s!r}")
        self._weights = self._ring.weights  # every replica on the ring, in the order given
        self._left: dict[str, _Left] = {}  # replicas that left the ring and may rejoin it
        self._lock = threading.Lock()
        self._sessions: weakref.WeakSet[RoutedSession] = weakref.WeakSet()

    @property
    def ring(self) -> HashRing:
        """The current ring (replicas that failed are no longer on it)."""
        return self._ring

    @property
    def replicas(self) -> tuple[str, ...]:
        """The replicas sessions are routed to now."""
        return self._ring.hosts

    def replica_for(self, session_id: str | int) -> str:
        """The replica a session opened now would be placed on (a replica that left the ring and is ready again
        rejoins it first).

        Raises:
            LookupError: no replica is left (without `wait_for_ready`; with it, the session's owner among every
                replica that left the ring is given, for its first call to wait for).
        """
        session_id = check_session_id(session_id)
        try:
            return self.owner(session_id)
        except LookupError:
            if not self.wait_for_ready:
                raise
        # Every replica left the ring: place it as if none had, and its first call waits for its owner.
        with self._lock:
            every = self._ring_of(self._weights)
        return every.lookup(session_id)

    def owner(self, session_id: str | int) -> str:
        """The session's owner on the ring as it is (a replica that left the ring and is ready again rejoins it
        first). Raises LookupError when no replica is on it."""
        self._readmit()
        return self._ring.lookup(session_id)

    def session(self, session_id: str | int | None = None, *, resume: bool = False) -> RoutedSession:
        """Open a `RoutedSession` on its replica (on the server with its first request).

        `session_id` None picks a fresh random id; `resume=True` continues a
        session opened earlier (START is sent with `resume`, as for `Client.session`).

        Raises:
            LookupError: no replica is left on the ring (every one was lost, and none is ready again yet).
        """
        session = RoutedSession(self, new_session_id() if session_id is None else session_id, resume=resume)
        with self._lock:
            self._sessions.add(session)
        return session

    def is_alone(self, replica: str, *, readmit: bool = False) -> bool:
        """Whether no replica but `replica` is on the ring (it may have left it itself); with `readmit`, replicas
        that left the ring are asked first whether they are ready again (at most every `readmit_interval_s`)."""
        if readmit and set(self._ring.hosts) <= {replica}:
            self._readmit()
        return set(self._ring.hosts) <= {replica}

    def keeps_waiting_for(self, replica: str, left_s: float) -> bool:
        """Whether a call waiting `left_s` more seconds for `replica` waits on: no other replica is on the ring, once
        those that left it were asked whether they are ready again (not asked when the asking could take longer
        than `left_s`: each check is two calls of up to `health_timeout_s`)."""
        with self._lock:
            num_left = len(self._left)
        return self.is_alone(replica, readmit=2 * self._health_timeout_s * num_left < left_s)

    def remove_replica(self, replica: str) -> bool:
        """Take `replica` out of the ring for good (a scale-down); True if it was on it.

        Sessions already on it stay there until a request to it fails;
        sessions opened later go to the smaller ring's owners.
        """
        return self._leave(replica, for_good=True)

    def add_replica(self, replica: str, weight: int = 1) -> None:
        """Put `replica` on the ring (last in host order) with `weight`, for sessions opened from now on."""
        check_url(replica)
        with self._lock:
            self._weights[replica] = weight
            self._left.pop(replica, None)
            self._rebuild()

    def lose_replica(self, replica: str, *, draining: bool = False) -> bool:
        """Take `replica` out of the ring because it could not be reached or is stopping: it rejoins once it
        reports the model ready again (`draining`: it refused a request as draining, and still reports ready
        until its stop begins: it rejoins once ready after it was seen not ready, or `drain_readmit_after_s`
        after it left). True if it was on the ring."""
        return self._leave(replica, for_good=False, draining=draining)

    def _leave(self, replica: str, *, for_good: bool, draining: bool = False) -> bool:
        with self._lock:
            was_on = replica in self._ring.hosts
            if for_good:
                self._weights.pop(replica, None)
                self._left.pop(replica, None)
            elif replica in self._weights:
                now = time.monotonic()
                self._left[replica] = _Left(since=now, asked=now, seen_down=not draining)
            hosts = self._rebuild()
        if was_on:
            logger.warning("replica %s left the ring; %d left: %s", replica, len(hosts), ", ".join(hosts))
        return was_on

    def _rebuild(self) -> tuple[str, ...]:
        """Make the ring over every replica given or added that has not left, in that order; returns its hosts.
        Callers hold the lock."""
        live = {replica: weight for replica, weight in self._weights.items() if replica not in self._left}
        self._ring = self._ring_of(live)
        return self._ring.hosts

    def _ring_of(self, weights: Mapping[str, int]) -> HashRing:
        """A ring over `weights` with this client's ring sizes."""
        return HashRing(weights, min_ring_size=self._ring.min_ring_size, max_ring_size=self._ring.max_ring_size)

    def _readmit(self) -> None:
        """Ask each replica that left the ring, and was not asked within ``readmit_interval_s``, whether it is
        ready again; put those that are back on the ring, in the order the replicas were given. One that left
        draining, never seen not ready since, stays off until ``drain_readmit_after_s`` after it left."""
        now = time.monotonic()
        with self._lock:
            due = [replica for replica, left in self._left.items() if now - left.asked >= self._readmit_interval_s]
            for replica in due:
                self._left[replica].asked = now  # one caller asks; the others go on with the ring as it is
        ready = {replica: self.is_ready(replica) for replica in due}
        back = []
        with self._lock:
            for replica, is_ready in ready.items():
                left = self._left.get(replica)
                if left is None:  # added or removed meanwhile
                    continue
                if not is_ready:
                    left.seen_down = True
                elif left.seen_down or now - left.since >= self._drain_readmit_after_s:
                    back.append(replica)
                    del self._left[replica]
            if not back:
                return
            hosts = self._rebuild()
        logger.warning("replica %s ready again: back on the ring; %d on it: %s", ", ".join(back), len(hosts),
                       ", ".join(hosts))

    def is_ready(self, replica: str) -> bool:
        """Whether `replica` reports itself live and the model ready, each call within `health_timeout_s` (False:
        not ready, not reachable, or no answer in time)."""
        with Client(replica, self.model, timeout_s=self._health_timeout_s, headers=self.headers,
                    tls=self.tls or False) as health:
            return health.is_ready()

    def close(self) -> None:
        """Close every session of this client that is still open; each END is tried once, without waiting for a
        replica that is down (`wait_for_ready`)."""
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:
            session.wait_for_ready = False
            if left_as_superseded(session, session._session):  # noqa: SLF001 (this package's own)
                continue
            try:
                session.close()
            except PreposError:
                logger.warning("closing session %s failed", session.session_id, exc_info=True)

    def __enter__(self) -> RoutedClient:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close()
