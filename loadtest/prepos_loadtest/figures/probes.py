"""Single measured requests on a fresh session, one per served path, at a given entry length.

Every probe opens its own session, lays down an entry of the asked length as
one system update, lets the server's background work go quiet, pauses
`gap_s`, then sends the measured question (yes/no choices, one answer token)
and closes the session. The path that actually served the request is what the
sample records; the number of tokens prefilled on the critical path follows
from that path (DESIGN.md, served paths). Each probe's entry text is its own
(a numbered feed): the engine copies a prefix another session holds
(``engine.share_prefixes``), and an entry that an earlier probe's session laid
down would then be copied instead of prefilled.
"""

from __future__ import annotations

import itertools
import time

from prepos_client import Client

from .common import QUESTION, YES_NO, Sample, TokenCounter
from .server import FLOOR, MAIN, PREFIX, REBUILD, FigureServer

WARM_UP = "Did the feed start? Answer yes or no."
_FEEDS = itertools.count(1)


def _entry_text(counter: TokenCounter, length: int) -> str:
    """A filler of `length` tokens no other probe's session has laid down."""
    return counter.filler(length, tag=f" {next(_FEEDS)}")
OTHER_SESSION = "Another session's short note."


def _prefill_tokens(path: str, counter: TokenCounter, entry_tokens: int, question: str) -> int:
    if path in ("exact", "gated"):
        return 0
    if path == "prepaid":
        return counter.delta_and_cue(question)
    return entry_tokens + counter.question_turn(question)  # prefix and rebuild: the whole log is on the path


def positioned(server: FigureServer, counter: TokenCounter, figure: str, length: int, mode: str,
               gap_s: float) -> Sample:
    """A question to a positioned session of `prepos`: `exact` (empty delta), `gated` (threshold 0) or `prepaid`."""
    text = _entry_text(counter, length)
    entry = counter.update_turn(text)
    question = "" if mode == "exact" else QUESTION
    options = {"gated": {"gate_threshold": 0.0, "speculate": True}, "prepaid": {"speculate": False}, "exact": {}}[mode]
    with Client(server.url, model=MAIN) as client, client.session() as session:
        session.append(text, role="system")
        server.wait_positioned(MAIN)
        time.sleep(gap_s)
        answer = session.ask(question, max_tokens=1, choices=list(YES_NO), **options)
    return Sample.of(figure, MAIN, length, entry, _prefill_tokens(answer.path, counter, entry, question), answer)


def prefix(server: FigureServer, counter: TokenCounter, figure: str, length: int, gap_s: float) -> Sample:
    """A question right after the entry, on `prepos_prefix` (no pre-positioning): a prefix cache's cost."""
    text = _entry_text(counter, length)
    entry = counter.update_turn(text)
    with Client(server.url, model=PREFIX) as client, client.session() as session:
        session.append(text, role="system")
        time.sleep(gap_s)
        answer = session.ask(QUESTION, max_tokens=1, choices=list(YES_NO))
    return Sample.of(figure, PREFIX, length, entry, _prefill_tokens(answer.path, counter, entry, QUESTION), answer)


def rebuild(server: FigureServer, counter: TokenCounter, figure: str, length: int, gap_s: float) -> Sample:
    """A question to a session whose KV another session's request evicted (`prepos_rebuild`, 1-byte KV budget)."""
    text = _entry_text(counter, length)
    with Client(server.url, model=REBUILD) as client, client.session() as victim:
        victim.append(text, role="system")
        warm = victim.ask(WARM_UP, max_tokens=1, choices=list(YES_NO))
        with client.session() as other:
            other.ask(OTHER_SESSION, max_tokens=1, choices=list(YES_NO))  # over the budget: the victim's KV goes
        time.sleep(gap_s)
        answer = victim.ask(QUESTION, max_tokens=1, choices=list(YES_NO))
    entry = (counter.update_turn(text) + counter.question_turn(WARM_UP) + len(warm.token_ids)
             + len(counter.framing.answer_terminator_ids))
    return Sample.of(figure, REBUILD, length, entry, _prefill_tokens(answer.path, counter, entry, QUESTION), answer)


def floor(server: FigureServer, figure: str, gap_s: float) -> Sample:
    """The same question to the no-op model: gRPC, Triton and the Python backend, no model work."""
    with Client(server.url, model=FLOOR) as client, client.session() as session:
        time.sleep(gap_s)
        answer = session.ask(QUESTION, max_tokens=1, choices=list(YES_NO))
    return Sample.of(figure, FLOOR, 0, 0, 0, answer)


def decode_step_ms(server: FigureServer, counter: TokenCounter, length: int, gap_s: float,
                   num_tokens: int = 9) -> float:
    """Client-seen time per decode step after the first token (free generation on a positioned `prepos` session)."""
    with Client(server.url, model=MAIN) as client, client.session() as session:
        session.append(_entry_text(counter, length), role="system")
        server.wait_positioned(MAIN)
        time.sleep(gap_s)
        answer = session.ask("Describe the feed in one long sentence.", max_tokens=num_tokens, speculate=False)
    steps = len(answer.token_ids) - 1
    return (answer.total_ms - answer.ttft_ms) / steps if steps > 0 else float("nan")
