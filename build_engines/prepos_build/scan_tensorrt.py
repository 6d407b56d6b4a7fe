"""The vocabulary scan as a TensorRT engine: the plugin form of ``scan_onnx`` with our plugin.

``prepos::VocabScan`` is a TensorRT Python plugin (``tensorrt.plugin``, TensorRT
10.6 or later): :func:`register_plugin` declares its outputs and binds its
implementation, :func:`scan_tensors`, which runs on the logits' device with torch
on TensorRT's stream. The ONNX parser maps the graph's single ``VocabScan`` node
(op type = plugin name, ``plugin_namespace`` attribute = namespace) to it.

- :func:`build_engine` parses the plugin form and serializes an engine whose
  vocabulary axis spans ``[1, max_vocab]``.
- :class:`TensorRTScan` deserializes such an engine and answers scans with it
  (same call and ``ScanResult`` as ``prepos.scan``); the process that runs the
  engine must import this module (it registers the plugin).

TensorRT is imported on first use only; without it every entry point raises
:class:`TensorRTUnavailable` with the reason. Greedy scans never sort: the
plugin reads the four scalar inputs on the host (one 24-byte copy) to choose
between greedy and sampling, so the engine is not CUDA-graph capturable.

``python -m prepos_build.scan_tensorrt --output DIR`` builds ``scan_plugin_<dtype>.engine``.
"""

# No ``from __future__ import annotations``: tensorrt.plugin reads the plugin functions' annotations as classes.
import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence, Tuple

import torch

from .scan_onnx import DOMAIN, INPUT_NAMES, OUTPUT_NAMES, PLUGIN_NAME, build_scan_model

log = logging.getLogger(__name__)

PLUGIN_ID = f"{DOMAIN}::{PLUGIN_NAME}"
DEFAULT_MAX_VOCAB = 262_144
DEFAULT_OPT_VOCAB = 151_936
_registered = False


class TensorRTUnavailable(RuntimeError):
    """TensorRT (10.6+, with ``tensorrt.plugin``) or a CUDA device is missing; the message says which."""


def _tensorrt():
    try:
        import tensorrt as trt
        import tensorrt.plugin  # noqa: F401  (10.6+: Python plugins)
    except ImportError as exc:
        raise TensorRTUnavailable(f"TensorRT 10.6+ with tensorrt.plugin is not installed ({exc})") from None
    return trt


