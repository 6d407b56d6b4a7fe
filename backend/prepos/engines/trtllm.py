"""The engine contract on TensorRT-LLM's executor API (``tensorrt_llm.bindings.executor``).

The executor has no per-session KV handle: it runs requests, and with block reuse
on (``KvCacheConfig(enable_block_reuse=True)``) the KV blocks of a finished request
stay in its pool, keyed by their token prefix, for any later request whose prompt
starts with the same tokens. A session's KV therefore lives as reusable blocks, and
the contract maps onto requests like this:

- **prefill(session, ids)** enqueues one request whose prompt is the whole token
  sequence (the scheduler builds it from the session's token log) with
  ``max_tokens=1``. Block reuse makes it pay only for the tokens past the last cached
  full block. The engine keeps, per session, the token ids it believes are cached
  (``cached_token_ids``) and a device buffer with the last logits.
- **The distribution at the decision point** is the logits of that single generated
  step, i.e. after the last prompt token. They stay on the GPU: a named logits
  post-processor (``LogitsPostProcessorConfig``) runs in-process on the executor's
  logits tensor and CUDA stream and copies the row into the session's buffer; an event
  recorded on that stream orders the engine loop's later work after the copy. Where
  the post-processor is not available (or ``logits_source="generation_logits"``), the
  request asks for ``return_generation_logits`` and the host copy is moved to the
  device; that needs an engine built with generation-logit gathering. The generated
  token itself is discarded: the scheduler decides the answer with its own scan.
- **decode(session, token)** is the prefill of ``cached + [token]``: one new token plus
  the recomputed rest of the last partial block, as one context-phase request.
  **decode_batch** enqueues the requests of all its sessions before it awaits any, so
  the executor's in-flight batching runs them as one batch.
- **prefill_steps** stays the base default (one step): the executor runs a prefill as
  one request and cannot be paused part-way.
- **Retention.** Each request carries a ``KvCacheRetentionConfig`` that gives the
  prompt's token range ``[0, len)`` (and any decode blocks) ``retention_priority``
  (0-100, default 80; the executor's default is 35) for ``retention_s`` seconds (default
  600, the session idle timeout), so session prefixes outlive other traffic in the
  pool. When the duration passes, blocks fall back to the default priority.
  TensorRT-LLM 0.14 (Triton's 24.10 container) has no retention: there the requests
  carry none, the engine logs a warning at start, and session blocks compete with
  other traffic by the executor's LRU order alone.
- **release(session)** only drops the engine's bookkeeping: the executor has no call
  that frees particular blocks. A released session's blocks stay in the pool as
  ordinary reusable blocks, at high priority until their duration passes, and are
  evicted by the executor's priority-then-LRU order when it needs room. Another
  session with the same prefix (a shared system prompt) may still reuse them.
- **truncate** is bookkeeping only: the next prompt is the shorter sequence plus
  whatever follows, and block reuse matches its prefix.
- **kv_bytes(session)** is the blocks the session's tokens occupy:
  ``ceil(len / tokens_per_block) * tokens_per_block * kv_bytes_per_token``, where
  ``kv_bytes_per_token`` comes from the TensorRT-LLM engine's ``config.json`` (layers,
  kv heads, head size, kv dtype). The executor allocates its pool up front
  (``free_gpu_memory_fraction`` of the free GPU memory) and evicts by itself, so
  ``kv_capacity_bytes`` stays None: prepos's memory budget is bookkeeping here.

Differences from the torch engines, and how they are handled:

- Only full blocks are matched by prefix (``tokens_per_block`` tokens each); the tokens
  of the last partial block are recomputed on every request, decode included. The
  engine predicts the full blocks it expects reused and records what the executor
  reports (:meth:`TrtllmEngine.reuse_stats`). Executors that also reuse partially
  matched blocks (``enable_partial_reuse``, TensorRT-LLM 1.x) may do better than the prediction.
- Blocks become reusable only when their request finishes. The engine waits for each
  request's final response before returning, and the engine loop runs one call at a
  time (a decode batch holds at most one request per session), so a session's next
  request always finds its previous one finished.
- Nothing guarantees that blocks are still resident: under memory pressure a prefill
  may pay more than expected. This is never a correctness issue, because the prompt is
  always the full token sequence; ``missed_blocks`` in the reuse statistics measures it.
- When the whole sequence is cached, the executor still recomputes the last token (it
  needs its logits), as the contract says.
- Pre-positioning prefills in chunks (``scheduler.chunk_tokens``), each one request here,
  and each chunk recomputes the partial block the previous one ended in (fewer than
  ``tokens_per_block`` tokens): chunks well above ``tokens_per_block`` amortize that.
- ``info.max_context`` is ``min(max_input_len, max_seq_len - 1)``: the executor rejects
  prompts beyond ``max_input_len`` and needs room for the one generated token.
- When a request fails (``Response.has_error()``), :class:`TrtllmRequestError` names the
  session and the executor's message; the session's cached ids are then empty (unknown),
  so ``decode`` refuses it and the scheduler's next prefill sends the full sequence.

Reuse statistics: each request asks for per-request performance metrics
(``OutputConfig(return_perf_metrics=True)``: reused and newly allocated blocks). Where
the installed TensorRT-LLM has no such option, the counters come from the difference of
the cumulative ``IterationStats.kv_cache_stats`` (``reused_blocks``, ``alloc_new_blocks``)
before and after the request. Metric names for them, should they be published:
``prepos_kv_blocks_reused_total``, ``prepos_kv_blocks_new_total`` and
``prepos_kv_blocks_missed_total``.

Engine directory: see :mod:`prepos.engines.trtllm_dir`.

All executor calls live in :func:`build_request`, :meth:`TrtllmEngine._init_executor`,
:meth:`TrtllmEngine._enqueue`, :meth:`TrtllmEngine._await_final`, :meth:`TrtllmEngine._iteration_reuse` and
:meth:`TrtllmEngine.close`; ``executor_module`` lets tests pass a small fake with the same
names as ``tensorrt_llm.bindings.executor``.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from prepos.engines.base import Engine, EngineInfo, check_decode_batch, check_prefill_batch, common_prefix_length
from prepos.engines.trtllm_dir import BUILD_FILE, TRTLLM_SUBDIR, TrtllmBuild, TrtllmEngineDirError, TrtllmModel
from prepos.engines.trtllm_request import ReuseRecord, ReuseStats, Retention, build_request, has_retention

log = logging.getLogger(__name__)

LOGITS_PROCESSOR_NAME = "prepos_decision_point"
CONTAINER_HINT = "NVIDIA's Triton TensorRT-LLM container"
LOGITS_SOURCES = ("auto", "post_processor", "generation_logits")
REQUEST_TIMEOUT_S = 300.0
_POLL = datetime.timedelta(milliseconds=500)


class TrtllmUnavailable(RuntimeError):
    """TensorRT-LLM (or a feature of it the engine needs) is not installed in this process."""


class TrtllmRequestError(RuntimeError):
    """The executor failed a session's request; the message names the session and the executor's error."""


def import_executor_module() -> Any:
    """``tensorrt_llm.bindings.executor``, or :class:`TrtllmUnavailable` saying where to get it."""
    try:
        from tensorrt_llm.bindings import executor
    except (ImportError, OSError) as err:
        raise TrtllmUnavailable(f"engine.name trtllm needs TensorRT-LLM, which this Python cannot import ({err}); "
                                f"run prepos in {CONTAINER_HINT}, or use engine.name torch") from None
    return executor


# ---- the engine --------------------------------------------------------------------------------


@dataclass
class _Session:
    logits: torch.Tensor  # [vocab] float32 on the engine's device; what prefill/decode return
    ids: list[int] = dataclasses.field(default_factory=list)


@dataclass
class _Capture:
    """Where the post-processor writes an in-flight request's logits, and what it left there."""

    client_id: int
    buffer: torch.Tensor
    done: bool = False
    event: Any = None  # torch.cuda.Event recorded on the executor's stream after the copy
    error: BaseException | None = None


