"""Which engine the configuration builds, and the KV budget the scheduler gets from it."""

from __future__ import annotations

import pytest

from fakes import FakeEngine
from prepos import core
from prepos.config import ConfigError, EngineConfig, MemoryConfig, read_config


def test_an_engine_with_kv_allocated_on_demand_gets_the_memory_budget():
    engine = FakeEngine()
    assert engine.kv_capacity_bytes is None
    assert core.kv_budget_bytes(MemoryConfig(kv_budget_bytes=12345), engine) == 12345


def test_a_fixed_pool_keeps_one_full_context_free():
    engine = FakeEngine(max_context=1000)  # 100 KV bytes per token: a full context is 100_000 bytes
    engine.kv_capacity_bytes = 1_000_000
    assert core.kv_budget_bytes(MemoryConfig(), engine) == 900_000
    assert core.kv_budget_bytes(MemoryConfig(kv_budget_bytes=1_000_000), engine) == 900_000


def test_a_pool_smaller_than_one_context_is_a_config_error():
    engine = FakeEngine(max_context=1000)
    engine.kv_capacity_bytes = 100_000
    with pytest.raises(ConfigError, match=r"memory\.kv_budget_bytes: .*100000 bytes.*1000 tokens"):
        core.kv_budget_bytes(MemoryConfig(kv_budget_bytes=100_000), engine)


def test_cuda_builds_the_paged_engine_with_the_configured_pool_and_pages(monkeypatch, tmp_path):
    built = {}

    class Recorder:
        def __init__(self, model_dir, **kwargs):
            built.update(kwargs, model_dir=model_dir)

    import prepos.engines.torch_paged as torch_paged

    monkeypatch.setattr(torch_paged, "PagedTorchLlamaEngine", Recorder)
    config = read_config({"engine.device": "cuda:1", "engine.dtype": "bfloat16", "engine.page_tokens": "16",
                          "engine.cuda_graph": "false", "engine.share_prefixes": "false", "engine.kept_prefixes": "5"},
                         environ={})
    engine = core.create_engine(config.engine, tmp_path, kv_budget_bytes=1 << 30, max_decode_batch=12)
    assert isinstance(engine, Recorder)
    assert built == dict(model_dir=str(tmp_path), device="cuda:1", dtype="bfloat16", kv_pool_bytes=1 << 30,
                         page_tokens=16, cuda_graph=False, max_batch=12, share_prefixes=False, kept_prefixes=5)


def test_cpu_builds_the_plain_torch_engine(monkeypatch, tmp_path):
    import prepos.engines.torch_llama as torch_llama

    monkeypatch.setattr(torch_llama, "TorchLlamaEngine",
                        lambda model_dir, **kw: ("plain", kw["device"], kw["cpu_kernels"], kw["share_prefixes"],
                                                 kw["kept_prefixes"]))
    assert core.create_engine(EngineConfig(), tmp_path) == ("plain", "cpu", True, True, 32)
    config = read_config({"engine.cpu_kernels": "false", "engine.share_prefixes": "false", "engine.kept_prefixes": "0"},
                         environ={})
    assert core.create_engine(config.engine, tmp_path) == ("plain", "cpu", False, False, 0)


@pytest.mark.parametrize("value", ["0", "48", "8192"])
def test_page_tokens_must_be_a_power_of_two(value):
    with pytest.raises(ConfigError, match="engine.page_tokens: must be a power of two"):
        read_config({"engine.page_tokens": value}, environ={})


def test_trtllm_gets_its_pool_share_and_holds_blocks_for_the_session_idle_timeout(monkeypatch, tmp_path):
    built = {}

    class Recorder:
        def __init__(self, engine_dir, **kwargs):
            built.update(kwargs, engine_dir=engine_dir)

    import prepos.engines.trtllm as trtllm

    monkeypatch.setattr(trtllm, "TrtllmEngine", Recorder)
    config = read_config({"engine.name": "trtllm", "engine.device": "cuda", "engine.trtllm_retention_priority": "90",
                          "engine.trtllm_free_gpu_memory_fraction": "0.5"}, environ={})
    assert isinstance(core.create_engine(config.engine, tmp_path, session_idle_timeout_s=120.0), Recorder)
    assert built == dict(engine_dir=tmp_path, free_gpu_memory_fraction=0.5, retention_priority=90,
                         retention_s=120.0, device="cuda")


@pytest.mark.parametrize("parameters, key", [
    ({"engine.name": "trtllm"}, "engine.device"),  # the default device is cpu
    ({"engine.name": "trtllm", "engine.device": "cuda", "engine.trtllm_retention_priority": "101"},
     "engine.trtllm_retention_priority"),
    ({"engine.trtllm_free_gpu_memory_fraction": "0"}, "engine.trtllm_free_gpu_memory_fraction"),
])
def test_trtllm_settings_out_of_range_name_the_key(parameters, key):
    with pytest.raises(ConfigError, match=f"^{key}: "):
        read_config(parameters, environ={})
