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
