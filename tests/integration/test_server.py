"""The real Triton server with the real model, over gRPC: paths, token identity, errors, metrics; and over HTTP
through the bridge model ``prepos_http``."""

from __future__ import annotations

import json
import queue
import re
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from prepos.bridge import ERROR_FIELDS, NARROWED_INPUTS
from prepos_client import Client, PreposError

from .conftest import start_server

pytestmark = pytest.mark.integration

SYSTEM = "You are a concise assistant. Answer in one short sentence."
TOOLS = ["get_weather", "get_time", "set_alarm", "send_message"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("triton"))
    yield srv
    srv.stop()


def eventually(condition, timeout_s: float = 10.0) -> None:
    """Wait for ``condition()`` (metrics are published when the server's engine loop goes idle)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def settled(read, quiet_s: float = 0.5, timeout_s: float = 10.0):
    """The value of ``read()`` once it stayed the same for ``quiet_s``: a count recorded for a request just answered
    is published only when the server's engine loop next goes idle, so a baseline read at once may miss it."""
    deadline = time.monotonic() + timeout_s
    value, since = read(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, "the value never settled"
        time.sleep(0.05)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
    return value


def wait_positioned(server, completed_before: float, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while server.metric("prepos_prepositionings_total", result="completed") <= completed_before:
        assert time.monotonic() < deadline, "the idle session was never pre-positioned"
        time.sleep(0.1)


class Conversation:
    """The token log a session must hold, rebuilt from the framing independently of the server."""

    def __init__(self, manifest, tokenizer):
        self.f = manifest["framing"]
        self.tok = tokenizer
        self.log: list[int] = []

    def entry(self, role):
        return self.f["roles"][role]["entry_ids"]

    def opening(self, role):
        return self.f["default_system_ids"] if not self.log and role != "system" else []

    def append(self, role, text):
        self.log += self.opening(role) + self.entry(role) + self.tok.encode(text) + self.f["close_ids"]

    def prompt(self, role, text):
        return self.log + self.opening(role) + self.entry(role) + self.tok.encode(text) + self.f["cue_ids"]

    def answered(self, prompt, answer_ids, finish_reason, choice=False):
        terminator = self.f["answer_terminator_ids"]
        emitted_stop = finish_reason == "stop" and not choice
        self.log = prompt + list(answer_ids) + ([terminator[0]] if emitted_stop else []) + terminator[emitted_stop:]


def reference_greedy(model, prompt, max_tokens, stop_ids):
    """Stateless: one full prefill of the token log, then greedy decoding (Hugging Face's implementation)."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])  # the mask is explicit: the stop token doubles as the pad token
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=list(stop_ids), pad_token_id=stop_ids[0])
    ids = out[0, len(prompt):].tolist()
    return [t for t in ids if t not in stop_ids]


def check_answer(model, conv, answer, role, text, max_tokens):
    prompt = conv.prompt(role, text)
    want = reference_greedy(model, prompt, max_tokens, conv.f["stop_token_ids"])
    assert list(answer.token_ids) == want, f"{answer.path} answer differs from the stateless reference"
    conv.answered(prompt, answer.token_ids, answer.finish_reason)


def test_multi_turn_session_paths_match_stateless_prefill(server, engine_manifest, tokenizer, reference_model):
    conv = Conversation(engine_manifest, tokenizer)
    with Client(server.grpc_url) as client, client.session() as session:
        completed = server.metric("prepos_prepositionings_total", result="completed")
        assert session.append(SYSTEM, role="system").path == "append"
        conv.append("system", SYSTEM)

        first = session.ask("What is the capital of France?", max_tokens=12)
        assert first.path in ("prefix", "prepaid")
        check_answer(reference_model, conv, first, "user", "What is the capital of France?", 12)

        wait_positioned(server, completed)
        completed = server.metric("prepos_prepositionings_total", result="completed")
        exact = session.ask("", max_tokens=12)
        assert exact.path == "exact"
        check_answer(reference_model, conv, exact, "user", "", 12)

        wait_positioned(server, completed)
        completed = server.metric("prepos_prepositionings_total", result="completed")
        prepaid = session.ask("And of Germany?", max_tokens=12, speculate=False)
        assert prepaid.path == "prepaid"
        check_answer(reference_model, conv, prepaid, "user", "And of Germany?", 12)

        wait_positioned(server, completed)
        completed = server.metric("prepos_prepositionings_total", result="completed")
        gated = session.ask("Which tool tells me if I need an umbrella?", choices=TOOLS, gate_threshold=0.0,
                            speculate=True)
        assert gated.path == "gated" and gated.text in TOOLS
        # Server-side anatomy of the first token: a scan and no engine work on the gated path; prefill on prepaid.
        assert gated.prefill_ms == 0 and gated.decode_ms == 0 and 0 < gated.scan_ms <= gated.compute_ms
        assert prepaid.prefill_ms > 0 and prepaid.decode_ms == 0 and prepaid.scan_ms > 0
        assert list(gated.token_ids) == tokenizer.encode(gated.text)
        conv.answered(conv.prompt("user", "Which tool tells me if I need an umbrella?"), gated.token_ids, "stop",
                      choice=True)

        # After a gated answer the delta, cue and answer are in the log: the next answer shows it.
        wait_positioned(server, completed)
        after = session.ask("Thanks. Say goodbye.", max_tokens=10, speculate=False)
        assert after.path == "prepaid"
        check_answer(reference_model, conv, after, "user", "Thanks. Say goodbye.", 10)

        closed = session.close()
        assert closed.path == "close"
    with Client(server.grpc_url) as client:
        ghost = client.session(session.session_id, resume=True)
        with pytest.raises(PreposError) as err:
            ghost.ask("anyone there?", max_tokens=2)
        assert "START" in str(err.value)
        ghost.detach()


def test_sessions_asking_at_once_each_get_the_stateless_answer(server, engine_manifest, tokenizer, reference_model):
    """Requests of several sessions arriving together prefill (as a batch where they meet in the engine loop) and
    decode together; each answer is still token-identical to its own stateless prefill."""
    questions = ["Name a fruit.", "What is two plus two?", "Say hello in French.", "Which planet is red?"]
    barrier = threading.Barrier(len(questions))
    answers: list = [None] * len(questions)

    def user(i: int) -> None:
        try:
            with Client(server.grpc_url) as client, client.session() as session:
                session.append(SYSTEM, role="system")
                barrier.wait(timeout=60)
                answers[i] = session.ask(questions[i], max_tokens=8, speculate=False)
        except BaseException as err:  # checked below
            answers[i] = err
            barrier.abort()

    batches_before = server.metric("prepos_prefill_batch_sessions_count")
    threads = [threading.Thread(target=user, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for question, answer in zip(questions, answers):
        assert not isinstance(answer, BaseException) and answer is not None, answer
        conv = Conversation(engine_manifest, tokenizer)
        conv.append("system", SYSTEM)
        assert answer.path in ("prefix", "prepaid")
        check_answer(reference_model, conv, answer, "user", question, 8)
    eventually(lambda: server.metric("prepos_prefill_batch_sessions_count") > batches_before)


def test_rebuild_after_eviction_matches_stateless_prefill(tmp_path, engine_manifest, tokenizer, reference_model):
    # A one-byte KV budget: every idle session's KV is evicted as soon as another session works.
    srv = start_server(tmp_path, env={"PREPOS_MEMORY_KV_BUDGET_BYTES": "1"})
    try:
        conv = Conversation(engine_manifest, tokenizer)
        with Client(srv.grpc_url) as client, client.session() as a, client.session() as b:
            a.append(SYSTEM, role="system")
            conv.append("system", SYSTEM)
            check_answer(reference_model, conv, a.ask("Name a color.", max_tokens=6), "user", "Name a color.", 6)
            b.ask("Hello!", max_tokens=2)  # b's work evicts a's KV
            rebuilt = a.ask("Name another one.", max_tokens=8)
            assert rebuilt.path == "rebuild"
            check_answer(reference_model, conv, rebuilt, "user", "Name another one.", 8)
        eventually(lambda: srv.metric("prepos_kv_evictions_total") >= 1)
    finally:
        srv.stop()


TOOL_LIST = ("You route requests to tools. Reply with only the name of the next tool to call.\nTools:\n"
             "get_weather(city): today's forecast for a city\nget_time(timezone): the current time in a timezone\n"
             "set_alarm(time, label): an alarm on the user's phone\nsend_message(to, text): a text message to a contact")


def test_sessions_opening_with_one_tool_list_copy_its_kv_and_answer_as_a_stateless_prefill(
        server, engine_manifest, tokenizer, reference_model):
    """A second session with the same system turn copies its KV from the first, still open; once both have
    closed, a third copies it from the opening kept behind. Each answers as a stateless prefill of its log."""
    system_tokens = len(tokenizer.encode(TOOL_LIST))

    def open_and_ask(client, question, copies):
        shared = server.metric("prepos_shared_prefix_tokens_total")
        conv = Conversation(engine_manifest, tokenizer)
        session = client.session()
        session.append(TOOL_LIST, role="system")
        conv.append("system", TOOL_LIST)
        check_answer(reference_model, conv, session.ask(question, max_tokens=6, speculate=False), "user", question, 6)
        if copies:
            eventually(lambda: server.metric("prepos_shared_prefix_tokens_total") >= shared + system_tokens)
        return session

    with Client(server.grpc_url) as client:
        first = open_and_ask(client, "Will it rain in Paris?", copies=False)
        second = open_and_ask(client, "What time is it in Tokyo?", copies=True)  # from first, open
        first.close()
        second.close()
        eventually(lambda: server.metric("prepos_kept_prefix_bytes") > 0)
        open_and_ask(client, "Wake me at seven.", copies=True).close()  # from the opening kept at close


def _raw_request(server, session_id, inputs, start=False, end=False):
    """Send one request on its own stream; return (list of responses, error message or None)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(lambda result, error: results.put((result, error)))
    tensors = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    client.async_stream_infer("prepos", tensors, sequence_id=session_id, sequence_start=start, sequence_end=end)
    responses, error = [], None
    while True:
        result, err = results.get(timeout=60)
        if err is not None:
            error = str(err)
            break
        responses.append(result)
        if result.as_numpy("finish_reason")[0]:
            break
    client.stop_stream()
    client.close()
    return responses, error


def _b(*values):
    return np.array([v if isinstance(v, bytes) else v.encode() for v in values], dtype=np.object_)


BAD_INPUTS = [
    ("input_ids", dict(text_input=_b("hi"), input_ids=np.array([1, 2], np.int32))),
    ("max_tokens", dict(text_input=_b("hi"), max_tokens=np.array([-1], np.int32))),
    ("temperature", dict(text_input=_b("hi"), temperature=np.array([np.nan], np.float32))),
    ("choices", dict(text_input=_b("hi"), choices=_b("yes", ""))),
    ("text_input", dict(text_input=_b(b"caf\xc3("))),
    ("text_input", dict(text_input=_b("hello " * 9000))),
    ("role", dict(text_input=_b("hi"), role=_b("wizard"))),
]


def test_bad_input_names_the_field_and_changes_nothing(server, engine_manifest, tokenizer, reference_model):
    conv = Conversation(engine_manifest, tokenizer)
    with Client(server.grpc_url) as client, client.session() as session:
        session.append(SYSTEM, role="system")
        conv.append("system", SYSTEM)
        check_answer(reference_model, conv, session.ask("Say hi.", max_tokens=4), "user", "Say hi.", 4)

        _, error = _raw_request(server, "never-started", dict(text_input=_b("hi")))
        assert error is not None and "START" in error
        for field, inputs in BAD_INPUTS:
            _, error = _raw_request(server, session.session_id, inputs)
            assert error is not None and re.search(rf"\b{field}: ", error), (field, error)

        # The session still answers, from an unchanged log, exactly as a stateless prefill would.
        check_answer(reference_model, conv, session.ask("Say bye.", max_tokens=6, speculate=False), "user",
                     "Say bye.", 6)


def test_metrics_on_the_metrics_port(server):
    with Client(server.grpc_url) as client, client.session() as session:
        completed = server.metric("prepos_prepositionings_total", result="completed")
        session.append("Answer yes or no.", role="system")
        wait_positioned(server, completed)
        completed = server.metric("prepos_prepositionings_total", result="completed")
        assert session.ask("", choices=["yes", "no"]).path == "exact"
        wait_positioned(server, completed)
        completed = server.metric("prepos_prepositionings_total", result="completed")
        gated = session.ask("Is the sky blue?", choices=["yes", "no"], gate_threshold=0.0, speculate=True)
        assert gated.path == "gated"
        # The shipped configuration keeps the uncertified gate off: without speculate=true, no gated answer.
        wait_positioned(server, completed)
        assert session.ask("Is the grass green?", choices=["yes", "no"], gate_threshold=0.0).path == "prepaid"
        # Counters are published when the engine loop goes idle, gauges at its housekeeping (every half second).
        eventually(lambda: server.metric("prepos_gate_decisions_total", outcome="disabled") >= 1)
        eventually(lambda: server.metric("prepos_requests_total", path="exact") >= 1)
        eventually(lambda: server.metric("prepos_first_token_ms_count", path="exact") >= 1)
        eventually(lambda: server.metric("prepos_gate_decisions_total", outcome="fired") >= 1)
        eventually(lambda: server.metric("prepos_sessions", state="positioned")
                   + server.metric("prepos_sessions", state="resident") >= 1)
        eventually(lambda: server.metric("prepos_kv_bytes") > 0)
        assert server.metric("prepos_kv_budget_bytes") > 0
    # The backend froze its startup objects (the model's and libraries', 170k on CPU) out of the collector's
    # walks, and publishes every collection by generation.
    frozen = [int(n) for n in re.findall(r"heap settled: (\d+) startup objects", server.log_file.read_text())]
    assert len(frozen) == 2 and max(frozen) > 50_000  # prepos's and the bridge's (smaller: no model in it)
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        published = response.read().decode()
    for generation in ("0", "1", "2"):
        assert f'prepos_gc_collections_total{{generation="{generation}"' in published
    # Refusals by every field of the model's inputs and of the server's state are there before the first one, and
    # the HTTP bridge's own refusals by every field it names, under its model.
    series = [line for line in published.splitlines() if line.startswith("prepos_request_errors_total{")]
    for model, fields in (("prepos", ("max_tokens", "role", "text_input", "START", "END", "journal", "timeout",
                                      "request", "model", "correlation_id")),
                          ("prepos_http", ERROR_FIELDS)):
        for field in fields:
            assert any(f'model="{model}"' in line and f'field="{field}"' in line for line in series), (model, field)


# ---- the HTTP bridge (prepos_http) over Triton's generate endpoints ----------------------------------------------


def _strict_json(text: str) -> dict:
    def refuse(constant):
        raise AssertionError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _generate(server, body: dict, *, stream: bool = False) -> tuple[int, list[dict]]:
    """POST to prepos_http's generate (or generate_stream) endpoint: the status and the JSON object(s) sent."""
    url = f"{server.http_url}/v2/models/prepos_http/generate{'_stream' if stream else ''}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    if not stream:
        return status, [_strict_json(text)]
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return status, [_strict_json(event) for event in events]


def _ids_of(message: dict) -> list[int]:
    ids = message.get("output_ids", [])
    return ids if isinstance(ids, list) else [ids]  # the endpoint writes a one-value array as a number


def test_http_generate_answers_one_turn_sessions_as_a_stateless_prefill_would(server, engine_manifest, tokenizer,
                                                                              reference_model):
    question = "What is the capital of France?"
    status, (answer,) = _generate(server, {"text_input": question, "max_tokens": 12})
    assert status == 200 and answer["path"] == "prefix" and answer["finish_reason"] in ("stop", "length")
    conv = Conversation(engine_manifest, tokenizer)
    want = reference_greedy(reference_model, conv.prompt("user", question), 12, conv.f["stop_token_ids"])
    assert _ids_of(answer) == want and answer["text_output"] == tokenizer.decode(want)
    assert answer["first_token_ms"] > 0 and answer["compute_ms"] >= answer["first_token_ms"] - answer["queue_ms"]
    # the phases are the whole request's, beside its compute_ms (decode_ms was the first token's: 0)
    assert len(want) > 1 and answer["decode_ms"] > 0 and answer["prefill_ms"] > 0
    assert answer["prefill_ms"] + answer["decode_ms"] + answer["scan_ms"] <= answer["compute_ms"] * 1.01
    # A second one-turn request is a new session: the same question gets the same answer.
    assert _ids_of(_generate(server, {"text_input": question, "max_tokens": 12})[1][0]) == want


def test_http_named_session_streams_and_keeps_its_log(server, engine_manifest, tokenizer, reference_model):
    conv = Conversation(engine_manifest, tokenizer)
    sid = "bridge-test-session"
    status, (update,) = _generate(server, {"session_id": sid, "start": True, "text_input": SYSTEM, "role": "system",
                                           "max_tokens": 0})
    assert status == 200 and update["path"] == "append" and update["finish_reason"] == "appended"
    assert "confidence" not in update  # unset for an update: left out, not NaN
    conv.append("system", SYSTEM)
    for question in ("Name a primary colour.", "Name another one."):
        status, events = _generate(server, {"session_id": sid, "text_input": question, "max_tokens": 10,
                                            "stream": True}, stream=True)
        assert status == 200 and len(events) > 2  # one event per token, then the final one
        ids = [t for event in events for t in _ids_of(event)]
        assert events[-1]["finish_reason"] in ("stop", "length") and all(not e["finish_reason"] for e in events[:-1])
        prompt = conv.prompt("user", question)
        assert ids == reference_greedy(reference_model, prompt, 10, conv.f["stop_token_ids"])
        conv.answered(prompt, ids, events[-1]["finish_reason"])
    # Bad input is named and changes nothing; the session goes on from the same log.
    for body, field in (({"session_id": sid, "text_input": "hi", "max_tokens": -1}, "max_tokens"),
                        ({"text_input": "hi", "end": True}, "end"),
                        ({"session_id": "", "text_input": "hi"}, "session_id")):
        status, (error,) = _generate(server, body)
        assert status == 400 and error["error"].startswith(f"{field}: "), error
        assert error["error"].endswith(" [INVALID_ARGUMENT]"), error  # prepos's and the bridge's, alike
    status, (answer,) = _generate(server, {"session_id": sid, "text_input": "And a third?", "max_tokens": 8})
    prompt = conv.prompt("user", "And a third?")
    assert _ids_of(answer) == reference_greedy(reference_model, prompt, 8, conv.f["stop_token_ids"])
    status, (closed,) = _generate(server, {"session_id": sid, "end": True, "max_tokens": 0})
    assert status == 200 and closed["path"] == "close"
    not_open = server.metric("prepos_request_errors_total", model="prepos_http", field="START")
    status, (error,) = _generate(server, {"session_id": sid, "text_input": "Still there?"})
    assert status == 400 and "START" in error["error"]  # closed: the next request must open it again
    # Triton's refusal, before prepos saw it: the bridge counts it and gives it the status prepos would
    assert error["error"].endswith(" [NOT_FOUND]"), error
    assert server.metric("prepos_request_errors_total", model="prepos_http", field="START") == not_open + 1


def test_http_bad_values_are_named_before_they_reach_the_session(server, engine_manifest, tokenizer,
                                                                  reference_model):
    conv = Conversation(engine_manifest, tokenizer)
    sid = "bridge-bad-values"
    status, _ = _generate(server, {"session_id": sid, "start": True, "text_input": SYSTEM, "role": "system",
                                   "max_tokens": 0})
    assert status == 200
    conv.append("system", SYSTEM)
    question = "Name a primary colour."
    fields = ("max_tokens", "input_ids", "timeout", "session_id", "resume", "START", "request")

    def refusals(model):
        return [server.metric("prepos_request_errors_total", model=model, field=field) for field in fields]

    bridge_before, prepos_before = refusals("prepos_http"), settled(lambda: refusals("prepos"))
    deadlines_before = settled(lambda: server.metric("prepos_requests_abandoned_total", model="prepos",
                                                     reason="deadline"))
    for body, status_want, start in (
            # a whole number INT32 cannot hold: named by the bridge (Triton alone would store 4294967299 as 3)
            ({"max_tokens": 4294967299}, 400, "max_tokens: 4294967299 does not fit INT32"),
            ({"input_ids": [1, 2**31]}, 400, "input_ids: entry 1, 2147483648 does not fit INT32"),
            ({"max_tokens": 8, "timeout": "soon"}, 400, "timeout: expected whole microseconds"),
            # a deadline that passes: prepos refuses the turn, and the session's log stays as it was
            ({"max_tokens": 8, "timeout": 1}, 400, "timeout: "),  # ... [DEADLINE_EXCEEDED], asserted below
            # a JSON value of the wrong kind: Triton's generate endpoint refuses it before any model runs
            ({"max_tokens": "eight"}, 500, "Unable to parse"),
    ):
        status, (error,) = _generate(server, {"session_id": sid, "text_input": question} | body)
        assert status == status_want and error["error"].startswith(start), (body, error)
        if body.get("timeout") == 1:
            assert error["error"].endswith(" [DEADLINE_EXCEEDED]"), error
    long_id = "x" * 129
    status, (error,) = _generate(server, {"session_id": long_id, "start": True, "text_input": "hi", "max_tokens": 0})
    assert status == 400 and error["error"] == "session_id: 129 bytes; at most 128 allowed [INVALID_ARGUMENT]"
    status, (error,) = _generate(server, {"resume": True, "text_input": "hi", "max_tokens": 4})  # nothing to resume
    assert status == 400 and error["error"].startswith("resume: needs session_id"), error
    # The bridge's own refusals are counted under its model, each once, before their answer, and reached no
    # session; the deadline that passed in prepos is prepos's (published when its engine loop goes idle), which the
    # bridge relays without counting it as Triton's.
    assert [a - b for a, b in zip(refusals("prepos_http"), bridge_before)] == [1, 1, 1, 1, 1, 0, 0]
    eventually(lambda: server.metric("prepos_requests_abandoned_total", model="prepos", reason="deadline")
               == deadlines_before + 1)
    assert refusals("prepos") == prepos_before
    status, (answer,) = _generate(server, {"session_id": sid, "text_input": question, "max_tokens": 8,
                                           "timeout": 120_000_000})
    prompt = conv.prompt("user", question)
    assert status == 200 and _ids_of(answer) == reference_greedy(reference_model, prompt, 8, conv.f["stop_token_ids"])
    assert _generate(server, {"session_id": sid, "end": True})[0] == 200


def test_http_requests_queued_on_one_session_do_not_hold_up_other_sessions(server):
    """Each relayed request holds one of the Python backend's Business Logic Scripting threads until prepos answers
    it; with Triton's 32, requests queued behind one session's answers took them all, and another session's
    request waited for a dozen of those answers. The launcher gives it more threads than the bridge relays."""
    sid, num_queued = "bridge-queue", 64
    assert _generate(server, {"session_id": sid, "start": True, "text_input": SYSTEM, "role": "system",
                              "max_tokens": 0})[0] == 200
    done: list[str] = []
    lock = threading.Lock()

    def ask(name: str, body: dict) -> None:
        status, _ = _generate(server, body)
        with lock:
            done.append(f"{name}:{status}")

    queued = [threading.Thread(target=ask, args=("queued", {"session_id": sid, "text_input": f"Item {i}.",
                                                            "max_tokens": 6})) for i in range(num_queued)]
    for thread in queued:
        thread.start()
    time.sleep(0.5)  # every queued request has reached the bridge
    with lock:
        answered_before = len(done)
    assert answered_before < num_queued - 32  # enough still queued to take all of Triton's default 32 threads
    # The bridge publishes its relays every half second: dozens on relay threads (256 at most), none waiting once
    # all have come in (a value published while they came in may hold one between its arrival and its thread).
    eventually(lambda: server.metric("prepos_bridge_relays", model="prepos_http", state="relaying") >= 16
               and server.metric("prepos_bridge_relays", model="prepos_http", state="waiting") == 0)
    other = threading.Thread(target=ask, args=("other", {"text_input": "Say hello.", "max_tokens": 1}))
    other.start()
    for thread in [*queued, other]:
        thread.join(180)
    assert sorted(set(done)) == ["other:200", "queued:200"] and len(done) == num_queued + 1
    # Served in turn with the session's requests, it waits for one or two of them, not for a dozen.
    waited_for = done.index("other:200") - answered_before
    assert waited_for <= 4, (answered_before, waited_for)
    assert _generate(server, {"session_id": sid, "end": True})[0] == 200
    eventually(lambda: server.metric("prepos_bridge_relays", model="prepos_http", state="relaying") == 0)


def test_http_deadline_passing_mid_answer_ends_the_request_with_the_error(server, engine_manifest, tokenizer,
                                                                          reference_model):
    # prepos's error after the first tokens: Triton's BLS would lose it and hang the bridge; it must arrive.
    conv = Conversation(engine_manifest, tokenizer)
    sid, storyteller = "bridge-deadline", "You are a storyteller. Tell long stories."
    assert _generate(server, {"session_id": sid, "start": True, "text_input": storyteller, "role": "system",
                              "max_tokens": 0})[0] == 200
    conv.append("system", storyteller)
    long_turn = {"session_id": sid, "text_input": "Write a long story about a dragon.", "max_tokens": 400,
                 "timeout": 2_000_000}  # its first tokens come well within 2 s, its 400 tokens well after
    status, events = _generate(server, long_turn | {"stream": True}, stream=True)
    assert status == 200 and len(events) > 1 and all("error" not in e for e in events[:-1]), events[-1]
    assert events[-1] == {"error": "timeout: the request's deadline passed before it finished; its turn was not accepted"
                                   " [DEADLINE_EXCEEDED]"}  # relayed as the bridge's last response: status kept
    status, (error,) = _generate(server, long_turn)
    assert status == 400 and error["error"].startswith("timeout: "), error
    # Neither turn was accepted: the next question is answered from the opening alone.
    question = "Name a primary colour."
    status, (answer,) = _generate(server, {"session_id": sid, "text_input": question, "max_tokens": 8})
    prompt = conv.prompt("user", question)
    assert status == 200 and _ids_of(answer) == reference_greedy(reference_model, prompt, 8, conv.f["stop_token_ids"])
    assert _generate(server, {"session_id": sid, "end": True})[0] == 200


def test_http_bridge_takes_every_prepos_input_and_gives_every_prepos_output(server):
    def config(model):
        with urllib.request.urlopen(f"{server.http_url}/v2/models/{model}/config", timeout=30) as response:
            return json.loads(response.read())

    bridge, prepos = config("prepos_http"), config("prepos")
    fields = lambda entries: {e["name"]: (e["data_type"], e["dims"]) for e in entries}  # noqa: E731
    # prepos's INT32 inputs are INT64 on the bridge, which checks that each value fits (NARROWED_INPUTS).
    widened = {name: ("TYPE_INT64", dims) for name, (kind, dims) in fields(prepos["input"]).items()
               if name in NARROWED_INPUTS and kind == "TYPE_INT32"}
    assert sorted(widened) == sorted(NARROWED_INPUTS)
    assert fields(bridge["input"]) == fields(prepos["input"]) | widened | {
        "session_id": ("TYPE_STRING", [1]), "start": ("TYPE_BOOL", [1]), "end": ("TYPE_BOOL", [1]),
        "stream": ("TYPE_BOOL", [1])}
    assert fields(bridge["output"]) == fields(prepos["output"])


def test_a_large_body_sent_as_form_data_is_answered_and_the_server_lives_on(server):
    """Triton 2.51's HTTP front end copies a form-data body (urllib's default Content-Type for a POST) onto its
    thread's stack: with the usual 8 MiB stack limit one POST of 4 MB crashed the whole server."""
    body = json.dumps({"text_input": "a" * (6 << 20), "max_tokens": 1}).encode()
    request = urllib.request.Request(f"{server.http_url}/v2/models/prepos_http/generate", data=body, method="POST")
    assert request.get_header("Content-type") is None  # urllib adds application/x-www-form-urlencoded
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=120)
    assert refused.value.code == 400 and "text_input" in refused.value.read().decode()  # the size limit, named
    with urllib.request.urlopen(f"{server.http_url}/v2/health/ready", timeout=10) as response:
        assert response.status == 200


def test_a_deeply_nested_json_body_is_answered_and_the_server_lives_on(server):
    """Triton 2.51 parses a request's JSON recursively on its HTTP thread's stack: with a 64 MiB stack limit a
    500 KB body of nested brackets crashed the whole server (SIGSEGV)."""
    depth = 1_000_000  # a 2 MB body
    body = ('{"text_input": ' + "[" * depth + "]" * depth + ', "max_tokens": 1}').encode()
    request = urllib.request.Request(f"{server.http_url}/v2/models/prepos_http/generate", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=120)
    assert refused.value.code == 400 and "text_input" in refused.value.read().decode()
    with urllib.request.urlopen(f"{server.http_url}/v2/health/ready", timeout=10) as response:
        assert response.status == 200


@pytest.mark.parametrize("body", [b'{"text_input": "hi", "max_tokens": 1, "\xff\xfe": 1}',
                                  b'{"text_input": "hi", "max_tokens": 1, "timeout": "\xff"}'],
                         ids=["key", "value"])
def test_a_parameter_that_is_not_utf8_is_refused_naming_the_parameters(server, body):
    """A body key that is not an input becomes a request parameter, which the Python stub fails to decode where it is
    not UTF-8: that was answered as the bridge's own fault (INTERNAL), naming nothing, and counted as one."""
    counted = server.metric("prepos_request_errors_total", model="prepos_http", field="parameters")
    internal = server.metric("prepos_request_errors_total", model="prepos_http", field="request")
    request = urllib.request.Request(f"{server.http_url}/v2/models/prepos_http/generate", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=120)
    text = refused.value.read().decode()
    assert refused.value.code == 400
    assert "parameters: not valid UTF-8 (byte 0xff at offset" in text and text.endswith('[INVALID_ARGUMENT]"}')
    assert server.metric("prepos_request_errors_total", model="prepos_http", field="parameters") == counted + 1
    assert server.metric("prepos_request_errors_total", model="prepos_http", field="request") == internal
    assert _generate(server, {"text_input": "Say yes.", "max_tokens": 1})[0] == 200


def test_a_queued_requests_deadline_error_reaches_that_request_not_the_one_still_answering(server):
    """The deadline error of a request queued behind a long answer goes out while that answer streams; a gRPC
    stream's error carries no request id, so it names its request, and the client gives it to that one."""
    from prepos_client import PreposTimeout

    with Client(server.grpc_url) as client, client.session() as session:
        session.append("You are a storyteller.", role="system")
        long = session.generate("Tell a long story about a lighthouse.", max_tokens=48, speculate=False)
        short = session.generate("Say yes.", max_tokens=4, speculate=False, timeout_s=0.05)
        told = list(long)  # not the short request's error: this turn runs to its end
        assert told and told[-1].finish_reason in ("length", "stop")
        with pytest.raises(PreposTimeout) as timed_out:
            list(short)
        assert timed_out.value.accepted is False and '(request "' in str(timed_out.value)
        assert session.ask("And then?", max_tokens=2, speculate=False).text  # the session goes on


def test_a_stream_kept_alive_by_pings_outlives_think_time(server):
    """A proxy or client that pings its connection while its session thinks (Envoy's upstream keepalive in the Helm
    chart) keeps its stream: by gRPC's defaults the server took the third such ping as abuse and closed the
    connection (GOAWAY too_many_pings), ending every session stream on it."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url, keepalive_options=grpcclient.KeepAliveOptions(
        keepalive_time_ms=1500, keepalive_permit_without_calls=True, http2_max_pings_without_data=0))
    results: queue.Queue = queue.Queue()
    client.start_stream(lambda result, error: results.put((result, error)))

    def append(request_id: str, *, start: bool = False, end: bool = False):
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(_b("Noted."))
        max_tokens = grpcclient.InferInput("max_tokens", [1], "INT32")
        max_tokens.set_data_from_numpy(np.array([0], np.int32))
        client.async_stream_infer("prepos", [text, max_tokens], request_id=request_id, sequence_id="kept-alive",
                                  sequence_start=start, sequence_end=end)
        return results.get(timeout=30)

    try:
        assert append("1", start=True)[1] is None
        time.sleep(7.5)  # five pings while the server sends nothing
        assert results.empty()  # no error: the connection is still up
        result, error = append("2", end=True)
        assert error is None and result.as_numpy("finish_reason")[0] == b"appended"
    finally:
        client.stop_stream()
        client.close()
