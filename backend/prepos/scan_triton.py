"""The vocabulary scan as one GPU kernel, written in OpenAI Triton.

One launch reads each allowed logit once. The vocabulary (or the ``choices``
subset, gathered through its ids) is cut into parts of ``block`` logits; each
program reduces its part to five numbers: max ``m``, ``s = sum exp(x - m)``,
``t = sum exp(x - m) * (x - m)``, the part's second-largest logit and the
position of its first maximum. The program that finishes last (an atomic ticket)
merges the parts: with ``M`` the overall max and ``S``, ``T`` rescaled to it,

- ``p_max = 1 / S`` and the answer is the first maximal position (lowest id on ties),
- ``margin = (1 - exp(second - M)) / S``,
- ``entropy = log S - T / S`` (nats),

so the features of :mod:`prepos.scan` come out of one pass in float32 (fp16 and
bf16 logits are widened on load). Rows are independent: a ``[rows, vocab]``
batch is one launch with a grid of ``parts x rows``.

Greedy scans run here. A sampled token needs the tempered distribution in
probability order (a sort), so ``temperature > 0`` goes to ``prepos.scan.scan_torch``
on the same device, as do results the two share by contract.

CUDA tensors run the compiled kernel. With ``TRITON_INTERPRET=1`` set before
Triton is imported, CPU tensors run the same kernel under Triton's interpreter
(NumPy, slow): that is how its semantics are tested on machines without a GPU;
the server serves it on CUDA only.

A :class:`TritonScan` owns a workspace (the parts and the tickets) on one device;
launches that share a workspace must be ordered on one stream.
"""

from __future__ import annotations

import math
import os
import threading
import types
from typing import Sequence

import torch

from prepos.scan import ScanResult, scan_torch, unreadable_logits

DEFAULT_BLOCK = 2048  # logits per program: 63 programs for a 128k vocabulary
_FIELDS = 5  # per part and per row: token position, p_max, p_second, entropy, max logit


class TritonUnavailable(RuntimeError):
    """OpenAI Triton is not installed, or the logits' device cannot run it; the message says which."""


