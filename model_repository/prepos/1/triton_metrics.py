"""The core's metrics sink on Triton's metrics port (Python backend custom metrics)."""

import triton_python_backend_utils as pb_utils

from prepos.stub import server_alive


def _kind(name):
    # Looked up at use: the stub binds MetricFamily only once the model is initialised.
    return getattr(pb_utils.MetricFamily, name.upper())


class TritonMetricsSink:
    """Creates one metric family per spec and one metric per label set, labelled with the model name. Once
    tritonserver is gone, updates are dropped (see :func:`server_alive`)."""

    def __init__(self, model_name: str):
        self._model = model_name
        self._families = {}
        self._buckets = {}
        self._metrics = {}

    def declare(self, spec) -> None:
        self._families[spec.name] = pb_utils.MetricFamily(
            name=spec.name, description=spec.description, kind=_kind(spec.kind)
        )
        self._buckets[spec.name] = list(spec.buckets) or None

    def _metric(self, name, labels):
        key = (name, tuple(sorted(labels.items())))
        metric = self._metrics.get(key)
        if metric is None:
            full = {"model": self._model, **labels}
            buckets = self._buckets[name]
            family = self._families[name]
            metric = family.Metric(labels=full, buckets=buckets) if buckets else family.Metric(labels=full)
            self._metrics[key] = metric
        return metric

    def inc(self, name, labels, value) -> None:
        if server_alive():
            self._metric(name, labels).increment(value)

    def set(self, name, labels, value) -> None:
        if server_alive():
            self._metric(name, labels).set(value)

    def observe(self, name, labels, value) -> None:
        if server_alive():
            self._metric(name, labels).observe(value)
