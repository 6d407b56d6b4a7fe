"""Auditing gated answers against the full path, and suspending the gate when the bound is passed."""

from __future__ import annotations

import numpy as np

from fakes import IM_END
from prepos.gate_watch import min_audits
from test_scheduler import Harness, expected, open_session

WATCH = {"watch_fraction": 1.0, "epsilon": 0.05, "confidence": 0.95}


def constant_logits(seq, vocab):
    logits = np.zeros(vocab, dtype=np.float32)
    logits[5] = 1.0  # whatever the delta, the same answer: every audit agrees
    logits[IM_END] = 0.5
    return logits


def gated_round(h, sid, text):
    sink = h.serve(h.request(sid, text, max_tokens=1))
    h.idle()  # the audit, then pre-positioning
    return sink


def test_min_audits_is_where_zero_errors_certify():
    n = min_audits(0.05, 0.05)
    assert (1 - 0.05) ** n <= 0.05 < (1 - 0.05) ** (n - 1)


def test_disagreeing_audits_suspend_the_gate_and_later_deltas_take_the_full_path(tmp_path):
    h = Harness(tmp_path, threshold=0.0, gate_kw=WATCH)
    open_session(h)
    h.idle()
    paths = [gated_round(h, "s1", f"question number {i}").path for i in range(min_audits(0.05, 0.05) + 1)]
    audits = h.metrics.sink.get("prepos_gate_audits_total", result="disagreed") + \
        h.metrics.sink.get("prepos_gate_audits_total", result="agreed")
    assert audits >= min_audits(0.05, 0.05)
    assert h.metrics.sink.get("prepos_gate_audits_total", result="disagreed") > 0.05 * audits
    assert h.metrics.sink.get("prepos_gate_suspended") == 1
    assert h.sched._watch.suspended
    assert paths[0] == "gated"
    assert gated_round(h, "s1", "and now?").path == "prepaid"  # suspended: the gate no longer fires
    # the audit's prefill was a prefix of the session's log: the KV stays consistent
    log = h.log("s1")
    cached = h.engine.kv["s1"]
    assert cached[: len(log)] == log


def test_agreeing_audits_keep_the_gate_on(tmp_path):
    h = Harness(tmp_path, threshold=0.0, gate_kw=WATCH, logits_fn=constant_logits)
    open_session(h)
    h.idle()
    for i in range(min_audits(0.05, 0.05) + 5):
        assert gated_round(h, "s1", f"q{i}").path == "gated"
    assert h.metrics.sink.get("prepos_gate_audits_total", result="agreed") == min_audits(0.05, 0.05) + 5
    assert h.metrics.sink.get("prepos_gate_audits_total", result="disagreed") == 0
    assert h.metrics.sink.get("prepos_gate_false_accept_upper_bound") <= 0.05
    assert not h.sched._watch.suspended


def test_no_watch_no_audits(tmp_path):
    h = Harness(tmp_path, threshold=0.0)
    open_session(h)
    h.idle()
    sink = h.submit(h.request("s1", "question", max_tokens=1))
    h.sched.run_once()
    assert sink.path == "gated" and not h.sched._background.audits
    h.idle()
    assert h.metrics.sink.get("prepos_gate_audits_total", result="agreed") == 0
    assert h.metrics.sink.get("prepos_gate_audits_total", result="disagreed") == 0


def test_an_audit_after_the_session_was_positioned_again_leaves_its_next_answer_right(tmp_path):
    """The audit prefills the full path in the session's own KV. When the session was positioned again first (it
    went idle while another session's long pre-positioning ran, and the idle policy took it first), the audit
    rewrites the KV that positioned state lives in: the state goes, and the session is positioned again after."""
    h = Harness(tmp_path, threshold=0.0, gate_kw={"watch_fraction": 1.0})
    open_session(h, sid="a")
    h.idle()
    open_session(h, sid="b", text="a long system turn " * 20)  # its pre-positioning takes many chunks
    while h.sched._background.running is None:
        h.sched.run_once()
    sink = h.serve(h.request("a", "what now?", max_tokens=1))  # while b's pre-positioning is under way
    assert sink.path == "gated" and h.sched._background.audits  # its audit waits for the background
    while h.sched._background.audits:
        positioned = h.sched.store.get("a").positioned is not None
        h.sched.run_once()
    assert positioned  # the policy positioned a again before its audit started
    h.idle()
    assert h.metrics.sink.get("prepos_gate_audits_total", result="agreed") + \
        h.metrics.sink.get("prepos_gate_audits_total", result="disagreed") == 1
    want = expected(h, "a", "", max_tokens=4)
    answer = h.serve(h.request("a", "", max_tokens=4))
    assert answer.path == "exact" and answer.ids == want


def audit_counts(h) -> tuple[float, float]:
    sink = h.metrics.sink
    audited = sink.get("prepos_gate_audits_total", result="agreed") + sink.get("prepos_gate_audits_total",
                                                                                result="disagreed")
    return audited, sink.get("prepos_gate_audits_void_total")


def test_an_audit_its_session_leaves_no_idle_window_for_is_counted_void(tmp_path):
    h = Harness(tmp_path, threshold=0.0, gate_kw={"watch_fraction": 1.0})
    open_session(h)
    h.idle()
    assert h.serve(h.request("s1", "first", max_tokens=1)).path == "gated"
    assert h.serve(h.request("s1", "second", max_tokens=1)).path == "prefix"  # served before any idle window
    h.idle()
    assert audit_counts(h) == (0, 1)  # the first answer's audit is void: its session went on
    assert h.serve(h.request("s1", "third", max_tokens=1)).path == "gated"
    h.serve(h.request("s1", end=True, max_tokens=0))  # closed at once
    h.idle()
    assert audit_counts(h) == (0, 2)
    open_session(h, sid="s2")
    h.idle()
    assert h.serve(h.request("s2", "fourth", max_tokens=1)).path == "gated"
    h.idle()
    assert audit_counts(h) == (1, 2)  # an idle window: audited


def test_an_audit_stopped_part_way_by_its_sessions_next_request_is_counted_void(tmp_path):
    h = Harness(tmp_path, threshold=0.0, gate_kw={"watch_fraction": 1.0}, num_layers=4)
    open_session(h)
    h.idle()
    assert h.serve(h.request("s1", "a question", max_tokens=1)).path == "gated"  # its audit takes a step per layer
    background = h.sched._background
    for _ in range(100):  # until the audit has started (the delta is ingested first)
        h.sched.run_once()
        if background.running is not None and not background.running.positioning:
            break
    assert background.running is not None and not background.running.positioning
    h.serve(h.request("s1", "next", max_tokens=1))
    h.idle()
    assert audit_counts(h) == (0, 1)


def test_an_audit_a_full_kv_pool_abandons_is_counted_void(tmp_path):
    from test_scheduler import _PoolFull

    h = Harness(tmp_path, threshold=0.0, gate_kw={"watch_fraction": 1.0})
    open_session(h)
    h.idle()
    assert h.serve(h.request("s1", "a question", max_tokens=1)).path == "gated"
    for _ in range(100):  # the delta's ingest, the request's own work, first
        if not h.sched._ready:
            break
        h.sched.run_once()
    assert h.sched._background.audits  # the audit waits for an idle window
    pool = _PoolFull(h.engine)
    pool.full = True  # its prefill finds no room
    h.idle()
    assert audit_counts(h) == (0, 1) and not h.sched._background.audits
