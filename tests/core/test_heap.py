"""The heap: startup objects frozen out of the collector's walks, and every collection's pause recorded."""

from __future__ import annotations

import gc

import pytest

from prepos.heap import CollectorPauses, settle_heap
from prepos.metrics import MemorySink, Metrics


class Node:
    def __init__(self):
        self.other = None


def cycle() -> Node:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # the test process's heap goes back to the collector


def test_settling_takes_living_objects_out_of_the_walks_and_leaves_later_garbage_collectable(unfrozen):
    startup = cycle()
    assert any(obj is startup for obj in gc.get_objects())
    settled = settle_heap()
    # What it froze, less any frozen object another thread of this process has freed since (none joins the frozen).
    assert 0 < gc.get_freeze_count() <= settled.num_frozen
    assert not any(obj is startup for obj in gc.get_objects())  # no generation holds it: no collection walks it

    later = cycle()
    probe = later.other
    del later
    assert any(obj is probe for obj in gc.get_objects())
    del probe
    before = len(gc.get_objects())
    assert gc.collect() >= 2  # the cycle made after the freeze is still found and freed
    assert len(gc.get_objects()) < before


def test_pauses_are_recorded_by_generation_only_while_installed():
    pauses = CollectorPauses()
    gc.collect()
    assert pauses.drain() == []
    pauses.install()
    try:
        gc.collect(0)
        gc.collect(2)
        drained = pauses.drain()
    finally:
        pauses.remove()
    generations = [generation for generation, _ in drained]
    assert generations[-2:] == [0, 2]
    assert all(pause_ms >= 0 for _, pause_ms in drained)
    assert pauses.drain() == []  # drained once
    gc.collect()
    assert pauses.drain() == []  # removed: nothing recorded


def test_metrics_publish_the_collections_at_flush():
    metrics = Metrics(MemorySink())
    pauses = CollectorPauses()
    metrics.watch_collector(pauses)
    pauses.install()
    try:
        gc.collect(2)
        gc.collect(2)
        assert metrics.sink.get("prepos_gc_collections_total", generation="2") == 0  # until the flush
        metrics.flush()
    finally:
        pauses.remove()
    assert metrics.sink.get("prepos_gc_collections_total", generation="2") >= 2
    full = metrics.sink.observations["prepos_gc_full_pause_ms", ()]
    assert len(full) >= 2
    assert metrics.sink.get("prepos_gc_pause_seconds_total", generation="2") == pytest.approx(sum(full) / 1e3)
    metrics.watch_collector(None)
    gc.collect(2)
    metrics.flush()
    assert len(metrics.sink.observations["prepos_gc_full_pause_ms", ()]) == len(full)
