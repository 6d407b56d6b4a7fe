"""Derive chat-turn framing from a tokenizer's chat template.

The server never renders a chat template at request time. It builds a
session's token log by concatenating separately tokenized pieces:

    [default_system]                      (when the first message is not a system one)
    entry(role) + content + close         (a system/user/tool turn nobody answers yet)
    entry(role) + content + cue           (a turn the assistant answers next)
    answer + answer_terminator            (an assistant answer)

This module finds those pieces by rendering conversations whose contents are
unique sentinel strings and splitting the rendered text at the sentinels. It
then checks, on text and on token ids, that concatenating the pieces
reproduces what the template renders, so a template that cannot be framed this
way is rejected instead of silently producing prompts the model never saw.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping, Sequence

log = logging.getLogger(__name__)

ROLES = ("system", "user", "tool")
OPTIONAL_ROLES = frozenset({"tool"})

# Sentinel contents: unique, start and end with a letter, no whitespace.
_S = "PreposSystemSentinelQ"
_U = "PreposUserSentinelQ"
_U2 = "PreposSecondUserSentinelQ"
_A = "PreposAnswerSentinelQ"
_T = "PreposToolSentinelQ"

# Realistic contents for the round-trip checks (each starts and ends with a letter).
SAMPLE_TEXTS = (
    "Hello there",
    "What is the capital of France",
    "The capital of France is Paris",
    "Tell me more about it",
    "First line\nsecond line ends here",
    "Numbers like 42 and symbols like # are fine too",
    "Caf\u00e9 au lait is tasty",
    "You are a terse assistant",
)


class FramingError(ValueError):
    """The tokenizer's chat template cannot be expressed as framing pieces."""


Message = Mapping[str, str]


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _roles(messages: Sequence[Message]) -> str:
    return "[" + ", ".join(m["role"] for m in messages) + "]"


