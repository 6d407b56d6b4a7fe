"""Random interleavings of calls that time out, server answers that come late (during the next call, or after
it gave up waiting), ordinary calls, lost streams, ENDs on client sessions and sessions the server ended keeping
their journals (a drain), against a fake that keeps sessions like the server. Every PreposTimeout must end up
saying what the server did with its turn, every call that succeeded must have its turn in the log once, and no
call may be refused for a START sent twice or missing."""

from __future__ import annotations

import os
import random
import threading

import pytest
from client_fakes import SessionRules, unavailable
from prepos_client import Client, PreposError, PreposTimeout

SEEDS = int(os.environ.get("PREPOS_RANDOM_SEEDS", "4")) * 5  # a longer hunt: PREPOS_RANDOM_SEEDS=100


@pytest.mark.parametrize("seed", range(SEEDS))
def test_every_timed_out_call_learns_what_became_of_its_turn(fake_triton, seed):
    rng = random.Random(seed)
    rules = fake_triton.responder = SessionRules()
    client = Client("127.0.0.1:9", timeout_s=0.05)
    session = client.session(session_id="s")
    timed_out = []  # (error, text, outcome the server gave: True, False, or None when the stream was lost)
    pending = None  # the held request's turn: (error, text), answered by the server later
    answered = []  # turns whose call succeeded: each must be in the log once
    for step in range(30):
        text = f"turn {step}"
        if pending is not None:
            action = rng.random()
            if action < 0.4:  # the server answers it before the next call
                accepted = rng.random() < 0.5
                rules.finish_held(fake_triton[-1], accepted=accepted)
                timed_out.append((*pending, accepted))
                pending = None
            elif action < 0.7:  # the answer comes while the next call waits for it
                accepted = rng.random() < 0.5
                threading.Timer(0.02, rules.finish_held, args=(fake_triton[-1],),
                                kwargs={"accepted": accepted}).start()
                assert session.ask(text, timeout_s=5.0).text == text
                timed_out.append((*pending, accepted))
                pending = None
                continue
            elif action < 0.85:  # no answer within the next call's limit: it sends nothing
                num_sent = len(fake_triton[-1].requests)
                with pytest.raises(PreposTimeout, match="has not reported its outcome") as info:
                    session.append(text, timeout_s=0.02)
                assert info.value.accepted is False and len(fake_triton[-1].requests) == num_sent
                continue
            else:  # the stream is lost: what became of the turn cannot be known
                (held,) = rules.held
                rules.held.clear()
                restarted = rng.random() < 0.5  # the server restarted and holds nothing; else it kept going
                if restarted and held.sequence_start:
                    rules.open_ids.discard(held.sequence_id)
                fake_triton[-1].callback(result=None, error=unavailable())
                fake_triton[-1].callback = None
                timed_out.append((*pending, None))
                pending = None
                if held.sequence_start and not restarted and "resume" not in held.inputs:
                    # The session is open: the client's plain START is refused (one with resume continues it).
                    with pytest.raises(PreposError, match="had opened it; the next call continues the session"):
                        session.ask(text, timeout_s=5.0)
                continue
        action = rng.random()
        if action < 0.1:  # the server ended the session, keeping its journal (a drain before a stop, say)
            rules.open_ids.discard("s")
            action = 0.4 + 0.6 * rng.random()  # the next call reopens it, whatever it is
        if action < 0.3:
            with pytest.raises(PreposTimeout, match="not known yet") as info:
                session.ask(f"SLOW {text}")
            assert info.value.accepted is None
            pending = (info.value, f"SLOW {text}")
        elif action < 0.4:  # END, then a new session under the same id
            session.close()
            session = client.session(session_id="s")
        elif action < 0.75:
            assert session.ask(text, timeout_s=5.0).text == text
            answered.append(text)
        else:
            assert session.append(text, timeout_s=5.0).finish_reason == "appended"
            answered.append(text)
    if pending is not None:
        rules.finish_held(fake_triton[-1], accepted=True)
        session.settle(timeout_s=5.0)
        timed_out.append((*pending, True))
    assert all(rules.accepted.count(text) == 1 for text in answered), rules.accepted
    for error, text, outcome in timed_out:
        assert error.accepted is outcome, (text, error.accepted, outcome)
        if outcome is not None:
            assert (text in rules.accepted) is outcome
    session.close()
