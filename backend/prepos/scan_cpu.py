"""The greedy vocabulary scan on CPU as one compiled call (``prepos_scan_greedy`` in the engines' CPU kernels).

The decode loop scans every session's distribution after every token. On CPU, torch's scan is half a dozen
ops over the vocabulary, each with its own dispatch and pass over memory; the kernel reads the logits in
four tight loops on the calling thread (bits checked, max, runner-up, the sums ``S = sum exp(x - m)`` and
``T = sum exp(x - m) (x - m)``), with the same algebra as the GPU kernel (:mod:`prepos.scan_triton`):
``p_max = 1 / S``, ``margin = (1 - exp(second - m)) / S``, ``entropy = log S - T / S``, in float32
with the sums returned as doubles.

It takes scans of the whole vocabulary of float32 CPU logits, the decode loop's case: greedy ones whole; for
sampled ones the kernel gives the features and the maximum, and :func:`prepos.scan.sample_index` draws the
token from the same tempered distribution :func:`prepos.scan.scan_torch` builds (the same token). Everything
else (a ``choices`` subset, other dtypes or devices), and logits the kernel refuses (NaN, +inf, all -inf),
goes to :func:`prepos.scan.scan_torch`, which gives the same contract and names the problem.
"""

from __future__ import annotations

import math
import threading
from typing import Sequence

import torch

from prepos.scan import ScanResult, sample_index, scan_torch


class CpuKernelUnavailable(RuntimeError):
    """The CPU kernels could not be built or failed their self-test here (the log says why)."""


class CpuKernelScan:
    """A scan implementation (:data:`prepos.scan.ScanFn`) over the compiled CPU kernels."""

    def __init__(self, kernels=None) -> None:
        if kernels is None:
            from prepos.engines import cpu_kernels

            kernels = cpu_kernels.load()
            if kernels is None:
                raise CpuKernelUnavailable("the CPU kernels are not available here (no C compiler, or they failed "
                                           "their self-test; see the log)")
        self._kernels = kernels
        self._lock = threading.Lock()  # the kernels' result buffer is shared

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
        stats = None
        if (allowed_ids is None and isinstance(logits, torch.Tensor) and logits.dim() == 1
                and logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.is_contiguous()
                and (temperature == 0.0 or uniform is not None)):
            with self._lock:
                stats = self._kernels.scan_greedy(logits)
        if stats is None:
            return scan_torch(logits, allowed_ids=allowed_ids, temperature=temperature, top_k=top_k, top_p=top_p,
                              uniform=uniform)
        position, top, second, s, t = stats
        n = logits.numel()
        if temperature != 0.0:  # the tempered distribution scan_torch samples from: the same token
            position = sample_index(torch.softmax((logits - top) / temperature, 0), top_k, top_p, uniform)
        p_max = 1.0 / s
        return ScanResult(
            token_id=int(position),
            p_max=p_max,
            margin=p_max - math.exp(second - top) / s if n > 1 else p_max,
            entropy=max(0.0, math.log(s) - t / s),
            num_allowed=n,
        )
