"""TrtllmEngine against a small fake of ``tensorrt_llm.bindings.executor``.

The fake runs no model: it records requests, simulates block reuse over stored
full-block prefixes (``tokens_per_block`` tokens, the last prompt token always
recomputed), answers with deterministic logits that depend on the whole prompt, and
reports per-request reuse metrics (or cumulative iteration stats, like older releases).
The smoke test against a real engine needs TensorRT-LLM and a GPU.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import types

import pytest
import torch

from prepos.engines.trtllm import (
    LOGITS_PROCESSOR_NAME,
    TrtllmEngine,
    TrtllmEngineDirError,
    TrtllmRequestError,
    TrtllmUnavailable,
)
from prepos.engines.trtllm_request import Retention, build_request

TPB = 16
VOCAB = 64
PADDED = 72  # the engine's logits rows are padded past the vocabulary
LAYERS, KV_HEADS, HEAD_SIZE = 2, 2, 8
BUILD = {"tokens_per_block": TPB, "max_batch_size": 4, "max_seq_len": 128, "max_input_len": 100,
         "max_num_tokens": 256, "dtype": "float16", "gather_generation_logits": True}


def fake_logits(ids) -> torch.Tensor:
    """Deterministic logits ``[PADDED]`` that change with every token of the prompt."""
    seed = sum((k + 1) * t for k, t in enumerate(ids)) % 100_003
    return torch.sin(torch.arange(PADDED, dtype=torch.float32) * 0.37 + seed)


class _Fields:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _State:
    """What the fake executor saw and holds: requests, stored block prefixes, injected failures."""

    def __init__(self):
        self.requests, self.blocks, self.config, self.model_path = [], set(), None, None
        self.fail_next: str | None = None
        self.reject_next: str | None = None
        self.cumulative = [0, 0]  # reused, new: what the iteration stats report
        self.shut_down = False
        self.awaits = []  # requests enqueued so far, at each await


def make_fake(*, post_processor: bool = True, perf_metrics: bool = True, cuda: bool = False,
              release: str = "1.x") -> types.SimpleNamespace:
    """The fake module; with ``cuda`` the post-processor gets CUDA logits on a side stream, like the executor's.
    ``release="0.14"`` has that release's bindings (Triton's 24.10 container): ``max_tokens`` by keyword only, no
    ``KvCacheRetentionConfig`` and no ``kv_cache_retention_config``, no per-request metrics."""
    assert release in ("0.14", "1.x")
    old = release == "0.14"
    perf_metrics = perf_metrics and not old
    state = _State()

    class TokenRangeRetentionConfig(_Fields):
        def __init__(self, token_start, token_end=None, priority=35, duration_ms=None):
            super().__init__(token_start=token_start, token_end=token_end, priority=priority, duration_ms=duration_ms)

    class KvCacheRetentionConfig(_Fields):
        def __init__(self, token_range_retention_configs, decode_retention_priority=35, decode_duration_ms=None):
            super().__init__(token_range_retention_configs=token_range_retention_configs,
                             decode_retention_priority=decode_retention_priority, decode_duration_ms=decode_duration_ms)

    KvCacheRetentionConfig.TokenRangeRetentionConfig = TokenRangeRetentionConfig

    def output_config(return_generation_logits=False, exclude_input_from_output=False, **kw):
        if "return_perf_metrics" in kw and not perf_metrics:
            raise TypeError("unexpected keyword argument 'return_perf_metrics'")
        return _Fields(return_generation_logits=return_generation_logits,
                       exclude_input_from_output=exclude_input_from_output,
                       return_perf_metrics=kw.get("return_perf_metrics", False))

    class Request(_Fields):
        def __init__(self, input_token_ids, max_tokens, *, streaming=False, output_config=None,
                     kv_cache_retention_config=None, logits_post_processor_name=None, client_id=None):
            super().__init__(input_token_ids=list(input_token_ids), max_tokens=max_tokens, streaming=streaming,
                             output_config=output_config, kv_cache_retention_config=kv_cache_retention_config,
                             logits_post_processor_name=logits_post_processor_name, client_id=client_id)

    class Request014(_Fields):  # 0.14's constructor: everything after the prompt by keyword, no retention
        def __init__(self, input_token_ids, *, max_tokens=None, streaming=False, output_config=None,
                     logits_post_processor_name=None, client_id=None):
            super().__init__(input_token_ids=list(input_token_ids), max_tokens=max_tokens, streaming=streaming,
                             output_config=output_config, kv_cache_retention_config=None,
                             logits_post_processor_name=logits_post_processor_name, client_id=client_id)

    class Response:
        def __init__(self, request_id, result=None, error_msg=""):
            self.request_id, self.result, self.error_msg = request_id, result, error_msg

        def has_error(self):
            return self.result is None

    class Executor:
        def __init__(self, model_path, model_type, executor_config):
            state.model_path, state.config = model_path, executor_config
            self._pending = {}

        def enqueue_request(self, request):
            if state.reject_next:
                message, state.reject_next = state.reject_next, None
                raise RuntimeError(message)
            state.requests.append(request)
            self._pending[len(state.requests)] = request
            return len(state.requests)

        def await_responses(self, request_id, timeout):
            state.awaits.append(len(state.requests))
            request = self._pending.pop(request_id)
            if state.fail_next:
                message, state.fail_next = state.fail_next, None
                return [Response(request_id, error_msg=message)]
            ids = request.input_token_ids
            reused, usable = 0, (len(ids) - 1) // TPB  # the last token is always computed
            while reused < usable and tuple(ids[: (reused + 1) * TPB]) in state.blocks:
                reused += 1
            new = -(-len(ids) // TPB) - reused
            state.blocks.update(tuple(ids[: (b + 1) * TPB]) for b in range(len(ids) // TPB))
            state.cumulative[0] += reused
            state.cumulative[1] += new
            logits = fake_logits(ids).view(1, 1, PADDED)
            result = _Fields(is_final=True, output_token_ids=[[int(logits.argmax())]], generation_logits=None,
                             request_perf_metrics=None)
            if request.logits_post_processor_name:
                processor = state.config.logits_post_processor_config.processor_map[request.logits_post_processor_name]
                if cuda:
                    stream = torch.cuda.Stream()
                    with torch.cuda.stream(stream):
                        processor(request_id, logits.cuda(), [ids], stream.cuda_stream, request.client_id)
                else:
                    processor(request_id, logits.clone(), [ids], 0, request.client_id)
            if request.output_config.return_generation_logits:
                result.generation_logits = logits.clone()
            if request.output_config.return_perf_metrics:
                result.request_perf_metrics = _Fields(kv_cache_metrics=_Fields(
                    num_reused_blocks=reused, num_new_allocated_blocks=new))
            return [Response(request_id, result)]

        def cancel_request(self, request_id):
            self._pending.pop(request_id, None)

        def get_latest_iteration_stats(self):
            return [_Fields(kv_cache_stats=_Fields(reused_blocks=state.cumulative[0],
                                                   alloc_new_blocks=state.cumulative[1]))]

        def shutdown(self):
            state.shut_down = True

    fake = types.SimpleNamespace(
        state=state, ModelType=types.SimpleNamespace(DECODER_ONLY="decoder-only"), KvCacheConfig=_Fields,
        ExecutorConfig=_Fields, OutputConfig=output_config, Request=Request014 if old else Request,
        Executor=Executor)
    if not old:
        fake.KvCacheRetentionConfig = KvCacheRetentionConfig
    if post_processor:
        fake.LogitsPostProcessorConfig = _Fields
    return fake


def write_engine_dir(root, build=None, *, kv_cache_quant_algo=None):
    trt = root / "trtllm"
    trt.mkdir(parents=True, exist_ok=True)
    (trt / "rank0.engine").write_bytes(b"\0" * 1000)
    config = {"pretrained_config": {"architecture": "LlamaForCausalLM", "dtype": "float16", "vocab_size": VOCAB,
                                    "hidden_size": 32, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
                                    "num_key_value_heads": KV_HEADS, "head_size": HEAD_SIZE,
                                    "quantization": {"kv_cache_quant_algo": kv_cache_quant_algo},
                                    "mapping": {"world_size": 1}},
              "build_config": {"plugin_config": {"use_paged_context_fmha": True}}}
    (trt / "config.json").write_text(json.dumps(config))
    (trt / "prepos_trtllm.json").write_text(json.dumps(BUILD if build is None else build))
    return root


@pytest.fixture
def engine_dir(tmp_path):
    return write_engine_dir(tmp_path)


def _engine(engine_dir, fake=None, **kw) -> TrtllmEngine:
    return TrtllmEngine(engine_dir, executor_module=fake or make_fake(), device="cpu", **kw)


def _ids(n, start=1):
    return [(start + 7 * k) % VOCAB for k in range(n)]


# ---- request construction ---------------------------------------------------------------------


def test_request_construction_sends_the_full_prompt_for_one_token_with_retention_and_the_post_processor():
    fake = make_fake()
    request = build_request(fake, [5, 6, 7], retention=Retention(80, 600.0),
                            logits_post_processor=LOGITS_PROCESSOR_NAME, return_perf_metrics=True, client_id=3)
    assert request.input_token_ids == [5, 6, 7] and request.max_tokens == 1 and not request.streaming
    assert request.logits_post_processor_name == LOGITS_PROCESSOR_NAME and request.client_id == 3
    out = request.output_config
    assert not out.return_generation_logits and out.exclude_input_from_output and out.return_perf_metrics
    retention = request.kv_cache_retention_config
    [prompt_range] = retention.token_range_retention_configs
    assert (prompt_range.token_start, prompt_range.token_end, prompt_range.priority) == (0, 3, 80)
    assert prompt_range.duration_ms == datetime.timedelta(seconds=600)
    assert retention.decode_retention_priority == 80 and retention.decode_duration_ms == datetime.timedelta(seconds=600)


def test_request_construction_without_post_processor_asks_for_generation_logits():
    request = build_request(make_fake(perf_metrics=False), [1, 2], retention=Retention(50, 30.0),
                            logits_post_processor=None, return_perf_metrics=False)
    assert request.output_config.return_generation_logits and request.logits_post_processor_name is None
    assert not request.output_config.return_perf_metrics
    assert request.kv_cache_retention_config.token_range_retention_configs[0].priority == 50


def test_request_construction_on_the_0_14_bindings_passes_max_tokens_by_keyword_and_no_retention():
    # Triton's 24.10 container: Request takes max_tokens by keyword only and has no retention (TypeError else).
    request = build_request(make_fake(release="0.14"), [5, 6, 7], retention=Retention(80, 600.0),
                            logits_post_processor=LOGITS_PROCESSOR_NAME, return_perf_metrics=False, client_id=3)
    assert request.input_token_ids == [5, 6, 7] and request.max_tokens == 1
    assert request.kv_cache_retention_config is None and request.client_id == 3


def test_the_engine_serves_on_the_0_14_bindings_and_warns_that_retention_is_missing(engine_dir, caplog):
    fake = make_fake(release="0.14")
    with caplog.at_level("WARNING", logger="prepos.engines.trtllm"):
        engine = _engine(engine_dir, fake)
    assert "no KV cache retention" in caplog.text and "engine.trtllm_retention_priority" in caplog.text
    ids = _ids(40)
    assert torch.equal(engine.prefill("a", ids), fake_logits(ids)[:VOCAB])
    assert torch.equal(engine.decode("a", 9), fake_logits([*ids, 9])[:VOCAB])
    assert torch.equal(engine.prefill("b", ids[:20]), fake_logits(ids[:20])[:VOCAB])
    assert [r.max_tokens for r in fake.state.requests] == [1, 1, 1]
    stats = engine.reuse_stats()
    assert stats.num_requests == 3 and stats.last.source == "iteration"
    assert stats.reused_blocks == 2 + 1  # the decode reuses 40 tokens' 2 full blocks; "b" its first of 1 full


def test_the_engine_on_bindings_with_retention_logs_no_warning(engine_dir, caplog):
    with caplog.at_level("WARNING", logger="prepos.engines.trtllm"):
        _engine(engine_dir, make_fake())
    assert "retention" not in caplog.text


@pytest.mark.parametrize("priority, duration", [(101, 600.0), (-1, 600.0), (True, 600.0), (80, 0.0)])
def test_retention_rejects_out_of_range_settings(priority, duration):
    with pytest.raises(ValueError, match="retention"):
        Retention(priority, duration)


def test_engine_requests_carry_its_retention_and_the_executor_gets_block_reuse(engine_dir):
    fake = make_fake()
    engine = _engine(engine_dir, fake, retention_priority=90, retention_s=120.0, free_gpu_memory_fraction=0.5)
    engine.prefill("a", _ids(20))
    [prompt_range] = fake.state.requests[0].kv_cache_retention_config.token_range_retention_configs
    assert (prompt_range.token_end, prompt_range.priority) == (20, 90)
    assert prompt_range.duration_ms == datetime.timedelta(seconds=120)
    config = fake.state.config
    assert config.kv_cache_config.enable_block_reuse and config.kv_cache_config.free_gpu_memory_fraction == 0.5
    assert config.max_beam_width == 1 and config.enable_chunked_context
    assert set(config.logits_post_processor_config.processor_map) == {LOGITS_PROCESSOR_NAME}
    assert fake.state.model_path == str(engine_dir / "trtllm")


# ---- the contract ------------------------------------------------------------------------------


def test_prefill_returns_the_logits_after_the_last_token_of_the_full_sequence(engine_dir):
    fake = make_fake()
    engine = _engine(engine_dir, fake)
    ids = _ids(37)
    logits = engine.prefill("a", ids)
    assert logits.shape == (VOCAB,) and logits.dtype == torch.float32 and logits.device.type == "cpu"
    assert torch.equal(logits, fake_logits(ids)[:VOCAB])
    assert not torch.equal(logits, fake_logits(ids[:-1])[:VOCAB])
    [request] = fake.state.requests
    assert request.input_token_ids == ids and request.max_tokens == 1
    assert request.logits_post_processor_name == LOGITS_PROCESSOR_NAME


def test_bookkeeping_of_cached_ids_truncate_release_and_kv_bytes(engine_dir):
    fake = make_fake()
    engine = _engine(engine_dir, fake)
    ids = _ids(40)
    engine.prefill("a", ids)
    assert engine.cached_token_ids("a") == tuple(ids)
    assert engine.kv_bytes("a") == 3 * TPB * engine.info.kv_bytes_per_token  # 40 tokens: 3 blocks of 16
    engine.truncate("a", 5)
    assert engine.cached_token_ids("a") == tuple(ids[:5])
    assert engine.kv_bytes("a") == TPB * engine.info.kv_bytes_per_token
    engine.truncate("a", 50)  # past the end keeps everything
    assert engine.cached_token_ids("a") == tuple(ids[:5])
    with pytest.raises(ValueError, match="num_tokens"):
        engine.truncate("a", -1)
    assert len(fake.state.requests) == 1  # truncate is bookkeeping only
    engine.prefill("a", ids[:5] + [3, 4])
    assert fake.state.requests[-1].input_token_ids == ids[:5] + [3, 4]
    engine.release("a")
    assert engine.cached_token_ids("a") == () and engine.kv_bytes("a") == 0
    engine.release("never-seen")  # a no-op
    assert engine.kv_bytes("never-seen") == 0


def test_decode_is_a_prefill_of_the_cached_ids_plus_the_token(engine_dir):
    fake = make_fake()
    engine = _engine(engine_dir, fake)
    ids = _ids(17)
    engine.prefill("a", ids)
    logits = engine.decode("a", 9)
    assert fake.state.requests[-1].input_token_ids == ids + [9]
    assert torch.equal(logits, fake_logits(ids + [9])[:VOCAB])
    assert engine.cached_token_ids("a") == tuple(ids + [9])
    with pytest.raises(ValueError, match="prefill it first"):
        engine.decode("b", 9)


def test_decode_batch_enqueues_every_step_before_awaiting_any(engine_dir):
    fake = make_fake()
    engine = _engine(engine_dir, fake)
    logs = {"a": _ids(17), "b": _ids(9, start=4), "c": _ids(33, start=2)}
    for sid, ids in logs.items():
        engine.prefill(sid, ids)
    sent, records = len(fake.state.requests), engine.reuse_stats().num_requests
    results = engine.decode_batch(list(logs), [5, 6, 7])
    assert fake.state.awaits[-3:] == [sent + 3] * 3  # the executor holds all three when the first is awaited
    for (sid, ids), tok, logits in zip(logs.items(), [5, 6, 7], results):
        assert torch.equal(logits, fake_logits(ids + [tok])[:VOCAB]), sid
        assert engine.cached_token_ids(sid) == tuple(ids + [tok])
    assert [r.input_token_ids for r in fake.state.requests[sent:]] == [ids + [t] for ids, t in zip(logs.values(), [5, 6, 7])]
    assert len({r.client_id for r in fake.state.requests}) == len(fake.state.requests)
    assert engine.reuse_stats().num_requests == records + 3 and not engine._captures


def test_decode_batch_fails_an_impossible_or_failed_step_alone(engine_dir):
    fake = make_fake()
    engine = _engine(engine_dir, fake)
    a, b, c = _ids(12), _ids(20, start=3), _ids(100)  # c is at max_context
    for sid, ids in (("a", a), ("b", b), ("c", c)):
        engine.prefill(sid, ids)
    sent = len(fake.state.requests)
    fake.state.fail_next = "no free KV cache blocks"  # the first request awaited: a's
    results = engine.decode_batch(["a", "nobody", "b", "c", "d"], [1, 2, VOCAB, 3, 4])
    assert isinstance(results[0], TrtllmRequestError) and "session 'a'" in str(results[0])
    assert isinstance(results[1], ValueError) and "'nobody' has no KV" in str(results[1])
    assert isinstance(results[2], ValueError) and "lie in" in str(results[2])
    assert isinstance(results[3], ValueError) and "max_context" in str(results[3])
    assert isinstance(results[4], ValueError) and "'d' has no KV" in str(results[4])
    assert len(fake.state.requests) == sent + 1 and engine.cached_token_ids("a") == ()  # only a's was sent
    assert engine.cached_token_ids("b") == tuple(b) and engine.cached_token_ids("c") == tuple(c)
    fake.state.reject_next = "queue full"
    results = engine.decode_batch(["b", "c"], [8, 0])
    assert isinstance(results[0], TrtllmRequestError) and "rejected" in str(results[0])
    assert isinstance(results[1], ValueError) and engine.cached_token_ids("b") == ()
    engine.prefill("b", b)  # what the scheduler does next: the full sequence
    good = engine.decode_batch(["b"], [8])[0]
    assert torch.equal(good, fake_logits(b + [8])[:VOCAB]) and not engine._captures


def test_decode_batch_without_per_request_metrics_runs_the_steps_one_after_another(engine_dir):
    fake = make_fake(perf_metrics=False)
    engine = _engine(engine_dir, fake)
    for sid, ids in (("a", _ids(12)), ("b", _ids(20, start=3))):
        engine.prefill(sid, ids)
    sent = len(fake.state.requests)
    results = engine.decode_batch(["a", "b"], [1, 2])
    assert fake.state.awaits[-2:] == [sent + 1, sent + 2]  # each awaited before the next was sent
    assert torch.equal(results[1], fake_logits(_ids(20, start=3) + [2])[:VOCAB])
    assert [r.source for r in [engine.reuse_stats().last]] == ["iteration"]


def test_prefill_batch_enqueues_every_prefill_before_awaiting_any_and_fails_a_bad_one_alone(engine_dir):
    fake = make_fake()
    engine = _engine(engine_dir, fake)
    engine.prefill("b", _ids(20, start=3))
    sent = len(fake.state.requests)
    prompts = {"a": _ids(17), "b": _ids(30, start=3), "bad": [1, VOCAB], "c": _ids(9, start=5)}
    results = engine.prefill_batch(list(prompts), list(prompts.values()))
    assert fake.state.awaits[-3:] == [sent + 3] * 3  # the executor holds all three when the first is awaited
    assert isinstance(results[2], ValueError) and "lie in" in str(results[2]) and engine.cached_token_ids("bad") == ()
    for sid in ("a", "b", "c"):
        logits = results[list(prompts).index(sid)]
        assert torch.equal(logits, fake_logits(prompts[sid])[:VOCAB]), sid
        assert engine.cached_token_ids(sid) == tuple(prompts[sid])
    assert [r.input_token_ids for r in fake.state.requests[sent:]] == [prompts[sid] for sid in ("a", "b", "c")]
    with pytest.raises(ValueError, match="appears twice"):
        engine.prefill_batch(["a", "a"], [_ids(3), _ids(4)])
    fake = make_fake(perf_metrics=False)
    engine = _engine(engine_dir, fake)
    engine.prefill_batch(["a", "b"], [_ids(12), _ids(7)])
    assert fake.state.awaits[-2:] == [1, 2]  # without per-request metrics: each awaited before the next is sent


def test_each_session_keeps_its_own_logits_until_its_next_call(engine_dir):
    engine = _engine(engine_dir)
    a = engine.prefill("a", _ids(10))
    b = engine.prefill("b", _ids(11, start=3))
    assert torch.equal(a, fake_logits(_ids(10))[:VOCAB])
    assert torch.equal(b, fake_logits(_ids(11, start=3))[:VOCAB])


@pytest.mark.parametrize("ids, match", [([], "empty"), ([1] * 101, "max_context"), ([VOCAB], "lie in")])
def test_prefill_rejects_bad_token_ids_without_sending_a_request(engine_dir, ids, match):
    fake = make_fake()
    engine = _engine(engine_dir, fake)
    with pytest.raises(ValueError, match=match):
        engine.prefill("a", ids)
    assert fake.state.requests == []


def test_engine_info_from_the_engine_config_and_the_build_settings(tmp_path):
    engine = _engine(write_engine_dir(tmp_path))
    assert engine.info.name == "trtllm" and engine.info.vocab_size == VOCAB and engine.info.device == "cpu"
    assert engine.info.kv_bytes_per_token == LAYERS * 2 * KV_HEADS * HEAD_SIZE * 2  # float16 KV
    assert engine.info.max_context == 100  # min(max_input_len, max_seq_len - 1)
    assert engine.info.weight_bytes == 1000
    assert engine.kv_capacity_bytes is None
    fp8 = _engine(write_engine_dir(tmp_path / "fp8", kv_cache_quant_algo="FP8"))
    assert fp8.info.kv_bytes_per_token == LAYERS * 2 * KV_HEADS * HEAD_SIZE


# ---- reuse statistics --------------------------------------------------------------------------


def test_reuse_stats_add_up_with_the_executors_block_arithmetic(engine_dir):
    fake = make_fake()
    engine = _engine(engine_dir, fake)
    ids = _ids(40)
    engine.prefill("a", ids)
    first = engine.reuse_stats().last
    assert (first.reused_blocks, first.new_blocks, first.prompt_tokens, first.source) == (0, 3, 40, "request")
    engine.decode("a", 5)  # 41 tokens: the 2 full blocks of the 40 cached ones are reused, the tail recomputed
    second = engine.reuse_stats().last
    assert (second.reused_blocks, second.new_blocks, second.expected_reused_blocks) == (2, 1, 2)
    assert second.missed_blocks == 0
    engine.prefill("b", ids[:32])  # another session with the same prefix: 1 block reused ((32 - 1) // 16)
    assert engine.reuse_stats().last.reused_blocks == 1
    assert engine.reuse_stats().last.expected_reused_blocks == 0  # nothing cached for b in the bookkeeping
    fake.state.blocks.clear()  # the executor evicted everything
    engine.decode("a", 6)
    evicted = engine.reuse_stats().last
    assert (evicted.reused_blocks, evicted.new_blocks, evicted.missed_blocks) == (0, 3, 2)
    total = engine.reuse_stats()
    assert total.num_requests == 4 and total.prompt_tokens == 40 + 41 + 32 + 42
    assert (total.reused_blocks, total.new_blocks, total.missed_blocks) == (3, 3 + 1 + 1 + 3, 2)


def test_reuse_stats_fall_back_to_iteration_stats_without_per_request_metrics(engine_dir):
    fake = make_fake(perf_metrics=False)
    engine = _engine(engine_dir, fake)
    engine.prefill("a", _ids(40))
    engine.decode("a", 5)
    last = engine.reuse_stats().last
    assert (last.reused_blocks, last.new_blocks, last.source) == (2, 1, "iteration")
    assert not fake.state.requests[-1].output_config.return_perf_metrics
    assert engine.reuse_stats().reused_blocks == 2 and engine.reuse_stats().new_blocks == 4


# ---- logits without the post-processor ----------------------------------------------------------


def test_generation_logits_serve_where_there_is_no_post_processor(engine_dir):
    fake = make_fake(post_processor=False)
    engine = _engine(engine_dir, fake)
    assert engine.logits_source == "generation_logits"
    ids = _ids(21)
    assert torch.equal(engine.prefill("a", ids), fake_logits(ids)[:VOCAB])
    request = fake.state.requests[-1]
    assert request.output_config.return_generation_logits and request.logits_post_processor_name is None


def test_generation_logits_need_an_engine_that_gathers_them(tmp_path):
    root = write_engine_dir(tmp_path, {**BUILD, "gather_generation_logits": False})
    with pytest.raises(TrtllmEngineDirError, match=r"prepos_trtllm\.json: 'gather_generation_logits' is false.*"
                                                   "no logits post-processor"):
        _engine(root, make_fake(post_processor=False))
    with pytest.raises(TrtllmEngineDirError, match="logits_source is generation_logits"):
        _engine(root, make_fake(), logits_source="generation_logits")
    assert _engine(root, make_fake()).logits_source == "post_processor"  # the post-processor does not need them
    with pytest.raises(TrtllmUnavailable, match="post-processor"):
        _engine(root, make_fake(post_processor=False), logits_source="post_processor")


# ---- errors ---------------------------------------------------------------------------------------


def test_executor_errors_name_the_session_and_leave_it_consistent(engine_dir):
    fake = make_fake()
    engine = _engine(engine_dir, fake)
    ids = _ids(20)
    engine.prefill("a", ids)
    fake.state.fail_next = "no free KV cache blocks"
    with pytest.raises(TrtllmRequestError, match=r"session 'a'.*no free KV cache blocks"):
        engine.prefill("a", ids + [1])
    assert engine.cached_token_ids("a") == () and engine.kv_bytes("a") == 0
    with pytest.raises(ValueError, match="prefill it first"):
        engine.decode("a", 1)
    fake.state.reject_next = "input length exceeds max_input_len"
    with pytest.raises(TrtllmRequestError, match=r"session 'a'.*rejected.*max_input_len"):
        engine.prefill("a", ids)
    assert engine.cached_token_ids("a") == ()
    logits = engine.prefill("a", ids + [1])  # recovers: the prompt is always the full sequence
    assert fake.state.requests[-1].input_token_ids == ids + [1]
    assert torch.equal(logits, fake_logits(ids + [1])[:VOCAB])
    assert engine.reuse_stats().num_requests == 2  # failed requests record nothing


def test_missing_tensorrt_llm_raises_unavailable_with_the_container_hint(engine_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # makes the import fail like a missing package
    with pytest.raises(TrtllmUnavailable, match="NVIDIA's Triton TensorRT-LLM container"):
        TrtllmEngine(engine_dir)


@pytest.mark.parametrize("key", sorted(BUILD))
def test_a_missing_build_setting_is_named_with_its_file(tmp_path, key):
    build = {k: v for k, v in BUILD.items() if k != key}
    with pytest.raises(TrtllmEngineDirError, match=rf"prepos_trtllm\.json: missing key '{key}'"):
        _engine(write_engine_dir(tmp_path, build))


@pytest.mark.parametrize("key, value, match", [("tokens_per_block", "16", "must be int"),
                                               ("gather_generation_logits", 1, "must be bool"),
                                               ("max_seq_len", True, "must be int"),
                                               ("tokens_per_block", 0, ">= 1"),
                                               ("max_input_len", 500, "exceeds 'max_seq_len'"),
                                               ("dtype", "float64", "'dtype'")])
def test_bad_build_settings_are_named(tmp_path, key, value, match):
    with pytest.raises(TrtllmEngineDirError, match=match):
        _engine(write_engine_dir(tmp_path, {**BUILD, key: value}))


def test_missing_engine_files_are_named(tmp_path):
    with pytest.raises(TrtllmEngineDirError, match="trtllm: not found"):
        _engine(tmp_path)
    root = write_engine_dir(tmp_path)
    (root / "trtllm" / "prepos_trtllm.json").unlink()
    with pytest.raises(TrtllmEngineDirError, match=r"prepos_trtllm\.json: not found"):
        _engine(root)
    write_engine_dir(root)
    (root / "trtllm" / "config.json").write_text(json.dumps({"build_config": {}}))
    with pytest.raises(TrtllmEngineDirError, match=r"config\.json: missing key 'pretrained_config'"):
        _engine(root)


def test_close_shuts_the_executor_down(engine_dir):
    fake = make_fake()
    engine = _engine(engine_dir, fake)
    engine.prefill("a", _ids(3))
    engine.close()
    assert fake.state.shut_down and engine.cached_token_ids("a") == ()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("post_processor", [True, False])
def test_on_cuda_the_logits_stay_on_the_device(engine_dir, post_processor):
    engine = TrtllmEngine(engine_dir, executor_module=make_fake(post_processor=post_processor, cuda=True))
    ids = _ids(30)
    logits = engine.prefill("a", ids)
    assert logits.device.type == "cuda" and engine.info.device == "cuda"
    assert torch.equal(logits.cpu(), fake_logits(ids)[:VOCAB])


# ---- a real engine ----------------------------------------------------------------------------------


def _have_trtllm() -> bool:
    try:
        import tensorrt_llm.bindings.executor  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means no usable TensorRT-LLM
        return False
    return torch.cuda.is_available() and bool(os.environ.get("PREPOS_TRTLLM_ENGINE_DIR"))


@pytest.mark.gpu
@pytest.mark.skipif(not _have_trtllm(), reason="needs TensorRT-LLM (NVIDIA's Triton TensorRT-LLM container)")
def test_real_engine_greedy_tokens_match_the_torch_engine():
    from prepos.engines.torch_llama import TorchLlamaEngine

    engine_dir = os.environ["PREPOS_TRTLLM_ENGINE_DIR"]
    engine = TrtllmEngine(engine_dir)
    reference = TorchLlamaEngine(engine_dir, device="cuda", dtype=engine.build.dtype)
    ids = [int(t) for t in torch.randint(0, engine.info.vocab_size, (3 * engine.tokens_per_block + 5,),
                                         generator=torch.Generator().manual_seed(0))]
    got, want = engine.prefill("s", ids), reference.prefill("s", ids)
    for _ in range(8):
        token = int(torch.argmax(want))
        assert int(torch.argmax(got)) == token
        got, want = engine.decode("s", token), reference.decode("s", token)
    assert engine.reuse_stats().last.reused_blocks >= 3  # the decode reused the session's full blocks
    engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not _have_trtllm(), reason="needs TensorRT-LLM (NVIDIA's Triton TensorRT-LLM container)")
def test_real_engine_decode_batches_give_each_session_its_greedy_tokens():
    from prepos.engines.torch_llama import TorchLlamaEngine

    engine_dir = os.environ["PREPOS_TRTLLM_ENGINE_DIR"]
    engine = TrtllmEngine(engine_dir)
    reference = TorchLlamaEngine(engine_dir, device="cuda", dtype=engine.build.dtype)
    gen = torch.Generator().manual_seed(1)
    sids = ["a", "b", "c"]
    got, want = {}, {}
    for n, sid in zip((2, 3, 5), sids):
        ids = [int(t) for t in torch.randint(0, engine.info.vocab_size, (n * engine.tokens_per_block + n,), generator=gen)]
        got[sid], want[sid] = engine.prefill(sid, ids), reference.prefill(sid, ids)
    for _ in range(6):
        tokens = [int(torch.argmax(want[sid])) for sid in sids]
        assert [int(torch.argmax(got[sid])) for sid in sids] == tokens
        for sid, logits in zip(sids, engine.decode_batch(sids, tokens)):
            assert not isinstance(logits, Exception), logits
            got[sid] = logits.clone()  # the session's buffer is rewritten by its next request
        want = {sid: reference.decode(sid, tok) for sid, tok in zip(sids, tokens)}
    engine.close()
