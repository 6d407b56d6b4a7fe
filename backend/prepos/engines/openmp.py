"""OpenMP threads and the engine loop: one thread runs the engine, so only it should own OpenMP workers.

Torch's CPU ops and the CPU kernels run their parallel regions on libgomp (the copy torch ships). libgomp
keeps a pool of worker threads per thread that opened a parallel region, and when it manages more threads
than there are CPUs it stops spinning at barriers and sleeps on a futex instead, which makes every barrier
cost a wake-up. The model is loaded on one thread (Triton's) and served on another (the engine loop), so
after loading there are two pools: on a 2-core machine a decode step on the loop thread then took 50-85%
longer than the same step on the loading thread, and the GEMM alone about 25% longer.
:func:`release_calling_thread` gives the loading thread's pool back once the loop runs, and keeps any later
parallel region on that thread (a scan answered inline, say) to the thread itself.

Torch's default thread count is the machine's physical cores, whatever CPU quota the process's cgroup sets (a
Kubernetes CPU limit). Threads past the quota are throttled together at each period's end: every barrier then
waits for a thread that may not run for the rest of the period. :func:`default_num_threads` lowers the default
to the quota.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1


def release_calling_thread() -> bool:
    """Free the calling thread's OpenMP worker threads and run its later parallel regions on one thread.

    Returns whether libgomp was found; other threads (the engine loop) keep their own thread counts."""
    torch.get_num_threads()  # torch sets a thread's OpenMP thread count on first use: done now, not later
    try:
        gomp = ctypes.CDLL("libgomp.so.1")  # by soname: the copy torch loaded
    except OSError as err:
        log.info("no libgomp to release (%s)", err)
        return False
    gomp.omp_set_num_threads(1)
    pause = getattr(gomp, "omp_pause_resource_all", None)
    if pause is None:  # OpenMP 5.0: the libgomp of GCC 9 on; some torch wheels (2.6's on PyPI) carry an older one
        log.info("this libgomp has no omp_pause_resource_all: the loading thread's OpenMP workers stay (asleep); "
                 "its later parallel regions run on one thread")
        return True
    pause.argtypes = [ctypes.c_int]
    pause(OMP_PAUSE_SOFT)
    return True


CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def cpu_quota(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPUs the process's cgroup may use (its CFS quota over its period), the lowest along its path to the
    root; None when no quota is set or none can be read. Reads cgroup v2 (``cpu.max``) or v1
    (``cpu/cpu.cfs_quota_us`` and ``cpu.cfs_period_us``)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    v2 = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
    v1 = next((line.split(":", 2)[2] for line in lines
               if len(line.split(":", 2)) == 3 and "cpu" in line.split(":", 2)[1].split(",")), None)
    quotas = []
    for folder in _ancestors(cgroup_root, v2 if v2 is not None else "/"):
        quotas.append(_v2_quota(folder / "cpu.max"))
    for folder in _ancestors(cgroup_root / "cpu", v1 if v1 is not None else "/"):
        quotas.append(_v1_quota(folder))
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _ancestors(root: Path, path: str) -> list[Path]:
    # In a container with its own cgroup namespace the path is "/": the root folder is the container's cgroup.
    parts = [part for part in path.strip().split("/") if part and part != ".."]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(cpu_max: Path) -> float | None:
    try:
        quota, _, period = cpu_max.read_text().strip().partition(" ")
        return int(quota) / int(period) if quota != "max" and int(period) > 0 and int(quota) > 0 else None
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None  # -1: no quota


def usable_cpus(quota: float | None) -> int:
    """The CPUs the process may run on at once: those of its CPU affinity, no more than ``quota`` (rounded
    down) where one is set; at least one."""
    cpus = len(os.sched_getaffinity(0))
    return max(1, cpus if quota is None else min(cpus, math.floor(quota)))


def default_num_threads(torch_default: int, quota: float | None) -> int:
    """The engine's intra-op thread count where ``engine.num_threads`` is 0: torch's default, but no more than
    the CPU quota allows (rounded down, at least one)."""
    if quota is None:
        return torch_default
    return max(1, min(torch_default, math.floor(quota)))