class TrtllmEngine(Engine):
    """The engine contract on a TensorRT-LLM executor with KV block reuse (see the module docstring).

    ``engine_dir`` is the prepos engine directory holding ``trtllm/``. The executor
    takes ``free_gpu_memory_fraction`` of the free GPU memory for its KV pool. Every
    request gives the session's tokens ``retention_priority`` for ``retention_s``
    seconds. ``logits_source`` picks how the decision point's logits arrive:
    ``post_processor`` (on the device), ``generation_logits`` (host copy, needs
    ``gather_generation_logits``) or ``auto`` (the first where available). ``device`` is
    where logits are returned (the executor's GPU; tests with a fake use ``cpu``).
    """

    def __init__(self, engine_dir: str | Path, *, free_gpu_memory_fraction: float = 0.85, retention_priority: int = 80,
                 retention_s: float = 600.0, executor_module: Any = None, device: str = "cuda",
                 logits_source: str = "auto") -> None:
        if not 0.0 < free_gpu_memory_fraction <= 1.0:
            raise ValueError(f"free_gpu_memory_fraction must be in (0, 1], got {free_gpu_memory_fraction}")
        if logits_source not in LOGITS_SOURCES:
            raise ValueError(f"logits_source must be one of {LOGITS_SOURCES}, got {logits_source!r}")
        self.retention = Retention(retention_priority, float(retention_s))
        self.device = torch.device(device)
        self._tle = executor_module if executor_module is not None else import_executor_module()
        self._init_build(Path(engine_dir))
        self._init_logits_source(logits_source)
        self._init_executor(free_gpu_memory_fraction)
        self._sessions: dict[str, _Session] = {}
        self._reuse = ReuseStats()
        self._iteration_counts = (0, 0)  # cumulative (reused, new) blocks at the last iteration-stats reading
        self._next_client_id = 0
        self._captures: dict[int, _Capture] = {}  # requests in flight, by client id
        log.info("trtllm engine %s: %d tokens per block, max context %d, logits via %s, retention %d for %.0f s",
                 self.trtllm_dir, self.tokens_per_block, self.info.max_context, self.logits_source,
                 self.retention.priority, self.retention.duration_s)
        if not has_retention(self._tle):
            log.warning("this TensorRT-LLM has no KV cache retention (KvCacheRetentionConfig, from 0.15): "
                        "engine.trtllm_retention_priority has no effect, and session blocks are kept by the executor's "
                        "LRU order alone")

    def _init_build(self, engine_dir: Path) -> None:
        self.trtllm_dir = engine_dir / TRTLLM_SUBDIR
        if not self.trtllm_dir.is_dir():
            raise TrtllmEngineDirError(f"{self.trtllm_dir}: not found; build the TensorRT-LLM engine into it first")
        self.build = TrtllmBuild.load(self.trtllm_dir / BUILD_FILE)
        self.model = TrtllmModel.load(self.trtllm_dir / "config.json")
        self.tokens_per_block = self.build.tokens_per_block
        weights = sum(p.stat().st_size for p in self.trtllm_dir.glob("rank*.engine"))  # the weights dominate it
        self.info = EngineInfo(
            name="trtllm",
            vocab_size=self.model.vocab_size,
            max_context=min(self.build.max_input_len, self.build.max_seq_len - 1),
            kv_bytes_per_token=self.model.kv_bytes_per_token,
            weight_bytes=weights,
            device=str(self.device),
        )
        if self.info.max_context < 1:
            raise TrtllmEngineDirError(f"{self.trtllm_dir / BUILD_FILE}: 'max_seq_len' leaves no room for a prompt")

    def _init_logits_source(self, requested: str) -> None:
        has_post_processor = hasattr(self._tle, "LogitsPostProcessorConfig")
        source = requested if requested != "auto" else "post_processor" if has_post_processor else "generation_logits"
        if source == "post_processor" and not has_post_processor:
            raise TrtllmUnavailable("this TensorRT-LLM has no logits post-processor (LogitsPostProcessorConfig); "
                                    "use logits_source generation_logits or " + CONTAINER_HINT)
        if source == "generation_logits" and not self.build.gather_generation_logits:
            why = "logits_source is generation_logits" if requested != "auto" else "there is no logits post-processor"
            raise TrtllmEngineDirError(
                f"{self.trtllm_dir / BUILD_FILE}: 'gather_generation_logits' is false, but the logits must come as "
                f"generation logits ({why}); rebuild the engine with generation-logit gathering")
        self.logits_source = source
        try:
            self._tle.OutputConfig(return_perf_metrics=True)
            self._per_request_stats = True
        except TypeError:  # older releases: only the iteration stats count reused blocks
            self._per_request_stats = False

    def _init_executor(self, free_gpu_memory_fraction: float) -> None:
        tle = self._tle
        kv_cache = tle.KvCacheConfig(enable_block_reuse=True, free_gpu_memory_fraction=free_gpu_memory_fraction)
        config = tle.ExecutorConfig(max_beam_width=1, kv_cache_config=kv_cache,
                                    enable_chunked_context=self.model.paged_context_fmha)
        if self.logits_source == "post_processor":
            config.logits_post_processor_config = tle.LogitsPostProcessorConfig(
                processor_map={LOGITS_PROCESSOR_NAME: self._on_logits})
        elif hasattr(config, "gather_generation_logits"):
            config.gather_generation_logits = True
        self._executor = tle.Executor(str(self.trtllm_dir), tle.ModelType.DECODER_ONLY, config)

    # ---- bookkeeping ----------------------------------------------------------------------------

    def cached_token_ids(self, session_id: str) -> Sequence[int]:
        s = self._sessions.get(session_id)
        return tuple(s.ids) if s is not None else ()

    def truncate(self, session_id: str, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` cached tokens in the bookkeeping (the executor's blocks stay as they are)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        s = self._sessions.get(session_id)
        if s is not None:
            del s.ids[num_tokens:]

    def release(self, session_id: str) -> None:
        """Forget the session; its blocks stay in the executor's pool until evicted (see the module docstring)."""
        self._sessions.pop(session_id, None)

    def kv_bytes(self, session_id: str) -> int:
        s = self._sessions.get(session_id)
        if s is None:
            return 0
        blocks = -(-len(s.ids) // self.tokens_per_block)
        return blocks * self.tokens_per_block * self.info.kv_bytes_per_token

    def reuse_stats(self) -> ReuseStats:
        """Block reuse since the engine started (cumulative counters) and the last request's :class:`ReuseRecord`."""
        return self._reuse

    # ---- forward passes -------------------------------------------------------------------------

    def prefill(self, session_id: str, token_ids: Sequence[int]) -> torch.Tensor:
        return self._run(session_id, self._checked(token_ids))

    def decode(self, session_id: str, token_id: int) -> torch.Tensor:
        return self._run(session_id, self._decode_ids(session_id, token_id))

    def prefill_batch(self, session_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> list[torch.Tensor | Exception]:
        """Every possible prefill's request is enqueued before any is awaited, so the executor's in-flight
        batching runs them together (as :meth:`decode_batch` does its steps)."""
        check_prefill_batch(session_ids, token_ids)
        if not self._per_request_stats:
            return super().prefill_batch(session_ids, token_ids)
        return self._batch(session_ids, [functools.partial(self._checked, ids) for ids in token_ids])

    def decode_batch(self, session_ids: Sequence[str], token_ids: Sequence[int]) -> list[torch.Tensor | Exception]:
        """Every possible step's request is enqueued before any is awaited, so the executor's in-flight batching
        runs them together; each is a decode's request (the cached ids plus the token). A step refused here gets
        its ``ValueError``, a request the executor fails its :class:`TrtllmRequestError`; the others go on.

        Without per-request metrics (older TensorRT-LLM), concurrent requests' block reuse could not be told
        apart in the iteration statistics: the steps then run one after another."""
        check_decode_batch(session_ids, token_ids)
        if not self._per_request_stats:
            return super().decode_batch(session_ids, token_ids)
        return self._batch(session_ids, [functools.partial(self._decode_ids, sid, tok)
                                         for sid, tok in zip(session_ids, token_ids)])

    def _batch(self, session_ids: Sequence[str], prompts: list[Callable[[], list[int]]]) -> list[torch.Tensor | Exception]:
        """Per session, the request of its prompt (``ValueError`` where it has none), all run by :meth:`_run_many`."""
        results: list[torch.Tensor | Exception | None] = []
        jobs, where = [], []
        for sid, prompt in zip(session_ids, prompts):
            try:
                ids = prompt()
            except ValueError as err:
                results.append(err)
                continue
            where.append(len(results))
            results.append(None)  # filled below
            jobs.append((sid, ids))
        for index, result in zip(where, self._run_many(jobs)):
            results[index] = result
        return results

    def _checked(self, token_ids: Sequence[int]) -> list[int]:
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("token_ids is empty")
        if len(ids) > self.info.max_context:
            raise ValueError(f"{len(ids)} tokens exceed max_context {self.info.max_context}")
        if min(ids) < 0 or max(ids) >= self.info.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.info.vocab_size})")
        return ids

    def _decode_ids(self, session_id: str, token_id: int) -> list[int]:
        """The prompt of a decode step: the session's cached ids plus ``token_id``; ``ValueError`` if impossible."""
        s = self._sessions.get(session_id)
        if s is None or not s.ids:
            raise ValueError(f"session {session_id!r} has no KV; prefill it first")
        return self._checked([*s.ids, int(token_id)])

    def _run(self, session_id: str, ids: list[int]) -> torch.Tensor:
        (result,) = self._run_many([(session_id, ids)])
        if isinstance(result, Exception):
            raise result
        return result

    def _run_many(self, jobs: list[tuple[str, list[int]]]) -> list[torch.Tensor | Exception]:
        """One request per ``(session, ids)`` of distinct sessions, all enqueued before any is awaited; per job the
        session's logits, or the error that failed its request (that session is then without KV)."""
        flight: list[Any] = []
        for session_id, ids in jobs:
            s = self._sessions.get(session_id)
            if s is None:
                s = self._sessions[session_id] = _Session(torch.empty(self.info.vocab_size, dtype=torch.float32,
                                                                      device=self.device))
            # Full blocks of the cached prefix; the last token is always recomputed for its logits.
            expected = min(common_prefix_length(s.ids, ids), len(ids) - 1) // self.tokens_per_block
            s.ids = []  # unknown until the request succeeds: a failure leaves the session without KV
            try:
                flight.append((session_id, ids, s, expected, *self._enqueue(session_id, ids, s.logits)))
            except TrtllmRequestError as err:
                flight.append(err)
        results: list[torch.Tensor | Exception] = []
        for job in flight:
            if isinstance(job, Exception):
                results.append(job)
                continue
            session_id, ids, s, expected, request_id, capture = job
            try:
                result = self._finish(session_id, request_id, capture, s.logits)
            except Exception as err:  # noqa: BLE001 - this job's error; the others are still awaited
                results.append(err)
                continue
            reused, new, source = self._reuse_counts(result)
            self._reuse = self._reuse.add(ReuseRecord(session_id, len(ids), reused, new, expected, source))
            if reused < expected:
                log.debug("session %r: %d of %d expected KV blocks reused (evicted)", session_id, reused, expected)
            s.ids = ids
            results.append(s.logits)
        return results

    def _enqueue(self, session_id: str, ids: list[int], buffer: torch.Tensor) -> tuple[int, _Capture]:
        """Send one request whose logits will land in ``buffer``; its executor id and capture."""
        self._next_client_id += 1
        capture = _Capture(self._next_client_id, buffer)
        post_processor = LOGITS_PROCESSOR_NAME if self.logits_source == "post_processor" else None
        request = build_request(self._tle, ids, retention=self.retention, logits_post_processor=post_processor,
                                return_perf_metrics=self._per_request_stats, client_id=capture.client_id)
        self._captures[capture.client_id] = capture  # before enqueueing: the executor's thread may call back at once
        try:
            return self._executor.enqueue_request(request), capture
        except RuntimeError as err:
            del self._captures[capture.client_id]
            raise TrtllmRequestError(f"session {session_id!r}: TensorRT-LLM rejected the request: {err}") from err

    def _finish(self, session_id: str, request_id: int, capture: _Capture, buffer: torch.Tensor) -> Any:
        """Wait for an enqueued request's final result; its logits are then in ``buffer``."""
        try:
            result = self._await_final(session_id, request_id)
        finally:
            self._captures.pop(capture.client_id, None)
        if self.logits_source != "post_processor":
            self._copy_generation_logits(session_id, result, buffer)
        elif capture.error is not None:
            raise TrtllmRequestError(f"session {session_id!r}: copying the logits failed: {capture.error}")
        elif not capture.done:
            raise TrtllmRequestError(f"session {session_id!r}: the logits post-processor was not called")
        elif capture.event is not None:
            torch.cuda.current_stream(buffer.device).wait_event(capture.event)
        return result

    def _await_final(self, session_id: str, request_id: int) -> Any:
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while True:
            for response in self._executor.await_responses(request_id, _POLL):
                if response.has_error():
                    raise TrtllmRequestError(f"session {session_id!r}: TensorRT-LLM request {request_id} failed: "
                                             f"{response.error_msg}")
                if response.result.is_final:
                    return response.result
            if time.monotonic() > deadline:
                self._executor.cancel_request(request_id)
                raise TrtllmRequestError(f"session {session_id!r}: TensorRT-LLM request {request_id} had no final "
                                         f"response after {REQUEST_TIMEOUT_S:.0f} s; cancelled")

    def _on_logits(self, request_id: int, logits: torch.Tensor, token_ids: Any, stream_ptr: int,
                   client_id: int | None = None) -> None:
        """The executor's logits post-processor: copy the decision point's row into the session's buffer.

        Runs on the executor's thread with its logits tensor (``[..., vocab_padded]``) and
        CUDA stream; the copy is enqueued on that stream and an event marks its end. An
        exception must not reach the executor: it is kept for the engine loop to raise.
        """
        captures = self._captures
        if client_id is None:  # a post-processor called without the request's client id: only one can be meant
            capture = next(iter(captures.values())) if len(captures) == 1 else None
        else:
            capture = captures.get(client_id)
        if capture is None:
            return
        try:
            row = logits.reshape(-1, logits.shape[-1])[0, : self.info.vocab_size]  # [vocab]
            if logits.is_cuda:
                stream = torch.cuda.ExternalStream(stream_ptr, device=logits.device)
                with torch.cuda.stream(stream):
                    capture.buffer.copy_(row, non_blocking=True)
                    capture.event = torch.cuda.Event()
                    capture.event.record(stream)
            else:
                capture.buffer.copy_(row)
            capture.done = True
        except Exception as err:  # noqa: BLE001 - handed to the engine loop
            capture.error = err

    def _copy_generation_logits(self, session_id: str, result: Any, buffer: torch.Tensor) -> None:
        logits = getattr(result, "generation_logits", None)  # [beam, 1, vocab_padded] on the host
        if logits is None:
            raise TrtllmRequestError(f"session {session_id!r}: the result has no generation logits; is the engine "
                                     "built with generation-logit gathering?")
        buffer.copy_(logits.reshape(-1, logits.shape[-1])[0, : self.info.vocab_size])

    # ---- reuse counts ---------------------------------------------------------------------------

    def _reuse_counts(self, result: Any) -> tuple[int, int, str]:
        metrics = getattr(result, "request_perf_metrics", None)
        if metrics is not None:
            kv = metrics.kv_cache_metrics
            return int(kv.num_reused_blocks), int(kv.num_new_allocated_blocks), "request"
        return self._iteration_reuse()

    def _iteration_reuse(self) -> tuple[int, int, str]:
        """Blocks reused and newly allocated since the last reading of the executor's cumulative iteration stats."""
        counts = [s.kv_cache_stats for s in self._executor.get_latest_iteration_stats()
                  if getattr(s, "kv_cache_stats", None) is not None]
        if not counts:
            return 0, 0, "none"
        reused, new = int(counts[-1].reused_blocks), int(counts[-1].alloc_new_blocks)
        before_reused, before_new = self._iteration_counts
        self._iteration_counts = (reused, new)
        return reused - before_reused, new - before_new, "iteration"

    def close(self) -> None:
        """Shut the executor down (its KV pool and threads go with it); the engine is unusable after."""
        executor, self._executor = getattr(self, "_executor", None), None
        self._sessions.clear()
        if executor is not None:
            executor.shutdown()
