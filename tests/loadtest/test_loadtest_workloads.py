"""Workloads: think-time sampling, the chat workload, the registry, and the JSONL trace format."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from prepos_loadtest.workloads import (
    CHAT_SYSTEM,
    SessionTrace,
    Step,
    ThinkTime,
    TraceFormatError,
    WORKLOADS,
    bfcl_sessions,
    build_workload,
    chat_sessions,
    monitor_sessions,
    read_trace,
    write_trace,
)


# --- think time ------------------------------------------------------------------


def test_think_time_without_sigma_is_the_median_and_draws_nothing():
    rng = random.Random(1)
    state = rng.getstate()
    assert [ThinkTime(2.5).sample(rng) for _ in range(3)] == [2.5, 2.5, 2.5]
    assert rng.getstate() == state


def test_think_time_is_lognormal_around_its_median():
    think, rng = ThinkTime(median_s=3.0, sigma=0.5), random.Random(8)
    samples = [think.sample(rng) for _ in range(4000)]
    assert all(sample > 0 for sample in samples)
    assert statistics.median(samples) == pytest.approx(3.0, rel=0.05)
    assert statistics.stdev(math.log(sample) for sample in samples) == pytest.approx(0.5, rel=0.08)


def test_think_time_is_reproducible_with_a_seeded_rng():
    think = ThinkTime(1.0, 0.8)
    rng_a, rng_b = random.Random(42), random.Random(42)
    first = [think.sample(rng_a) for _ in range(20)]
    assert first == [think.sample(rng_b) for _ in range(20)]
    assert len(set(first)) == 20


@pytest.mark.parametrize(("median_s", "sigma", "field"), [(-1.0, 0.0, "median_s"), (float("nan"), 0.0, "median_s"),
                                                        (1.0, -0.1, "sigma"), (1.0, float("inf"), "sigma")])
def test_think_time_rejects_bad_values_naming_the_field(median_s, sigma, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        ThinkTime(median_s, sigma)


def test_a_think_time_distribution_changes_delays_but_not_content():
    constant = monitor_sessions(3, seed=4)
    spread = monitor_sessions(3, seed=4, think_time=ThinkTime(1.0, 0.7))
    assert [[(s.role, s.delta, s.max_tokens, s.choices) for s in t.steps] for t in constant] == \
           [[(s.role, s.delta, s.max_tokens, s.choices) for s in t.steps] for t in spread]
    assert {s.delay_s for t in constant for s in t.steps} == {0.0, 1.0}
    assert len({s.delay_s for t in spread for s in t.steps}) > 10


def test_bfcl_think_time_applies_to_user_turns_only():
    traces = bfcl_sessions(2, seed=3, think_time=ThinkTime(2.0, 0.5))
    for trace in traces:
        for step in trace.steps:
            assert (step.delay_s > 0) == (step.role == "user")


# --- chat ------------------------------------------------------------------------


def test_chat_sessions_are_multi_turn_free_generation():
    traces = chat_sessions(5, num_turns=3, max_tokens=16, seed=2)
    assert [t.name for t in traces] == [f"chat_{i}" for i in range(5)]
    for trace in traces:
        system, *turns = trace.steps
        assert system == Step(0.0, "system", CHAT_SYSTEM, 0)
        assert len(turns) == 3
        assert all(s.role == "user" and s.max_tokens == 16 and s.choices is None and s.delay_s > 0 for s in turns)
        assert len({s.delta for s in turns}) == 3


def test_chat_think_time_has_the_configured_median():
    traces = chat_sessions(300, num_turns=4, think_time=ThinkTime(median_s=2.0, sigma=0.6))
    delays = [s.delay_s for t in traces for s in t.steps if s.role == "user"]
    assert statistics.median(delays) == pytest.approx(2.0, rel=0.1)


def test_chat_sessions_are_deterministic_per_seed():
    assert chat_sessions(4, seed=9) == chat_sessions(4, seed=9)
    assert chat_sessions(4, seed=9) != chat_sessions(4, seed=10)


def test_build_workload_knows_the_built_in_workloads():
    assert set(WORKLOADS) == {"bfcl", "monitor", "chat"}
    assert build_workload("chat", 2, seed=1) == chat_sessions(2, seed=1)
    assert build_workload("monitor", 2, seed=1, think_time=ThinkTime(0.5)) == \
        monitor_sessions(2, seed=1, think_time_s=0.5)
    with pytest.raises(ValueError, match="^workload: unknown workload 'nope'"):
        build_workload("nope", 1)


# --- JSONL traces ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_trace_file_round_trip(tmp_path, name):
    traces = build_workload(name, 3, seed=5, think_time=ThinkTime(1.5, 0.4))
    path = tmp_path / f"{name}.jsonl"
    num_lines = write_trace(path, traces)
    assert num_lines == sum(len(t.steps) for t in traces)
    assert read_trace(path) == traces


def test_trace_lines_hold_the_documented_fields(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, [SessionTrace("s", (Step(0.25, "user", "Is it on?", 1, ("yes", "no"), "yes"),
                                          Step(0.0, "tool", "done", 0)))])
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first == {"session": "s", "delay_s": 0.25, "role": "user", "delta": "Is it on?", "max_tokens": 1,
                     "choices": ["yes", "no"], "expected": "yes"}
    assert second == {"session": "s", "delay_s": 0.0, "role": "tool", "delta": "done", "max_tokens": 0,
                      "choices": None}


def test_read_trace_groups_interleaved_sessions_in_order_of_appearance(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [{"session": "b", "delta": "b1", "max_tokens": 0}, {"session": "a", "delta": "a1", "max_tokens": 2},
             {"session": "b", "delta": "b2", "max_tokens": 1, "delay_s": 3, "role": "tool"}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    traces = read_trace(path)
    assert traces == [
        SessionTrace("b", (Step(0.0, "user", "b1", 0), Step(3.0, "tool", "b2", 1))),
        SessionTrace("a", (Step(0.0, "user", "a1", 2),)),
    ]


def test_read_trace_leaves_value_ranges_to_the_server(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"session": "s", "delta": "x", "max_tokens": -1}) + "\n")
    assert read_trace(path)[0].steps[0].max_tokens == -1


@pytest.mark.parametrize(("line", "message"), [
    ('{"session": "s", "delta": "x"}', r":1: max_tokens: missing"),
    ('{"session": "s", "delta": "x", "max_tokens": "3"}', r":1: max_tokens: expected an integer"),
    ('{"session": "s", "delta": "x", "max_tokens": true}', r":1: max_tokens: expected an integer"),
    ('{"session": "s", "delta": "x", "max_tokens": 1, "delay_s": -2}', r":1: delay_s: expected a number"),
    ('{"session": "s", "delta": "x", "max_tokens": 1, "choices": "yes"}', r":1: choices: expected a list"),
    ('{"session": "", "delta": "x", "max_tokens": 1}', r":1: session: expected a non-empty string"),
    ('{"session": "s", "delta": "x", "max_token": 1}', r":1: max_token: unknown field"),
    ('["s", "x", 1]', r":1: expected a JSON object"),
    ('{"session": "s", ', r":1: not valid JSON: Expecting property name enclosed in double quotes at character 19 "
                          r"of the line$"),  # the line's end
    ('{"session": "s"} {"delta": "x"}', r":1: not valid JSON: Extra data at character 18 of the line$"),
    ('{"session": "s", "delta": "x", "max_tokens": 2147483648}', r":1: max_tokens: expected an integer \(INT32"),
])
def test_read_trace_names_line_and_field_of_a_bad_step(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceFormatError, match=message):
        read_trace(path)


def test_write_trace_refuses_duplicate_session_names(tmp_path):
    trace = SessionTrace("same", (Step(0.0, "user", "x", 0),))
    with pytest.raises(ValueError, match="^session: two traces are named 'same'"):
        write_trace(tmp_path / "t.jsonl", [trace, trace])
