"""Engine statistics as Triton custom metrics (pb_utils.MetricFamily), served on the metrics port.

Counters and gauges are copied from the engine's stats snapshot (deepinfer/stats.py) by a poll
thread; TTFT and inter-token latency are observed by the engine driver as responses leave the
engine. pb_utils is passed in, so this module does not import Triton.
"""

from __future__ import annotations

import gc
import threading
from typing import Callable

TTFT_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 1.0]
E2E_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]
COUNTERS = {"prompt_tokens_total": "Prompt tokens of admitted requests",
            "generation_tokens_total": "Generated tokens delivered",
            "preemptions_total": "Requests preempted to free cache",
            "spec_draft_tokens_proposed_total": "DSpark draft tokens proposed",
            "spec_draft_tokens_verified_total": "DSpark draft tokens verified (after the confidence policy)",
            "spec_draft_tokens_accepted_total": "DSpark draft tokens accepted",
            "spec_verify_steps_total": "Request-steps that verified drafts",
            "computed_tokens_total": "Tokens run through the model (recompute after preemption included)",
            "steps_total": "Engine steps",
            "requests_finished_stop": "Requests finished by EOS / stop",
            "requests_finished_length": "Requests finished at max_tokens",
            "requests_finished_abort": "Requests stopped (client gone, stop sequence)",
            "requests_finished_error": "Requests failed by an engine fault",
            "prefix_cache_queries_total": "Tokens of admitted requests looked up in the prefix cache",
            "prefix_cache_hits_total": "Tokens served from the prefix cache",
            "prefix_cache_replayed_tokens_total": "Tokens recomputed by SWA bounded replay after a hit",
            "prefix_cache_snapshot_hits_total": "Prefix hits that landed on a window snapshot (exact)",
            "prefix_cache_evictions_total": "Cached blocks taken back for new allocations",
            "prefix_cache_host_offloads_total": "Cached blocks copied to the host-memory tier",
            "prefix_cache_host_hits_total": "Cached blocks brought back from the host-memory tier",
            "prefix_cache_disk_spills_total": "Host-tier blocks written to the disk tier",
            "prefix_cache_disk_hits_total": "Cached blocks read back from the disk tier",
            "kv_transfers_total": "P/D hand-overs done (prefill: held caches read and freed; decode: caches pulled)",
            "kv_transfer_bytes_total": "Bytes of caches pulled from prefill instances",
            "kv_transfer_replayed_tokens_total": "Positions a decode instance replayed to rebuild the window (kv_transfer_window=False)",
            "kv_transfer_failures_total": "Pulls that failed (blocks gone, timeout, peer down)",
            "kv_holds_expired_total": "Held prefill caches freed at kv_transfer_timeout_s (no decode pulled them)",
            "images_encoded_total": "Requests' images encoded by the vision tower ahead of their steps",
            "image_encode_failures_total": "Requests failed because their images could not be encoded",
            "gc_collections_total": "Python garbage collections in the engine's process",
            "gc_full_collections_total": "Full (generation-2) Python garbage collections in the engine's process",
            "gc_pause_seconds_total": "Seconds the engine's process spent in Python garbage collections"}
GAUGES = {"num_requests_running": "Requests in the running batch",
          "num_requests_waiting": "Requests waiting to be scheduled",
          "cache_usage": "Fraction of KV cache blocks in use",
          "spec_mean_accepted_length": "Tokens per verifying request-step (1 + accepted drafts)",
          "spec_acceptance_rate": "Accepted / verified draft tokens",
          "prefix_cache_hit_rate": "Prefix cache hits / lookups, in tokens",
          "cache_blocks_used": "KV cache blocks in use (held P/D caches included)",
          "kv_requests_held": "Prefill: finished requests whose caches wait for a decode pull",
          "kv_requests_loading": "Decode: requests whose caches are being pulled"}
