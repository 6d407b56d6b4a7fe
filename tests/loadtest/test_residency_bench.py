"""The residency benchmark: each mode's two models differ in one setting, and its table reads its results (its
argument checks: test_bench_cli)."""

from __future__ import annotations

import argparse

import residency_bench


def test_each_mode_compares_its_own_setting_under_one_budget():
    for mode, key in (("block", "engine.page_tokens"), ("eviction", "memory.eviction_policy")):
        models = residency_bench.variants(mode, 1 << 30)
        assert len(models) == 2 and len({m[key] for m in models.values()}) == 2
        assert all(set(m) == {key, "memory.kv_budget_bytes"} and m["memory.kv_budget_bytes"] == str(1 << 30)
                   for m in models.values())
    assert {m["engine.page_tokens"] for m in residency_bench.variants("block", 1).values()} == {"64", "256"}
    assert {m["memory.eviction_policy"] for m in residency_bench.variants("eviction", 1).values()} == {"lru", "next_use"}


def test_the_table_gives_residency_kv_per_resident_session_and_the_later_passes():
    results = {"prepos_block64": {"kv_bytes_per_session": 3 * 2**20, "resident": 300, "paths": {"prepaid": 280, "prefix": 20},
                                  "rebuilds": [0], "wall_s": 8.5, "ttft_p50_ms": 77.9, "ttft_p99_ms": 110.6},
               "prepos_block256": {"kv_bytes_per_session": 12 * 2**20, "resident": 89, "paths": {"rebuild": 300},
                                   "rebuilds": [300], "wall_s": 15.6, "ttft_p50_ms": 265.4, "ttft_p99_ms": 289.4}}
    args = argparse.Namespace(mode="block", sessions=300, users=8, budget_mib=1024, passes=2)
    table = residency_bench.summarize(results, args, "test")
    assert table.startswith("`engine.page_tokens`: 300 sessions")
    rows = [line for line in table.splitlines() if line.startswith("| prepos_")]
    assert rows == ["| prepos_block64 | 300 of 300 | 3.00 | prefix 20, prepaid 280 | 0 | 8.5 | 77.9 / 110.6 |",
                    "| prepos_block256 | 89 of 300 | 12.00 | rebuild 300 | 300 | 15.6 | 265.4 / 289.4 |"]


def test_a_variants_setting_replaces_the_shipped_one_as_triton_and_the_launcher_read_it(tmp_path, caplog):
    """Variants' entries were added at the head of the parameters list: a key the shipped config sets too was
    then set twice, and Triton takes the later entry, the shipped one, so the variant's value went unused."""
    import logging

    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from prepos.launch_checks import check_repositories
    from prepos_loadtest.repository import variant_repository

    repo = variant_repository(tmp_path, "repo", {"prepos_a": {"scheduler.chunk_tokens": "64",
                                                              "memory.max_sessions": "7"}})
    config = text_format.Parse((repo / "prepos_a" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert config.name == "prepos_a"
    parameters = {k: v.string_value for k, v in config.parameters.items()}
    assert parameters.items() >= {"scheduler.chunk_tokens": "64", "memory.max_sessions": "7",
                                  "engine.device": "cpu"}.items()
    with caplog.at_level(logging.WARNING, logger="prepos.launcher"):
        check_repositories([repo], {})
    assert 'sets "scheduler.chunk_tokens" twice: the later entry counts' in caplog.text
