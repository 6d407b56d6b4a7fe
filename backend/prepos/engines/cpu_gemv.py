"""The torch engine's CPU decode GEMV (``cpu_gemv.c``), compiled for this machine on first use.

A decode step on CPU is a matrix-vector product per weight matrix, bound by reading the weights. On a
2-core AMD EPYC, torch's batched matmul (MKL) read SmolLM2-135M's matrices at 20-28 GB/s where a plain
sum over memory reads 31-34 GB/s; ``cpu_gemv.c`` is a GEMV over 32-column blocks that each thread
streams front to back, and reads them at 28-32 GB/s (``loadtest/chunking_bench.py --parts kernel``).

:func:`load` compiles the source with the system C compiler (``$CC``, else ``cc``) at ``-O3
-march=native -fopenmp`` into a cache directory (``$PREPOS_CACHE_DIR``, else ``$XDG_CACHE_HOME/prepos``
or ``~/.cache/prepos``), keyed by the source, the flags, the compiler's version and the CPU's flags, so
the next load on the same machine reuses it; then checks it against torch on random input before
handing it out. The library links libgomp by soname, which torch has already loaded, so the kernel runs
on torch's own OpenMP runtime rather than a second thread pool. Where any step fails (no compiler, no
OpenMP, a wrong result) :func:`load` logs why and returns ``None``, and the engine keeps torch's matmul.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

BLOCK = 32  # columns per block, fixed by the kernel
SOURCE = Path(__file__).with_name("cpu_gemv.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC")
_ABI = 1


class CpuGemv:
    """``alpha * (x @ W) + residual`` for a float32 CPU matrix packed as ``[blocks, k, 32]``."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fn = lib.prepos_gemv32
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_float, ctypes.c_long, ctypes.c_long, ctypes.c_int]
        self._fn.restype = None

    def __call__(self, w: torch.Tensor, x: torch.Tensor, *, alpha: float = 1.0,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """``[blocks * 32]`` float32: ``alpha * (x @ W)``, plus ``residual`` when given.

        ``w`` is ``[blocks, k, 32]``, ``x`` ``[k]``, ``residual`` ``[blocks * 32]``; all float32, contiguous, on
        CPU (``ValueError`` otherwise: the kernel reads raw memory and must not be handed anything else).
        """
        blocks, k, width = w.shape
        out = blocks * BLOCK
        for name, t, shape in (("w", w, (blocks, k, BLOCK)), ("x", x, (k,)), ("residual", residual, (out,))):
            if t is not None and (tuple(t.shape) != shape or t.dtype != torch.float32 or t.device.type != "cpu"
                                  or not t.is_contiguous()):
                raise ValueError(f"{name}: need a contiguous float32 CPU tensor {shape}, got "
                                 f"{tuple(t.shape)} {t.dtype} on {t.device}")
        return self.unchecked(w, x, alpha, residual)

    def unchecked(self, w: torch.Tensor, x: torch.Tensor, alpha: float, residual: torch.Tensor | None) -> torch.Tensor:
        """``__call__`` without its checks, for a caller that guarantees them (the engine's decode step, whose
        weights were packed for the kernel and whose vectors it made itself)."""
        y = torch.empty(w.shape[0] * BLOCK)
        self._fn(w.data_ptr(), x.data_ptr(), y.data_ptr(), None if residual is None else residual.data_ptr(),
                 alpha, w.shape[0], w.shape[1], torch.get_num_threads())
        return y


def _cache_dir() -> Path:
    if os.environ.get("PREPOS_CACHE_DIR"):
        return Path(os.environ["PREPOS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "prepos"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _build(compiler: str, cache: Path) -> Path:
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join(x.encode() if isinstance(x, str) else x for x in
                                    (source, " ".join(FLAGS), version, _cpu_flags(), platform.machine()))).hexdigest()
    path = cache / f"cpu_gemv-{key[:16]}.so"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, path)  # atomic: a concurrent load sees the old state or the whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("compiled %s -> %s", SOURCE.name, path)
    return path


def _self_test(gemv: CpuGemv) -> None:
    g = torch.Generator().manual_seed(0)
    for blocks, k in ((3, 40), (5, 7), (1, 1)):
        w, x, res = torch.randn(blocks, k, BLOCK, generator=g), torch.randn(k, generator=g), torch.randn(blocks * BLOCK, generator=g)
        want = res + 0.5 * torch.bmm(x.expand(blocks, 1, k), w).view(-1)
        got = gemv(w, x, alpha=0.5, residual=res)
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            raise RuntimeError(f"self-test: wrong result for [{blocks}, {k}, 32] "
                               f"(max error {(got - want).abs().max().item():.3g})")
        if not torch.allclose(gemv(w, x), (want - res) * 2, rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"self-test: wrong result without residual for [{blocks}, {k}, 32]")


def load(cache_dir: str | os.PathLike | None = None) -> CpuGemv | None:
    """The compiled kernel, checked against torch; ``None`` (with the reason logged) where it cannot be had."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        log.info("CPU GEMV kernel not built: no C compiler (%s) on PATH; decode uses torch's matmul", compiler)
        return None
    try:
        path = _build(compiler, Path(cache_dir) if cache_dir else _cache_dir())
        lib = ctypes.CDLL(str(path))
        if lib.prepos_gemv_abi() != _ABI:
            raise RuntimeError(f"{path}: ABI {lib.prepos_gemv_abi()}, expected {_ABI}")
        gemv = CpuGemv(lib, path)
        _self_test(gemv)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("CPU GEMV kernel unavailable (%s); decode uses torch's matmul", e)
        return None
    return gemv
