"""deepinfer/host_gc.py: a serving process's startup objects frozen out of the collector's walk, and its
collections counted for the metrics."""

from __future__ import annotations

import gc
import weakref

import pytest

from deepinfer import host_gc
from deepinfer.stats import EngineStats


class _Node:
    pass


@pytest.fixture
def thawed():
    yield
    host_gc.unfreeze()          # the rest of the test process collects as before


def test_freeze_collects_cycles_first_then_leaves_survivors_out_of_the_walk(thawed):
    garbage = _Node()
    garbage.me = garbage                         # a cycle only the collector frees
    dead = weakref.ref(garbage)
    del garbage
    kept = _Node()
    frozen = host_gc.freeze_startup_heap()
    assert dead() is None, "a cycle alive at the freeze would never be collected"
    assert frozen == gc.get_freeze_count() > 0
    later = _Node()
    walked = {id(o) for o in gc.get_objects()}
    assert id(kept) not in walked and id(later) in walked
    host_gc.unfreeze()
    assert gc.get_freeze_count() == 0 and id(kept) in {id(o) for o in gc.get_objects()}


def test_collections_are_counted_into_the_engine_stats():
    pauses = host_gc.pauses.install()
    before = dict(pauses.counters())
    gc.collect()
    after = pauses.counters()
    assert after["gc_full_collections_total"] == before["gc_full_collections_total"] + 1
    assert after["gc_collections_total"] >= before["gc_collections_total"] + 1
    assert after["gc_pause_seconds_total"] > before["gc_pause_seconds_total"]
    snap = EngineStats().snapshot()["counters"]
    assert snap["gc_full_collections_total"] >= after["gc_full_collections_total"]
