"""The decode-vs-bound figure pairs each round's decode steps with the bandwidth probe taken just before them."""

from __future__ import annotations

import types

import engine_microbench


def test_each_round_pairs_its_own_probe(monkeypatch):
    # Bandwidth halves in the second round and the decode slows with it: each round is 2x its own bound.
    probes = iter([100e9, 50e9, 100e9])
    steps = iter([[0.02, 0.02], [0.04, 0.04], [0.02, 0.02]])
    calls = []

    def fake_probe(device, runs=7):
        calls.append("probe")
        return next(probes)

    def fake_decode(engine, ids, n, device):
        calls.append(f"decode {n}")
        return next(steps)

    monkeypatch.setattr(engine_microbench, "read_bandwidth", fake_probe)
    monkeypatch.setattr(engine_microbench, "engine_decode", fake_decode)
    engine = types.SimpleNamespace(info=types.SimpleNamespace(weight_bytes=1e9))  # bound 10 ms at 100 GB/s

    rounds = engine_microbench.paired_rounds(engine, [1, 2, 3], steps=6, device="cpu", rounds=3)

    assert calls == ["probe", "decode 2"] * 3
    assert [r["ratio"] for r in rounds] == [2.0, 2.0, 2.0]


def test_long_context_bound_adds_the_kv_read(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    LlamaForCausalLM(config).save_pretrained(str(tmp_path), safe_serialization=True)
    monkeypatch.setattr(engine_microbench, "read_bandwidth", lambda device, runs=7: 1e9)  # 1 GB/s: bytes = ns

    result = engine_microbench.measure(str(tmp_path), context=10, steps=5, prefill_runs=1, with_hf=False,
                                       rounds=1, long_context=90)

    kv_per_token = 2 * 2 * 2 * 8 * 4  # layers x (k, v) x kv heads x head_dim x float32
    assert result["decode_bound_ms"] == result["weight_bytes"] / 1e6
    assert result["long_decode_bound_ms"] == (result["weight_bytes"] + 91 * kv_per_token) / 1e6
    assert result["long_decode_median_ms"] > 0
    table = engine_microbench.format_table(result)
    assert "engine decode median @ctx 90" in table and "bound @ctx 90 (weights + KV read)" in table
    turn = result["turn"]  # over the 64 of 90 tokens that fill whole KV blocks
    assert turn["tokens"] == 64 and turn["delta"] == 35 and len(turn["full_ms"]) == len(turn["room_ms"]) == 7
    assert "turn +35 over 64, KV full, grown by the turn" in table and "turn +35 over 64, room made ahead" in table
    chunked = result["chunked"]
    assert chunked["tokens"] == 90 and chunked["chunk"] == 32 and len(chunked["grown_s"]) == len(chunked["room_s"]) == 1
    assert "prefill 90 in chunks of 32, room made first" in table
    without = engine_microbench.measure(str(tmp_path), context=10, steps=5, prefill_runs=1, with_hf=False,
                                        rounds=1, long_context=0)
    assert without["long_decode_median_ms"] is None and without["turn"] is None and without["chunked"] is None
    assert "@ctx 0" not in engine_microbench.format_table(without)
