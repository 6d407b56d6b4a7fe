"""The engine as the engine loop uses it: every call that may write a session's KV is reported first.

A session's positioned state (its cached distribution, and the KV length it was computed at) describes what the
KV held when its pre-positioning finished. Any later write to that KV -- a request's prefill or decode, a gate
audit, a truncate, a release -- makes it describe something else, and a request that then answered from it would
decode on top of the wrong tokens. Reporting every such call from this one place makes the rule hold for every
path that writes, present or future, instead of each caller having to remember it.
"""

from __future__ import annotations

from typing import Callable, Sequence

from prepos.engines.base import Engine


class WriteReportingEngine:
    """Delegates to ``engine``; calls ``on_write(session_id)`` before each call that may change what a session's
    KV holds (prefills, decodes, ``share_prefix``, truncates, releases, ``keep_prefix``). Room made ahead
    (``reserve``) changes no tokens and is not reported; everything else passes through unchanged."""

    def __init__(self, engine: Engine, on_write: Callable[[str | int], None]) -> None:
        self._engine = engine
        self._on_write = on_write

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def prefill(self, session_id, token_ids: Sequence[int]):
        self._on_write(session_id)
        return self._engine.prefill(session_id, token_ids)

    def prefill_steps(self, session_id, token_ids: Sequence[int]):
        self._on_write(session_id)
        return self._engine.prefill_steps(session_id, token_ids)

    def prefill_batch(self, session_ids: Sequence, token_ids: Sequence[Sequence[int]]):
        for session_id in session_ids:
            self._on_write(session_id)
        return self._engine.prefill_batch(session_ids, token_ids)

    def decode(self, session_id, token_id: int):
        self._on_write(session_id)
        return self._engine.decode(session_id, token_id)

    def decode_batch(self, session_ids: Sequence, token_ids: Sequence[int]):
        for session_id in session_ids:
            self._on_write(session_id)
        return self._engine.decode_batch(session_ids, token_ids)

    def share_prefix(self, session_id, token_ids: Sequence[int]) -> int:
        self._on_write(session_id)
        return self._engine.share_prefix(session_id, token_ids)

    def truncate(self, session_id, num_tokens: int) -> None:
        self._on_write(session_id)
        self._engine.truncate(session_id, num_tokens)

    def release(self, session_id) -> None:
        self._on_write(session_id)
        self._engine.release(session_id)

    def keep_prefix(self, session_id, num_tokens: int) -> bool:
        self._on_write(session_id)
        return self._engine.keep_prefix(session_id, num_tokens)
