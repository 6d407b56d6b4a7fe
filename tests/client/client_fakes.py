"""Hand-built Triton responses and a fake gRPC client for the client tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import (
    InferenceServerException,
    deserialize_bytes_tensor,
    serialize_byte_tensor,
    triton_to_np_dtype,
)


def make_result(
    request_id: str = "1",
    *,
    text: bytes | str | None = None,
    ids: list[int] | None = None,
    path: str | None = None,
    confidence: float | None = None,
    finish_reason: str | None = None,
    queue_ms: float | None = None,
    compute_ms: float | None = None,
    first_token_ms: float | None = None,
    final: bool | None = None,
) -> InferResult:
    """An InferResult as tritonclient builds it from the wire (outputs in raw_output_contents)."""
    response = service_pb2.ModelInferResponse(model_name="prepos", id=request_id)

    def add(name: str, datatype: str, array: np.ndarray) -> None:
        output = response.outputs.add()
        output.name = name
        output.datatype = datatype
        output.shape.extend(array.shape)
        if datatype == "BYTES":
            raw = serialize_byte_tensor(array).item() if array.size else b""
        else:
            raw = array.tobytes()
        response.raw_output_contents.append(raw)

    def add_str(name: str, value: bytes | str | None) -> None:
        if value is not None:
            raw = value.encode("utf-8") if isinstance(value, str) else value
            add(name, "BYTES", np.array([raw], dtype=np.object_))

    def add_fp32(name: str, value: float | None) -> None:
        if value is not None:
            add(name, "FP32", np.array([value], dtype=np.float32))

    add_str("text_output", text)
    if ids is not None:
        add("output_ids", "INT32", np.array(ids, dtype=np.int32))
    add_str("path", path)
    add_fp32("confidence", confidence)
    add_str("finish_reason", finish_reason)
    add_fp32("queue_ms", queue_ms)
    add_fp32("compute_ms", compute_ms)
    add_fp32("first_token_ms", first_token_ms)
    if final is not None:
        response.parameters["triton_final_response"].bool_param = final
    return InferResult(response)


def decode_input(infer_input) -> np.ndarray:
    """The numpy value an InferInput carries on the wire."""
    raw = infer_input._get_content()
    if infer_input.datatype() == "BYTES":
        values = deserialize_bytes_tensor(raw)
    else:
        values = np.frombuffer(raw, dtype=triton_to_np_dtype(infer_input.datatype()))
    return values.reshape(list(infer_input.shape()))


@dataclass
class SentRequest:
    """One request the fake client was asked to send."""

    inputs: dict[str, np.ndarray]
    request_id: str
    sequence_id: str | int
    sequence_start: bool
    sequence_end: bool
    enable_empty_final_response: bool


def echo_responder(request: SentRequest) -> list:
    """Answer like the server: an ack for max_tokens=0, else the delta echoed in one final chunk."""
    max_tokens = request.inputs.get("max_tokens")
    if max_tokens is not None and int(max_tokens[0]) == 0:
        closing = request.sequence_end and "text_input" not in request.inputs
        return [
            make_result(
                request.request_id,
                text="",
                ids=[],
                path="close" if closing else "append",
                confidence=float("nan"),
                finish_reason="closed" if closing else "appended",
                final=True,
            )
        ]
    text = request.inputs["text_input"][0].decode() if "text_input" in request.inputs else ""
    return [
        make_result(
            request.request_id,
            text=text,
            ids=[7],
            path="prefix",
            confidence=0.5,
            finish_reason="length",
            final=True,
        )
    ]


@dataclass
class FakeTriton:
    """Stands in for tritonclient.grpc.InferenceServerClient: replies through the stream callback."""

    url: str
    responder: Callable[[SentRequest], list] = echo_responder
    requests: list[SentRequest] = field(default_factory=list)
    stream_headers: list[dict] = field(default_factory=list)
    stop_calls: list[bool] = field(default_factory=list)
    callback: Callable | None = None
    closed: bool = False
    fail_enqueue: bool = False
    ready: Callable[[], bool] | None = None  # answers is_model_ready (None: ready); may raise, as for no server
    num_ready_checks: int = 0

    def start_stream(self, callback, stream_timeout=None, headers=None, compression_algorithm=None):
        assert self.callback is None, "one stream per client"
        self.callback = callback
        self.stream_headers.append(dict(headers or {}))

    def async_stream_infer(
        self,
        model_name,
        inputs,
        model_version="",
        outputs=None,
        request_id="",
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        enable_empty_final_response=False,
        priority=0,
        timeout=None,
        parameters=None,
    ):
        assert self.callback is not None, "stream not started"
        if self.fail_enqueue:
            self.callback(result=None, error=unavailable())
            raise InferenceServerException("The stream is no longer in valid state")
        request = SentRequest(
            {infer_input.name(): decode_input(infer_input) for infer_input in inputs},
            request_id,
            sequence_id,
            sequence_start,
            sequence_end,
            enable_empty_final_response,
        )
        self.requests.append(request)
        for item in self.responder(request):
            if isinstance(item, InferenceServerException):
                self.callback(result=None, error=item)
            else:
                self.callback(result=item, error=None)

    def is_server_live(self, headers=None, client_timeout=None):
        return True  # a server that is down shows in is_model_ready (see `ready`)

    def is_model_ready(self, model_name, model_version="", headers=None, client_timeout=None):
        self.num_ready_checks += 1
        return True if self.ready is None else self.ready()

    def stop_stream(self, cancel_requests=False):
        self.stop_calls.append(cancel_requests)
        self.callback = None

    def close(self):
        self.closed = True


def unavailable() -> InferenceServerException:
    return InferenceServerException(msg="failed to connect to all addresses", status="StatusCode.UNAVAILABLE")


class SessionRules:
    """A responder that keeps sessions like the server: START opens one (refused while it is open, unless it
    carries `resume`, which continues it), a request without START needs an open session, END closes it. A
    request whose text starts with "SLOW" gets no response until `finish_held` answers it, as the server does
    when its deadline passes (an error, and a START it carried opens nothing) or when its final response was
    already on its way (accepted). `accepted` lists the texts of the turns taken, in order."""

    def __init__(self, answer: Callable[[SentRequest], list] = echo_responder):
        self.answer = answer
        self.open_ids: set = set()
        self.held: list[SentRequest] = []
        self.accepted: list[str] = []

    def __call__(self, request: SentRequest) -> list:
        if request.sequence_start:
            resume = request.inputs.get("resume")
            if request.sequence_id in self.open_ids and not (resume is not None and resume[0]):
                return [InferenceServerException(msg=f"START: session {request.sequence_id!r} is already open")]
            self.open_ids.add(request.sequence_id)
        elif request.sequence_id not in self.open_ids:
            return [InferenceServerException(
                msg=f"START: session {request.sequence_id!r} is not open; send START with its first request")]
        text = request.inputs.get("text_input")
        if text is not None and text[0].startswith(b"SLOW"):
            self.held.append(request)
            return []
        if request.sequence_end:
            self.open_ids.discard(request.sequence_id)
        if text is not None:
            self.accepted.append(text[0].decode())
        return self.answer(request)

    def finish_held(self, fake: FakeTriton, *, accepted: bool) -> None:
        """Answer the oldest held request through `fake`'s stream."""
        request = self.held.pop(0)
        if accepted:
            self.accepted.append(request.inputs["text_input"][0].decode())
            if request.sequence_end:
                self.open_ids.discard(request.sequence_id)
            result = make_result(request.request_id, text="late", ids=[7], path="prefix", finish_reason="length",
                                 final=True)
            fake.callback(result=result, error=None)
            return
        if request.sequence_start or request.sequence_end:
            self.open_ids.discard(request.sequence_id)  # a stopped START opens nothing; END always closes
        fake.callback(result=None, error=InferenceServerException(
            msg="timeout: the request's deadline passed before it finished; its turn was not accepted"))


