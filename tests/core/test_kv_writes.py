"""Every engine call that may change what a session's KV holds is reported before it runs; nothing else is."""

from __future__ import annotations

from fakes import FakeEngine
from prepos.kv_writes import WriteReportingEngine


def test_writes_are_reported_and_reads_and_room_are_not():
    reported: list = []
    engine = WriteReportingEngine(FakeEngine(), reported.append)
    engine.prefill("a", [5, 6, 7])
    list(engine.reserve_steps("a", 40))  # room only: the tokens stay
    engine.reserve("a", 50)
    assert engine.cached_token_ids("a") == (5, 6, 7) and engine.kv_bytes("a") > 0 and engine.info.vocab_size > 0
    assert reported == ["a"]
    engine.decode("a", 8)
    engine.prefill_batch(["b", "c"], [[1, 2], [3, 4]])
    engine.decode_batch(["b", "c"], [5, 6])
    steps = engine.prefill_steps("d", [9, 9, 9])  # reported when the work is handed out, before a step runs
    assert reported[-1] == "d"
    list(steps)
    engine.share_prefix("e", [5, 6, 7, 9])
    engine.truncate("a", 2)
    engine.keep_prefix("b", 1)
    engine.release("c")
    assert reported == ["a", "a", "b", "c", "b", "c", "d", "e", "a", "b", "c"]
