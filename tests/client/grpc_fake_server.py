"""A tiny in-process gRPC server that speaks Triton's inference protocol like the prepos model.

It lets the client tests run the real tritonclient transport (streams,
metadata, request parameters) without starting Triton.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import numpy as np
from client_fakes import make_result
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype


def request_inputs(request: service_pb2.ModelInferRequest) -> dict[str, np.ndarray]:
    values = {}
    for tensor, raw in zip(request.inputs, request.raw_input_contents):
        if tensor.datatype == "BYTES":
            array = deserialize_bytes_tensor(raw)
        else:
            array = np.frombuffer(raw, dtype=triton_to_np_dtype(tensor.datatype))
        values[tensor.name] = array.reshape(list(tensor.shape))
    return values


class FakePreposServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Echoes deltas back; `max_tokens` < 0 is rejected; special deltas exercise stream shapes.

    `EMPTY_FINAL`: one chunk, then a flags-only final response.
    `SPLIT`: "✓✓" sent in two chunks split inside a character.
    `SLOW`: answered after a second.
    """

    def __init__(self) -> None:
        self.stream_metadata: list[dict[str, str]] = []
        self.requests: list[service_pb2.ModelInferRequest] = []
        self.num_open_streams = 0
        self._lock = threading.Lock()

    def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=request.name == "prepos")

    def ModelStreamInfer(self, request_iterator, context):
        self.stream_metadata.append(dict(context.invocation_metadata()))
        with self._lock:
            self.num_open_streams += 1
        context.add_callback(self._stream_ended)
        for request in request_iterator:
            self.requests.append(request)
            for response in self._respond(request):
                yield response

    def _stream_ended(self) -> None:
        with self._lock:
            self.num_open_streams -= 1

    def _respond(self, request):
        inputs = request_inputs(request)
        request_id = request.id
        max_tokens = int(inputs["max_tokens"][0]) if "max_tokens" in inputs else 16
        text = inputs["text_input"][0].decode() if "text_input" in inputs else ""
        if max_tokens < 0:
            return [service_pb2.ModelStreamInferResponse(error_message=f"max_tokens: must be >= 0, got {max_tokens} [INVALID_ARGUMENT]")]
        if max_tokens == 0:
            closing = request.parameters["sequence_end"].bool_param and "text_input" not in inputs
            return [
                self._stream_response(
                    request_id,
                    text="",
                    ids=[],
                    path="close" if closing else "append",
                    confidence=float("nan"),
                    finish_reason="closed" if closing else "appended",
                    final=True,
                )
            ]
        if text == "EMPTY_FINAL":
            return [
                self._stream_response(request_id, text="a", ids=[1], path="exact", confidence=0.9, final=False),
                self._stream_response(request_id, final=True),
            ]
        if text == "SLOW":
            time.sleep(1.0)
        if text == "SPLIT":
            raw = "✓✓".encode()
            return [
                self._stream_response(request_id, text=raw[:4], ids=[1], path="prefix", final=False),
                self._stream_response(request_id, text=raw[4:], ids=[2], path="prefix", finish_reason="length",
                                      final=True),
            ]
        return [
            self._stream_response(request_id, text=text, ids=[7], path="prefix", confidence=0.5, finish_reason="stop",
                                  queue_ms=0.1, compute_ms=0.2, first_token_ms=0.3, final=True)
        ]

    @staticmethod
    def _stream_response(request_id: str, **outputs) -> service_pb2.ModelStreamInferResponse:
        return service_pb2.ModelStreamInferResponse(infer_response=make_result(request_id, **outputs).get_response())


class FakePreposServer:
    """Runs `FakePreposServicer` on a free loopback port until `stop`."""

    def __init__(self) -> None:
        self.servicer = FakePreposServicer()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self.servicer, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.url = f"127.0.0.1:{port}"
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None)