# multi-GPU engine: the expert placement's balance (Σmax/Σmean of per-rank MoE tokens over the EPLB
# window, before / after the last rebalance) and, with a `rank` label, each rank's own figures
PARALLEL_GAUGES = {"moe_load_balance": "Max/mean rank MoE load over the EPLB window (before the last rebalance)",
                   "moe_load_balance_after": "Max/mean rank MoE load the last rebalance planned for"}
RANK_GAUGES = {"rank_num_requests_running": ("num_requests_running", "Requests running on this rank"),
               "rank_num_requests_waiting": ("num_requests_waiting", "Requests waiting on this rank"),
               "rank_cache_usage": ("cache_usage", "Fraction of this rank's KV cache blocks in use"),
               "rank_generation_tokens": ("generation_tokens_total", "Tokens generated on this rank")}


class TritonMetrics:
    def __init__(self, pb_utils, labels: dict, snapshot: Callable[[], dict], period_s: float = 1.0,
                 num_ranks: int = 1):
        self.snapshot = snapshot
        self.period_s = period_s
        mf = pb_utils.MetricFamily
        self._families = []

        def family(name, doc, kind):
            f = mf(name=f"deepinfer_{name}", description=doc, kind=kind)
            self._families.append(f)
            return f

        self.counters = {k: family(k, d, mf.COUNTER).Metric(labels=labels) for k, d in COUNTERS.items()}
        self.gauges = {k: family(k, d, mf.GAUGE).Metric(labels=labels) for k, d in GAUGES.items()}
        self.rank_gauges: list[dict] = []
        if num_ranks > 1:
            self.gauges.update({k: family(k, d, mf.GAUGE).Metric(labels=labels) for k, d in PARALLEL_GAUGES.items()})
            fams = {k: family(k, d, mf.GAUGE) for k, (_, d) in RANK_GAUGES.items()}
            self.rank_gauges = [{RANK_GAUGES[k][0]: f.Metric(labels={**labels, "rank": str(r)}) for k, f in fams.items()}
                                for r in range(num_ranks)]
        hist = getattr(mf, "HISTOGRAM", None)
        self.ttft = self.itl = self.e2e = None
        if hist is not None:   # python_backend 24.09+
            self.e2e = family("e2e_request_latency_seconds", "Engine request latency, arrival to last token", hist).Metric(
                labels=labels, buckets=E2E_BUCKETS)
            self.ttft = family("time_to_first_token_seconds", "Time to first token", hist).Metric(
                labels=labels, buckets=TTFT_BUCKETS)
            self.itl = family("inter_token_latency_seconds", "Inter-token latency", hist).Metric(
                labels=labels, buckets=ITL_BUCKETS)
        self._last = {k: 0 for k in COUNTERS}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="deepinfer-metrics", daemon=True)
        self._thread.start()

    def observe_ttft(self, seconds: float) -> None:
        if self.ttft is not None:
            self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        if self.itl is not None:
            self.itl.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        if self.e2e is not None:
            self.e2e.observe(seconds)

    def update(self) -> None:
        snap = self.snapshot()
        for k, metric in self.counters.items():
            value = snap["counters"].get(k, 0)
            if value > self._last[k]:
                metric.increment(value - self._last[k])
                self._last[k] = value
        for k, metric in self.gauges.items():
            metric.set(float(snap["gauges"].get(k, 0)))
        for metrics, values in zip(self.rank_gauges, snap["gauges"].get("ranks", [])):
            for k, metric in metrics.items():
                metric.set(float(values.get(k, 0)))

    def _poll(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.update()
            except Exception:  # noqa: BLE001 - metrics must never take the model down
                pass

    def close(self) -> None:
        """NOTE: the poll thread must be gone before the metrics go, and every Metric must be released
        before its MetricFamily: freeing a family first (as interpreter teardown may) crashed the stub
        in its C++ metrics cleanup now and then."""
        self._stop.set()
        self._thread.join(max(5.0, 2 * self.period_s))
        self.counters = self.gauges = {}
        self.rank_gauges = []
        self.ttft = self.itl = self.e2e = None
        gc.collect()
        self._families.clear()
