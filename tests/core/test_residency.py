"""Memory budget order: speculative state goes first, then idle sessions' KV; the token log stays."""

from __future__ import annotations

import pytest
import torch

from fakes import FakeClock, FakeEngine
from prepos.metrics import Metrics
from prepos.residency import Residency
from prepos.session import Positioned, SessionState


def positioned_session(res, engine, sid, log, spec, active_s):
    session = res.open(sid)
    session.append(log)
    session.last_active_s = active_s
    engine.prefill(sid, [*log, *spec])
    session.positioned = Positioned(log_length=len(log), role="user", choices=None, spec_ids=tuple(spec),
                                    forced_ids=(), logits=torch.zeros(100))  # 400 bytes
    res.note_kv(session, background=True)
    return session


@pytest.mark.parametrize("budget, a_state, num_spec, num_kv", [
    (2500, SessionState.RESIDENT, 1, 0),  # dropping a's speculative state is enough: its KV stays
    (1500, SessionState.EVICTED, 1, 1),  # not enough: then a's whole KV goes
])
def test_speculative_state_goes_before_an_idle_sessions_kv(budget, a_state, num_spec, num_kv):
    clock, metrics = FakeClock(), Metrics()
    engine = FakeEngine(clock=clock)  # 100 KV bytes per token
    res = Residency(engine=engine, metrics=metrics, max_sessions=10, kv_budget_bytes=10**9, eviction_policy="lru",
                    journal=None, clock=clock)
    log_a = list(range(3, 13))
    a = positioned_session(res, engine, "a", log_a, [20, 21, 22, 23, 24], active_s=1.0)
    assert res.kv.used_bytes == 15 * 100 + 400
    res.kv.budget_bytes = budget
    b = res.open("b")
    b.append(list(range(3, 13)))
    b.last_active_s = 2.0
    engine.prefill("b", b.token_log)
    res.note_kv(b)  # b's foreground work needs 1000 bytes
    assert a.state is a_state and a.positioned is None
    assert a.token_log == log_a  # the log is never dropped
    assert res.kv.used_bytes <= budget
    if a_state is SessionState.RESIDENT:
        assert engine.kv["a"] == log_a  # the speculative tokens were cut off the KV
    assert metrics.sink.get("prepos_kv_evictions_total", what="speculative") == num_spec
    assert metrics.sink.get("prepos_kv_evictions_total", what="kv") == num_kv
    assert b.state is SessionState.RESIDENT


def test_the_tokens_of_an_answer_stopped_before_it_was_accepted_go_before_any_accepted_kv():
    clock, metrics = FakeClock(), Metrics()
    engine = FakeEngine(clock=clock)  # 100 KV bytes per token
    res = Residency(engine=engine, metrics=metrics, max_sessions=10, kv_budget_bytes=10**9, eviction_policy="lru",
                    journal=None, clock=clock)
    stopped = res.open("stopped")
    stopped.append(list(range(3, 13)))
    stopped.last_active_s = 1.0
    engine.prefill("stopped", [*stopped.token_log, 40, 41, 42, 43, 44, 45])  # a cancelled answer's tokens
    res.note_kv(stopped)
    assert stopped.positioned is None and res.kv.used_bytes == 1600
    res.kv.budget_bytes = 2000
    b = res.open("b")
    b.append(list(range(3, 8)))
    b.last_active_s = 2.0
    engine.prefill("b", b.token_log)
    res.note_kv(b)  # 500 more bytes: over by 100
    assert engine.kv["stopped"] == stopped.token_log  # cut back to its log: its accepted KV stays
    assert stopped.state is SessionState.RESIDENT and res.kv.used_bytes == 1500
    assert metrics.sink.get("prepos_kv_evictions_total", what="speculative") == 1
    assert metrics.sink.get("prepos_kv_evictions_total", what="kv") == 0


def test_the_budget_counts_kv_shared_by_reference_once_and_eviction_goes_on_until_bytes_are_freed():
    clock, metrics = FakeClock(), Metrics()
    engine = FakeEngine(clock=clock, by_reference=True)  # 100 KV bytes per token
    res = Residency(engine=engine, metrics=metrics, max_sessions=10, kv_budget_bytes=2600, eviction_policy="lru",
                    journal=None, clock=clock)
    opening = list(range(3, 23))  # 20 tokens
    sessions = []
    for n, sid in enumerate(["a", "b", "c"]):
        session = res.open(sid)
        session.append([*opening, 30 + n])
        session.last_active_s = float(n)
        engine.prefill(sid, session.token_log)
        res.note_kv(session)
        sessions.append(session)
    assert res.kv.used_bytes == 2300  # 20 shared + 3 own tokens, where the sessions' sum is 6300
    assert all(s.state is SessionState.RESIDENT for s in sessions)
    d = res.open("d")
    d.append(list(range(100, 105)))
    d.last_active_s = 3.0
    engine.prefill("d", d.token_log)
    res.note_kv(d)  # 2800 bytes: evicting a frees its own 100, b its 100, and then the budget holds
    assert [s.state for s in sessions] == [SessionState.EVICTED, SessionState.EVICTED, SessionState.RESIDENT]
    assert res.kv.used_bytes == 2600


@pytest.mark.parametrize("policy", ["lru", "next_use"])
def test_a_session_whose_kv_others_all_hold_goes_after_those_that_free_bytes(policy):
    clock, metrics = FakeClock(), Metrics()
    engine = FakeEngine(clock=clock, by_reference=True)  # 100 KV bytes per token
    res = Residency(engine=engine, metrics=metrics, max_sessions=10, kv_budget_bytes=2500, eviction_policy=policy,
                    journal=None, clock=clock)
    opening = list(range(3, 23))  # 20 tokens
    logs = {"a": opening, "b": [*opening, 30, 31], "c": [*opening, 40, 41]}  # a holds only what b and c hold too
    sessions = {}
    for n, (sid, log) in enumerate(logs.items()):
        session = sessions[sid] = res.open(sid)
        session.append(log)
        session.last_active_s = float(n)  # a is the least recently active
        engine.prefill(sid, log)
        res.note_kv(session)
    assert res.kv.used_bytes == 2400
    assert engine.kv_release_bytes("a") == 0 and engine.kv_release_bytes("b") == 200
    d = res.open("d")
    d.append(list(range(100, 103)))
    d.last_active_s = 3.0
    engine.prefill("d", d.token_log)
    res.note_kv(d)  # 2700 bytes: evicting a would free nothing, b frees its own 200
    assert [sessions[sid].state for sid in "abc"] == [SessionState.RESIDENT, SessionState.EVICTED,
                                                      SessionState.RESIDENT]
    assert res.kv.used_bytes == 2500
    assert metrics.sink.get("prepos_kv_evictions_total", what="kv") == 1

    e = res.open("e")
    e.append(list(range(200, 203)))
    e.last_active_s = 4.0
    engine.prefill("e", e.token_log)
    res.kv.budget_bytes = 2400
    res.note_kv(e)  # 2800 bytes: c frees 200 (a then holds the opening alone), d 300, and the budget holds
    assert [s.state for s in (sessions["a"], sessions["c"], d)] == [SessionState.RESIDENT, SessionState.EVICTED,
                                                                    SessionState.EVICTED]
    assert res.kv.used_bytes == 2300

    res.kv.budget_bytes = 500  # a goes last, and now frees the opening
    res.fit()
    assert sessions["a"].state is SessionState.EVICTED and e.state is SessionState.RESIDENT
    assert res.kv.used_bytes == 300
