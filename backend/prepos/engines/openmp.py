"""OpenMP threads and the engine loop: one thread runs the engine, so only it should own OpenMP workers.

Torch's CPU ops and the CPU kernels run their parallel regions on libgomp (the copy torch ships). libgomp
keeps a pool of worker threads per thread that opened a parallel region, and when it manages more threads
than there are CPUs it stops spinning at barriers and sleeps on a futex instead, which makes every barrier
cost a wake-up. The model is loaded on one thread (Triton's) and served on another (the engine loop), so
after loading there are two pools: on a 2-core machine a decode step on the loop thread then took 50-85%
longer than the same step on the loading thread, and the GEMM alone about 25% longer.
:func:`release_calling_thread` gives the loading thread's pool back once the loop runs, and keeps any later
parallel region on that thread (a scan answered inline, say) to the thread itself.
"""

from __future__ import annotations

import ctypes
import logging

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
    if pause is not None:
        pause.argtypes = [ctypes.c_int]
        pause(OMP_PAUSE_SOFT)
    return True
