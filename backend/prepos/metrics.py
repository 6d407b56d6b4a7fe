"""Metric names and recording, decoupled from Triton by a small sink interface.

The Triton adapter supplies a sink backed by the Python backend's custom
metrics (served on Triton's metrics port); tests use :class:`MemorySink`.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from prepos.heap import CollectorPauses

FIRST_TOKEN_BUCKETS_MS = (0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
DECODE_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
GC_PAUSE_BUCKETS_MS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "counter", "gauge" or "histogram"
    description: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    values: tuple[str, ...] = ()
    """A counter's known values of its one label, published at 0 from the start (as is an unlabelled counter),
    so a scrape finds every series before its first event and rates start from 0."""
    initial: float | None = None
    """An unlabelled gauge's value from the start (None: none until its first event)."""


SERVER_STATE_FIELDS = ("journal", "timeout", "request", "model", "correlation_id")
"""The fields of refusals that name no input: the journal's disk, a deadline, an internal failure, the model's
state (no KV memory left, shutting down) and a request without a sequence id;
:meth:`Metrics.publish_error_fields` publishes them at 0 with the inputs'."""

SPECS = (
    MetricSpec("prepos_requests_total", "counter",
               "Client requests served to their end, by path (append and close included; rejected ones are in "
               "prepos_request_errors_total, stopped ones in prepos_requests_abandoned_total)", ("path",),
               values=("exact", "gated", "prepaid", "prefix", "rebuild", "append", "close")),
    MetricSpec("prepos_request_errors_total", "counter", "Requests rejected, by the input the error names", ("field",)),
    MetricSpec("prepos_first_token_ms", "histogram", "Server-side time from arrival to first response, by path (ms)",
               ("path",), FIRST_TOKEN_BUCKETS_MS),
    MetricSpec("prepos_gate_decisions_total", "counter", "Gate decisions on requests with a delta, by outcome", ("outcome",),
               values=("fired", "declined", "disabled")),
    MetricSpec("prepos_prepositionings_total", "counter", "Pre-positionings, by result", ("result",),
               values=("completed", "invalidated", "preempted", "abandoned")),
    MetricSpec("prepos_sessions", "gauge", "Open sessions, by state", ("state",)),
    MetricSpec("prepos_kv_bytes", "gauge",
               "KV cache bytes held: sessions' KV and positioned distributions, and the opening turns kept from "
               "closed sessions (prepos_kept_prefix_bytes)"),
    MetricSpec("prepos_kv_budget_bytes", "gauge", "KV cache budget in bytes"),
    MetricSpec("prepos_kept_prefix_bytes", "gauge",
               "KV bytes of the opening turns kept from closed sessions for later sessions to copy (in prepos_kv_bytes)"),
    MetricSpec("prepos_kv_evictions_total", "counter",
               "Evictions under the memory budget, by what went: speculative state or a session's whole KV", ("what",),
               values=("speculative", "kv")),
    MetricSpec("prepos_kv_blocks_total", "counter",
               "TensorRT-LLM engine: KV blocks of its requests, by outcome: reused (cached prefix), new (computed), "
               "missed (expected cached but evicted)", ("outcome",)),
    MetricSpec("prepos_shared_prefix_tokens_total", "counter",
               "Torch engine: prefix tokens whose KV a session copied from another session's (a system prompt they "
               "share) instead of computing them"),
    MetricSpec("prepos_prefill_tokens_total", "counter", "Tokens prefilled, by where the work ran", ("where",),
               values=("foreground", "background")),
    MetricSpec("prepos_engine_seconds_total", "counter",
               "Engine-loop seconds spent on requests (foreground) and on pre-positioning (background)", ("where",),
               values=("foreground", "background")),
    MetricSpec("prepos_decode_batch_sessions", "histogram",
               "Sessions in each decode step the engine ran (requests waiting to decode go in one batch)", (),
               DECODE_BATCH_BUCKETS),
    MetricSpec("prepos_prefill_batch_sessions", "histogram",
               "Sessions in each foreground prefill the engine ran (requests waiting to prefill go in one batch)", (),
               DECODE_BATCH_BUCKETS),
    MetricSpec("prepos_requests_abandoned_total", "counter",
               "Requests stopped before their end, by reason (cancelled, deadline); their turn is not accepted",
               ("reason",), values=("cancelled", "deadline")),
    MetricSpec("prepos_sessions_opened_total", "counter", "New sessions opened by a START (not a resume)"),
    MetricSpec("prepos_sessions_closed_total", "counter", "Sessions closed, by reason", ("reason",),
               values=("end", "idle_timeout", "drain", "taken_over", "start_rejected")),
    MetricSpec("prepos_sessions_recovered_total", "counter",
               "Sessions reopened from their journal (a resume, a request after a restart, a copy taken over)"),
    MetricSpec("prepos_sessions_drained_total", "counter",
               "Sessions ended by a drain before a stop, their journals kept (see prepos.drain)"),
    MetricSpec("prepos_sessions_taken_over_total", "counter",
               "Sessions whose copy here was dropped for their journal, which another server wrote since"),
    MetricSpec("prepos_journals_expired_total", "counter",
               "Journals of sessions no client came back for, deleted after journal.expire_s"),
    MetricSpec("prepos_turns_dropped_total", "counter", "Turns dropped from session logs by the context overflow policy"),
    MetricSpec("prepos_gate_audits_total", "counter",
               "Gated answers audited against the full path, by result (agreed, disagreed)", ("result",),
               values=("agreed", "disagreed")),
    MetricSpec("prepos_gate_audits_void_total", "counter",
               "Gated answers sampled for audit whose audit did not run or finish: their session was served, "
               "closed or evicted first"),
    MetricSpec("prepos_gate_false_accept_upper_bound", "gauge",
               "Upper confidence bound on the gate's false-accept rate from the audits (none before the first)"),
    MetricSpec("prepos_gate_suspended", "gauge", "1 once the audits suspended the gate (until a reload), else 0",
               initial=0),
    MetricSpec("prepos_gc_collections_total", "counter",
               "Python garbage collections in the backend process, by generation (every thread stops during one)",
               ("generation",), values=("0", "1", "2")),
    MetricSpec("prepos_gc_pause_seconds_total", "counter",
               "Seconds the backend process spent in garbage collections, by generation", ("generation",),
               values=("0", "1", "2")),
    MetricSpec("prepos_gc_full_pause_ms", "histogram",
               "Pause of each full (generation 2) garbage collection in the backend process (ms)", (),
               GC_PAUSE_BUCKETS_MS),
)