def triton_interprets(triton: types.ModuleType) -> bool:
    """Whether the imported OpenAI Triton runs kernels under its interpreter: ``triton.knobs`` (3.4 on), else
    ``TRITON_INTERPRET`` as earlier releases read it, "1" and nothing else (NVIDIA's containers ship 3.0-3.2,
    which have no knobs)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernel():
    """The kernel and whether it runs interpreted (on CPU tensors) or compiled (on CUDA)."""
    try:
        import triton

        from prepos._scan_kernel import vocab_scan
    except ImportError as exc:
        raise TritonUnavailable(f"OpenAI Triton is not installed ({exc})") from None
    return vocab_scan, triton_interprets(triton)


class TritonScan:
    """Scans on one device through the kernel; callable like ``prepos.scan.scan_numpy``.

    ``block`` is the logits per program (a power of two). ``allowed_ids`` lists are
    moved to the device once and kept in a bounded cache (a session asks with the
    same tool names turn after turn).
    """

    def __init__(self, device: str | torch.device = "cuda", *, block: int = DEFAULT_BLOCK,
                 num_warps: int = 4, id_cache: int = 256) -> None:
        if block < 16 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 16, got {block}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise TritonUnavailable("no CUDA device for the scan kernel")
        if self.device.type not in ("cuda", "cpu"):
            raise TritonUnavailable(f"the scan kernel runs on CUDA (or interpreted on CPU), not {self.device}")
        self._jit, interpreted = _kernel()
        if interpreted != (self.device.type == "cpu"):
            raise TritonUnavailable(
                f"the scan kernel runs {'interpreted' if interpreted else 'compiled'} in this process "
                f"(TRITON_INTERPRET={'1' if interpreted else 'unset'} when Triton was imported), "
                f"so not on {self.device}: CUDA needs it compiled, CPU needs the interpreter")
        self.block = block
        self.num_warps = num_warps
        self._parts = torch.empty(0, dtype=torch.float32, device=self.device)
        self._tickets = torch.zeros(0, dtype=torch.int32, device=self.device)
        self._ids: dict[tuple[int, ...], torch.Tensor] = {}
        self._id_cache = id_cache
        self._one_row_out = torch.empty(1, _FIELDS, dtype=torch.float32, device=self.device)

    # ---- device-side entry: no host sync ---------------------------------------------------

    def features(self, logits: torch.Tensor, ids: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """Launch the scan on ``logits [vocab]`` or ``[rows, vocab]``; return ``[rows, 5]`` float32 on the device.

        Per row: position of the answer (in ``ids`` when given, else the token id),
        p_max, the runner-up's probability, entropy, the max logit (``-inf``: no
        finite allowed logit; ``+inf``, or p_max NaN: a +inf or NaN logit; the
        other fields are then meaningless).
        ``ids`` is an int32/int64 tensor of allowed token ids on the same device.
        """
        rows2d = logits.view(1, -1) if logits.dim() == 1 else logits
        if rows2d.dim() != 2 or rows2d.stride(1) != 1:
            raise ValueError(f"logits must be [vocab] or [rows, vocab] with contiguous rows, got {tuple(logits.shape)}")
        if rows2d.device != self.device:
            raise ValueError(f"logits are on {rows2d.device}, this scan runs on {self.device}")
        rows, vocab = rows2d.shape
        n = vocab if ids is None else ids.numel()
        if n == 0 or rows == 0:
            raise ValueError("scan: nothing to scan (empty logits or empty allowed set)")
        parts = -(-n // self.block)
        if self._parts.numel() < rows * parts * _FIELDS:
            self._parts = torch.empty(rows * parts * _FIELDS, dtype=torch.float32, device=self.device)
        if self._tickets.numel() < rows:
            self._tickets = torch.zeros(rows, dtype=torch.int32, device=self.device)
        if out is None:
            out = self._one_row_out if rows == 1 else torch.empty(rows, _FIELDS, dtype=torch.float32,
                                                                   device=self.device)
        self._jit[(parts, rows)](
            rows2d, rows2d.stride(0), ids if ids is not None else rows2d, n, self._parts, self._tickets, out, parts,
            HAS_IDS=ids is not None, BLOCK=self.block, PARTS=max(2, 1 << (parts - 1).bit_length()),
            num_warps=self.num_warps,
        )
        return out

    # ---- the scan contract -----------------------------------------------------------------

    def __call__(
        self,
        logits: torch.Tensor,
        *,
        allowed_ids: Sequence[int] | torch.Tensor | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        uniform: float | None = None,
    ) -> ScanResult:
        if temperature != 0.0:  # sampling needs a sort: torch's scan on the same device
            return scan_torch(logits, allowed_ids=allowed_ids, temperature=temperature, top_k=top_k,
                              top_p=top_p, uniform=uniform)
        if logits.dim() != 1:
            raise ValueError(f"logits must be [vocab], got {tuple(logits.shape)}")
        id_list = None
        ids = None
        if allowed_ids is not None:  # in id order: ties go to the lowest id
            id_list = sorted(allowed_ids.tolist() if isinstance(allowed_ids, torch.Tensor) else allowed_ids)
            ids = self._device_ids(id_list, logits.numel())
        stats = self.features(logits, ids).view(-1).tolist()  # the one host sync
        if not (math.isfinite(stats[4]) and math.isfinite(stats[1])):  # a NaN logit makes p_max NaN
            raise unreadable_logits(logits, id_list)
        position = int(stats[0])
        n = logits.numel() if id_list is None else len(id_list)
        p_max = stats[1]
        return ScanResult(
            token_id=position if id_list is None else id_list[position],
            p_max=p_max,
            margin=p_max - stats[2] if n > 1 else p_max,
            entropy=max(0.0, stats[3]),
            num_allowed=n,
        )

    def _device_ids(self, id_list: list[int], vocab: int) -> torch.Tensor:
        key = tuple(id_list)
        ids = self._ids.get(key)
        if ids is None:
            if not id_list:
                raise ValueError("scan: nothing to scan (empty logits or empty allowed set)")
            if min(id_list) < 0 or max(id_list) >= vocab:
                raise ValueError(f"scan: allowed ids must lie in [0, {vocab})")
            if len(self._ids) >= self._id_cache:
                self._ids.clear()
            ids = torch.tensor(id_list, dtype=torch.int32, device=self.device)
            self._ids[key] = ids
        return ids


_default: dict[torch.device, TritonScan] = {}
_default_lock = threading.Lock()


def shared_scan(device: torch.device) -> TritonScan:
    """The one :class:`TritonScan` of ``device`` in this process (created on first use)."""
    with _default_lock:
        scan = _default.get(device)
        if scan is None:
            scan = _default[device] = TritonScan(device)
    return scan


def scan_triton(logits: torch.Tensor, **kwargs) -> ScanResult:
    """The scan through the kernel on ``logits``' device (see :func:`shared_scan`)."""
    return shared_scan(logits.device)(logits, **kwargs)
