"""Random interleavings of calls that time out, server answers that come late (during the next call, or after
it gave up waiting), ordinary calls, lost streams, ENDs on client sessions, sessions the server ended keeping
their journals (a drain), and restarts of the server (draining, the model unloaded, down, back), met by a client
that waits for the server (`wait_for_ready`) or one that does not, against a fake that keeps sessions like the
server. Every PreposTimeout must end up saying what the server did with its turn, every call that succeeded must
have its turn in the log once, and no call may be refused for a START sent twice or missing."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
from client_fakes import RestartingServer, unavailable
from prepos_client import Client, PreposError, PreposTimeout, PreposUnavailable
from prepos_client import channel as channel_module
from tritonclient.utils import InferenceServerException

SEEDS = int(os.environ.get("PREPOS_RANDOM_SEEDS", "4")) * 5  # a longer hunt: PREPOS_RANDOM_SEEDS=100


def raised(call, *args, **kwargs) -> PreposError | None:
    try:
        call(*args, timeout_s=5.0, **kwargs)
    except PreposError as error:
        return error
    return None


@pytest.mark.parametrize("seed", range(SEEDS))
def test_every_timed_out_call_learns_what_became_of_its_turn(fake_triton, seed, monkeypatch):
    monkeypatch.setattr(channel_module, "WAIT_FIRST_S", 0.002)  # the looks at a restarting server come sooner
    rng = random.Random(seed)
    server = fake_triton.responder = RestartingServer()
    rules = server.rules
    waits = seed % 2 == 1  # a client that waits out a restart of the server, or one that does not
    client = Client("127.0.0.1:9", timeout_s=0.05, wait_for_ready=waits)

    def new_session():
        opened = client.session(session_id="s")
        fake_triton[-1].ready = server.ready
        return opened

    session = new_session()
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
        elif action < 0.13:  # the server crashes while answering a call: its turn taken or not, it is not sent again
            outcome = {}
            asking = threading.Thread(target=lambda: outcome.update(error=raised(session.ask, f"SLOW {text}")))
            asking.start()
            while not rules.held:
                time.sleep(0.001)
            held = rules.held.pop()
            if rng.random() < 0.5:  # journaled before the crash
                rules.accepted.append(held.inputs["text_input"][0].decode())
            server.stop("down", "up")
            fake_triton[-1].callback(result=None, error=InferenceServerException(
                msg="Socket closed", status="StatusCode.UNAVAILABLE"))
            asking.join(5)
            assert isinstance(outcome.get("error"), PreposUnavailable), outcome
            if not waits:
                server.phase, server.coming = "up", []  # back before the next call
            continue
        elif action < 0.2:  # the server restarts: the next call meets it stopping, or down
            server.stop(*rng.choice([("draining", "draining", "unloaded", "down", "up"), ("unloaded", "up"),
                                     ("down", "down", "up")]))
            if not waits:
                with pytest.raises(PreposError, match="draining|unknown model|failed to connect"):
                    session.append(text, timeout_s=5.0)
                server.phase, server.coming = "up", []  # back before the next call
            action = 0.4 + 0.6 * rng.random()  # a call that waits for the server if the client does
        if action < 0.3:
            with pytest.raises(PreposTimeout, match="not known yet") as info:
                session.ask(f"SLOW {text}")
            assert info.value.accepted is None
            pending = (info.value, f"SLOW {text}")
        elif action < 0.4:  # END, then a new session under the same id
            session.close()
            session = new_session()
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
