"""Buffered metrics: what requests record reaches the sink once, summed, when the engine loop publishes it."""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

from prepos.metrics import BufferedSink, MemorySink
from test_scheduler import Harness, open_session


def test_a_buffered_sink_publishes_sums_last_values_and_every_observation_once():
    target = MemorySink()
    sink = BufferedSink(target)
    sink.inc("requests", {"path": "gated"}, 1)
    sink.inc("requests", {"path": "gated"}, 2)
    sink.inc("requests", {"path": "exact"}, 1)
    sink.set("kv", {}, 10)
    sink.set("kv", {}, 7)
    sink.observe("ttft", {"path": "gated"}, 0.2)
    sink.observe("ttft", {"path": "gated"}, 0.3)
    assert target.values == {} and target.observations == {}  # nothing before the flush
    sink.flush()
    assert target.get("requests", path="gated") == 3 and target.get("requests", path="exact") == 1
    assert target.get("kv") == 7
    assert target.observations["ttft", (("path", "gated"),)] == [0.2, 0.3]
    sink.flush()  # a second flush publishes nothing again
    assert target.get("requests", path="gated") == 3 and len(target.observations["ttft", (("path", "gated"),)]) == 2


class CountingSink(MemorySink):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def set(self, name, labels, value) -> None:
        self.calls += 1
        super().set(name, labels, value)


def test_a_gauge_is_published_again_only_when_its_value_changes():
    target = CountingSink()
    sink = BufferedSink(target)
    for _ in range(3):  # housekeeping sets the same gauges every time
        sink.set("sessions", {"state": "idle"}, 2)
        sink.set("kv", {}, 100)
        sink.flush()
    assert target.calls == 2 and target.get("sessions", state="idle") == 2
    sink.set("kv", {}, 120)
    sink.set("sessions", {"state": "idle"}, 2)
    sink.set("sessions", {"state": "decoding"}, 1)  # a new label set is a new gauge
    sink.flush()
    assert target.calls == 4 and target.get("kv") == 120 and target.get("sessions", state="decoding") == 1
    sink.set("kv", {}, 100)  # back to a value published before: it is published again
    sink.flush()
    assert target.calls == 5 and target.get("kv") == 100


def test_increments_racing_a_flush_are_neither_lost_nor_counted_twice():
    target = MemorySink()
    sink = BufferedSink(target)
    done = threading.Event()

    def record():
        for _ in range(5000):
            sink.inc("requests", {"path": "exact"}, 1)

    def publish():
        while not done.is_set():
            sink.flush()

    flusher = threading.Thread(target=publish)
    flusher.start()
    workers = [threading.Thread(target=record) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.set()
    flusher.join()
    sink.flush()
    assert target.get("requests", path="exact") == 20_000


def test_the_loop_publishes_at_housekeeping_under_load_and_when_it_goes_idle(tmp_path):
    h = Harness(tmp_path)
    target = MemorySink()
    h.metrics.sink = BufferedSink(target)
    open_session(h)
    h.serve(h.request("s1", "hello", max_tokens=2))
    assert target.get("prepos_requests_total", path="prefix") == 0  # recorded, not yet published
    h.clock.t += 1.0  # past the next housekeeping: the loop publishes even while it has work
    h.sched.run_once()
    assert target.get("prepos_requests_total", path="prefix") == 1
    assert target.get("prepos_kv_bytes") > 0

    h.sched.start()  # the loop thread: it publishes as soon as it has nothing left to do
    try:
        sink = h.submit(h.request("s1", "again", max_tokens=2))
        deadline = time.monotonic() + 10
        while target.get("prepos_requests_total", path="prepaid") + target.get("prepos_requests_total",
                                                                                 path="prefix") < 2:
            assert time.monotonic() < deadline, "the idle loop never published the second request"
            time.sleep(0.01)
        assert sink.done
    finally:
        h.sched.stop()


def test_known_counter_series_are_published_at_zero_and_no_event_falls_outside_them(tmp_path):
    from prepos.metrics import SPECS, Metrics

    fresh = Metrics(MemorySink())
    for spec in SPECS:
        if spec.kind == "counter" and not spec.labels:
            assert (spec.name, ()) in fresh.sink.values
        for value in spec.values:
            assert fresh.sink.values[spec.name, ((spec.labels[0], value),)] == 0.0
    assert fresh.sink.values["prepos_gate_suspended", ()] == 0.0  # a gauge with a value from the start
    assert ("prepos_gate_false_accept_upper_bound", ()) not in fresh.sink.values  # none before the first audit
    h = Harness(tmp_path, threshold=0.0, kv_budget=100 * 120)  # a gate that fires, a budget that evicts
    for sid in ("s1", "s2", "s3"):
        open_session(h, sid)
        h.serve(h.request(sid, "hello", max_tokens=3))
        h.idle()
        h.serve(h.request(sid, "and then?", max_tokens=2))
        h.serve(h.request(sid, "", max_tokens=2))
    h.serve(h.request("s1", None, end=True, max_tokens=0))
    known = {spec.name: (spec.labels[0], set(spec.values)) for spec in SPECS if spec.values}
    seen = set()
    for name, labels in h.metrics.sink.values:
        if name in known:
            label, values = known[name]
            assert dict(labels)[label] in values, (name, labels)
            seen.add((name, dict(labels)[label]))
    assert ("prepos_requests_total", "gated") in seen and ("prepos_requests_total", "close") in seen


def test_refusals_by_every_input_and_by_the_servers_state_are_published_at_zero():
    from prepos.metrics import Metrics
    from prepos.protocol import CONTROL_NAMES, INPUT_NAMES

    metrics = Metrics(MemorySink())
    metrics.publish_error_fields((*INPUT_NAMES, *CONTROL_NAMES))
    for field in (*INPUT_NAMES, "START", "END", "journal", "timeout", "request"):
        assert metrics.sink.values["prepos_request_errors_total", (("field", field),)] == 0.0
    metrics.request_rejected("journal")
    assert metrics.sink.get("prepos_request_errors_total", field="journal") == 1


def _fields_named(source: Path) -> set[str]:
    """The fields that the ``ProtocolError(...)`` calls of a source file name as a string literal."""
    calls = (node for node in ast.walk(ast.parse(source.read_text())) if isinstance(node, ast.Call))
    return {call.args[0].value for call in calls
            if getattr(call.func, "id", None) == "ProtocolError" and call.args
            and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)}


