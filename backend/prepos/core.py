"""Builds the core from configuration: engine, tokenizer, framing, gate, scan, scheduler.

This is what the Triton adapter holds; it is also usable without Triton
(tests, benchmarks) with any :class:`~prepos.protocol.ResponseSink`.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Mapping

import numpy as np

from prepos.config import (ConfigError, EngineConfig, MemoryConfig, PreposConfig, check_sequence_slots,
                           idle_timeout_mismatch, read_config, setting_error)
from prepos.engines.base import Engine
from prepos.engines.openmp import cpu_quota, default_num_threads, release_calling_thread, usable_cpus
from prepos.heap import CollectorPauses
from prepos.metrics import BufferedSink, Metrics, MetricsSink
from prepos.protocol import CONTROL_NAMES, INPUT_NAMES, Rejection, Request, ResponseSink, parse_request
from prepos.scan import get_scan
from prepos.scan_cpu import CpuKernelScan, CpuKernelUnavailable
from prepos.scheduler import Scheduler
from prepos.template import EngineManifest, Tokenizer

log = logging.getLogger("prepos.core")


def create_engine(config: EngineConfig, engine_dir: Path, kv_budget_bytes: int = 0,
                  session_idle_timeout_s: float = 600.0, max_decode_batch: int = 32) -> Engine:
    """The engine named by ``config.name``, loaded from ``engine_dir``.

    The torch engine on CUDA is the paged one (static KV pool of ``kv_budget_bytes``, 0 = half the free GPU
    memory; decode as CUDA graphs of up to ``max_decode_batch`` sessions per step); on CPU the plain one (KV grows per session on demand). The TensorRT-LLM
    engine keeps a session's KV blocks at high retention priority for ``session_idle_timeout_s``.
    """
    if config.name == "trtllm":
        from prepos.engines.trtllm import TrtllmEngine

        return TrtllmEngine(engine_dir, free_gpu_memory_fraction=config.trtllm_free_gpu_memory_fraction,
                            retention_priority=config.trtllm_retention_priority,
                            retention_s=session_idle_timeout_s, device=config.device)
    if config.name == "torch" and config.device.startswith("cuda"):
        from prepos.engines.torch_paged import PagedTorchLlamaEngine

        return PagedTorchLlamaEngine(str(engine_dir), device=config.device, dtype=config.dtype,
                                     kv_pool_bytes=kv_budget_bytes, page_tokens=config.page_tokens,
                                     cuda_graph=config.cuda_graph, max_batch=max_decode_batch,
                                     share_prefixes=config.share_prefixes, kept_prefixes=config.kept_prefixes)
    if config.name == "torch":
        from prepos.engines.torch_llama import TorchLlamaEngine

        return TorchLlamaEngine(str(engine_dir), device=config.device, dtype=config.dtype,
                                num_threads=engine_threads(config.num_threads), cpu_kernels=config.cpu_kernels,
                                kv_block_tokens=config.page_tokens, share_prefixes=config.share_prefixes,
                                kept_prefixes=config.kept_prefixes)
    raise ConfigError(f"engine.name: unknown engine {config.name!r}; use torch or trtllm")


def engine_threads(configured: int = 0) -> int:
    """The torch engine's thread count: ``engine.num_threads`` where set (``configured``), else torch's default
    lowered to the process's CPU quota (a Kubernetes CPU limit) where one is set. A configured count above the
    CPUs the process may use is kept, with a warning: its threads would wait on each other at every barrier."""
    import torch

    quota = cpu_quota()
    shown = "none" if quota is None else f"{quota:g}"
    if configured:
        if configured > (usable := usable_cpus(quota)):
            log.warning("engine.num_threads %d is more than the %d CPUs this process may use (CPU quota %s): "
                        "threads past them wait for each other at every parallel step", configured, usable, shown)
        return configured
    torch_default = torch.get_num_threads()
    threads = default_num_threads(torch_default, quota)
    log.info("engine threads: %d (torch's default %d; CPU quota %s)", threads, torch_default, shown)
    return threads


def check_device(device: str) -> None:
    """A CUDA ``engine.device`` torch does not see is a ConfigError naming the key, not torch's own error."""
    if not device.startswith("cuda"):
        return
    import torch

    index = int(device.partition(":")[2] or 0)
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        found = f"{torch.cuda.device_count()} CUDA devices" if torch.cuda.is_available() else \
            f"no CUDA (torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'})"
        raise setting_error("engine.device", f"{device!r}, but torch sees {found}; use cpu here")


def kv_budget_bytes(memory: MemoryConfig, engine: Engine) -> int:
    """The KV budget the scheduler evicts against.

    An engine with a fixed pool can hold no more than the pool; the budget keeps one full context of it
    free, because the scheduler counts a session's KV after a step: the step that crosses the budget must
    still find pages.
    """
    if engine.kv_capacity_bytes is None:
        return memory.resolved_budget()
    headroom = engine.info.max_context * engine.info.kv_bytes_per_token
    usable = engine.kv_capacity_bytes - headroom
    if usable <= 0:
        raise ConfigError(f"memory.kv_budget_bytes: the engine's KV pool ({engine.kv_capacity_bytes} bytes) does not "
                          f"hold one full context ({headroom} bytes for {engine.info.max_context} tokens) and more; "
                          "raise it, or 0 for half the free GPU memory")
    return usable


