"""The torch engine's CPU kernels (``cpu_kernels.c``): decode, and prefill's matrix products, compiled for
this machine on first use.

A decode step on CPU is a matrix-vector product per weight matrix, bound by reading the weights, plus
one token's attention over the session's cached keys and values. On a 2-core AMD EPYC, torch's batched
matmul (MKL) read SmolLM2-135M's matrices at 15-29 GB/s where a plain sum over memory reads 31-34 GB/s,
and its CPU flash attention read a 2,000-token KV cache at about 8 GB/s. ``cpu_kernels.c`` has a GEMV
over 32-column blocks that each thread streams front to back, and a one-token attention whose work items
are (kv head, chunk of keys), so both threads share even one head's keys
(``loadtest/chunking_bench.py --parts sweep,kernel,attention`` measures them). Prefill multiplies many
rows by the same packed matrices, which is compute-bound: torch's matmul over the 32-column blocks ran at
about 85-125 GFLOP/s there, and ``cpu_kernels.c``'s GEMM, which keeps a tile of 8 rows x 32 columns in
vector registers while a block streams past, at about 150-220 (``--parts prefill``). Prefill's causal
attention uses the same register tiles, for scores and for values, over chunks of 64 keys with a running
softmax per row; each kv head's keys are transposed into those chunks once per layer, for all its work items.

:func:`load` compiles the source with the system C compiler (``$CC``, else ``cc``) at ``-O3 -march=native
-ffast-math -fopenmp`` (then links it without ``-ffast-math``, which would switch on flush-to-zero for the
whole process) into a cache directory (``$PREPOS_CACHE_DIR``, else ``$XDG_CACHE_HOME/prepos`` or
``~/.cache/prepos``), keyed by the source, the flags, the compiler's version and the CPU's flags, so the
next load on the same machine reuses it; then checks every kernel against torch on random input before
handing them out. The library links libgomp by soname, which torch has already loaded, so the kernels run
on torch's own OpenMP runtime rather than a second thread pool. Where any step fails (no compiler, no
OpenMP, a wrong result) :func:`load` logs why and returns ``None``, and the engine keeps torch's ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
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
SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")  # compiling the source
# Linking is a separate step without -ffast-math: with it the compiler links in crtfastmath, whose constructor
# turns on flush-to-zero for the thread that loads the library, and every thread it starts later.
LINK_FLAGS = ("-shared", "-fopenmp")
LIBS = ("-lm",)
ATTENTION_CHUNK = 256  # keys per work item, ATTN_CHUNK in the source
PREFILL_KEYS = 64  # keys per chunk of the prefill attention, PREFILL_KEYS in the source
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # query heads per kv head and head size the attention kernel takes
_ABI = 8


def attention_fits(group: int, head_dim: int) -> bool:
    """Whether the attention kernel takes ``group`` query heads per kv head of ``head_dim`` each."""
    return group <= MAX_GROUP and head_dim <= MAX_HEAD_DIM


def prefill_attention_fits(head_dim: int) -> bool:
    """Whether the prefill attention kernel takes ``head_dim`` (it reads values 32 columns at a time)."""
    return head_dim % BLOCK == 0


def prefill_scratch(kv_heads: int, head_dim: int, keys: int) -> torch.Tensor:
    """The prefill attention's scratch for ``keys`` keys: each kv head's keys transposed in chunks of
    ``PREFILL_KEYS`` ([kv_heads, chunks, head_dim, PREFILL_KEYS] float32), so all its work items share one copy."""
    chunks = -(-keys // PREFILL_KEYS)
    return torch.empty(kv_heads * chunks * head_dim * PREFILL_KEYS)


class CpuKernels:
    """The compiled kernels: :meth:`gemv` and :meth:`attend` check their input; the ``*_unchecked`` forms are
    for the engine's decode step, which packed its weights for them and made its vectors itself."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._gemv = lib.prepos_gemv32
        self._gemv.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_float, ctypes.c_long, ctypes.c_long, ctypes.c_int]
        self._gemv.restype = None
        self._attend = lib.prepos_decode_attention
        self._attend.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 5 + [ctypes.c_float, ctypes.c_int]
        self._attend.restype = None
        self._gemm = lib.prepos_gemm32
        self._gemm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 3 + [ctypes.c_int]
        self._gemm.restype = None
        self._prefill_attend = lib.prepos_prefill_attention
        self._prefill_attend.argtypes = ([ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 6
                                         + [ctypes.c_float, ctypes.c_int])
        self._prefill_attend.restype = None
        self._layers = lib.prepos_decode_layers
        self._layers.argtypes = ([ctypes.c_void_p] * 9 + [ctypes.c_long] * 8 + [ctypes.c_float, ctypes.c_int])
        self._layers.restype = None
        self._layers_batch = lib.prepos_decode_layers_batch
        self._layers_batch.argtypes = ([ctypes.c_void_p] * 11 + [ctypes.c_long] * 7 + [ctypes.c_float, ctypes.c_int])
        self._layers_batch.restype = None
        self._scan = lib.prepos_scan_greedy
        self._scan.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
        self._scan.restype = ctypes.c_int
        self._scan_out = torch.empty(5, dtype=torch.float64)
        self.self_testing = False  # outputs start as NaN (see _output)

    def _output(self, *shape: int) -> torch.Tensor:
        """A kernel's output tensor. While self-testing, filled with NaN: the self-test's inputs are the same at
        every load, so an element a broken kernel never writes could hold a freed tensor's correct value from an
        earlier load in the process and pass."""
        return torch.full(shape, math.nan) if self.self_testing else torch.empty(shape)

    def scan_greedy(self, logits: torch.Tensor) -> list[float] | None:
        """The greedy scan's numbers of 1-D float32 contiguous CPU ``logits`` (``ValueError`` otherwise):
        ``[first position of the max, max, second-largest value, S, T]`` (see ``prepos_scan_greedy``), or None
        when a logit is NaN or +inf or all are -inf. Not thread-safe: one result buffer per instance."""
        if logits.dim() != 1 or logits.dtype != torch.float32 or logits.device.type != "cpu" or not logits.is_contiguous():
            raise ValueError(f"logits: need a contiguous float32 CPU tensor [vocab], got {tuple(logits.shape)} "
                             f"{logits.dtype} on {logits.device}")
        if self._scan(logits.data_ptr(), logits.numel(), self._scan_out.data_ptr()):
            return None
        return self._scan_out.tolist()

    def gemv(self, w: torch.Tensor, x: torch.Tensor, *, alpha: float = 1.0,
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
        return self.gemv_unchecked(w, x, alpha, residual)

    def gemv_unchecked(self, w: torch.Tensor, x: torch.Tensor, alpha: float, residual: torch.Tensor | None
                       ) -> torch.Tensor:
        y = self._output(w.shape[0] * BLOCK)
        self._gemv(w.data_ptr(), x.data_ptr(), y.data_ptr(), None if residual is None else residual.data_ptr(),
                   alpha, w.shape[0], w.shape[1], torch.get_num_threads())
        return y

    def gemm(self, w: torch.Tensor, x: torch.Tensor, *, scale: torch.Tensor | None = None,
             residual: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, blocks * 32]`` float32: row ``r`` is ``scale[r] * (x[r] @ W)``, plus ``residual[r]`` when given.

        ``w`` is ``[blocks, k, 32]``, ``x`` ``[n, k]``, ``scale`` ``[n]``, ``residual`` ``[n, blocks * 32]``; all
        float32, contiguous, on CPU (``ValueError`` naming the argument otherwise).
        """
        blocks, k, width = w.shape
        n = x.shape[0] if x.dim() == 2 else -1
        for name, t, shape in (("w", w, (blocks, k, BLOCK)), ("x", x, (n, k)), ("scale", scale, (n,)),
                               ("residual", residual, (n, blocks * BLOCK))):
            if t is not None and (tuple(t.shape) != shape or t.dtype != torch.float32 or t.device.type != "cpu"
                                  or not t.is_contiguous()):
                raise ValueError(f"{name}: need a contiguous float32 CPU tensor {shape}, got "
                                 f"{tuple(t.shape)} {t.dtype} on {t.device}")
        return self.gemm_unchecked(w, x, scale, residual)

    def gemm_unchecked(self, w: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None,
                       residual: torch.Tensor | None) -> torch.Tensor:
        y = self._output(x.shape[0], w.shape[0] * BLOCK)
        self._gemm(w.data_ptr(), x.data_ptr(), y.data_ptr(), None if residual is None else residual.data_ptr(),
                   None if scale is None else scale.data_ptr(), x.shape[0], w.shape[0], w.shape[1],
                   torch.get_num_threads())
        return y

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One token's attention: ``q [kv_heads, group, head_dim]`` over keys and values ``[kv_heads, n, head_dim]``
        (each head's rows contiguous; heads may sit further apart, as in a KV cache with spare capacity), scaled
        by ``1/sqrt(head_dim)``, no mask. Returns ``[kv_heads * group * head_dim]``, heads in ``q``'s order.
        ``ValueError`` names what does not fit (float32 CPU tensors, ``group <= 16``, ``head_dim <= 256``)."""
        kv_heads, group, head_dim = q.shape
        n = k.shape[1]
        if not attention_fits(group, head_dim):
            raise ValueError(f"q: group {group} and head_dim {head_dim} must be at most {MAX_GROUP} and {MAX_HEAD_DIM}")
        if not q.is_contiguous():
            raise ValueError("q: must be contiguous")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype != torch.float32 or t.device.type != "cpu":
                raise ValueError(f"{name}: need float32 on CPU, got {t.dtype} on {t.device}")
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != (kv_heads, n, head_dim) or t.stride()[1:] != (head_dim, 1) or n < 1:
                raise ValueError(f"{name}: need [{kv_heads}, n >= 1, {head_dim}] with contiguous rows, got "
                                 f"{tuple(t.shape)} strides {t.stride()}")
        if k.stride(0) != v.stride(0):
            raise ValueError(f"k and v: head strides differ ({k.stride(0)} vs {v.stride(0)})")
        return self.attend_unchecked(q, k.data_ptr(), v.data_ptr(), kv_heads, group, head_dim, n, k.stride(0))

    def attend_unchecked(self, q: torch.Tensor, k_ptr: int, v_ptr: int, kv_heads: int, group: int, head_dim: int,
                         n: int, head_stride: int) -> torch.Tensor:
        out = self._output(kv_heads * group * head_dim)
        chunks = -(-n // ATTENTION_CHUNK)
        work = torch.empty(kv_heads * chunks * group * (head_dim + 2))
        self._attend(q.data_ptr(), k_ptr, v_ptr, out.data_ptr(), work.data_ptr(), kv_heads, group, head_dim, n,
                     head_stride, head_dim ** -0.5, torch.get_num_threads())
        return out


    def prefill_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of ``n`` new tokens: ``q [n, heads, head_dim]`` (each token's heads contiguous; tokens
        may sit further apart) over keys and values ``[kv_heads, start + n, head_dim]`` that already hold the new
        tokens at ``start..``; token ``i`` sees keys ``0..start + i``. Query head ``h`` reads kv head
        ``h // (heads / kv_heads)``, scale ``1/sqrt(head_dim)``. Returns ``[n, heads * head_dim]``.
        ``ValueError`` names what does not fit (as :meth:`attend`)."""
        n, heads, head_dim = q.shape
        kv_heads, keys = k.shape[0], k.shape[1]
        if (kv_heads < 1 or heads % kv_heads or not attention_fits(heads // kv_heads, head_dim)
                or not prefill_attention_fits(head_dim)):
            raise ValueError(f"q: {heads} heads over {kv_heads} kv heads of head_dim {head_dim}: need a group of at "
                             f"most {MAX_GROUP} and head_dim a multiple of {BLOCK} up to {MAX_HEAD_DIM}")
        if q.stride()[1:] != (head_dim, 1) or q.stride(0) < heads * head_dim:
            raise ValueError(f"q: each token's heads must be contiguous, got strides {q.stride()}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype != torch.float32 or t.device.type != "cpu":
                raise ValueError(f"{name}: need float32 on CPU, got {t.dtype} on {t.device}")
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != (kv_heads, keys, head_dim) or t.stride()[1:] != (head_dim, 1) or keys < n or n < 1:
                raise ValueError(f"{name}: need [{kv_heads}, at least {max(n, 1)} keys, {head_dim}] with contiguous "
                                 f"rows, got {tuple(t.shape)} strides {t.stride()}")
        if k.stride(0) != v.stride(0):
            raise ValueError(f"k and v: head strides differ ({k.stride(0)} vs {v.stride(0)})")
        return self.prefill_attend_unchecked(q, q.stride(0), k.data_ptr(), v.data_ptr(), kv_heads, heads // kv_heads,
                                             head_dim, n, keys - n, k.stride(0),
                                             prefill_scratch(kv_heads, head_dim, keys))

    def prefill_attend_unchecked(self, q: torch.Tensor, q_stride: int, k_ptr: int, v_ptr: int, kv_heads: int,
                                 group: int, head_dim: int, n: int, start: int, head_stride: int,
                                 scratch: torch.Tensor) -> torch.Tensor:
        """As :meth:`prefill_attend`, with ``scratch`` from :func:`prefill_scratch` for at least ``start + n``
        keys (one per prefill serves every layer: the kernel overwrites what it reads)."""
        out = self._output(n, kv_heads * group * head_dim)
        self._prefill_attend(q.data_ptr(), q_stride, k_ptr, v_ptr, out.data_ptr(), scratch.data_ptr(), kv_heads,
                             group, head_dim, n, start, head_stride, head_dim ** -0.5, torch.get_num_threads())
        return out


class DecodeLayers:
    """Every decoder layer of one token in one kernel call (``prepos_decode_layers``), for a model whose packed
    matrices are all in 32-column blocks. Holds the matrices' addresses; the engine keeps the matrices alive."""

    def __init__(self, kernels: CpuKernels, wqkv: list[torch.Tensor], wo: list[torch.Tensor], wgu: list[torch.Tensor],
                 wdown: list[torch.Tensor], *, heads: int, kv_heads: int, head_dim: int, inter: int, n_eps: float):
        self._fn, self._fn_batch = kernels._layers, kernels._layers_batch
        self.layers, self.hidden = len(wqkv), wqkv[0].shape[1]
        self.heads, self.kv_heads, self.head_dim, self.inter, self.n_eps = heads, kv_heads, head_dim, inter, n_eps
        if heads % kv_heads or not attention_fits(heads // kv_heads, head_dim) or head_dim % 2:
            raise ValueError(f"heads {heads} over kv heads {kv_heads} with head_dim {head_dim}: outside what the "
                             f"attention kernel takes (group <= {MAX_GROUP}, even head_dim <= {MAX_HEAD_DIM})")
        expected = {"q/k/v": (self.hidden, (heads + 2 * kv_heads) * head_dim), "o": (heads * head_dim, self.hidden),
                    "gate/up": (self.hidden, 2 * inter), "down": (inter, self.hidden)}
        for (name, (d_in, out)), ws in zip(expected.items(), (wqkv, wo, wgu, wdown)):
            for w in ws:
                if tuple(w.shape) != (out // BLOCK, d_in, BLOCK) or out % BLOCK or w.dtype != torch.float32 \
                        or not w.is_contiguous():
                    raise ValueError(f"{name}: need [{out // BLOCK}, {d_in}, 32] float32 contiguous, got "
                                     f"{tuple(w.shape)} {w.dtype}")
        self._ptrs = [(ctypes.c_void_p * self.layers)(*(w.data_ptr() for w in ws)) for ws in (wqkv, wo, wgu, wdown)]
        self._fixed = 3 * (heads + kv_heads) * head_dim + 3 * inter  # qkv, q and k after RoPE, attention, gu, act

    def __call__(self, x: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, pos: int
                 ) -> torch.Tensor:
        """The residual stream after every layer, for ``x [hidden]`` (float32, contiguous; not changed) at ``pos``;
        writes each layer's key and value at ``pos`` of ``kv [layers, 2, kv_heads, cap, head_dim]`` (contiguous,
        ``pos < cap``). ``cos``/``sin_signed`` are RoPE's rows for ``pos`` (``[head_dim]``, sign folded into sin)."""
        scratch = torch.empty(self._fixed + self._attention_floats([pos]))
        out = x.clone()
        self._fn(out.data_ptr(), *self._ptrs, kv.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), scratch.data_ptr(),
                 self.layers, self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter, kv.shape[3], pos,
                 self.n_eps, torch.get_num_threads())
        return out

    def _attention_floats(self, positions: list[int]) -> int:
        """Scratch floats for the attention's partial results of tokens at ``positions``: per token, kv head and
        chunk of keys, the group's heads' max, sum and weighted values."""
        chunks = sum(-(-(pos + 1) // ATTENTION_CHUNK) for pos in positions)
        return self.kv_heads * chunks * (self.heads // self.kv_heads) * (self.head_dim + 2)

    def batch(self, x: torch.Tensor, kvs: list[torch.Tensor], positions: list[int], cos: torch.Tensor,
              sin_signed: torch.Tensor) -> torch.Tensor:
        """:meth:`__call__` for ``n`` tokens of ``n`` sessions at once (``prepos_decode_layers_batch``): ``x [n,
        hidden]`` (float32, contiguous; not changed), token ``b`` at ``positions[b]`` of the session whose KV is
        ``kvs[b]`` (each contiguous, ``[layers, 2, kv_heads, cap, head_dim]`` with ``position < cap``; distinct
        sessions). ``cos``/``sin_signed`` are RoPE's whole tables (``[positions, head_dim]``, contiguous).
        Each matrix product takes the ``n`` rows together. Returns the residual streams ``[n, hidden]``."""
        n = len(kvs)
        scratch = torch.empty(n * (self._fixed + 1) + self._attention_floats(positions))  # + 1: each row's norm
        out = x.clone()
        self._fn_batch(out.data_ptr(), *self._ptrs, (ctypes.c_void_p * n)(*(kv.data_ptr() for kv in kvs)),
                       (ctypes.c_long * n)(*(kv.shape[3] for kv in kvs)), (ctypes.c_long * n)(*positions),
                       cos.data_ptr(), sin_signed.data_ptr(), scratch.data_ptr(), n, self.layers, self.hidden,
                       self.heads, self.kv_heads, self.head_dim, self.inter, self.n_eps, torch.get_num_threads())
        return out


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
                                    (source, " ".join(FLAGS + LINK_FLAGS + LIBS), version, _cpu_flags(),
                                     platform.machine()))).hexdigest()
    path = cache / f"cpu_kernels-{key[:16]}.so"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
    os.close(fd)
    obj = tmp[:-3] + ".o"
    try:
        for command in ([compiler, *FLAGS, "-c", str(SOURCE), "-o", obj], [compiler, *LINK_FLAGS, obj, "-o", tmp, *LIBS]):
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if done.returncode:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, path)  # atomic: a concurrent load sees the old state or the whole library
    finally:
        for leftover in (tmp, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)
    log.info("compiled %s -> %s", SOURCE.name, path)
    return path


def _self_test(kernels: CpuKernels) -> None:
    g = torch.Generator().manual_seed(0)
    for blocks, k in ((3, 40), (5, 7), (1, 1)):
        w, x, res = (torch.randn(blocks, k, BLOCK, generator=g), torch.randn(k, generator=g),
                     torch.randn(blocks * BLOCK, generator=g))
        want = torch.bmm(x.expand(blocks, 1, k), w).view(-1)
        for got, expected in ((kernels.gemv(w, x, alpha=0.5, residual=res), res + 0.5 * want), (kernels.gemv(w, x), want)):
            if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
                raise RuntimeError(f"self-test: gemv wrong for [{blocks}, {k}, 32] "
                                   f"(max error {(got - expected).abs().max().item():.3g})")
    for blocks, k, n in ((3, 40, 11), (2, 7, 1), (1, 5, 70)):  # a tail tile, one row, a second panel
        w, x = torch.randn(blocks, k, BLOCK, generator=g), torch.randn(n, k, generator=g)
        scale, res = torch.rand(n, generator=g), torch.randn(n, blocks * BLOCK, generator=g)
        want = torch.matmul(x, w).transpose(0, 1).reshape(n, -1)
        for got, expected in ((kernels.gemm(w, x, scale=scale, residual=res), res + scale[:, None] * want),
                              (kernels.gemm(w, x), want)):
            if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
                raise RuntimeError(f"self-test: gemm wrong for {n} rows x [{blocks}, {k}, 32] "
                                   f"(max error {(got - expected).abs().max().item():.3g})")
    for kv_heads, group, head_dim, n in ((2, 3, 16, 1), (1, 1, 8, 300), (3, 2, 64, 700)):
        q = torch.randn(kv_heads, group, head_dim, generator=g)
        cache = torch.randn(2, kv_heads, n + 5, head_dim, generator=g)[:, :, :n]  # heads further apart than n rows
        got = kernels.attend(q, cache[0], cache[1])
        want = torch.nn.functional.scaled_dot_product_attention(q[None], cache[0][None], cache[1][None]).reshape(-1)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"self-test: attention wrong for {kv_heads} kv heads x {group}, head_dim {head_dim}, "
                               f"{n} keys (max error {(got - want).abs().max().item():.3g})")
    for kv_heads, group, head_dim, start, n in ((2, 3, 32, 0, 5), (1, 2, 64, 70, 30), (3, 1, 32, 130, 70)):
        q = torch.randn(n, kv_heads * group, head_dim, generator=g) * 2
        cache = torch.randn(2, kv_heads, start + n + 3, head_dim, generator=g)[:, :, :start + n]
        got, want = kernels.prefill_attend(q, cache[0], cache[1]), causal_attention_reference(q, cache[0], cache[1])
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"self-test: prefill attention wrong for {n} tokens after {start} ({kv_heads} kv heads "
                               f"x {group}, head_dim {head_dim}; max error {(got - want).abs().max().item():.3g})")
    _scan_self_test(kernels, g)


def _scan_self_test(kernels: CpuKernels, g: torch.Generator) -> None:
    for n, ties in ((1, False), (7, True), (49_152, False), (50_000, True)):
        x = torch.randn(n, generator=g) * 4
        if ties:
            x[n // 2] = x[n - 1] = x.max() + 1  # two maxima: the first is the answer, the runner-up ties it
        x[:: max(2, n // 9)] = float("-inf") if n > 1 else x[0]
        got = kernels.scan_greedy(x)
        d = x.double() - x.double().max()
        want = [float(torch.argmax(x)), x.max().item(), torch.topk(x, 2).values[-1].item() if n > 1 else float("-inf"),
                d.exp().sum().item(), torch.where(d > -87, d.exp() * d, 0).sum().item()]
        if got is None or got[:3] != want[:3] or not math.isclose(got[3], want[3], rel_tol=1e-4) \
                or not math.isclose(got[4], want[4], rel_tol=1e-3, abs_tol=1e-4):
            raise RuntimeError(f"self-test: greedy scan wrong for {n} logits: {got} against {want}")
    for bad in (float("nan"), float("inf")):
        if kernels.scan_greedy(torch.tensor([0.0, bad, 1.0])) is not None:
            raise RuntimeError(f"self-test: greedy scan did not refuse a logit {bad}")
    if kernels.scan_greedy(torch.full((4,), float("-inf"))) is not None:
        raise RuntimeError("self-test: greedy scan did not refuse logits that are all -inf")


def causal_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """:meth:`CpuKernels.prefill_attend`'s result by SDPA: ``q [n, heads, hd]`` over ``k``/``v`` ``[kv_heads,
    start + n, hd]``, token ``i`` seeing keys ``0..start + i``; ``[n, heads * hd]``."""
    n, keys = q.shape[0], k.shape[1]
    pos = torch.arange(keys)
    mask = pos[None, :] <= pos[keys - n:, None]
    a = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                                         enable_gqa=True)
    return a[0].transpose(0, 1).reshape(n, -1)


def load(cache_dir: str | os.PathLike | None = None) -> CpuKernels | None:
    """The compiled kernels, checked against torch; ``None`` (with the reason logged) where it cannot be had."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        log.info("CPU kernels not built: no C compiler (%s) on PATH; the engine uses torch's ops", compiler)
        return None
    try:
        path = _build(compiler, Path(cache_dir) if cache_dir else _cache_dir())
        lib = ctypes.CDLL(str(path))
        if lib.prepos_kernels_abi() != _ABI:
            raise RuntimeError(f"{path}: ABI {lib.prepos_kernels_abi()}, expected {_ABI}")
        kernels = CpuKernels(lib, path)
        kernels.self_testing = True
        try:
            _self_test(kernels)
        finally:
            kernels.self_testing = False
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("CPU kernels unavailable (%s); the engine uses torch's ops", e)
        return None
    return kernels
