"""Triton adapter for prepos: tensors -> core requests -> Triton responses.

All logic lives in the ``prepos`` core package; this file only converts.
"""

import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

try:
    import prepos  # noqa: F401  (installed into the environment)
except ImportError:  # running from a source checkout: model_repository/prepos/1/model.py -> backend/
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "backend"))

from prepos.config import check_model_config, sequence_slots
from prepos.core import Core
from prepos.drain import Drainer
from prepos.heap import settle_heap
from prepos.bridge import BRIDGE_PARAMETER, relayed_error_outputs
from prepos.protocol import CancelPoll, ProtocolError, Rejection, ResponseChunk, control_flags, triton_error
from prepos.stub import server_alive
from prepos.triton_metrics import TritonMetricsSink

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _triton_error(error: ProtocolError):
    # Looked up at use: the stub binds TritonError only once the model is initialised.
    return triton_error(pb_utils.TritonError, str(error), error.status)


class TritonSink:
    """Sends a request's response chunks through its decoupled response sender.

    ``bridged``: the request came from the HTTP bridge, whose Triton loses an error response that follows other
    responses (see ``prepos.bridge``); such an error goes to it as a final response of outputs instead."""

    def __init__(self, sender, bridged: bool = False):
        self._sender = sender
        self._bridged = bridged
        self._sent = False
        self._cancel_poll = CancelPoll(self._ask_cancelled)

    def _ask_cancelled(self) -> bool:
        return not server_alive() or self._sender.is_cancelled()

    def send(self, chunk: ResponseChunk, final: bool) -> None:
        if not server_alive():
            return  # nobody to send to (see server_alive)
        tensors = [
            pb_utils.Tensor("text_output", np.array([chunk.text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("output_ids", np.array(chunk.token_ids, dtype=np.int32)),
            pb_utils.Tensor("path", np.array([chunk.path.encode()], dtype=np.object_)),
            pb_utils.Tensor("confidence", np.array([chunk.confidence], dtype=np.float32)),
            pb_utils.Tensor("finish_reason", np.array([chunk.finish_reason.encode()], dtype=np.object_)),
            pb_utils.Tensor("queue_ms", np.array([chunk.queue_ms], dtype=np.float32)),
            pb_utils.Tensor("compute_ms", np.array([chunk.compute_ms], dtype=np.float32)),
            pb_utils.Tensor("first_token_ms", np.array([chunk.first_token_ms], dtype=np.float32)),
            pb_utils.Tensor("prefill_ms", np.array([chunk.prefill_ms], dtype=np.float32)),
            pb_utils.Tensor("decode_ms", np.array([chunk.decode_ms], dtype=np.float32)),
            pb_utils.Tensor("scan_ms", np.array([chunk.scan_ms], dtype=np.float32)),
        ]
        self._sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if final else 0)
        self._sent = True

    def cancelled(self) -> bool:
        return self._cancel_poll()

    def send_error(self, error: ProtocolError) -> None:
        if not server_alive():
            return
        if self._bridged and self._sent:
            tensors = [pb_utils.Tensor(name, value) for name, value in relayed_error_outputs(error).items()]
            self._sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL)
            return
        self._sender.send(pb_utils.InferenceResponse(output_tensors=[], error=_triton_error(error)), flags=FINAL)


class TritonPythonModel:
    def initialize(self, args):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        model_config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        check_model_config(model_config, parameters)
        idle_us = model_config.get("sequence_batching", {}).get("max_sequence_idle_microseconds")
        idle_s = int(idle_us) / 1e6 if idle_us else None
        if idle_s and "scheduler.session_idle_timeout_s" not in parameters:
            parameters["scheduler.session_idle_timeout_s"] = str(idle_s)
        model_dir = f"{args['model_repository']}"
        metrics = TritonMetricsSink(args["model_name"], pb_utils.MetricFamily)
        self.core = Core.from_parameters(parameters, model_dir, metrics,
                                         sequence_slots=sequence_slots(model_config), sequence_idle_s=idle_s)
        settle_heap()  # this process's startup objects leave the garbage collector's walks (see prepos.heap)
        self.core.start()
        drain_file = self.core.config.drain_file(model_dir)
        self.drainer = Drainer(drain_file, self.core.scheduler) if drain_file else None
        if self.drainer is not None:
            self.drainer.start()

    def execute(self, requests):
        for request in requests:
            arrival_s = time.perf_counter()
            parameters = json.loads(request.parameters() or "{}")
            sink = TritonSink(request.get_response_sender(), BRIDGE_PARAMETER in parameters)
            inputs = {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}
            try:
                timeout_us = request.timeout()  # the client's request timeout, 0 = none
                parsed = self.core.parse(inputs, session_id=request.correlation_id(), request_id=request.request_id(),
                                         arrival_s=arrival_s, timeout_s=timeout_us / 1e6 if timeout_us else None)
            except ProtocolError as err:
                start, end = control_flags(inputs)
                parsed = Rejection(request.correlation_id(), start, end, err)
            self.core.submit(parsed, sink, inline=True)
        return None

    def finalize(self):
        if self.drainer is not None:
            self.drainer.stop()
        self.core.stop()
