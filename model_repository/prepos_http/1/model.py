"""Triton adapter of the HTTP bridge (``prepos.bridge``): a request in, the same request to ``prepos`` as its session.

Each request is relayed on a thread of its own (a BLS call to a decoupled model blocks while it streams), so
long answers do not hold up other sessions' requests; their calls into the stub go one at a time (``IPC``). All logic lives in ``prepos.bridge``; this file only converts.
"""

import json
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import triton_python_backend_utils as pb_utils

try:
    import prepos  # noqa: F401  (installed into the environment)
except ImportError:  # running from a source checkout: model_repository/prepos_http/1/model.py -> backend/
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "backend"))

from prepos.bridge import (BRIDGE_PARAMETER, CHECKED_INPUTS, ERROR_FIELDS, NARROWED_INPUTS, absent_outputs,
                           bridge_target, forwarded_inputs, merge_responses, narrowed_inputs, read_bridge_config,
                           relayed_error, request_parameters, target_in_repository, triton_refusal)
from prepos.heap import settle_heap
from prepos.metrics import RefusalCounter, RelayGauge
from prepos.protocol import ProtocolError, Status, triton_error
from prepos.stub import server_alive
from prepos.supervise import BLS_THREADS
from prepos.triton_metrics import TritonMetricsSink

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
IPC = threading.RLock()
"""Held around every call the relay threads make into the backend stub (response senders, BLS requests, tensors;
not the BLS call itself, which waits for Triton to take the request, nor the wait for prepos's next response,
which would hold up every other relay): one at a time. Made from many threads at once, while HTTP clients
dropped their requests, they corrupted the stub's heap (``malloc(): unaligned fastbin chunk detected``; once
tritonserver itself aborted): 3 times in under 70 rounds of 16 dropped requests; with the lock, not in 120 rounds
(``make stress-http``)."""
log = logging.getLogger("prepos.bridge")


class TritonPythonModel:
    def initialize(self, args):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        settings = read_bridge_config(parameters, os.environ)  # a bad value stops the model from loading
        if settings.max_streams >= BLS_THREADS:
            log.warning("bridge.max_streams is %d: unless tritonserver's --backend-config=python,thread-pool-size is "
                        "above it (the launcher sets %d), requests queued on one session hold up other sessions'",
                        settings.max_streams, BLS_THREADS)
        self.target_model = settings.target_model
        if not target_in_repository(args["model_repository"], self.target_model):
            log.warning("bridge.target_model %r is not a model of this repository (%s): unless another repository "
                        "holds it, every request will be refused as not ready", self.target_model,
                        os.path.dirname(args["model_repository"]))
        self.outputs = [output["name"] for output in config["output"]]
        # The bridge's own refusals, and Triton's of the requests it relays: prepos counts its own.
        metrics = TritonMetricsSink(args["model_name"], pb_utils.MetricFamily, lock=IPC)
        self.refusals = RefusalCounter(metrics, ERROR_FIELDS)
        self.relays = RelayGauge(metrics)  # requests on a relay thread, and waiting for one
        self.relays.start()
        self.pool = ThreadPoolExecutor(max_workers=settings.max_streams, thread_name_prefix="bridge")
        settle_heap()  # as in prepos: the relay's requests do not wait on walks of the startup objects

    def execute(self, requests):
        for request in requests:
            self.relays.queued()
            self.pool.submit(self._relay, request, time.perf_counter())
        return None

    def _relay(self, request, arrival_s):
        self.relays.started()
        try:
            self._relay_request(request, arrival_s)
        finally:
            self.relays.finished()

    def _relay_request(self, request, arrival_s):
        with IPC:
            sender = request.get_response_sender()
        try:
            with IPC:
                inputs = {tensor.name(): tensor for tensor in request.inputs()}
                checked = {name: tensor.as_numpy() for name, tensor in inputs.items() if name in CHECKED_INPUTS}
                narrowing = {name: inputs[name].as_numpy() for name in inputs if name in NARROWED_INPUTS}
                timeout = request.timeout()
            try:  # every check the bridge makes comes before anything reaches the session
                with IPC:
                    parameters = request_parameters(request.parameters)
                target = bridge_target(checked, parameters, timeout)
                narrowed = narrowed_inputs(narrowing)
            except ProtocolError as err:
                self.refusals.refused(err.field)  # counted before the answer: a scrape after it sees the refusal
                with IPC:
                    _send_error(sender, str(err), err.status)
                return
            flags = ((pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if target.start else 0)
                     | (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if target.end else 0))
            with IPC:
                forward = pb_utils.InferenceRequest(
                    model_name=self.target_model, requested_output_names=self.outputs,
                    inputs=[pb_utils.Tensor(name, narrowed[name]) if name in narrowed else inputs[name]
                            for name in forwarded_inputs(list(inputs))],
                    correlation_id=target.session_id, flags=flags, parameters={BRIDGE_PARAMETER: True},
                    timeout=target.timeout_us_left(time.perf_counter() - arrival_s))
            responses = iter(forward.exec(decoupled=True))  # waits for Triton to take the request: not under the lock
            held = []
            while True:
                try:
                    response = next(responses)  # waits for prepos: not under the lock
                except StopIteration:
                    break
                with IPC:
                    try:
                        if response.has_error():
                            error = response.error()
                            refusal = triton_refusal(error.message())  # None: prepos's own, which prepos counts
                            if refusal is not None:  # Triton's, before prepos saw it: counted here, its status added
                                field, status = refusal
                                self.refusals.refused(field)
                                if status is not None:
                                    error = triton_error(pb_utils.TritonError, error.message(), status)
                            sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
                            return
                        tensors = response.output_tensors()
                        # a cancelled client's request still runs to its end; no is_cancelled once the server is gone
                        if not tensors or not server_alive() or sender.is_cancelled():
                            continue
                        outputs = {tensor.name(): tensor.as_numpy() for tensor in tensors}
                        error = relayed_error(outputs)
                        if error is not None:  # an error after other responses (prepos.bridge), always the last
                            _send_error(sender, *error)
                            return
                        if target.stream:
                            unset = absent_outputs(outputs)
                            sender.send(pb_utils.InferenceResponse(
                                output_tensors=[t for t in tensors if t.name() not in unset]))
                        else:
                            held.append(outputs)
                    finally:  # what the stub made for this response is freed here, under the lock
                        response = tensors = outputs = None
            if not server_alive():
                return  # nobody to answer (see server_alive)
            with IPC:
                if sender.is_cancelled():  # its client is gone; the final flag still closes the response sender
                    sender.send(flags=FINAL)
                    return
                merged = merge_responses(held)
                if merged:
                    response = pb_utils.InferenceResponse(
                        output_tensors=[pb_utils.Tensor(n, v) for n, v in merged.items()])
                    sender.send(response, flags=FINAL)
                else:
                    sender.send(flags=FINAL)
        except Exception as err:  # noqa: BLE001 - the client gets an answer, never a hang
            log.exception("relaying a request to %s failed", self.target_model)
            with IPC:
                _send_error(sender, f"prepos_http: {err}", Status.INTERNAL)
            self.refusals.refused("request")  # after the answer: the client has one whatever this does
        finally:  # the stub's objects this relay made (the BLS call's included) are freed under the lock too
            with IPC:
                forward = responses = held = inputs = response = tensors = outputs = None

    def finalize(self):
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.relays.stop()


def _send_error(sender, message, status):
    """Answer a request with an error, its final response (under ``IPC``)."""
    sender.send(pb_utils.InferenceResponse(error=triton_error(pb_utils.TritonError, message, status)), flags=FINAL)
