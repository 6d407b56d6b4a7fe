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


class SharingEngine(FakeEngine):
    """The fake engine, its sessions' KV shared by reference where their tokens agree (as whole tokens here)."""

    def kv_total_bytes(self):
        held = {tuple(ids[:n]) for ids in self.kv.values() for n in range(1, len(ids) + 1)}
        return len(held) * self.info.kv_bytes_per_token


def test_the_budget_counts_kv_shared_by_reference_once_and_eviction_goes_on_until_bytes_are_freed():
    clock, metrics = FakeClock(), Metrics()
    engine = SharingEngine(clock=clock)  # 100 KV bytes per token
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
