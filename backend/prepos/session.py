"""Sessions and the session store.

A session's token log is the source of truth; its KV (held by the engine) can
always be rebuilt from it. State transitions live here:

    open -> (requests append to the log; any append invalidates `positioned`)
    idle -> positioning -> positioned  (pre-positioning in the idle window)
    resident KV -> evicted (memory pressure) -> rebuilt on the next request
    closed (END or idle timeout): the store forgets the session
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from prepos.protocol import ProtocolError, Status
from prepos.scan import ScanResult


class SessionState(enum.Enum):
    SERVING = "serving"  # a foreground request is being served
    POSITIONED = "positioned"  # idle, cached distribution valid
    RESIDENT = "resident"  # idle, KV resident but not positioned
    EVICTED = "evicted"  # idle, no KV (or never had any)


@dataclass
class Positioned:
    """The cached decision point: KV holds ``log + spec_ids`` and ``logits`` are the distribution after it."""

    log_length: int  # token log length when positioned; any append makes it stale
    role: str  # role whose entry was pre-paid
    choices: tuple[str, ...] | None  # choice set whose shared leading tokens were followed
    spec_ids: tuple[int, ...]  # opening + entry + speculative delta + cue + forced choice tokens
    forced_ids: tuple[int, ...]  # the trailing forced choice tokens of spec_ids
    logits: torch.Tensor  # [vocab], owned copy
    greedy_scan: ScanResult | None = None  # precomputed scan at temperature 0 under ``choices``
    delta_ids: tuple[int, ...] = ()  # the speculative delta in spec_ids (a placeholder, or none)


BURST_GAP_S = 0.5  # requests of a session closer together than this belong to one burst


@dataclass
class Session:
    session_id: str | int
    token_log: list[int] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)  # where each accepted turn begins in the token log
    positioned: Positioned | None = None
    has_kv: bool = False
    evicted: bool = False  # KV was dropped under memory pressure; the next request rebuilds it
    serving: bool = False
    ending: bool = False  # the request being served carries END: the session closes when it is done
    journaled: bool = True  # its accepted turns go to its journal (where there is one); not a START+END session's
    last_role: str = "user"
    last_choices: tuple[str, ...] | None = None
    last_active_s: float = 0.0
    requests_served: int = 0
    gap_s: float | None = None  # typical idle gap before this session's next request (moving average), once known
    pending: deque = field(default_factory=deque)  # (Request, ResponseSink) in arrival order
    task: Iterator[None] | None = None  # the engine loop's foreground task serving ``pending``

    @property
    def state(self) -> SessionState:
        if self.serving:
            return SessionState.SERVING
        if self.positioned_valid():
            return SessionState.POSITIONED
        return SessionState.RESIDENT if self.has_kv else SessionState.EVICTED

    def positioned_valid(self) -> bool:
        return self.positioned is not None and self.positioned.log_length == len(self.token_log)

    def note_arrival(self, arrival_s: float) -> None:
        """A request of this session starts: fold the idle gap since its previous request ended into ``gap_s``
        (the newest gap weighs half). A gap under ``BURST_GAP_S`` is one burst (an update and then its question,
        say), not an idle window, and is left out."""
        gap = arrival_s - self.last_active_s
        if self.requests_served and gap >= BURST_GAP_S:
            self.gap_s = gap if self.gap_s is None else (self.gap_s + gap) / 2
        self.requests_served += 1

    def append(self, token_ids: Sequence[int]) -> None:
        """Accept one turn into the log; the cached distribution no longer matches it."""
        if token_ids:
            self.turn_starts.append(len(self.token_log))
            self.token_log.extend(token_ids)
            self.positioned = None

    def turns(self) -> list[list[int]]:
        """The accepted turns, in order (their concatenation is the token log)."""
        bounds = [*self.turn_starts, len(self.token_log)]
        return [self.token_log[a:b] for a, b in zip(bounds, bounds[1:])]

    def turns_within(self, max_log_tokens: int) -> list[list[int]] | None:
        """The turns left when the oldest after the first (the system turn) are dropped until the log holds at
        most ``max_log_tokens`` tokens, or None when even the first turn alone is longer. Changes nothing."""
        kept, total = self.turns(), len(self.token_log)
        while total > max_log_tokens and len(kept) > 1:
            total -= len(kept.pop(1))
        return kept if total <= max_log_tokens else None

    def replace_turns(self, turns: Sequence[Sequence[int]]) -> None:
        """The log becomes ``turns`` (what :meth:`turns_within` kept); the cached distribution no longer matches."""
        self.token_log, self.turn_starts, self.positioned = [], [], None
        for turn in turns:
            self.append(turn)

    def mark_kv(self, resident: bool) -> None:
        self.has_kv = resident
        if not resident:
            self.positioned = None

    def mark_evicted(self) -> None:
        self.mark_kv(False)
        self.evicted = True


class SessionStore:
    """Open sessions by id. Not thread-safe: owned by the engine loop."""

    def __init__(self, max_sessions: int):
        self._sessions: dict[str | int, Session] = {}
        self._max_sessions = max_sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def open(self, session_id: str | int, now_s: float) -> Session:
        """Open a new session. Raises ProtocolError if it is open already or the store is full."""
        if session_id in self._sessions:
            raise ProtocolError("START", f"session {session_id!r} is already open", Status.ALREADY_EXISTS)
        if len(self._sessions) >= self._max_sessions:
            raise ProtocolError("START", f"session {session_id!r} not opened: too many open sessions (limit "
                                          f"{self._max_sessions})", Status.RESOURCE_EXHAUSTED)
        session = Session(session_id, last_active_s=now_s)
        self._sessions[session_id] = session
        return session

    def lookup(self, session_id: str | int) -> Session:
        """The open session with this id. Raises ProtocolError if there is none."""
        try:
            return self._sessions[session_id]
        except KeyError:
            raise ProtocolError(
                "START", f"session {session_id!r} is not open; send START with its first request", Status.NOT_FOUND
            ) from None

    def get(self, session_id: str | int) -> Session | None:
        return self._sessions.get(session_id)

    def close(self, session_id: str | int) -> Session | None:
        return self._sessions.pop(session_id, None)

    def count_by_state(self) -> dict[SessionState, int]:
        counts = {state: 0 for state in SessionState}
        for session in self._sessions.values():
            counts[session.state] += 1
        return counts
