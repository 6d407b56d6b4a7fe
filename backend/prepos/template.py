"""Turn framing from the chat template, tokenization, and answer constraints.

A turn is entry + delta + cue + answer (+ answer terminator); an update is
entry + delta + close. The framing pieces come from the engine directory's
``prepos_engine.json``, derived from the model's own chat template by
``build_engines``. Token logs are built by concatenating separately tokenized
pieces, so the server and a stateless reference agree on every token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer as HFTokenizer


@dataclass(frozen=True)
class Framing:
    entry_ids: dict[str, tuple[int, ...]]  # role -> template tokens that open its turn
    close_ids: tuple[int, ...]  # ends a content turn that gets no answer
    cue_ids: tuple[int, ...]  # between the delta and the answer
    answer_terminator_ids: tuple[int, ...]  # after an answer's content
    default_system_ids: tuple[int, ...]  # what the template inserts when no system turn opens the session
    stop_token_ids: frozenset[int]  # tokens that end an answer

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(sorted(self.entry_ids))

    @classmethod
    def from_json(cls, framing: dict) -> "Framing":
        return cls(
            entry_ids={role: tuple(v["entry_ids"]) for role, v in framing["roles"].items()},
            close_ids=tuple(framing["close_ids"]),
            cue_ids=tuple(framing["cue_ids"]),
            answer_terminator_ids=tuple(framing["answer_terminator_ids"]),
            default_system_ids=tuple(framing["default_system_ids"]),
            stop_token_ids=frozenset(framing["stop_token_ids"]),
        )

    def opening_ids(self, log_is_empty: bool, role: str) -> tuple[int, ...]:
        """Tokens before a turn's entry: the default system turn when the session starts with a non-system turn."""
        return self.default_system_ids if log_is_empty and role != "system" else ()

    def closing_ids(self, answer_ids: Sequence[int]) -> tuple[int, ...]:
        """Tokens that close an answer; when the answer ended on the terminator's first token, only the rest."""
        terminator = self.answer_terminator_ids
        if answer_ids and terminator and answer_ids[-1] == terminator[0]:
            return terminator[1:]
        return terminator


_MAX_CACHED_DECODES = 4096
_CACHED_DECODE_LENGTH = 8
_MAX_CACHED_CHOICES = 4096
_CACHED_CHOICE_CHARS = 256


class Tokenizer:
    """Text <-> token ids with the engine's tokenizer (no special tokens added).

    Text is text: a special token's spelling in it (``<|im_end|>``, ``<|im_start|>system``) is tokenized as the
    characters it is made of, never as the special token, so a delta, a choice or a placeholder cannot close its
    turn or open another role's. Framing tokens come from the engine manifest's ids; a client that means to send
    special tokens sends ``input_ids``."""

    def __init__(self, path: str | Path):
        self._tok = HFTokenizer.from_file(str(path))
        self._tok.encode_special_tokens = True
        # Short answers repeat (a choice, yes/no): their text is looked up, not decoded, on the first-token path.
        self._decoded: dict[tuple[int, ...], str] = {}
        # Choices recur across sessions (a tool set's names) in ever new combinations: each one's ids are kept,
        # so a new combination's trie costs lookups rather than a tokenizer call per name.
        self._choice_ids: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_choice(self, text: str) -> tuple[int, ...]:
        """``encode`` for one ``choices`` entry, remembered for short entries."""
        ids = self._choice_ids.get(text)
        if ids is None:
            ids = tuple(self.encode(text))
            if len(text) <= _CACHED_CHOICE_CHARS:
                if len(self._choice_ids) >= _MAX_CACHED_CHOICES:
                    self._choice_ids.clear()
                self._choice_ids[text] = ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        if len(ids) > _CACHED_DECODE_LENGTH:
            return self._tok.decode(list(ids), skip_special_tokens=False)
        key = tuple(ids)
        text = self._decoded.get(key)
        if text is None:
            if len(self._decoded) >= _MAX_CACHED_DECODES:
                self._decoded.clear()
            text = self._decoded[key] = self._tok.decode(list(ids), skip_special_tokens=False)
        return text


