"""The residency benchmark: its two models differ only in the KV block, its table reads its results, and bad
arguments are refused before a server starts."""

from __future__ import annotations

import argparse

import pytest

import residency_bench


def test_the_two_models_differ_only_in_the_kv_block_and_share_the_budget():
    models = residency_bench.variants(1 << 30)
    assert {m["engine.page_tokens"] for m in models.values()} == {"64", "256"}
    assert all(set(m) == {"engine.page_tokens", "memory.kv_budget_bytes"} and m["memory.kv_budget_bytes"] == str(1 << 30)
               for m in models.values())


def test_the_table_gives_residency_kv_per_resident_session_and_the_second_pass():
    results = {"prepos_block64": {"kv_bytes_per_session": 3 * 2**20, "resident": 300, "paths": {"prepaid": 280, "prefix": 20},
                                  "wall_s": 8.5, "ttft_p50_ms": 77.9, "ttft_p99_ms": 110.6},
               "prepos_block256": {"kv_bytes_per_session": 12 * 2**20, "resident": 89, "paths": {"rebuild": 300},
                                   "wall_s": 15.6, "ttft_p50_ms": 265.4, "ttft_p99_ms": 289.4}}
    table = residency_bench.summarize(results, argparse.Namespace(sessions=300, users=8, budget_mib=1024), "test")
    rows = [line for line in table.splitlines() if line.startswith("| prepos_")]
    assert rows == ["| prepos_block64 | 300 of 300 | 3.00 | prefix 20, prepaid 280 | 8.5 | 77.9 / 110.6 |",
                    "| prepos_block256 | 89 of 300 | 12.00 | rebuild 300 | 15.6 | 265.4 / 289.4 |"]


@pytest.mark.parametrize(("argv", "flag"), [
    (["--sessions", "0"], "--sessions"),
    (["--budget-mib", "0"], "--budget-mib"),
    (["--pause", "nan"], "--pause"),
    (["--engine-dir", "/nonexistent-engine"], "--engine-dir"),
])
def test_bad_arguments_name_the_flag(argv, flag, capsys, tmp_path):
    with pytest.raises(SystemExit) as exited:
        residency_bench.main([*argv, "--out", str(tmp_path / "out")])
    assert exited.value.code == 2 and flag in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