class Core:
    """The engine loop plus request parsing, ready to take requests from any thread."""

    def __init__(self, config: PreposConfig, model_dir: str | Path, metrics_sink: MetricsSink | None = None,
                 engine: Engine | None = None):
        self.config = config
        if engine is None:
            check_device(config.engine.device)
        engine_dir = config.engine_dir(model_dir)
        try:
            manifest = EngineManifest.load(engine_dir)
        except FileNotFoundError as err:
            raise setting_error("engine.dir", str(err)) from None
        self.tokenizer = Tokenizer(engine_dir / "tokenizer.json")
        self.engine = engine if engine is not None else create_engine(
            config.engine, engine_dir, config.memory.kv_budget_bytes, config.scheduler.session_idle_timeout_s,
            config.scheduler.max_decode_batch)
        # Requests record into memory; the engine loop publishes to the sink off the path of any request.
        self.metrics = Metrics(BufferedSink(metrics_sink) if metrics_sink is not None else None)
        self.metrics.publish_error_fields((*INPUT_NAMES, *CONTROL_NAMES))
        self._collector_pauses = CollectorPauses()  # timed from start() to stop(), published with the metrics
        self.framing = manifest.framing
        journal = None
        journal_dir = config.journal_dir(model_dir)
        if journal_dir is not None:
            from prepos.journal import SessionJournal

            try:
                journal = SessionJournal(journal_dir, fsync=config.journal.fsync)
            except OSError as err:
                raise setting_error("journal.dir", f"cannot use {journal_dir} ({err.strerror or err})") from None
            log.info("session journals in %s (%d sessions to reopen on their next request)",
                     journal_dir, len(journal.session_ids()))
        self.scheduler = Scheduler(
            engine=self.engine,
            tokenizer=self.tokenizer,
            framing=manifest.framing,
            config=config.scheduler,
            scan=self._scan(config, model_dir),
            metrics=self.metrics,
            max_sessions=config.memory.max_sessions,
            kv_budget_bytes=kv_budget_bytes(config.memory, self.engine),
            eviction_policy=config.memory.eviction_policy,
            max_log_tokens=config.memory.max_log_tokens,
            journal=journal,
            journal_expire_s=config.journal.expire_s,
            gate_config=config.gate,
        )
        log.info("prepos core ready: model %s, engine %s on %s, %d-token context",
                 manifest.model_name, self.engine.info.name, self.engine.info.device, self.engine.info.max_context)

    @staticmethod
    def _scan(config: PreposConfig, model_dir: str | Path):
        if config.engine.scan == "tensorrt":
            from prepos_build.scan_tensorrt import TensorRTScan

            path = Path(config.engine.scan_engine)
            return TensorRTScan(path if path.is_absolute() else Path(model_dir) / path, device=config.engine.device)
        if config.engine.scan in ("auto", "triton"):
            from prepos.scan_triton import TritonScan, TritonUnavailable

            if config.engine.scan == "triton":
                return TritonScan(config.engine.device)
            if config.engine.device.startswith("cuda"):
                try:
                    return TritonScan(config.engine.device)
                except TritonUnavailable as exc:
                    log.warning("engine.scan auto: the Triton scan kernel is not usable (%s); using torch", exc)
            elif config.engine.cpu_kernels:
                try:
                    return CpuKernelScan()
                except CpuKernelUnavailable as exc:
                    log.warning("engine.scan auto: %s; using torch", exc)
            return get_scan("torch")
        if config.engine.scan == "cpu":
            try:
                return CpuKernelScan()
            except CpuKernelUnavailable as exc:
                raise ConfigError(f"engine.scan: cpu needs the CPU kernels, but {exc}") from None
        return get_scan(config.engine.scan)

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str], model_dir: str | Path,
                        metrics_sink: MetricsSink | None = None, *, sequence_slots: int | None = None,
                        sequence_idle_s: float | None = None) -> "Core":
        """``sequence_slots``: Triton's sequence slots for the model (checked against ``memory.max_sessions``);
        ``sequence_idle_s``: its sequence idle timeout (a warning where the session idle timeout differs)."""
        config = read_config(parameters)
        check_sequence_slots(config.memory, sequence_slots)
        mismatch = idle_timeout_mismatch(config.scheduler, sequence_idle_s)
        if mismatch:
            log.warning("%s", mismatch)
        return cls(config, model_dir, metrics_sink)

    def parse(self, inputs: Mapping[str, np.ndarray], *, session_id: str | int, request_id: str | None,
              arrival_s: float, timeout_s: float | None = None) -> Request:
        """Validate one request's input arrays (raises ProtocolError); ``timeout_s`` (the client's request
        timeout) sets the request's deadline."""
        return parse_request(
            inputs,
            session_id=session_id,
            request_id=request_id or uuid.uuid4().hex[:12],
            limits=self.config.limits,
            default_max_tokens=self.config.scheduler.default_max_tokens,
            arrival_s=arrival_s,
            timeout_s=timeout_s,
        )

    def submit(self, request: Request | Rejection, sink: ResponseSink, *, inline: bool = False) -> None:
        self.scheduler.submit(request, sink, inline=inline)

    def start(self) -> None:
        """Start the engine loop; from then on it makes every engine call, and the calling thread gives back
        the OpenMP threads loading the model left it (see :mod:`prepos.engines.openmp`)."""
        self.metrics.watch_collector(self._collector_pauses)
        self._collector_pauses.install()
        self.scheduler.start()
        if release_calling_thread():
            log.info("engine loop started; this thread's OpenMP workers released")

    def stop(self) -> None:
        self.scheduler.stop()
        self._collector_pauses.remove()
        self.metrics.watch_collector(None)
        close = getattr(self.engine, "close", None)
        if close is not None:  # engines with threads or device pools of their own (TensorRT-LLM's executor)
            close()
