"""The shared-prefix benchmark: its two models differ in engine.share_prefixes only, and its table reads its
rounds (its argument checks: test_bench_cli)."""

from __future__ import annotations

import argparse

import share_bench


def test_the_two_models_differ_in_prefix_sharing_only():
    assert [m["engine.share_prefixes"] for m in share_bench.MODELS.values()] == ["true", "false"]
    assert all(set(m) == {"engine.share_prefixes"} for m in share_bench.MODELS.values())


def test_the_table_gives_ttft_paths_and_per_session_engine_work_over_the_rounds():
    def one(ttfts, paths, seconds, prefilled, shared):
        return {"answers": [("get_weather", path, t, t / 10, t / 2) for t, path in zip(ttfts, paths)],
                "counters": {"prepos_engine_seconds_total": seconds, "prepos_prefill_tokens_total": prefilled,
                             "prepos_shared_prefix_tokens_total": shared}}

    shared = [one([100, 300], ["prefix", "prefix"], 0.4, 600, 400), one([200, 400], ["prefix", "prepaid"], 0.6, 800, 600)]
    results = {"prepos_shared": share_bench.combine(shared, 2)}
    assert results["prepos_shared"]["paths"] == {"prefix": 3, "prepaid": 1}
    # per session: the median round's counter over the sessions of a round
    assert (results["prepos_shared"]["engine_s"], results["prepos_shared"]["prefilled"],
            results["prepos_shared"]["shared"]) == (0.25, 350, 250)
    args = argparse.Namespace(sessions=2, users=4, think=0.0, rounds=2, close=True)
    table = share_bench.summarize(results, 3, 4, args, "test")
    assert table.startswith("`engine.share_prefixes`: 2 BFCL sessions per round, 4 at a time, 0 s between the system "
                            "turn and the first question, each closed after its answer, 2 rounds (test)")
    rows = [line for line in table.splitlines() if line.startswith("| prepos_")]
    assert rows == ["| prepos_shared | 300.0 / 400.0 | 30.0 / 150.0 | prefix 3, prepaid 1 | 0.250 | 350 | 250 |"]
    assert table.endswith("Same answer on both models: 3 of 4.")