class _Renderer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja errors, raise_exception() in templates, ...
            raise FramingError(
                f"chat template failed to render {_roles(messages)}"
                f" (add_generation_prompt={add_generation_prompt}): {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(text, str):
            raise FramingError(
                f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str"
            )
        return text


def _split(text: str, sentinels: Sequence[str], what: str) -> list[str]:
    """Split ``text`` at each sentinel, in order; each must occur exactly once."""
    parts: list[str] = []
    rest = text
    for s in sentinels:
        if text.count(s) != 1:
            raise FramingError(
                f"chat template does not render message content verbatim exactly once"
                f" ({what}: content {s!r} occurs {text.count(s)} times in {text!r})"
            )
        head, _, rest = rest.partition(s)
        parts.append(head)
    parts.append(rest)
    return parts


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise FramingError(message)


def _first_difference(a: str | Sequence[Any], b: str | Sequence[Any]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def compose(
    texts: Mapping[str, Any], messages: Sequence[Message], add_generation_prompt: bool
) -> list[tuple[str, str]]:
    """The pieces of a conversation as the server concatenates them.

    ``texts`` holds ``entry`` (role -> text), ``close``, ``cue``,
    ``answer_terminator`` and ``default_system``. Returns ``(kind, text)``
    pairs, kind being ``"frame"`` or ``"content"``.
    """
    pieces: list[tuple[str, str]] = []
    if not messages or messages[0]["role"] != "system":
        pieces.append(("frame", texts["default_system"]))
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        last = i == len(messages) - 1
        if role == "assistant":
            pieces.append(("content", content))
            pieces.append(("frame", texts["answer_terminator"]))
            continue
        if role not in texts["entry"]:
            raise FramingError(f"no framing for role {role!r}")
        answered = (not last and messages[i + 1]["role"] == "assistant") or (
            last and add_generation_prompt
        )
        pieces.append(("frame", texts["entry"][role]))
        pieces.append(("content", content))
        pieces.append(("frame", texts["cue"] if answered else texts["close"]))
    return [p for p in pieces if p[1]]


def _conversations(contents: Sequence[str], with_tool: bool) -> list[list[dict[str, str]]]:
    c = list(contents)

    def at(i: int) -> str:
        return c[i % len(c)]

    convs = [
        [_msg("user", at(0))],
        [_msg("system", at(1)), _msg("user", at(2))],
        [_msg("user", at(3)), _msg("assistant", at(4)), _msg("user", at(5))],
        [
            _msg("system", at(6)),
            _msg("user", at(7)),
            _msg("assistant", at(8)),
            _msg("user", at(9)),
            _msg("assistant", at(10)),
            _msg("user", at(11)),
        ],
    ]
    if with_tool:
        convs += [
            [_msg("system", at(1)), _msg("user", at(2)), _msg("assistant", at(3)), _msg("tool", at(4))],
            [
                _msg("user", at(5)),
                _msg("assistant", at(6)),
                _msg("tool", at(7)),
                _msg("assistant", at(8)),
                _msg("user", at(9)),
            ],
        ]
    return convs


def _check_text(
    render: _Renderer, texts: Mapping[str, Any], messages: Sequence[Message], gen: bool
) -> None:
    rendered = render(messages, gen)
    framed = "".join(t for _, t in compose(texts, messages, gen))
    if rendered != framed:
        i = _first_difference(rendered, framed)
        raise FramingError(
            f"chat template rendering of {_roles(messages)} (add_generation_prompt={gen}) is not"
            f" a concatenation of framing pieces: differs at char {i}:"
            f" template {rendered[max(0, i - 30):i + 40]!r} vs framing {framed[max(0, i - 30):i + 40]!r}"
        )


def _check_tokens(
    render: _Renderer,
    encode: Callable[[str], list[int]],
    texts: Mapping[str, Any],
    messages: Sequence[Message],
    gen: bool,
) -> str | None:
    rendered = render(messages, gen)
    whole = encode(rendered)
    pieced: list[int] = []
    for _, text in compose(texts, messages, gen):
        pieced.extend(encode(text))
    if whole == pieced:
        return None
    i = _first_difference(whole, pieced)
    return (
        f"tokenizing the framing pieces separately differs from tokenizing the rendered"
        f" {_roles(messages)} (add_generation_prompt={gen}) at token {i}:"
        f" whole {whole[max(0, i - 3):i + 4]} vs pieces {pieced[max(0, i - 3):i + 4]}"
    )


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for i, tok in decoder.items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def _dedup(ids: Iterable[int]) -> list[int]:
    out: list[int] = []
    for i in ids:
        if i not in out:
            out.append(i)
    return out


def _derive_texts(render: _Renderer) -> dict[str, Any]:
    # [system S, user U]: entry(system) S close entry(user) U close
    su = render([_msg("system", _S), _msg("user", _U)], False)
    entry_system, between, close = _split(su, [_S, _U], "[system, user]")
    _expect(
        between.startswith(close),
        f"text between a system turn and a user turn ({between!r}) does not start with the"
        f" text that closes the user turn ({close!r}); turns are not closed uniformly",
    )
    entry_user = between[len(close):]

    # [system S, user U] + generation prompt: ... U cue
    su_gen = render([_msg("system", _S), _msg("user", _U)], True)
    head_s, head_u, cue = _split(su_gen, [_S, _U], "[system, user] + generation prompt")
    _expect(
        (head_s, head_u) == (entry_system, between),
        "adding the generation prompt changes the text before the last user content"
        f" ({head_s!r}, {head_u!r} vs {entry_system!r}, {between!r})",
    )
    _expect(cue != close, f"the template ignores add_generation_prompt (cue == close == {close!r})")

    # [user U]: default_system entry(user) U close
    u = render([_msg("user", _U)], False)
    pre, post = _split(u, [_U], "[user]")
    _expect(post == close, f"a lone user turn ends with {post!r}, a user turn after a system one with {close!r}")
    _expect(
        pre.endswith(entry_user),
        f"a lone user turn starts with {pre!r}, which does not end with the user turn entry {entry_user!r}",
    )
    default_system = pre[: len(pre) - len(entry_user)]

    # [user U1, assistant A, user U2]: default_system entry(user) U1 cue A terminator entry(user) U2 close
    uau = render([_msg("user", _U), _msg("assistant", _A), _msg("user", _U2)], False)
    p0, p1, p2, p3 = _split(uau, [_U, _A, _U2], "[user, assistant, user]")
    _expect(
        p0 == default_system + entry_user,
        f"[user, assistant, user] starts with {p0!r}, expected {default_system + entry_user!r}",
    )
    _expect(
        p1 == cue,
        f"text between a user turn and the assistant's answer in history ({p1!r}) differs from"
        f" the generation prompt cue ({cue!r})",
    )
    _expect(
        p2.endswith(entry_user),
        f"text after an assistant answer ({p2!r}) does not end with the user turn entry {entry_user!r}",
    )
    answer_terminator = p2[: len(p2) - len(entry_user)]
    _expect(p3 == close, f"the last user turn ends with {p3!r}, expected {close!r}")

    return {
        "entry": {"system": entry_system, "user": entry_user},
        "close": close,
        "cue": cue,
        "answer_terminator": answer_terminator,
        "default_system": default_system,
    }


def _derive_entry(render: _Renderer, texts: Mapping[str, Any], role: str) -> str:
    text = render([_msg("system", _S), _msg(role, _T)], False)
    head, between, tail = _split(text, [_S, _T], f"[system, {role}]")
    _expect(
        head == texts["entry"]["system"],
        f"a system turn before a {role} turn starts with {head!r}, expected {texts['entry']['system']!r}",
    )
    _expect(tail == texts["close"], f"a {role} turn ends with {tail!r}, expected {texts['close']!r}")
    _expect(
        between.startswith(texts["close"]),
        f"text between a system turn and a {role} turn ({between!r}) does not start with {texts['close']!r}",
    )
    return between[len(texts["close"]):]


def derive_framing(tokenizer: Any, *, strict_tokens: bool = True) -> dict[str, Any]:
    """Derive the framing object of ``prepos_engine.json`` from ``tokenizer.chat_template``.

    Raises ``FramingError`` when the tokenizer has no chat template, when the
    template does not render as framing pieces, or (with ``strict_tokens``)
    when tokenizing the pieces separately does not reproduce the tokenization
    of the rendered text. Optional roles (``tool``) the template cannot frame
    are left out with a warning.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise FramingError("tokenizer has no chat template")
    render = _Renderer(tokenizer)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    texts = _derive_texts(render)
    for role in ROLES:
        if role in texts["entry"]:
            continue
        try:
            texts["entry"][role] = _derive_entry(render, texts, role)
        except FramingError as exc:
            if role not in OPTIONAL_ROLES:
                raise
            log.warning("chat template cannot frame role %r, leaving it out: %s", role, exc)

    base = dict(texts)
    base["entry"] = {r: t for r, t in texts["entry"].items() if r != "tool"}
    sentinel_contents = [_U, _A, _U2, _S, _T]

    # Text-level checks on the core roles, then on the tool role (dropping it if it fails).
    for contents in (sentinel_contents, SAMPLE_TEXTS):
        for conv in _conversations(contents, with_tool=False):
            for gen in (False, True):
                _check_text(render, base, conv, gen)
    if "tool" in texts["entry"]:
        try:
            for contents in (sentinel_contents, SAMPLE_TEXTS):
                for conv in _conversations(contents, with_tool=True)[4:]:
                    for gen in (False, True):
                        _check_text(render, texts, conv, gen)
        except FramingError as exc:
            log.warning("chat template cannot frame role 'tool' in a conversation, leaving it out: %s", exc)
            del texts["entry"]["tool"]

    # Token-level checks: the server concatenates separately tokenized pieces.
    problems: list[str] = []
    for shift in range(2):
        contents = SAMPLE_TEXTS[shift:] + SAMPLE_TEXTS[:shift]
        for conv in _conversations(contents, with_tool="tool" in texts["entry"]):
            for gen in (False, True):
                p = _check_tokens(render, encode, texts, conv, gen)
                if p:
                    problems.append(p)
    if problems:
        if strict_tokens:
            raise FramingError(problems[0] + f" ({len(problems)} mismatching renderings)")
        for p in problems:
            log.warning("%s", p)

    answer_terminator_ids = encode(texts["answer_terminator"])
    specials = _special_ids(tokenizer)
    stop: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        stop.append(eos)
    elif isinstance(eos, (list, tuple)):
        stop.extend(int(e) for e in eos)
    terminator_special = next((i for i in answer_terminator_ids if i in specials), None)
    if terminator_special is not None:
        stop.append(terminator_special)
    else:
        log.warning("answer terminator %r holds no special token", texts["answer_terminator"])
    stop = _dedup(stop)
    if not stop:
        raise FramingError("no stop token: the tokenizer has no eos token and the answer terminator no special token")

    return {
        "roles": {
            role: {"entry_text": texts["entry"][role], "entry_ids": encode(texts["entry"][role])}
            for role in ROLES
            if role in texts["entry"]
        },
        "close_text": texts["close"],
        "close_ids": encode(texts["close"]),
        "cue_text": texts["cue"],
        "cue_ids": encode(texts["cue"]),
        "answer_terminator_text": texts["answer_terminator"],
        "answer_terminator_ids": answer_terminator_ids,
        "default_system_text": texts["default_system"],
        "default_system_ids": encode(texts["default_system"]),
        "stop_token_ids": stop,
    }


def framing_texts(framing: Mapping[str, Any]) -> dict[str, Any]:
    """The text pieces of a framing object, in the shape ``compose`` takes."""
    return {
        "entry": {r: v["entry_text"] for r, v in framing["roles"].items()},
        "close": framing["close_text"],
        "cue": framing["cue_text"],
        "answer_terminator": framing["answer_terminator_text"],
        "default_system": framing["default_system_text"],
    }


def render_with_framing(
    framing: Mapping[str, Any], messages: Sequence[Message], add_generation_prompt: bool
) -> str:
    """The text a conversation renders to under ``framing`` (equals the template's rendering)."""
    return "".join(t for _, t in compose(framing_texts(framing), messages, add_generation_prompt))
