"""Building a request's turn: role and token checks, the delta's tokens, framing, and the context limit.

A turn is opening (the default system turn, first turn only) + entry + delta +
cue or close. Whether a turn fits is decided here, under the context overflow
policy: ``reject`` answers with an error naming the input; ``drop_oldest``
drops the session's oldest turns after the first (the system turn) until the
new turn and its answer fit.
"""

from __future__ import annotations

from typing import Sequence

from prepos.protocol import ProtocolError, Request
from prepos.session import Session
from prepos.template import ChoiceTrie, Framing, Tokenizer

OVERFLOW_POLICIES = ("reject", "drop_oldest")
_MAX_CACHED_TRIES = 64


class TurnBuilder:
    """Turns and choice tries for one model (its tokenizer, framing, vocabulary and context)."""

    def __init__(self, tokenizer: Tokenizer, framing: Framing, *, vocab_size: int, max_log_tokens: int,
                 overflow: str = "reject"):
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"unknown context overflow policy {overflow!r}")
        self._tokenizer = tokenizer
        self._framing = framing
        self._vocab_size = vocab_size
        self.max_log_tokens = max_log_tokens
        self.overflow = overflow
        self.terminator_id = (framing.answer_terminator_ids or tuple(sorted(framing.stop_token_ids)))[0]
        self._tries: dict[tuple[str, ...], ChoiceTrie] = {}

    def check(self, request: Request) -> None:
        """Checks that need the model: the role has framing, token ids are in the vocabulary."""
        if request.role not in self._framing.entry_ids:
            raise ProtocolError("role", f"unknown role {request.role!r}; expected one of {', '.join(self._framing.roles)}")
        if request.delta_ids is not None:
            bad = [i for i in request.delta_ids if i >= self._vocab_size]
            if bad:
                raise ProtocolError("input_ids", f"token id {bad[0]} out of range [0, {self._vocab_size})")
        trie = self.trie(request.choices)
        if trie is not None:  # the terminator ends a choice where a longer one goes on: no choice may hold it
            for index, ids in enumerate(trie.token_ids):
                if self.terminator_id in ids:
                    raise ProtocolError("choices", f"entry {index} holds the answer terminator "
                                                   f"{self._tokenizer.decode([self.terminator_id])!r}")

    def delta_ids(self, request: Request) -> list[int]:
        if request.delta_ids is not None:
            return list(request.delta_ids)
        return self._tokenizer.encode(request.delta_text) if request.delta_text else []

    def turn_ids(self, session: Session, role: str, delta_ids: Sequence[int], closing: Sequence[int]) -> list[int]:
        """Opening (default system turn, first turn only) + entry + delta + closing."""
        return [*self._framing.opening_ids(not session.token_log, role), *self._framing.entry_ids[role],
                *delta_ids, *closing]

    def answer_room(self, request: Request, trie: ChoiceTrie | None) -> int:
        """Tokens the answer and the tokens that close it may add to the log after the turn and the forced
        leading choice tokens: none for an append; for ``choices`` the longest choice's rest, a terminator and
        the closing (a choice is never cut short); else the closing and one answer token under ``reject``,
        ``max_tokens`` of them under ``drop_oldest``."""
        if request.is_append:
            return 0
        closing = len(self._framing.answer_terminator_ids)
        if trie is not None:
            return max(map(len, trie.token_ids)) - len(trie.leading_ids()) + 1 + closing
        return (request.max_tokens if self.overflow == "drop_oldest" else 1) + closing

    def max_answer_tokens(self, request: Request, prompt_length: int) -> int:
        """Answer tokens a free-text answer may take after a prompt of ``prompt_length`` tokens: ``max_tokens``,
        or fewer where the log would not have room for them and the answer's closing (finish reason length)."""
        room = self.max_log_tokens - prompt_length - len(self._framing.answer_terminator_ids)
        return max(1, min(request.max_tokens, room))

    def may_overflow(self, session: Session, request: Request, framing_length: int, answer_room: int) -> bool:
        """Whether the request might not fit; False is a proof (byte-level tokenizers give at most one
        token per byte, +1 for a prefix space), so short texts need no tokenizing to be checked."""
        return len(request.delta_text or "") * 4 + 1 + framing_length + len(session.token_log) + answer_room \
            > self.max_log_tokens

    def fit_turns(self, session: Session, request: Request, num_new: int, answer_room: int,
                  num_forced: int = 0) -> list[list[int]] | None:
        """Whether ``num_new`` more tokens (``num_forced`` of them a choice set's forced leading tokens) and
        ``answer_room`` for the answer (:meth:`answer_room`) fit the session's log: None when they fit as it is;
        under ``drop_oldest``, the turns it keeps when its oldest after the first go to make room (the caller drops
        them when it accepts the turn, so that a request stopped before then changes nothing). Changes nothing.

        Raises ProtocolError when they do not fit (``reject``), or cannot (``drop_oldest``), naming what is too
        long: ``choices`` or ``max_tokens`` when the turn would fit with a one-token answer, else the delta.
        """
        if len(session.token_log) + num_new + answer_room <= self.max_log_tokens:
            return None
        if self.overflow == "drop_oldest":
            kept = session.turns_within(self.max_log_tokens - num_new - answer_room)
            if kept is not None:
                return kept
        turn, least = num_new - num_forced, 1 + len(self._framing.answer_terminator_ids)  # a one-token answer
        policy = f"(context overflow policy {self.overflow!r})"
        if request.choices:
            longest = num_forced + answer_room
            if self._fits(session, turn + least):
                raise ProtocolError("choices", f"the longest choice needs {longest} tokens with the answer's closing "
                                               f"and this turn {turn}, but the session holds {len(session.token_log)} "
                                               f"of at most {self.max_log_tokens} tokens {policy}")
            what = f"+{longest} for the longest choice"
        else:
            if not request.is_append and self._fits(session, turn + least):  # only drop_oldest reserves more
                self._refuse_max_tokens(session, request, turn)
            what = f"+{answer_room} for the answer"
        if request.delta_ids is None and not request.delta_text and not request.is_append:
            # An empty delta brings nothing too long: its turn's framing alone has no room left, whatever is asked.
            raise ProtocolError("choices" if request.choices else "max_tokens",
                                f"the session has no room for another turn: its framing needs {turn} tokens ({what}) "
                                f"but the session holds {len(session.token_log)} of at most {self.max_log_tokens} "
                                f"tokens {policy}; close it and start a new one")
        raise ProtocolError(
            "input_ids" if request.delta_ids is not None else "text_input",
            f"the turn needs {turn} tokens ({what}) but the session holds {len(session.token_log)} of at most "
            f"{self.max_log_tokens} tokens {policy}",
        )

    def _fits(self, session: Session, num_tokens: int) -> bool:
        """Whether ``num_tokens`` more fit the session's log, under ``drop_oldest`` once its oldest turns go."""
        if len(session.token_log) + num_tokens <= self.max_log_tokens:
            return True
        return self.overflow == "drop_oldest" and session.turns_within(self.max_log_tokens - num_tokens) is not None

    def _refuse_max_tokens(self, session: Session, request: Request, num_new: int) -> None:
        """Under ``drop_oldest``, a free-text answer whose ``max_tokens`` cannot fit however many turns go, where the
        turn alone would: raise ProtocolError naming ``max_tokens``, with the most answer tokens that can."""
        closing = len(self._framing.answer_terminator_ids)
        first = len(session.turns()[0]) if session.token_log else 0  # the system turn, never dropped
        largest = self.max_log_tokens - first - num_new - closing
        taken = f"the session's first turn takes {first} and this turn {num_new}" if first else \
            f"this turn takes {num_new}"
        raise ProtocolError(
            "max_tokens",
            f"{request.max_tokens} answer tokens cannot fit even with every turn after the first dropped: {taken} "
            f"of at most {self.max_log_tokens} tokens, which leaves room for at most {largest} (context overflow "
            "policy 'drop_oldest')",
        )

    def trie(self, choices: tuple[str, ...] | None) -> ChoiceTrie | None:
        if choices is None:
            return None
        trie = self._tries.get(choices)
        if trie is None:
            if len(self._tries) > _MAX_CACHED_TRIES:
                self._tries.clear()
            trie = self._tries[choices] = ChoiceTrie(choices, self._tokenizer, self.terminator_id)
        return trie
