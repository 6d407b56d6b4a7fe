"""The thread that loaded the model gives its OpenMP workers back once the engine loop runs the engine."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def test_release_frees_the_callers_workers_and_leaves_other_threads_their_count():
    # In a child process: it changes the calling thread's OpenMP state for good.
    script = textwrap.dedent("""
        import os, threading, torch
        from prepos.engines.openmp import release_calling_thread

        def threads():
            return len(os.listdir("/proc/self/task"))

        torch.set_num_threads(2)
        a = torch.randn(600, 600)
        for _ in range(3):
            a @ a  # parallel regions: this thread's OpenMP pool holds a worker now
        torch.ones(1 << 20).sum()
        before = threads()
        assert release_calling_thread()
        after = threads()
        counts = {}
        other = threading.Thread(target=lambda: counts.setdefault("other", torch.get_num_threads()))
        other.start()
        other.join()
        import ctypes
        pausable = hasattr(ctypes.CDLL("libgomp.so.1"), "omp_pause_resource_all")  # the copy torch loaded
        print(before, after, torch.get_num_threads(), counts["other"], int(pausable))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after, mine, other, pausable = map(int, out.stdout.split())
    assert mine == 1 and other == 2
    if not pausable:  # torch 2.6's wheel: a libgomp from before OpenMP 5.0's pause (its workers cannot be freed)
        pytest.skip("torch's libgomp has no omp_pause_resource_all: the worker stays (the thread counts held)")
    assert after < before  # the pool's worker thread is gone


def cgroup(tmp_path, proc_lines: list[str], files: dict[str, str]):
    """A fake cgroup tree under ``tmp_path/fs`` and a fake /proc/self/cgroup; returns cpu_quota's arguments."""
    root = tmp_path / "fs"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc = tmp_path / "proc_cgroup"
    proc.write_text("".join(line + "\n" for line in proc_lines))
    return root, proc


def test_cpu_quota_reads_cgroup_v2_and_takes_the_lowest_limit_on_the_path(tmp_path):
    from prepos.engines.openmp import cpu_quota

    root, proc = cgroup(tmp_path, ["0::/kubepods/pod1/ctr"], {
        "cpu.max": "max 100000", "kubepods/cpu.max": "800000 100000",
        "kubepods/pod1/cpu.max": "250000 100000", "kubepods/pod1/ctr/cpu.max": "max 100000"})
    assert cpu_quota(root, proc) == 2.5
    root, proc = cgroup(tmp_path / "none", ["0::/"], {"cpu.max": "max 100000"})
    assert cpu_quota(root, proc) is None


def test_cpu_quota_reads_cgroup_v1_and_a_namespaced_container(tmp_path):
    from prepos.engines.openmp import cpu_quota

    # v1: the cpu controller's own line; -1 is no quota
    root, proc = cgroup(tmp_path, ["4:memory:/x", "3:cpu,cpuacct:/docker/abc"], {
        "cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000",
        "cpu/docker/abc/cpu.cfs_quota_us": "150000", "cpu/docker/abc/cpu.cfs_period_us": "100000"})
    assert cpu_quota(root, proc) == 1.5
    # the path names a host folder the container's mount does not show: its root is the container's cgroup
    root, proc = cgroup(tmp_path / "ns", ["0::/kubepods/pod1/ctr"], {"cpu.max": "300000 100000"})
    assert cpu_quota(root, proc) == 3.0
    # nothing readable
    assert cpu_quota(tmp_path / "absent", tmp_path / "absent-proc") is None


def test_default_threads_keep_to_the_quota():
    from prepos.engines.openmp import default_num_threads

    assert default_num_threads(32, None) == 32
    assert default_num_threads(32, 8.0) == 8
    assert default_num_threads(32, 2.5) == 2
    assert default_num_threads(32, 0.5) == 1
    assert default_num_threads(4, 8.0) == 4


def test_the_torch_engine_runs_on_the_quotas_threads(monkeypatch, tied):
    from pathlib import Path

    import torch
    from prepos import core
    from prepos.config import EngineConfig

    engine_dir = Path(tied[0])
    monkeypatch.setattr(core, "cpu_quota", lambda: 1.0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        core.create_engine(EngineConfig(), engine_dir)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        core.create_engine(EngineConfig(num_threads=2), engine_dir)
        assert torch.get_num_threads() == 2  # a count set in the config wins
    finally:
        torch.set_num_threads(before)


def test_a_configured_thread_count_above_the_usable_cpus_is_kept_with_a_warning(monkeypatch, caplog):
    from prepos import core

    monkeypatch.setattr(core, "cpu_quota", lambda: 2.0)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})  # the quota is the tighter bound
    with caplog.at_level("WARNING", logger="prepos.core"):
        assert core.engine_threads(8) == 8
        assert core.engine_threads(2) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "engine.num_threads 8 is more than the 2 CPUs" in warnings[0]