class MetricsSink(Protocol):
    def declare(self, spec: MetricSpec) -> None: ...

    def inc(self, name: str, labels: dict[str, str], value: float) -> None: ...

    def set(self, name: str, labels: dict[str, str], value: float) -> None: ...

    def observe(self, name: str, labels: dict[str, str], value: float) -> None: ...


class MemorySink:
    """Keeps values in dictionaries; for tests and for the benchmark's own reading."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple], float] = defaultdict(float)
        self.observations: dict[tuple[str, tuple], list[float]] = defaultdict(list)

    def declare(self, spec: MetricSpec) -> None:
        pass

    def inc(self, name: str, labels: dict[str, str], value: float) -> None:
        self.values[name, tuple(sorted(labels.items()))] += value

    def set(self, name: str, labels: dict[str, str], value: float) -> None:
        self.values[name, tuple(sorted(labels.items()))] = value

    def observe(self, name: str, labels: dict[str, str], value: float) -> None:
        self.observations[name, tuple(sorted(labels.items()))].append(value)

    def get(self, name: str, **labels: str) -> float:
        return self.values.get((name, tuple(sorted(labels.items()))), 0.0)


class BufferedSink:
    """Collects updates in memory and hands them to ``target`` on :meth:`flush`.

    Recording costs a dictionary update; the target's own calls (an IPC each
    for Triton's custom metrics, 0.1 to 0.2 ms, holding the stub's GIL) happen
    at flush, which the engine loop does when it goes idle and at every
    housekeeping (so under load too). A gauge is published only when its value
    differs from the one last published, so an idle server makes no calls.
    Thread-safe.
    """

    def __init__(self, target: MetricsSink):
        self.target = target
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._published: dict[tuple[str, tuple], float] = {}  # gauge key -> the value the target holds
        self._counts: dict[tuple[str, tuple], list] = {}  # key -> [labels, amount]
        self._gauges: dict[tuple[str, tuple], list] = {}  # key -> [labels, value]
        self._observations: list[tuple[str, dict[str, str], float]] = []

    def declare(self, spec: MetricSpec) -> None:
        self.target.declare(spec)

    def inc(self, name: str, labels: dict[str, str], value: float) -> None:
        key = (name, tuple(labels.items()))
        with self._lock:
            entry = self._counts.get(key)
            if entry is None:
                self._counts[key] = [labels, value]
            else:
                entry[1] += value

    def set(self, name: str, labels: dict[str, str], value: float) -> None:
        with self._lock:
            self._gauges[name, tuple(labels.items())] = [labels, value]

    def observe(self, name: str, labels: dict[str, str], value: float) -> None:
        with self._lock:
            self._observations.append((name, labels, value))

    def flush(self) -> None:
        with self._flush_lock:
            with self._lock:
                counts, self._counts = self._counts, {}
                gauges, self._gauges = self._gauges, {}
                observations, self._observations = self._observations, []
            for (name, _), (labels, amount) in counts.items():
                self.target.inc(name, labels, amount)
            for key, (labels, value) in gauges.items():
                if self._published.get(key) != value:
                    self.target.set(key[0], labels, value)
                    self._published[key] = value
            for name, labels, value in observations:
                self.target.observe(name, labels, value)


class Metrics:
    """What the core records; one method per event."""

    def __init__(self, sink: MetricsSink | None = None):
        self.sink = sink if sink is not None else MemorySink()
        self._collector_pauses: CollectorPauses | None = None
        for spec in SPECS:
            self.sink.declare(spec)
            if spec.kind == "counter" and not spec.labels:
                self.sink.inc(spec.name, {}, 0)
            for value in spec.values:
                self.sink.inc(spec.name, {spec.labels[0]: value}, 0)
            if spec.initial is not None:
                self.sink.set(spec.name, {}, spec.initial)

    def watch_collector(self, pauses: CollectorPauses | None) -> None:
        """Record ``pauses``'s garbage collections at every :meth:`flush` (None stops)."""
        self._collector_pauses = pauses

    def flush(self) -> None:
        """Record the garbage collections since the last flush, then publish what a :class:`BufferedSink` holds
        (nothing to do for other sinks)."""
        if self._collector_pauses is not None:
            for generation, pause_ms in self._collector_pauses.drain():
                labels = {"generation": str(generation)}
                self.sink.inc("prepos_gc_collections_total", labels, 1)
                self.sink.inc("prepos_gc_pause_seconds_total", labels, pause_ms / 1e3)
                if generation == 2:
                    self.sink.observe("prepos_gc_full_pause_ms", {}, pause_ms)
        if isinstance(self.sink, BufferedSink):
            self.sink.flush()

    def request_served(self, path: str, first_token_ms: float | None) -> None:
        self.sink.inc("prepos_requests_total", {"path": path}, 1)
        if first_token_ms is not None:
            self.sink.observe("prepos_first_token_ms", {"path": path}, first_token_ms)

    def publish_error_fields(self, inputs: Sequence[str]) -> None:
        """Publish ``prepos_request_errors_total`` at 0 for each of ``inputs`` (the model's, START and END
        included) and :data:`SERVER_STATE_FIELDS`, so alerts see their first refusal."""
        for field in (*inputs, *SERVER_STATE_FIELDS):
            self.sink.inc("prepos_request_errors_total", {"field": field}, 0)

    def request_rejected(self, field: str) -> None:
        self.sink.inc("prepos_request_errors_total", {"field": field}, 1)

    def gate_decided(self, outcome: str) -> None:
        self.sink.inc("prepos_gate_decisions_total", {"outcome": outcome}, 1)

    def prepositioning_ended(self, result: str) -> None:
        self.sink.inc("prepos_prepositionings_total", {"result": result}, 1)

    def prefilled(self, where: str, num_tokens: int) -> None:
        self.sink.inc("prepos_prefill_tokens_total", {"where": where}, num_tokens)

    def sessions(self, by_state: dict[str, int]) -> None:
        for state, count in by_state.items():
            self.sink.set("prepos_sessions", {"state": state}, count)

    def kv(self, used_bytes: int, budget_bytes: int, kept_prefix_bytes: int = 0) -> None:
        self.sink.set("prepos_kv_bytes", {}, used_bytes)
        self.sink.set("prepos_kv_budget_bytes", {}, budget_bytes)
        self.sink.set("prepos_kept_prefix_bytes", {}, kept_prefix_bytes)

    def kv_blocks(self, reused: int, new: int, missed: int) -> None:
        for outcome, count in (("reused", reused), ("new", new), ("missed", missed)):
            if count:
                self.sink.inc("prepos_kv_blocks_total", {"outcome": outcome}, count)

    def shared_prefix_tokens(self, count: int) -> None:
        if count:
            self.sink.inc("prepos_shared_prefix_tokens_total", {}, count)

    def evicted(self, what: str) -> None:
        self.sink.inc("prepos_kv_evictions_total", {"what": what}, 1)

    def engine_batch(self, kind: str, sessions: int) -> None:
        """A batch of ``kind`` (``prefill`` or ``decode``) steps of ``sessions`` sessions ran."""
        self.sink.observe(f"prepos_{kind}_batch_sessions", {}, sessions)

    def engine_time(self, where: str, seconds: float) -> None:
        self.sink.inc("prepos_engine_seconds_total", {"where": where}, seconds)

    def request_abandoned(self, reason: str) -> None:
        self.sink.inc("prepos_requests_abandoned_total", {"reason": reason}, 1)

    def session_opened(self) -> None:
        self.sink.inc("prepos_sessions_opened_total", {}, 1)

    def session_closed(self, reason: str) -> None:
        self.sink.inc("prepos_sessions_closed_total", {"reason": reason}, 1)

    def session_recovered(self) -> None:
        self.sink.inc("prepos_sessions_recovered_total", {}, 1)

    def session_drained(self) -> None:
        self.sink.inc("prepos_sessions_drained_total", {}, 1)

    def session_taken_over(self) -> None:
        self.sink.inc("prepos_sessions_taken_over_total", {}, 1)

    def journals_expired(self, count: int) -> None:
        self.sink.inc("prepos_journals_expired_total", {}, count)

    def gate_audited(self, result: str, upper_bound: float) -> None:
        self.sink.inc("prepos_gate_audits_total", {"result": result}, 1)
        self.sink.set("prepos_gate_false_accept_upper_bound", {}, upper_bound)

    def gate_audit_void(self) -> None:
        self.sink.inc("prepos_gate_audits_void_total", {}, 1)

    def gate_suspended(self) -> None:
        self.sink.set("prepos_gate_suspended", {}, 1)

    def turns_dropped(self, num_turns: int) -> None:
        self.sink.inc("prepos_turns_dropped_total", {}, num_turns)


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric ``name`` whose labels include all of ``labels`` (0 when there is none).

    ``name`` matches exactly: ``prepos_kv_bytes`` does not pick up ``prepos_kv_bytes_total``.
    """
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        rest = line[len(name):]
        if not (rest.startswith("{") or rest.startswith(" ")):
            continue
        if all(f'{key}="{value}"' in rest for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


class RefusalCounter:
    """``prepos_request_errors_total`` alone, for a model that refuses requests but serves none itself (the HTTP
    bridge, ``prepos_http``): its refusals are counted under its own ``model`` label, the fields it can name
    published at 0 from the start. Each refusal is one update of ``sink`` on the refusing thread (an IPC on
    Triton's sink, on the error path only). Thread-safe."""

    NAME = "prepos_request_errors_total"

    def __init__(self, sink: MetricsSink, fields: Sequence[str]):
        self._sink = sink
        self._lock = threading.Lock()
        self._sink.declare(next(spec for spec in SPECS if spec.name == self.NAME))
        for field in fields:
            self._sink.inc(self.NAME, {"field": field}, 0)

    def refused(self, field: str) -> None:
        with self._lock:
            self._sink.inc(self.NAME, {"field": field}, 1)


BRIDGE_RELAYS = MetricSpec(
    "prepos_bridge_relays", "gauge",
    "HTTP bridge requests by state: relaying (on a relay thread until prepos answers) or waiting (for a relay "
    "thread: more than bridge.max_streams at once)", ("state",))


class RelayGauge:
    """``prepos_bridge_relays{state=relaying|waiting}`` for the HTTP bridge: requests holding a relay thread, and
    requests waiting for one (past ``bridge.max_streams``, and each for the moment between its arrival and its
    thread). Each change is a dictionary update; a thread of its own publishes the values every
    ``interval_s`` when they changed (:class:`BufferedSink`), so no request waits on a metrics IPC. Both are 0 from
    the start. Thread-safe."""

    STATES = ("relaying", "waiting")

    def __init__(self, sink: MetricsSink, interval_s: float = 0.5):
        self._sink = BufferedSink(sink)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.STATES, 0)
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._sink.declare(BRIDGE_RELAYS)
        for state in self.STATES:
            self._sink.set(BRIDGE_RELAYS.name, {"state": state}, 0)
        self._sink.flush()
        self._thread = threading.Thread(target=self._publish, name="bridge-relays", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _move(self, left: str | None, entered: str | None) -> None:
        with self._lock:
            for state, step in ((left, -1), (entered, 1)):
                if state is not None:
                    self._counts[state] += step
                    self._sink.set(BRIDGE_RELAYS.name, {"state": state}, self._counts[state])

    def queued(self) -> None:
        """A request came in; it waits for a relay thread."""
        self._move(None, "waiting")

    def started(self) -> None:
        """A waiting request is on a relay thread now."""
        self._move("waiting", "relaying")

    def finished(self) -> None:
        """A relayed request was answered (or its relay failed)."""
        self._move("relaying", None)

    def _publish(self) -> None:
        while not self._stopped.wait(self._interval_s):
            self._sink.flush()
