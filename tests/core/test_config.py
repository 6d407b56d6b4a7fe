import re

import pytest

from prepos.config import ConfigError, MemoryConfig, check_sequence_slots, read_config, sequence_slots
from prepos.launcher import REPO_ROOT


def test_parameters_and_environment_override_defaults():
    config = read_config({"gate.threshold": "0.8", "scheduler.preposition": "false"}, environ={"PREPOS_GATE_THRESHOLD": "0.7"})
    assert config.gate.threshold == 0.7 and config.scheduler.preposition is False
    assert config.engine.name == "torch" and config.scheduler.chunk_tokens == 32


@pytest.mark.parametrize("params, key", [
    ({"gate.treshold": "1"}, "gate.treshold"),
    ({"scheduler.chunk_tokens": "0"}, "scheduler.chunk_tokens"),
    ({"scheduler.chunk_tokens": "many"}, "scheduler.chunk_tokens"),
    ({"scheduler.max_decode_batch": "0"}, "scheduler.max_decode_batch"),
    ({"scheduler.stream_interval": "0"}, "scheduler.stream_interval"),
    ({"scheduler.stream_interval": "2000"}, "scheduler.stream_interval"),
    ({"engine.name": "onnx"}, "engine.name"),
    # every gate score lies in [0, 1], as a request's gate_threshold must
    ({"gate.threshold": "1.5"}, "gate.threshold"),
    ({"gate.threshold": "-0.1"}, "gate.threshold"),
    ({"gate.threshold": "nan"}, "gate.threshold"),
    ({"scheduler.preposition": "perhaps"}, "scheduler.preposition"),
    ({"scheduler.idle_policy": "random"}, "scheduler.idle_policy"),
    ({"memory.eviction_policy": "mru"}, "memory.eviction_policy"),
    ({"engine.device": "gpu"}, "engine.device"),
    ({"engine.device": "cuda:x"}, "engine.device"),
    ({"journal.expire_s": "-1"}, "journal.expire_s"),
    ({"journal.expire_s": "300"}, "journal.expire_s"),  # below the 600 s idle timeout
    ({"journal.expire_s": "7200", "scheduler.session_idle_timeout_s": "86400"}, "journal.expire_s"),
    # a default every request without max_tokens would be refused for
    ({"scheduler.default_max_tokens": "5000"}, "scheduler.default_max_tokens"),
    ({"scheduler.default_max_tokens": "65", "limits.max_tokens": "64"}, "scheduler.default_max_tokens"),
    # inf would pass the journal's check against it and name journal.expire_s instead
    ({"scheduler.session_idle_timeout_s": "inf"}, "scheduler.session_idle_timeout_s"),
    ({"limits.max_tokens": str(2**31)}, "limits.max_tokens"),  # the max_tokens input is INT32
])
def test_bad_values_name_the_key(params, key):
    with pytest.raises(ConfigError, match=f"^{key}: "):
        read_config(params, environ={})


def test_a_bad_value_from_the_environment_names_its_variable():
    with pytest.raises(ConfigError, match=r"^gate\.threshold: cannot read 'abc' as float \(set by the environment "
                                          r"variable PREPOS_GATE_THRESHOLD\)$"):
        read_config({"gate.threshold": "0.8"}, environ={"PREPOS_GATE_THRESHOLD": "abc"})
    with pytest.raises(ConfigError, match=r"^scheduler\.chunk_tokens: .*PREPOS_SCHEDULER_CHUNK_TOKENS\)$"):
        read_config({}, environ={"PREPOS_SCHEDULER_CHUNK_TOKENS": "0"})  # a range check of the area's own
    with pytest.raises(ConfigError) as raised:  # from config.pbtxt: no variable to name
        read_config({"scheduler.chunk_tokens": "0"}, environ={"PREPOS_GATE_THRESHOLD": "0.5"})
    assert "environment" not in str(raised.value)


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


def test_the_session_limit_must_stay_below_tritons_sequence_slots():
    assert sequence_slots({"sequence_batching": {"oldest": {"max_candidate_sequences": 8192}}}) == 8192
    assert sequence_slots({"sequence_batching": {"direct": {}}}) is None and sequence_slots({}) is None
    check_sequence_slots(MemoryConfig(max_sessions=4095), 4096)
    check_sequence_slots(MemoryConfig(max_sessions=10**6), None)  # no oldest strategy: nothing to compare
    with pytest.raises(ConfigError, match=r"memory.max_sessions: 4096 must be below .*max_candidate_sequences = 4096"):
        check_sequence_slots(MemoryConfig(max_sessions=4096), 4096)


def test_the_shipped_model_config_leaves_room_above_the_default_session_limit():
    text = (REPO_ROOT / "model_repository" / "prepos" / "config.pbtxt").read_text()
    slots = int(re.search(r"max_candidate_sequences: (\d+)", text).group(1))
    assert slots >= 2 * MemoryConfig().max_sessions  # rejected STARTs hold slots until END or idle timeout


def test_every_idle_policy_the_config_accepts_exists():
    from prepos.config import IDLE_POLICY_NAMES
    from prepos.policies import IDLE_POLICIES

    assert set(IDLE_POLICY_NAMES) == set(IDLE_POLICIES)


def test_every_eviction_policy_the_config_accepts_exists():
    from prepos.config import EVICTION_POLICY_NAMES
    from prepos.memory import EVICTION_POLICIES

    assert set(EVICTION_POLICY_NAMES) == set(EVICTION_POLICIES)


