"""The decode-batching benchmark's table: each row's rate is the median wave's, the ratio batched over unbatched."""

from __future__ import annotations

import argparse

import batch_bench


def test_rates_are_median_waves_and_the_ratio_is_batched_over_unbatched():
    def waves(*rates):  # one 10-token wave per rate: 10 tokens in 10 / rate seconds
        return [{"wall_s": 10 / r, "tokens": 10, "total_ms": [100.0 * i for i in range(1, 5)]} for r in rates]

    runs = {4: {"prepos_batched": waves(90, 10, 100), "prepos_unbatched": waves(45, 50, 40)}}
    table = batch_bench.summarize(runs, argparse.Namespace(users=[4], waves=3, max_tokens=48, mode="decode"), "test machine")
    rows = [line for line in table.splitlines() if line.startswith("| 4 |")]
    assert rows[0].startswith("| 4 | prepos_batched | 90.0 | ")
    assert rows[1].startswith("| 4 | prepos_unbatched | 45.0 | ")
    assert rows[1].endswith("| 2.00 |")  # 90 / 45
    assert "| 300 / 400 |" in rows[0]  # p50 / p99 of 100..400 ms, three times: ranks 6 and 11 of 12


def test_each_mode_compares_its_own_setting_with_pre_positioning_off():
    for mode, key in (("decode", "scheduler.max_decode_batch"), ("prefill", "scheduler.max_prefill_batch")):
        models = batch_bench.variants(mode)
        assert list(models) == ["prepos_batched", "prepos_unbatched"]
        assert models["prepos_unbatched"][key] == "1" and int(models["prepos_batched"][key]) > 1
    assert batch_bench.variants("scan") == {"prepos_scan_cpu": {"scheduler.preposition": "false", "engine.scan": "cpu"},
                                            "prepos_scan_torch": {"scheduler.preposition": "false", "engine.scan": "torch"}}
    for mode, (key, _) in batch_bench.MODES.items():
        assert all(m["scheduler.preposition"] == "false" and set(m) == {"scheduler.preposition", key}
                   for m in batch_bench.variants(mode).values())


def test_the_pieces_table_gives_the_longest_waits_p50_and_max_and_the_long_turns_median_first_token():
    runs = {2: {"prepos_pieces": [{"gap_ms": [100.0], "long_first_ms": [5000.0]},
                                  {"gap_ms": [300.0], "long_first_ms": [7000.0]},
                                  {"gap_ms": [200.0], "long_first_ms": [6000.0]}],
                "prepos_whole": [{"gap_ms": [4000.0], "long_first_ms": [4500.0]},
                                 {"gap_ms": [4200.0], "long_first_ms": [4400.0]},
                                 {"gap_ms": [3900.0], "long_first_ms": [4600.0]}]}}
    args = argparse.Namespace(users=[2], waves=3, max_tokens=64, long_tokens=3000, mode="pieces")
    rows = [line for line in batch_bench.summarize_pieces(runs, args, "test machine").splitlines()
            if line.startswith("| 2 |")]
    assert rows == ["| 2 | prepos_pieces | 200 / 300 | 6000 |", "| 2 | prepos_whole | 4000 / 4200 | 4500 |"]
