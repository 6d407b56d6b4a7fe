"""A metrics sink on Triton's metrics port (Python backend custom metrics), for the models in this repository.

Used only inside a Triton Python backend stub: the model adapter passes ``pb_utils.MetricFamily`` in, so this
module imports nothing of Triton's and loads anywhere."""

from __future__ import annotations

import contextlib
from typing import Any

from prepos.metrics import MetricSpec
from prepos.stub import server_alive


class TritonMetricsSink:
    """Creates one metric family per spec and one metric per label set, labelled with the model name. Once
    tritonserver is gone, updates are dropped (see :func:`server_alive`).

    ``metric_family`` is ``pb_utils.MetricFamily``, which the stub binds only once the model is initialised: build
    the sink in ``initialize``. Two models may declare the same family (same name, kind and description): Triton
    keeps one, and each model's series carry its ``model`` label. ``lock``, where given, is held around every call
    into the stub (a model whose threads must call into it one at a time: the HTTP bridge)."""

    def __init__(self, model_name: str, metric_family: Any, lock: Any = None):
        self._model = model_name
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._metric_family = metric_family
        self._families: dict[str, Any] = {}
        self._buckets: dict[str, list[float] | None] = {}
        self._metrics: dict[tuple, Any] = {}

    def declare(self, spec: MetricSpec) -> None:
        kind = getattr(self._metric_family, spec.kind.upper())
        with self._lock:
            self._families[spec.name] = self._metric_family(name=spec.name, description=spec.description, kind=kind)
        self._buckets[spec.name] = list(spec.buckets) or None

    def _metric(self, name: str, labels: dict[str, str]) -> Any:
        key = (name, tuple(sorted(labels.items())))
        metric = self._metrics.get(key)
        if metric is None:
            full = {"model": self._model, **labels}
            buckets = self._buckets[name]
            family = self._families[name]
            metric = family.Metric(labels=full, buckets=buckets) if buckets else family.Metric(labels=full)
            self._metrics[key] = metric
        return metric

    def inc(self, name: str, labels: dict[str, str], value: float) -> None:
        if server_alive():
            with self._lock:
                self._metric(name, labels).increment(value)

    def set(self, name: str, labels: dict[str, str], value: float) -> None:
        if server_alive():
            with self._lock:
                self._metric(name, labels).set(value)

    def observe(self, name: str, labels: dict[str, str], value: float) -> None:
        if server_alive():
            with self._lock:
                self._metric(name, labels).observe(value)
