from prepos.memory import KvLedger
from prepos.session import Session


def test_ledger_keeps_a_running_total_and_orders_victims_least_recent_first():
    ledger = KvLedger(budget_bytes=100)
    sessions = [Session(f"s{i}", has_kv=True, last_active_s=t) for i, t in enumerate([5.0, 1.0, 3.0])]
    for s in sessions:
        ledger.record(s.session_id, 40)
    assert ledger.used_bytes == 120 and ledger.over_budget
    ledger.record("s0", 10)
    assert ledger.used_bytes == 90 and not ledger.over_budget
    busy = Session("busy", has_kv=True, last_active_s=0.0, serving=True)
    victims = ledger.victims([*sessions, busy], protect=sessions[0], older_than=None)
    assert [v.session_id for v in victims] == ["s1", "s2"]  # not the protected one, not one being served
    assert [v.session_id for v in ledger.victims(sessions, protect=sessions[2], older_than=3.0)] == ["s1"]
    ledger.forget("s1")
    assert ledger.used_bytes == 50