def test_every_field_a_refusal_names_is_published_at_zero_by_the_model_that_refuses():
    import prepos
    from prepos.bridge import ERROR_FIELDS
    from prepos.metrics import SERVER_STATE_FIELDS
    from prepos.protocol import CONTROL_NAMES, INPUT_NAMES

    backend = Path(prepos.__file__).parent
    repository = backend.parents[1] / "model_repository"
    published = {"prepos": {*INPUT_NAMES, *CONTROL_NAMES, *SERVER_STATE_FIELDS}, "prepos_http": set(ERROR_FIELDS)}
    named = {"prepos": set(), "prepos_http": set()}
    for source in [*backend.rglob("*.py"), repository / "prepos/1/model.py"]:
        named["prepos_http" if source.name == "bridge.py" else "prepos"] |= _fields_named(source)
    named["prepos_http"] |= _fields_named(repository / "prepos_http/1/model.py")
    for model in named:
        assert named[model] and named[model] <= published[model], (model, named[model] - published[model])
    assert {"model", "correlation_id", "journal"} <= named["prepos"]  # what a refusal of the server's state names
    assert {"session_id", "timeout", "resume"} <= named["prepos_http"]


def test_the_bridge_counts_its_own_refusals_by_field_with_every_field_at_zero_from_the_start():
    from prepos.bridge import ERROR_FIELDS
    from prepos.metrics import RefusalCounter

    sink = MemorySink()
    counter = RefusalCounter(sink, ERROR_FIELDS)
    assert {labels for name, labels in sink.values} == {(("field", field),) for field in ERROR_FIELDS}
    assert set(sink.values.values()) == {0.0}
    for field in ("session_id", "session_id", "max_tokens"):
        counter.refused(field)
    assert sink.get("prepos_request_errors_total", field="session_id") == 2
    assert sink.get("prepos_request_errors_total", field="max_tokens") == 1
    assert sink.get("prepos_request_errors_total", field="timeout") == 0


