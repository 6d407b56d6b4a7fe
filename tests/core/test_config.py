import pytest

from prepos.config import ConfigError, read_config


def test_parameters_and_environment_override_defaults():
    config = read_config({"gate.threshold": "0.8", "scheduler.preposition": "false"}, environ={"PREPOS_GATE_THRESHOLD": "0.7"})
    assert config.gate.threshold == 0.7 and config.scheduler.preposition is False
    assert config.engine.name == "torch" and config.scheduler.chunk_tokens == 32


@pytest.mark.parametrize("params, key", [
    ({"gate.treshold": "1"}, "gate.treshold"),
    ({"scheduler.chunk_tokens": "0"}, "scheduler.chunk_tokens"),
    ({"scheduler.chunk_tokens": "many"}, "scheduler.chunk_tokens"),
    ({"scheduler.max_decode_batch": "0"}, "scheduler.max_decode_batch"),
    ({"engine.name": "onnx"}, "engine.name"),
    ({"scheduler.preposition": "perhaps"}, "scheduler.preposition"),
])
def test_bad_values_name_the_key(params, key):
    with pytest.raises(ConfigError, match=f"^{key}: "):
        read_config(params, environ={})


def test_a_tensorrt_scan_needs_its_engine_file():
    import pytest

    from prepos.config import ConfigError, read_config

    with pytest.raises(ConfigError, match="engine.scan_engine"):
        read_config({"engine.scan": "tensorrt"}, environ={})
    assert read_config({"engine.scan": "tensorrt", "engine.scan_engine": "scan.plan"}, environ={}).engine.scan_engine


def test_the_triton_scan_is_for_cuda_and_auto_picks_by_device():
    from prepos.core import Core
    from prepos.scan import scan_torch

    with pytest.raises(ConfigError, match="^engine.scan: triton runs on CUDA only"):
        read_config({"engine.scan": "triton"}, environ={})
    assert read_config({"engine.scan": "triton", "engine.device": "cuda:1"}, environ={}).engine.scan == "triton"
    off = read_config({"engine.cpu_kernels": "false"}, environ={})
    assert off.engine.scan == "auto" and Core._scan(off, ".") is scan_torch  # CPU without its kernels: torch's


def test_auto_on_cpu_is_the_kernel_scan_where_the_kernels_build_and_torch_where_not(monkeypatch):
    import prepos.engines.cpu_kernels as cpu_kernels
    from prepos.core import Core
    from prepos.scan import scan_torch
    from prepos.scan_cpu import CpuKernelScan

    config, explicit = read_config({}, environ={}), read_config({"engine.scan": "cpu"}, environ={})
    if cpu_kernels.load() is not None:
        assert isinstance(Core._scan(config, "."), CpuKernelScan)
        assert isinstance(Core._scan(explicit, "."), CpuKernelScan)
    monkeypatch.setattr(cpu_kernels, "load", lambda *a, **kw: None)  # no compiler, say
    assert Core._scan(config, ".") is scan_torch
    with pytest.raises(ConfigError, match="^engine.scan: cpu needs the CPU kernels"):
        Core._scan(explicit, ".")
