"""Python's cyclic garbage collector in a serving process.

A full (generation-2) collection walks every tracked object with the GIL held. With an engine built (its
modules, tokenizer, grammar tables: ~290k objects on the tiny checkpoint) one took 70-100 ms on a dev CPU
(perf/host_gc_pause.py), and the interpreter starts one whenever enough survivors pile up: the engine thread
stops launching a step's kernels and the frontends stop streaming for that long, at a moment nobody picks.

    freeze_startup_heap()   once a serving process has built its engine: count its collections from then
                            (pauses), collect, then move every survivor to the permanent generation
                            (gc.freeze), so later collections walk only what serving made. Reference
                            counting still frees frozen objects; only their cycles wait for unfreeze()
                            (model unload, shutdown).
    pauses                  the process's collections timed through gc.callbacks (counts and seconds per
                            generation), for EngineStats' counters and the metrics endpoint.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


class GcPauses:
    """Collections of this process and the time they held the interpreter, from gc.callbacks. The callback
    touches plain attributes only (it may run inside any allocation, with any lock held)."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0
        self.installed = False

    def install(self) -> "GcPauses":
        if not self.installed:
            gc.callbacks.append(self._callback)
            self.installed = True
        return self

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        took = time.perf_counter() - self._start
        g = min(int(info.get("generation", 2)), 2)
        self.collections[g] += 1
        self.seconds[g] += took

    def counters(self) -> dict:
        """EngineStats counters: every collection, the full ones, and the seconds they took ({} until installed)."""
        if not self.installed:
            return {}
        return {"gc_collections_total": sum(self.collections), "gc_full_collections_total": self.collections[2],
                "gc_pause_seconds_total": sum(self.seconds)}


pauses = GcPauses()


def freeze_startup_heap() -> int:
    """Collections counted from here (pauses), then collect and freeze what survives (gc.freeze); -> the
    objects frozen. Call once the process's engine is built (and its CUDA graphs captured), before serving."""
    pauses.install()
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("host gc: %d startup objects frozen (%.0f ms); later full collections skip them", n,
             (time.perf_counter() - t) * 1e3)
    return n


def unfreeze() -> None:
    """Frozen objects back into the oldest generation, so their cycles can be collected (an engine torn down)."""
    gc.unfreeze()