@dataclass(frozen=True)
class EngineManifest:
    model_name: str
    vocab_size: int
    max_context: int
    framing: Framing

    @classmethod
    def load(cls, engine_dir: str | Path) -> "EngineManifest":
        path = Path(engine_dir) / "prepos_engine.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: build the engine first (make engine, or python -m prepos_build)")
        data = json.loads(path.read_text())
        return cls(data["model_name"], int(data["vocab_size"]), int(data["max_context"]), Framing.from_json(data["framing"]))


@dataclass
class _TrieNode:
    children: dict[int, "_TrieNode"] = field(default_factory=dict)
    choice: int | None = None  # index of the choice that ends here


class ChoiceTrie:
    """The trie of the choices' token sequences: constrained decoding walks it.

    At a node the allowed tokens are its children, plus the answer terminator
    when a choice ends there and a longer one continues. An answer is complete
    at a leaf, or when the terminator is taken.
    """

    def __init__(self, choices: Sequence[str], tokenizer: Tokenizer, terminator_id: int):
        self.choices = tuple(choices)
        self.terminator_id = terminator_id
        self.token_ids = [tokenizer.encode_choice(c) for c in self.choices]
        self._root = _TrieNode()
        for index, ids in enumerate(self.token_ids):
            node = self._root
            for token in ids:
                node = node.children.setdefault(token, _TrieNode())
            node.choice = index

    def _walk(self, prefix: Sequence[int]) -> _TrieNode:
        node = self._root
        for token in prefix:
            node = node.children[token]
        return node

    def forced_ids(self, prefix: Sequence[int] = ()) -> list[int]:
        """Tokens that follow ``prefix`` with no choice left to make (the shared leading tokens)."""
        node, forced = self._walk(prefix), []
        while len(node.children) == 1 and node.choice is None:
            token, node = next(iter(node.children.items()))
            forced.append(token)
        return forced

    def leading_ids(self) -> list[int]:
        """The forced tokens before an answer's first decision. A sole choice leaves its last token to that
        decision (one allowed token, certainty 1), so every answer is scanned at least once."""
        forced = self.forced_ids()
        if forced and self.finished(forced) is not None:
            forced.pop()
        return forced

    def allowed_ids(self, prefix: Sequence[int]) -> list[int]:
        """Sorted tokens allowed after ``prefix``; empty when ``prefix`` is a complete answer."""
        node = self._walk(prefix)
        allowed = sorted(node.children)
        if allowed and node.choice is not None:
            allowed.append(self.terminator_id)
        return allowed

    def finished(self, prefix: Sequence[int]) -> int | None:
        """Index of the choice ``prefix`` completes (a leaf, or a choice plus the terminator), else None."""
        if prefix and prefix[-1] == self.terminator_id:
            node = self._walk(prefix[:-1])
            return node.choice
        node = self._walk(prefix)
        return node.choice if not node.children else None


class IncrementalDetokenizer:
    """Turns a growing list of answer tokens into text chunks, holding back incomplete characters and possible stop strings."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]):
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already sent
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text now safe to send. Sets ``stopped`` when a stop string appears."""
        self._ids.extend(token_ids)
        text = self._tokenizer.decode(self._ids)
        for stop in self._stop:
            at = text.find(stop, max(0, self._emitted - len(stop)))
            if at >= 0:
                self.stopped = True
                text = text[:at]
        if self.stopped:
            out = text[self._emitted:]
            self._emitted = len(text)
            return out
        safe = len(text)
        if text.endswith("\ufffd"):
            safe = len(text.rstrip("\ufffd"))
        for stop in self._stop:  # hold back a tail that may grow into a stop string
            for size in range(min(len(stop) - 1, safe), 0, -1):
                if text[safe - size:safe] == stop[:size]:
                    safe -= size
                    break
        safe = max(safe, self._emitted)
        out = text[self._emitted:safe]
        self._emitted = safe
        return out

    def flush(self) -> str:
        """Text held back, sent when the answer ends."""
        if self.stopped:
            return ""
        text = self._tokenizer.decode(self._ids)
        out = text[self._emitted:]
        self._emitted = len(text)
        return out
