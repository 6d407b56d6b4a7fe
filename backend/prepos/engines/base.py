"""The engine contract: what the scheduler needs from a model runtime.

An engine owns per-session KV caches. The scheduler never sees KV tensors; it
asks an engine to make a session's KV hold a token sequence and gets the
next-token logits there. Engines are interchangeable (torch, TensorRT-LLM) and
nothing here knows about Triton or threads: one engine loop calls an engine.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Generator, Sequence

import torch


@dataclass(frozen=True)
class EngineInfo:
    """Static facts about a loaded engine."""

    name: str
    vocab_size: int
    max_context: int  # tokens a session's KV may hold
    kv_bytes_per_token: int  # KV bytes one cached token costs, all layers
    weight_bytes: int  # bytes read by one decode step (the memory-bound floor)
    device: str  # "cpu", "cuda", "cuda:0", ...


class KVCapacityError(RuntimeError):
    """The engine's KV memory has no room for a session's new tokens; the message gives the sizes."""


class Engine(abc.ABC):
    """Per-session KV cache plus forward passes.

    Every method is called from one thread (the engine loop). Logits are a 1-D
    float32 torch tensor ``[vocab]`` on the engine's device; callers must not
    modify them, and they stay valid until the next call for the same session.
    """

    info: EngineInfo
    kv_capacity_bytes: int | None = None
    """KV bytes of a pool the engine allocated up front (sessions beyond it cannot grow), or None where
    KV memory is allocated on demand."""
    num_shared_tokens: int = 0
    """Tokens whose KV :meth:`share_prefix` (or a prefill) copied from another session's since construction."""

    @abc.abstractmethod
    def prefill(self, session_id: str, token_ids: Sequence[int]) -> torch.Tensor:
        """Make the session's KV hold exactly ``token_ids``; return the logits after the last one.

        Reuses the longest common prefix of ``token_ids`` and what the session's
        KV already holds: only the tokens past that prefix are computed (when
        ``token_ids`` is fully cached already, the last token is recomputed to
        produce its logits). Creates the session's KV if it has none.
        Raises ``ValueError`` if ``token_ids`` is empty or longer than
        ``info.max_context``.
        """

    def prefill_steps(self, session_id: str, token_ids: Sequence[int]) -> Generator[None, None, torch.Tensor]:
        """``prefill`` as a generator that yields between parts of the forward pass; returns the logits.

        Between two steps the caller may use the engine for other sessions (the
        engine loop serves foreground requests there), so a long background
        prefill delays them by at most one step. Closing the generator early
        abandons the work: the session's KV then holds a prefix of what it held
        before the call. This default runs the whole prefill as one step.
        """
        return self.prefill(session_id, token_ids)
        yield  # unreachable; makes this a generator

    @abc.abstractmethod
    def decode(self, session_id: str, token_id: int) -> torch.Tensor:
        """Append one token to the session's KV; return the logits after it.

        Equivalent to ``prefill(session_id, cached_token_ids(session_id) + [token_id])``
        but without the prefix comparison. The session must have KV.
        """

    def decode_batch(self, session_ids: Sequence[str], token_ids: Sequence[int]) -> list[torch.Tensor | Exception]:
        """``decode`` for several distinct sessions at once, one token each; one result per session, in order:
        its logits, or the ``ValueError`` / ``KVCapacityError`` that made its step impossible (that session's
        KV is then unchanged; the others' steps still happen).

        An engine that reads its weights once for the whole batch makes a step of ``n`` sessions cost about
        what one costs (a decode step is bound by reading the weights). This default decodes them one after
        another. ``ValueError`` for the call as a whole when a session appears twice.
        """
        check_decode_batch(session_ids, token_ids)
        results: list[torch.Tensor | Exception] = []
        for sid, tok in zip(session_ids, token_ids):
            try:
                results.append(self.decode(sid, tok))
            except (ValueError, KVCapacityError) as err:
                results.append(err)
        return results

    def prefill_batch(self, session_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> list[torch.Tensor | Exception]:
        """``prefill`` for several distinct sessions at once; one result per session, in order: its logits, or
        the ``ValueError`` / ``KVCapacityError`` that made its prefill impossible (that session's KV then holds
        a prefix of what it held; the others' prefills still happen).

        Requests that arrive together each bring a short turn: an engine that runs all their new tokens through
        each weight together reads the weights once instead of once per session. This default prefills them one
        after another. ``ValueError`` for the call as a whole when a session appears twice.
        """
        check_prefill_batch(session_ids, token_ids)
        results: list[torch.Tensor | Exception] = []
        for sid, ids in zip(session_ids, token_ids):
            try:
                results.append(self.prefill(sid, ids))
            except (ValueError, KVCapacityError) as err:
                results.append(err)
        return results

    def share_prefix(self, session_id: str, token_ids: Sequence[int]) -> int:
        """Let the session's KV hold as much of ``token_ids`` as is already computed, here or in another
        session, short of its last token; return how many leading tokens of ``token_ids`` it holds now.

        An engine that shares prefixes across sessions copies (or maps) the KV of the longest prefix of
        ``token_ids`` that another session's KV holds, when that is longer than what this session's KV holds:
        a system prompt or tool list that many sessions open with is then computed once. The session's KV past
        what ``token_ids`` and it share may be dropped. A later :meth:`prefill` of ``token_ids`` computes only
        the rest. Ids that :meth:`prefill` would refuse share nothing (the prefill reports them). This default
        shares nothing: it returns the common prefix of ``token_ids`` and the session's KV and changes nothing.
        """
        return common_prefix_length(self.cached_token_ids(session_id), token_ids)

    def keep_prefix(self, session_id: str, num_tokens: int) -> bool:
        """Release the session (it closed); an engine that shares prefixes may keep the KV of its first
        ``num_tokens`` tokens (its opening turn; as many of them as its KV holds) for later sessions' prefills to
        copy. Returns whether it kept them. Kept prefixes count in :meth:`kept_prefix_bytes` and give way first (:meth:`drop_kept_prefix`).
        This default releases."""
        self.release(session_id)
        return False

    def kept_prefix_bytes(self) -> int:
        """KV bytes the kept prefixes hold (allocated capacity)."""
        return 0

    def drop_kept_prefix(self) -> bool:
        """Release one kept prefix, the least recently copied; False when none is kept."""
        return False

    @abc.abstractmethod
    def cached_token_ids(self, session_id: str) -> Sequence[int]:
        """The tokens the session's KV holds now, in order (empty if it has none)."""

    @abc.abstractmethod
    def truncate(self, session_id: str, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` cached tokens of the session."""

    @abc.abstractmethod
    def release(self, session_id: str) -> None:
        """Free the session's KV. A no-op for a session without KV."""

    @abc.abstractmethod
    def kv_bytes(self, session_id: str) -> int:
        """Bytes of KV memory the session holds now (allocated capacity, not just used)."""

    def kv_release_bytes(self, session_id: str) -> int:
        """Bytes of KV memory :meth:`release` would free now: :meth:`kv_bytes`, less what other sessions or kept
        prefixes also hold by reference (an engine that shares KV that way overrides this)."""
        return self.kv_bytes(session_id)

    def reserve(self, session_id: str, num_tokens: int) -> None:
        """Let the session's KV hold ``num_tokens`` tokens (at most ``info.max_context``) without growing. An engine
        whose KV grows by copying it elsewhere grows it now: the scheduler does so in a session's idle window, so
        that its next request does not pay that copy. Runs :meth:`reserve_steps` through."""
        for _ in self.reserve_steps(session_id, num_tokens):
            pass

    def reserve_steps(self, session_id: str, num_tokens: int) -> Generator[None, None, None]:
        """:meth:`reserve`, yielding between steps of the copy (so that other work can go between them). A session
        that changes meanwhile keeps its KV as it is. This default does nothing (KV that grows in place)."""
        return
        yield

    def kv_total_bytes(self) -> int | None:
        """Bytes of KV memory held over all sessions and kept prefixes, where KV that several of them share by
        reference is counted once; None where nothing is shared that way, so that the total is the sum of
        :meth:`kv_bytes` and :meth:`kept_prefix_bytes`."""
        return None


def check_decode_batch(session_ids: Sequence[str], token_ids: Sequence[int]) -> None:
    """``ValueError`` unless ``decode_batch`` got one token per session and no session twice."""
    _check_batch("decode_batch", session_ids, token_ids, "tokens")


def check_prefill_batch(session_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> None:
    """``ValueError`` unless ``prefill_batch`` got one token sequence per session and no session twice."""
    _check_batch("prefill_batch", session_ids, token_ids, "token sequences")


def _check_batch(call: str, session_ids: Sequence[str], items: Sequence, what: str) -> None:
    if len(session_ids) != len(items):
        raise ValueError(f"{call}: {len(session_ids)} sessions but {len(items)} {what}")
    if len(set(session_ids)) != len(session_ids):
        raise ValueError(f"{call}: a session appears twice in {list(session_ids)!r}")


_COMPARE_BLOCK = 64  # tokens common_prefix_length compares at once


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences.

    Lists and tuples are compared a block at a time (one C-level comparison per 64 tokens), then token by token
    inside the first block that differs."""
    n = min(len(a), len(b))
    i = 0
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b):  # a list never equals a tuple
            a, b = list(a), list(b)
        while i + _COMPARE_BLOCK <= n and a[i:i + _COMPARE_BLOCK] == b[i:i + _COMPARE_BLOCK]:
            i += _COMPARE_BLOCK
    while i < n and a[i] == b[i]:
        i += 1
    return i
