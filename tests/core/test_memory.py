from prepos.memory import FarthestNextUse, KvLedger
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
    victims = ledger.victims([*sessions, busy], protect=sessions[0], older_than=None, now_s=6.0)
    assert [v.session_id for v in victims] == ["s1", "s2"]  # not the protected one, not one being served
    assert [v.session_id for v in ledger.victims(sessions, protect=sessions[2], older_than=3.0, now_s=6.0)] == ["s1"]
    ledger.forget("s1")
    assert ledger.used_bytes == 50


def test_ledger_counts_the_engines_kv_total_where_it_tells_one_and_every_sessions_other_bytes():
    total = {"kv": None}
    ledger = KvLedger(budget_bytes=100, kv_total=lambda: total["kv"])
    ledger.record("a", 60, 5)
    ledger.record("b", 60, 7)
    assert ledger.used_bytes == 132 and ledger.over_budget  # no total told: the sessions' KV summed
    total["kv"] = 70  # b shares 50 of a's bytes by reference
    assert ledger.used_bytes == 82 and not ledger.over_budget
    ledger.forget("a")
    total["kv"] = 60  # a's own 10 bytes went; b still holds the rest
    assert ledger.used_bytes == 67


def _ids(sessions):
    return [s.session_id for s in sessions]


def test_next_use_evicts_the_session_due_farthest_away_and_the_long_overdue_ones_first():
    policy = FarthestNextUse()
    # last request ended at last_active_s; each asks again one gap later
    soon = Session("soon", last_active_s=90.0, gap_s=12.0)  # due at 102
    later = Session("later", last_active_s=99.0, gap_s=10.0)  # due at 109
    latest = Session("latest", last_active_s=99.5, gap_s=30.0)  # due at 129.5
    gone = Session("gone", last_active_s=10.0, gap_s=5.0)  # due at 15: late by more than its gap
    late = Session("late", last_active_s=80.0, gap_s=15.0)  # due at 95: late, but by less than its gap
    fresh = Session("fresh", last_active_s=98.0)  # one request so far: the median gap, 12, so due at 110
    assert _ids(policy.order([soon, late, later, latest, gone, fresh], now_s=100.0)) == [
        "gone", "latest", "fresh", "later", "soon", "late"]
    # with no gap known, least recently active first
    a, b = Session("a", last_active_s=5.0), Session("b", last_active_s=1.0)
    assert _ids(policy.order([a, b], now_s=6.0)) == ["b", "a"]


def test_a_sessions_gap_is_the_idle_time_before_its_requests_newest_weighing_half():
    s = Session("s", last_active_s=0.0)
    s.note_arrival(0.0)
    assert s.gap_s is None  # the first request has no gap before it
    s.last_active_s = 1.0
    s.note_arrival(5.0)
    assert s.gap_s == 4.0
    s.last_active_s = 6.0
    s.note_arrival(8.0)
    assert s.gap_s == 3.0  # (4 + 2) / 2
    s.last_active_s = 9.0
    s.note_arrival(8.5)  # sent before the previous one ended: one burst, no idle window
    s.last_active_s = 9.5
    s.note_arrival(9.8)  # an update, then its question at once: one burst
    assert s.gap_s == 3.0 and s.requests_served == 5
