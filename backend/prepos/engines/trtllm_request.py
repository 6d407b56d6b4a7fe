"""What the TensorRT-LLM engine asks of the executor for each prefill, and the KV block reuse it reports back.

Kept apart from :mod:`prepos.engines.trtllm` so that the engine contract's request construction can be checked
without TensorRT-LLM: ``tle`` is ``tensorrt_llm.bindings.executor`` or a fake with the same names.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Retention:
    """KV retention every request asks for: ``priority`` (0-100, higher is evicted later) for ``duration_s``."""

    priority: int = 80
    duration_s: float = 600.0

    def __post_init__(self) -> None:
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or not 0 <= self.priority <= 100:
            raise ValueError(f"retention_priority must be an integer in [0, 100], got {self.priority!r}")
        if not self.duration_s > 0:
            raise ValueError(f"retention_s must be > 0, got {self.duration_s!r}")


def has_retention(tle: Any) -> bool:
    """Whether the executor module can give a request's blocks a retention priority (``KvCacheRetentionConfig``,
    TensorRT-LLM 0.15 on; 0.14, in Triton's 24.10 container, has none)."""
    return hasattr(tle, "KvCacheRetentionConfig")


def build_request(tle: Any, token_ids: Sequence[int], *, retention: Retention, logits_post_processor: str | None,
                  return_perf_metrics: bool, client_id: int | None = None) -> Any:
    """The executor request for one prefill of ``token_ids``: the engine contract's request construction.

    The prompt is the whole sequence and one token is generated (its logits are the
    decision point's distribution; the token is discarded). The prompt's token range gets
    ``retention`` where the executor module has retention (:func:`has_retention`). The
    logits come through the named post-processor, or, with ``logits_post_processor=None``,
    as the result's generation logits. ``tle`` is ``tensorrt_llm.bindings.executor`` or a
    fake with the same names. ``max_tokens`` goes by keyword: 0.14 and 0.15 take it only
    so (1.x either way).
    """
    ids = [int(t) for t in token_ids]
    extra: dict[str, Any] = {}
    if has_retention(tle):
        duration = datetime.timedelta(seconds=retention.duration_s)
        prompt_range = tle.KvCacheRetentionConfig.TokenRangeRetentionConfig(
            token_start=0, token_end=len(ids), priority=retention.priority, duration_ms=duration)
        extra["kv_cache_retention_config"] = tle.KvCacheRetentionConfig(
            [prompt_range], decode_retention_priority=retention.priority, decode_duration_ms=duration)
    output = {"exclude_input_from_output": True, "return_generation_logits": logits_post_processor is None}
    if return_perf_metrics:
        output["return_perf_metrics"] = True
    return tle.Request(ids, max_tokens=1, streaming=False, output_config=tle.OutputConfig(**output),
                       logits_post_processor_name=logits_post_processor, client_id=client_id, **extra)


@dataclass(frozen=True)
class ReuseRecord:
    """KV block reuse of one request, as the executor reported it."""

    session_id: str
    prompt_tokens: int
    reused_blocks: int
    new_blocks: int
    expected_reused_blocks: int  # full blocks of what the engine believed the session had cached
    source: str  # "request" (per-request metrics), "iteration" (iteration stats) or "none"

    @property
    def missed_blocks(self) -> int:
        """Expected blocks the executor did not reuse: evicted, or never stored."""
        return max(0, self.expected_reused_blocks - self.reused_blocks)


@dataclass(frozen=True)
class ReuseStats:
    """Cumulative block reuse since the engine started, and the last request's record."""

    num_requests: int = 0
    prompt_tokens: int = 0
    reused_blocks: int = 0
    new_blocks: int = 0
    missed_blocks: int = 0
    last: ReuseRecord | None = None

    def add(self, record: ReuseRecord) -> ReuseStats:
        return ReuseStats(self.num_requests + 1, self.prompt_tokens + record.prompt_tokens,
                          self.reused_blocks + record.reused_blocks, self.new_blocks + record.new_blocks,
                          self.missed_blocks + record.missed_blocks, record)