# The server's refusals, as a client receives them
NOT_HELD = ("[request id: 3] inference request for sequence s to model 'prepos' must specify the START flag on the "
            "first request of the sequence")
DRAINING = "START: the server is draining before it stops: no session opens or resumes here now; resume ..."
UNLOADED = "Request for unknown model: 'prepos' has no available versions"
NO_JOURNAL = ("resume: session 's' is not open on this server and has no journal to reopen it from; send START "
              "without resume to begin a new session")


class RestartingServer:
    """One server through a stop and a restart. It serves by `SessionRules` while "up"; `stop` makes it go, at
    each look at its readiness, through the phases given: "draining" (the model ready, every session ended,
    every START refused), "unloaded" (Triton's refusal of a model it no longer serves), "down" (nothing to
    connect to) and "up" again (a new server: no session held, each journaled one reopened by START and
    `resume`)."""

    def __init__(self, *, journal: bool = True):
        self.rules = SessionRules()
        self.journal = journal
        self.phase = "up"
        self.coming: list[str] = []
        self.refusal_when_down = unavailable()

    def stop(self, *phases: str) -> None:
        self.phase, *self.coming = phases
        self.rules.open_ids.clear()  # the drain ended every session

    def ready(self) -> bool:
        if self.coming:
            self.phase = self.coming.pop(0)
        if self.phase == "down":
            raise unavailable()
        return self.phase != "unloaded"

    def __call__(self, request: SentRequest) -> list:
        resume = "resume" in request.inputs and bool(request.inputs["resume"][0])
        if self.phase == "down":
            return [self.refusal_when_down]
        if self.phase == "unloaded":
            return [InferenceServerException(msg=UNLOADED)]
        if not request.sequence_start and request.sequence_id not in self.rules.open_ids:
            return [InferenceServerException(msg=NOT_HELD)]
        if self.phase == "draining" and request.sequence_start:
            return [InferenceServerException(msg=DRAINING)]
        if resume and not self.journal and request.sequence_id not in self.rules.open_ids:
            return [InferenceServerException(msg=NO_JOURNAL)]
        return self.rules(request)