def scan_tensors(
    logits: torch.Tensor, mask: torch.Tensor, temperature: float, top_k: int,
    top_p: torch.Tensor, uniform: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plugin's maths on ``logits``' device: ``(token_id int64[1], p_max, margin, entropy float32[1])``.

    ``logits``/``mask`` are ``[V]``; ``top_p``/``uniform`` are float32 ``[1]`` tensors
    on the same device; ``temperature`` and ``top_k`` are host numbers. Same
    semantics as the standard ONNX form (and so as ``prepos.scan``); no host sync.
    A greedy scan of CUDA logits runs the OpenAI Triton kernel of ``prepos.scan_triton``
    (where Triton is installed); the rest is torch.
    With no finite allowed logit ``p_max`` is NaN.
    """
    if temperature <= 0.0 and logits.is_cuda:
        kernel = _kernel_scan(logits.device)
        if kernel is not None:  # greedy on the GPU: the OpenAI Triton kernel, one launch
            f = kernel.features(logits.masked_fill(~mask, float("-inf")))[0]  # [5]
            p_max = torch.where(torch.isfinite(f[4:5]), f[1:2], torch.full_like(f[1:2], float("nan")))
            return f[0:1].to(torch.int64), p_max, p_max - f[2:3], f[3:4].clamp_min(0.0)
    # allowed: [V] float32, -inf where masked
    allowed = logits.float().masked_fill(~mask, float("-inf"))
    vocab = allowed.numel()
    top = allowed.max()
    shifted = allowed - top
    e = torch.exp(shifted)
    total = e.sum()
    p = e / total
    top2 = torch.topk(p, min(2, vocab)).values
    p_max = top2[:1]
    p_second = top2[1:2] if vocab > 1 else torch.zeros_like(p_max)
    plogp = torch.where(p > 0, p * (shifted - torch.log(total)), torch.zeros_like(p))
    entropy = (-plogp.sum()).clamp_min(0.0).reshape(1)
    if temperature <= 0.0:
        token = torch.argmax(allowed).reshape(1)  # first maximal index: lowest id on ties
    else:
        q = torch.exp(shifted / temperature)
        q = q / q.sum()
        k = top_k if 0 < top_k < vocab else vocab
        sorted_q, order = torch.sort(q, descending=True, stable=True)
        sorted_q, order = sorted_q[:k], order[:k]
        cum = torch.cumsum(sorted_q, 0) / sorted_q.sum()
        keep_p = torch.clamp((cum < top_p).sum() + 1, max=k)
        keep = torch.where(top_p < 1.0, keep_p, torch.full_like(keep_p, k))
        keep = torch.minimum(keep, (sorted_q > 0).sum().clamp_min(1))  # masked tokens are never answers
        kept = torch.arange(k, device=q.device) < keep
        cum2 = torch.cumsum(torch.where(kept, sorted_q, torch.zeros_like(sorted_q)), 0)
        target = uniform * cum2.gather(0, (keep - 1).reshape(1))
        index = torch.minimum(((cum2 <= target) & kept).sum(), keep - 1)
        token = order.gather(0, index.reshape(1))
    return token.to(torch.int64), p_max, p_max - p_second, entropy


def _kernel_scan(device: torch.device):
    """The process's Triton scan kernel on ``device``, or None where it cannot run (then torch does the scan)."""
    try:
        from prepos.scan_triton import TritonUnavailable, shared_scan
    except ImportError:
        return None
    try:
        return shared_scan(device)
    except TritonUnavailable:
        return None


def register_plugin() -> None:
    """Register ``prepos::VocabScan`` with TensorRT (idempotent); needed to build and to run engines."""
    global _registered
    if _registered:
        return
    trt = _tensorrt()
    import tensorrt.plugin as trtp

    @trtp.register(PLUGIN_ID)
    def _describe(logits: trtp.TensorDesc, mask: trtp.TensorDesc, temperature: trtp.TensorDesc,
                  top_k: trtp.TensorDesc, top_p: trtp.TensorDesc, uniform: trtp.TensorDesc,
                  ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        return (trtp.from_shape_expr((1,), dtype=trt.int64),) + tuple(
            trtp.from_shape_expr((1,), dtype=trt.float32) for _ in OUTPUT_NAMES[1:])

    @trtp.impl(PLUGIN_ID)
    def _run(logits: trtp.Tensor, mask: trtp.Tensor, temperature: trtp.Tensor, top_k: trtp.Tensor,
             top_p: trtp.Tensor, uniform: trtp.Tensor,
             outputs: Tuple[trtp.Tensor, trtp.Tensor, trtp.Tensor, trtp.Tensor], stream: int) -> None:
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            t = {name: torch.as_tensor(x, device="cuda")
                 for name, x in zip(INPUT_NAMES, (logits, mask, temperature, top_k, top_p, uniform))}
            host = torch.cat([t["temperature"].double(), t["top_k"].double()]).cpu()  # the one host read
            results = scan_tensors(t["logits"], t["mask"].bool(), float(host[0]), int(host[1]), t["top_p"],
                                   t["uniform"])
            for out, value in zip(outputs, results):
                torch.as_tensor(out, device="cuda").copy_(value)

    _registered = True


def build_engine(output: str | Path, dtype: str = "float32", *, max_vocab: int = DEFAULT_MAX_VOCAB,
                 opt_vocab: int = DEFAULT_OPT_VOCAB, workspace_bytes: int = 1 << 28) -> Path:
    """Build ``output`` (a serialized engine) from the plugin form for ``dtype`` logits; returns its path.

    Raises :class:`TensorRTUnavailable` without TensorRT, ``ValueError`` on bad
    sizes, ``RuntimeError`` with the parser's or builder's messages on failure.
    """
    if not 1 <= opt_vocab <= max_vocab:
        raise ValueError(f"opt_vocab: must lie in [1, max_vocab={max_vocab}], got {opt_vocab}")
    trt = _tensorrt()
    register_plugin()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(build_scan_model("plugin", dtype).SerializeToString()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse the scan's plugin form: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    profile = builder.create_optimization_profile()
    for name in ("logits", "mask"):
        profile.set_shape(name, (1,), (opt_vocab,), (max_vocab,))
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise RuntimeError("TensorRT failed to build the scan engine (see its log above)")
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(engine))
    log.info("wrote %s (%d bytes, vocab up to %d)", path, path.stat().st_size, max_vocab)
    return path


class TensorRTScan:
    """A scan implementation backed by a scan engine from :func:`build_engine`; one CUDA stream, not thread-safe.

    Called like ``prepos.scan.scan_numpy`` with CUDA logits ``[vocab]`` of the
    engine's dtype; returns a ``ScanResult`` after one host sync.
    """

    def __init__(self, engine_path: str | Path, device: str = "cuda") -> None:
        trt = _tensorrt()
        if not torch.cuda.is_available():
            raise TensorRTUnavailable("no CUDA device for the scan engine")
        register_plugin()
        self._device = torch.device(device)
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engine = self._runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        if self._engine is None:
            raise RuntimeError(f"engine_path: {engine_path} is not a scan engine this TensorRT can load")
        self._context = self._engine.create_execution_context()
        half = self._engine.get_tensor_dtype("logits") == trt.DataType.HALF
        self._logits_dtype = torch.float16 if half else torch.float32
        self._stream = torch.cuda.Stream(self._device)
        # static buffers: the scalars in, the four results out
        self._scalars = {n: torch.zeros(1, dtype=torch.int64 if n == "top_k" else torch.float32, device=self._device)
                         for n in INPUT_NAMES[2:]}
        self._outputs = {n: torch.zeros(1, dtype=torch.int64 if n == "token_id" else torch.float32, device=self._device)
                         for n in OUTPUT_NAMES}
        self._all_allowed: dict[int, torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, *, allowed_ids: Sequence[int] | torch.Tensor | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, uniform: float | None = None):
        from prepos.scan import ScanResult, unreadable_logits

        if logits.ndim != 1:
            raise ValueError(f"logits: must be one-dimensional [vocab], got shape {tuple(logits.shape)}")
        if temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {temperature}")
        if temperature != 0.0 and uniform is None:
            raise ValueError("scan: sampling needs a uniform draw")
        if logits.dtype == torch.bfloat16 and self._logits_dtype == torch.float32:
            logits = logits.float()  # exact
        if logits.dtype != self._logits_dtype:
            raise ValueError(f"logits: this scan engine takes {self._logits_dtype}, got {logits.dtype}")
        vocab = logits.numel()
        logits = logits.to(self._device).contiguous()
        mask = self._mask(vocab, allowed_ids)
        self._stream.wait_stream(torch.cuda.current_stream(self._device))  # logits and mask are ready
        with torch.cuda.stream(self._stream):
            for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                                ("uniform", min(uniform or 0.0, 0.99999994))):
                self._scalars[name].fill_(value)
            shaped = [self._context.set_input_shape(name, (vocab,)) for name in ("logits", "mask")]
            if not all(shaped):
                raise ValueError(f"logits: vocabulary {vocab} lies outside the engine's profile (see --max-vocab)")
            tensors = {"logits": logits, "mask": mask, **self._scalars, **self._outputs}
            for name, tensor in tensors.items():
                self._context.set_tensor_address(name, tensor.data_ptr())
            if not self._context.execute_async_v3(self._stream.cuda_stream):
                raise RuntimeError("the scan engine failed to run")
            token, p_max, margin, entropy = torch.cat(
                [self._outputs["token_id"].double()] + [self._outputs[n].double() for n in OUTPUT_NAMES[1:]]).tolist()
        if p_max != p_max or p_max in (float("inf"), float("-inf")):
            raise unreadable_logits(logits, allowed_ids)
        num_allowed = vocab if allowed_ids is None else len(allowed_ids)
        return ScanResult(token_id=int(token), p_max=p_max, margin=margin, entropy=entropy, num_allowed=num_allowed)

    def _mask(self, vocab: int, allowed_ids) -> torch.Tensor:
        if allowed_ids is None:
            if vocab not in self._all_allowed:
                self._all_allowed[vocab] = torch.ones(vocab, dtype=torch.bool, device=self._device)
            return self._all_allowed[vocab]
        ids = torch.as_tensor(allowed_ids, dtype=torch.long).cpu()
        if ids.ndim != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"allowed_ids: must be a non-empty list of token ids in [0, {vocab})")
        if ids.unique().numel() != ids.numel():
            raise ValueError("allowed_ids: repeated token ids")
        mask = torch.zeros(vocab, dtype=torch.bool, device=self._device)
        mask[ids.to(self._device)] = True
        return mask


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prepos_build.scan_tensorrt",
                                description="Build the vocabulary scan's TensorRT engine (plugin form).")
    p.add_argument("--output", required=True, help="directory for scan_plugin_<dtype>.engine")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="logits dtype (%(default)s)")
    p.add_argument("--max-vocab", type=int, default=DEFAULT_MAX_VOCAB, help="largest vocabulary (%(default)s)")
    p.add_argument("--opt-vocab", type=int, default=DEFAULT_OPT_VOCAB, help="vocabulary tuned for (%(default)s)")
    args = p.parse_args(argv)
    if args.max_vocab < 1:  # the check in build_engine would name the other size
        p.error(f"--max-vocab: must be >= 1, got {args.max_vocab}")
    if not 1 <= args.opt_vocab <= args.max_vocab:
        p.error(f"--opt-vocab: must lie in [1, --max-vocab {args.max_vocab}], got {args.opt_vocab}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        path = build_engine(Path(args.output) / f"scan_plugin_{args.dtype}.engine", args.dtype,
                            max_vocab=args.max_vocab, opt_vocab=args.opt_vocab)
    except (TensorRTUnavailable, ValueError, RuntimeError) as exc:
        sys.stderr.write(f"prepos_build.scan_tensorrt: error: {exc}\n")
        return 2
    sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
