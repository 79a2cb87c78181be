"""Engine statistics as plain counters, gauges and histograms, for the Triton model to publish.

Prometheus-shaped (cumulative bucket counts, sum, count) so a metrics exporter can copy them
field by field. Written by the engine thread, read from any thread through snapshot().
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from . import host_gc

# seconds; Prometheus-style upper bounds (+Inf implied)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]                        # upper bounds, ascending
    counts: list[int] = field(default_factory=list)   # per bucket (not cumulative); last = +Inf
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict:
        cum, acc = [], 0
        for c in self.counts:
            acc += c
            cum.append(acc)
        return {"buckets": list(self.buckets), "cumulative_counts": cum, "sum": self.sum, "count": self.count}


class EngineStats:
    """Counters (monotonic), gauges (current), histograms (latency, seconds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters = {
            "prompt_tokens_total": 0,        # prompt tokens of admitted requests (once each)
            "generation_tokens_total": 0,    # tokens delivered to callers
            "computed_tokens_total": 0,      # tokens run through the model (recompute and chunks included)
            "preemptions_total": 0,
            "requests_finished_stop": 0,
            "requests_finished_length": 0,
            "requests_finished_abort": 0,
            "requests_finished_error": 0,
            "steps_total": 0,
            # speculative decoding (DSpark): drafts proposed, sent to verification (after the
            # confidence policy and the token budget), accepted; request-steps that verified drafts
            "spec_draft_tokens_proposed_total": 0,
            "spec_draft_tokens_verified_total": 0,
            "spec_draft_tokens_accepted_total": 0,
            "spec_verify_steps_total": 0,
            "spec_paused_steps_total": 0,    # steps that drafted nothing after them (spec/pause.py)
            # prefix caching (sched/prefix_admission.py): tokens of admitted requests looked up, of
            # them served from the cache, recomputed by bounded replay; hits that landed on a window
            # snapshot; snapshots saved; cached blocks taken back for new allocations
            "prefix_cache_queries_total": 0,
            "prefix_cache_hits_total": 0,
            "prefix_cache_replayed_tokens_total": 0,
            "prefix_cache_snapshot_hits_total": 0,
            "prefix_cache_snapshots_saved_total": 0,
            "prefix_cache_evictions_total": 0,
            "prefix_cache_host_offloads_total": 0,   # blocks copied to the host tier on eviction
            "prefix_cache_host_hits_total": 0,       # blocks brought back from the host tier on a hit
            "prefix_cache_disk_spills_total": 0,     # host-tier blocks written to the disk tier on eviction
            "prefix_cache_disk_hits_total": 0,       # blocks read back from the disk tier on a hit
            # prefill/decode disaggregation (deepinfer/disagg/): requests handed over (prefill: held
            # caches read and freed; decode: caches pulled), the bytes pulled, hand-overs that failed
            "kv_transfers_total": 0,
            "kv_transfer_bytes_total": 0,
            "kv_transfer_replayed_tokens_total": 0,   # kv_transfer_window=False: positions replayed
            "kv_transfer_failures_total": 0,
            "kv_holds_expired_total": 0,
            # images (worker/image_embeds.py, parallel/image_ahead.py): a request's images encoded ahead of
            # its steps (an image two requests share in one pass counts for each), requests failed by it
            "images_encoded_total": 0,
            "image_encode_failures_total": 0,
        }
        self.gauges = {
            "num_requests_running": 0,
            "num_requests_waiting": 0,
            "cache_blocks_used": 0,
            "cache_blocks_total": 0,
            "cache_usage": 0.0,
            "spec_mean_accepted_length": 0.0,   # tokens per verifying request-step: 1 + accepted / verify steps
            "spec_acceptance_rate": 0.0,        # accepted / verified drafts
            "prefix_cache_hit_rate": 0.0,       # prefix_cache_hits_total / prefix_cache_queries_total
            "prefix_cache_blocks_cached": 0,    # blocks findable by hash (referenced or idle)
            "kv_requests_held": 0,              # prefill: finished requests whose caches wait for a decode pull
            "kv_requests_loading": 0,           # decode: requests whose caches are being pulled
        }
        self.histograms = {
            "time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "inter_token_latency_seconds": Histogram(ITL_BUCKETS),
            "e2e_request_latency_seconds": Histogram(E2E_BUCKETS),
        }

    # engine thread -------------------------------------------------------------------------
    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self.histograms[name].observe(value)

    def set_gauges(self, **values) -> None:
        with self._lock:
            self.gauges.update(values)

    # any thread ----------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """{"counters": {...}, "gauges": {...}, "histograms": {name: {buckets, cumulative_counts, sum, count}}}"""
        gc_counters = host_gc.pauses.counters()    # the process's collections, where a serving process counts them
        with self._lock:
            return {
                "counters": {**self.counters, **gc_counters},
                "gauges": dict(self.gauges),
                "histograms": {k: h.snapshot() for k, h in self.histograms.items()},
            }