class _FakeFamily:
    """``pb_utils.MetricFamily`` as far as the sink uses it: families made, and each metric's labels and value."""

    COUNTER, GAUGE, HISTOGRAM = "counter-kind", "gauge-kind", "histogram-kind"
    made: list[tuple[str, str, str]] = []

    def __init__(self, name, description, kind):
        self.made.append((name, description, kind))
        self.metrics = []

    def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils's name
        metric = _FakeMetric(labels, buckets)
        self.metrics.append(metric)
        return metric


class _FakeMetric:
    def __init__(self, labels, buckets):
        self.labels, self.buckets, self.values = labels, buckets, []

    def increment(self, value):
        self.values.append(value)

    set = observe = increment


def test_the_triton_sink_labels_every_series_with_its_model_and_makes_each_series_once(monkeypatch):
    from prepos import triton_metrics
    from prepos.metrics import SPECS, RefusalCounter

    monkeypatch.setattr(triton_metrics, "server_alive", lambda: True)
    monkeypatch.setattr(_FakeFamily, "made", [])
    sink = triton_metrics.TritonMetricsSink("prepos_http", _FakeFamily)
    counter = RefusalCounter(sink, ("session_id", "timeout"))
    counter.refused("session_id")
    counter.refused("session_id")
    errors = next(spec for spec in SPECS if spec.name == "prepos_request_errors_total")
    # The same family as the prepos model declares: Triton keeps one, told apart by the model label.
    assert _FakeFamily.made == [(errors.name, errors.description, _FakeFamily.COUNTER)]
    family = sink._families[errors.name]
    assert [(m.labels, m.values) for m in family.metrics] == [
        ({"model": "prepos_http", "field": "session_id"}, [0, 1, 1]),
        ({"model": "prepos_http", "field": "timeout"}, [0]),
    ]
    histogram = next(spec for spec in SPECS if spec.kind == "histogram")
    sink.declare(histogram)
    sink.observe(histogram.name, {}, 2.5)
    (metric,) = sink._families[histogram.name].metrics
    assert metric.buckets == list(histogram.buckets) and metric.values == [2.5]
    monkeypatch.setattr(triton_metrics, "server_alive", lambda: False)  # tritonserver gone: updates dropped
    counter.refused("timeout")
    assert family.metrics[1].values == [0]


def test_the_bridges_relays_are_published_by_state_from_a_thread_of_their_own_when_they_change():
    from prepos.metrics import RelayGauge

    sink = MemorySink()
    relays = RelayGauge(sink, interval_s=0.01)
    assert sink.get("prepos_bridge_relays", state="relaying") == 0 and ("prepos_bridge_relays", (
        ("state", "waiting"),)) in sink.values  # both there from the start
    for _ in range(3):
        relays.queued()
    relays.started()
    relays.started()
    relays.finished()
    assert sink.get("prepos_bridge_relays", state="waiting") == 0  # nothing published on a request's thread
    relays.start()
    try:
        deadline = time.monotonic() + 10
        while sink.get("prepos_bridge_relays", state="waiting") != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sink.get("prepos_bridge_relays", state="waiting") == 1
        assert sink.get("prepos_bridge_relays", state="relaying") == 1
    finally:
        relays.stop()
    relays.started()
    relays.finished()
    relays.finished()
    time.sleep(0.05)
    assert sink.get("prepos_bridge_relays", state="relaying") == 1  # stopped: nothing published any more


def test_every_metric_family_is_documented_in_the_readme():
    from prepos.metrics import SPECS

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert [spec.name for spec in SPECS if f"`{spec.name}" not in readme] == []


def test_the_triton_sink_calls_into_the_stub_holding_its_lock(monkeypatch):
    # The HTTP bridge's threads call into its stub one at a time (model_repository/prepos_http): metrics too.
    import threading

    from prepos import triton_metrics
    from prepos.metrics import SPECS

    lock = threading.RLock()
    held = []
    monkeypatch.setattr(triton_metrics, "server_alive", lambda: True)
    monkeypatch.setattr(_FakeMetric, "increment", lambda self, value: held.append(lock._is_owned()))
    monkeypatch.setattr(_FakeMetric, "set", lambda self, value: held.append(lock._is_owned()))
    sink = triton_metrics.TritonMetricsSink("prepos_http", _FakeFamily, lock=lock)
    gauge = next(spec for spec in SPECS if spec.kind == "gauge")
    sink.declare(gauge)
    sink.inc(gauge.name, {}, 1)
    sink.set(gauge.name, {}, 2)
    assert held == [True, True] and not lock._is_owned()
