"""The vocabulary scan on ONNX Runtime (CPU): the standard-operator ONNX graph.

Same contract as ``prepos.scan`` (greedy, features, temperature, ``top_k``,
``top_p`` and the uniform draw are all in the graph of
``prepos_build.scan_onnx``), computed in float32 where the NumPy reference
accumulates in float64: features agree to float32 rounding, a greedy answer
exactly, and a sampled answer except where the draw or ``top_p`` sits on a
rounding boundary of the cumulative mass (as for the torch scan; tied logits can
put ``top_p`` exactly on one, where float32 and float64 may round apart).

Inputs the graph cannot honour exactly are refused with a ``ValueError`` naming
the argument, never answered differently: logits that are not one-dimensional
float32/float16/bfloat16, ``allowed_ids`` that are empty, negative, out of range
or repeated, and a negative ``temperature``.

One ONNX Runtime session per logits dtype is built on first use and kept (the
vocabulary axis is dynamic); ``session.run`` is thread-safe, building is locked.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import numpy as np
import torch

from prepos.scan import ScanResult, allowed_id_array, unreadable_logits

log = logging.getLogger(__name__)

_LAST_BELOW_ONE = float(np.nextafter(np.float32(1.0), np.float32(0.0)))


class OnnxRuntimeScan:
    """A scan implementation (``engine.scan = onnxruntime``); call it like ``scan_numpy``."""

    def __init__(self, num_threads: int = 1, sampling_head: int | None = None) -> None:
        """``sampling_head``: the graph's (``prepos_build.scan_onnx.build_scan_model``); None: its default, 0: a
        sampled answer sorts the whole vocabulary (the benchmark's baseline)."""
        # One thread by default: the engine loop owns the cores, and a scan is one pass over [vocab].
        if num_threads < 1:
            raise ValueError(f"num_threads: must be >= 1, got {num_threads}")
        self._num_threads = num_threads
        self._sampling_head = sampling_head
        self._sessions: dict[str, object] = {}
        self._all_allowed: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def session(self, dtype: str):
        """The ORT session for ``float32`` or ``float16`` logits, built once."""
        sess = self._sessions.get(dtype)
        if sess is None:
            with self._lock:
                sess = self._sessions.get(dtype)
                if sess is None:
                    sess = self._sessions[dtype] = self._build(dtype)
        return sess

    def _build(self, dtype: str):
        import onnxruntime as ort

        from prepos_build.scan_onnx import build_scan_model

        options = ort.SessionOptions()
        options.intra_op_num_threads = self._num_threads
        options.inter_op_num_threads = 1
        model = build_scan_model("standard", dtype) if self._sampling_head is None else \
            build_scan_model("standard", dtype, sampling_head=self._sampling_head)
        log.info("scan: ONNX Runtime %s session for %s logits (%d threads)", ort.__version__, dtype, self._num_threads)
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def _mask(self, vocab: int, allowed_ids) -> np.ndarray:
        if allowed_ids is None:
            mask = self._all_allowed.get(vocab)
            if mask is None:
                mask = np.ones(vocab, dtype=bool)
                mask.setflags(write=False)
                self._all_allowed[vocab] = mask
            return mask
        mask = np.zeros(vocab, dtype=bool)
        mask[allowed_id_array(allowed_ids, vocab)] = True  # refuses what the reference refuses, in its words
        return mask

    def __call__(
        self,
        logits: np.ndarray | torch.Tensor,
        *,
        allowed_ids: Sequence[int] | torch.Tensor | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        uniform: float | None = None,
    ) -> ScanResult:
        """Scan ``logits`` ``[vocab]`` under the contract of ``prepos.scan``; raises ``ValueError`` on bad input."""
        x = _as_numpy(logits)
        if temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {temperature}")
        if temperature != 0.0 and uniform is None:
            raise ValueError("scan: sampling needs a uniform draw")
        mask = self._mask(x.shape[0], allowed_ids)
        u = 0.0 if uniform is None else min(float(uniform), _LAST_BELOW_ONE)
        token, p_max, margin, entropy = self.session(x.dtype.name).run(None, {
            "logits": x,
            "mask": mask,
            "temperature": np.array([temperature], dtype=np.float32),
            "top_k": np.array([top_k], dtype=np.int64),
            "top_p": np.array([top_p], dtype=np.float32),
            "uniform": np.array([u], dtype=np.float32),
        })
        if not np.isfinite(p_max[0]):
            raise unreadable_logits(x, allowed_ids)
        num_allowed = x.shape[0] if allowed_ids is None else int(len(allowed_ids))
        return ScanResult(token_id=int(token[0]), p_max=float(p_max[0]), margin=float(margin[0]),
                          entropy=float(entropy[0]), num_allowed=num_allowed)


def _as_numpy(logits: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(logits, torch.Tensor):
        if logits.dtype == torch.bfloat16:  # every bfloat16 is a float32: exact
            logits = logits.float()
        logits = logits.detach().cpu().numpy()
    x = np.asarray(logits)
    if x.ndim != 1 or x.shape[0] == 0:
        raise ValueError(f"logits: must be one-dimensional [vocab] and non-empty, got shape {tuple(x.shape)}")
    if x.dtype not in (np.float32, np.float16):
        raise ValueError(f"logits: dtype {x.dtype} is not supported; use float32, float16 or bfloat16")
    return np.ascontiguousarray(x)


scan_onnxruntime = OnnxRuntimeScan()
