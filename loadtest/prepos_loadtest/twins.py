"""Calm twins: a session's acknowledged turns replayed, in order and without time limits, in a fresh session, whose
greedy or seeded answers must be the same (the trial drivers' check that nothing they did changed a session)."""

from __future__ import annotations

from collections.abc import Sequence

from prepos_client import Client


def differing_answers(client: Client, turns: Sequence[tuple]) -> int:
    """Replay ``turns`` (("append" | "ask", keyword arguments of Session.append / Session.ask, the answer's token
    ids: None for an update, or for a question whose answer was never seen, which is asked and not compared)) in a
    new session on ``client``; the number of answers that came out differently."""
    differed = 0
    with client.session() as twin:
        for kind, kw, answer in turns:
            if kind == "append":
                twin.append(**kw)
                continue
            token_ids = tuple(twin.ask(**kw).token_ids)
            if answer is not None and token_ids != tuple(answer):
                differed += 1
    return differed
