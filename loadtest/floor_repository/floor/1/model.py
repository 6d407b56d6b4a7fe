"""No-op decoupled model: the same hand-off as prepos (execute -> queue -> one thread -> response), no work."""

import queue
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def execute(self, requests):
        for request in requests:
            self._queue.put((time.perf_counter(), request.get_response_sender()))
        return None

    def _loop(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            arrival_s, sender = item
            elapsed_ms = (time.perf_counter() - arrival_s) * 1e3
            tensors = [
                pb_utils.Tensor("text_output", np.array([b""], dtype=np.object_)),
                pb_utils.Tensor("path", np.array([b"floor"], dtype=np.object_)),
                pb_utils.Tensor("finish_reason", np.array([b"stop"], dtype=np.object_)),
                pb_utils.Tensor("first_token_ms", np.array([elapsed_ms], dtype=np.float32)),
            ]
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        self._queue.put(None)
        self._thread.join(5)