@pytest.mark.parametrize(("model_config", "parameters", "environ", "says"), [
    ({"instance_group": [{"count": 2, "kind": "KIND_CPU"}]}, {}, {}, "^instance_group: 2 instances; prepos runs one"),
    ({"sequence_batching": {"max_sequence_idle_microseconds": "1000000"}}, {}, {},
     "^sequence_batching.max_sequence_idle_microseconds: 1 s, Triton's default"),
    # a session timeout of its own does not make Triton's 1 s any less: Triton still ends the sequences
    ({"sequence_batching": {"max_sequence_idle_microseconds": "1000000"}}, {},
     {"PREPOS_SCHEDULER_SESSION_IDLE_TIMEOUT_S": "600"}, "^sequence_batching.max_sequence_idle_microseconds: 1 s"),
    ({"instance_group": [{"count": 1, "kind": "KIND_GPU", "gpus": [0, 1]}]}, {}, {}, "^instance_group: 2 instances"),
])
def test_a_triton_model_configuration_prepos_cannot_run_with_is_refused(model_config, parameters, environ, says):
    from prepos.config import check_model_config
    with pytest.raises(ConfigError, match=says):
        check_model_config(model_config, parameters, environ)


def test_a_one_second_idle_timeout_is_taken_where_the_session_timeout_says_so_too():
    from prepos.config import check_model_config
    one_second = {"sequence_batching": {"max_sequence_idle_microseconds": "1000000"},
                  "instance_group": [{"count": 1, "kind": "KIND_CPU"}]}
    check_model_config(one_second, {"scheduler.session_idle_timeout_s": "1"}, {})
    check_model_config(one_second, {}, {"PREPOS_SCHEDULER_SESSION_IDLE_TIMEOUT_S": "1"})
    check_model_config({"sequence_batching": {"max_sequence_idle_microseconds": "600000000"}}, {}, {})


def test_an_engine_or_journal_directory_that_cannot_be_used_names_its_key_and_variable(tmp_path, monkeypatch):
    from prepos.core import Core

    monkeypatch.setenv("PREPOS_ENGINE_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"^engine.dir: .*nowhere/prepos_engine.json not found.*"
                                          r"\(set by the environment variable PREPOS_ENGINE_DIR\)$"):
        Core.from_parameters({}, tmp_path)


def test_a_cuda_device_torch_does_not_see_is_a_config_error_naming_the_key(tmp_path):
    import torch

    from prepos.core import Core

    device = f"cuda:{torch.cuda.device_count()}"  # one past the last device, wherever this runs
    with pytest.raises(ConfigError, match=rf"^engine.device: '{device}', but torch sees "):
        Core.from_parameters({"engine.device": device, "engine.dir": str(tmp_path)}, tmp_path)


def test_journals_expire_after_a_day_by_default_and_0_keeps_them():
    assert read_config({}, environ={}).journal.expire_s == 86400.0
    assert read_config({"journal.expire_s": "0", "scheduler.session_idle_timeout_s": "1e9"}, environ={}).journal.expire_s == 0


def test_a_session_idle_timeout_other_than_tritons_is_named_with_what_goes_wrong():
    from prepos.config import SchedulerConfig, idle_timeout_mismatch

    assert idle_timeout_mismatch(SchedulerConfig(session_idle_timeout_s=600.0), 600.0) is None
    assert idle_timeout_mismatch(SchedulerConfig(session_idle_timeout_s=30.0), None) is None  # Triton sets none
    shorter = idle_timeout_mismatch(SchedulerConfig(session_idle_timeout_s=30.0), 600.0)
    assert shorter.startswith("scheduler.session_idle_timeout_s (30 s) is shorter than Triton's "
                              "sequence_batching.max_sequence_idle_microseconds (600 s)") and "slot" in shorter
    longer = idle_timeout_mismatch(SchedulerConfig(session_idle_timeout_s=900.0), 600.0)
    assert "is longer than" in longer and "START" in longer


def test_an_unknown_variable_of_a_settings_area_stops_the_load_naming_it():
    for variable in ("PREPOS_GATE_NOSUCH", "PREPOS_SCHEDULER_STREAM_INTERVALL"):  # a misspelt one changed nothing
        with pytest.raises(ConfigError, match=f"^{variable}: unknown environment variable .*known: .*PREPOS_"):
            read_config({}, environ={variable: "4"})
    # Variables of no settings area (the cache, the bridge's, read by the bridge) are not this model's to judge.
    config = read_config({}, environ={"PREPOS_CACHE_DIR": "/tmp/x", "PREPOS_BRIDGE_MAX_STREAMS": "8",
                                      "PREPOS_SCHEDULER_STREAM_INTERVAL": "4"})
    assert config.scheduler.stream_interval == 4
    assert read_config({"scheduler.default_max_tokens": "4096"}, environ={}).scheduler.default_max_tokens == 4096


def test_the_sequence_slots_check_names_the_variable_that_set_max_sessions():
    with pytest.raises(ConfigError, match=r"PREPOS_MEMORY_MAX_SESSIONS\)$"):
        check_sequence_slots(MemoryConfig(max_sessions=9000), 8192, environ={"PREPOS_MEMORY_MAX_SESSIONS": "9000"})
    with pytest.raises(ConfigError) as raised:
        check_sequence_slots(MemoryConfig(max_sessions=9000), 8192, environ={})
    assert "environment" not in str(raised.value)
