"""Calm twins: a session's acknowledged turns (those of calls that timed out but were accepted after all included)
replayed, in order and without time limits, in a fresh session, whose greedy or seeded answers must be the same
(the trial drivers' check that nothing they did changed a session)."""

from __future__ import annotations

from collections.abc import Sequence

from prepos_client import Client, PreposError, PreposTimeout, Session


def accepted_after_all(session: Session, error: PreposTimeout) -> bool:
    """Whether the turn of a call of ``session`` that raised ``error`` was accepted all the same (its final response
    came after the client gave up), once settled: a twin then replays it. Raises PreposError when that cannot be
    known (its stream was lost), since no twin could be built."""
    session.settle()
    if error.accepted is None:
        raise PreposError(f"the outcome of a call that timed out is unknown after settling: {error}")
    return error.accepted


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
