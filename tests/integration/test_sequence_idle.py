"""Triton's sequence idle timer against a long answer, on the real server. Triton counts a sequence's idleness from
its last request's arrival, not its last answer: an answer that streams for longer than
``max_sequence_idle_microseconds`` loses the sequence in Triton while prepos still serves it, and the session's
next request is refused at once, naming no request. The Python client gave that refusal to the answer still
streaming (told "changed nothing", while its turn was then accepted) and left the refused request waiting, and
every later call of the session timed out waiting for its outcome."""

from __future__ import annotations

import time

import pytest

from prepos_client import Client, PreposError

from .conftest import repository_with, start_server

pytestmark = pytest.mark.integration

IDLE_S = 2


def test_a_long_answer_that_outlives_tritons_idle_timer_keeps_its_turn_and_the_next_request_is_told(tmp_path):
    server = start_server(tmp_path / "run", env={"PREPOS_SCHEDULER_SESSION_IDLE_TIMEOUT_S": str(IDLE_S)},
                          repositories=[repository_with(tmp_path, "max_sequence_idle_microseconds",
                                                                   IDLE_S * 1_000_000)])
    try:
        with Client(server.grpc_url, timeout_s=120) as client, client.session("long-answer") as session:
            session.append("You are a patient assistant.", role="system")
            sent = time.monotonic()
            # an answer that runs to max_tokens here (400 tokens, about 12 s on 2 CPU cores), where counting to a
            # thousand stopped at 121 tokens (3.8 s): shorter than Triton's timer on a quiet machine
            long = session.generate("Write a very long, detailed story of at least 2000 words about a lighthouse "
                                    "keeper and his cat.", max_tokens=400, speculate=False)
            chunks = []
            for chunk in long:  # read until Triton's reaper has surely ended the sequence (twice its timeout)
                chunks.append(chunk)
                if time.monotonic() - sent > 2 * IDLE_S + 1:
                    break
            assert chunks[-1].finish_reason is None, "the answer ended before Triton's idle timer could pass"
            after = session.generate("Say yes.", max_tokens=2, speculate=False)  # refused by Triton at once
            chunks += list(long)  # before: PreposError "is not open on the server ... changed nothing"
            assert chunks[-1].finish_reason in ("length", "stop")
            with pytest.raises(PreposError) as refused:  # before: no answer within the time limit, then a wedge
                list(after)
            assert "this request changed nothing, and the next call asks the server to reopen" in str(refused.value)
            again = session.ask("Say no.", max_tokens=2, speculate=False)  # sent with START and resume
            assert again.text
            long_ids = [i for c in chunks for i in c.token_ids]
            assert len(long_ids) > 10
    finally:
        server.stop()
