"""The gateway's own Prometheus metrics (GET /metrics), beside the engine's on Triton's metrics port.

What only the gateway sees: each API's requests by HTTP status, rejections by reason, end-to-end
latency and time to the first chunk per API, prompt/generation tokens per API, finish reasons,
streams in flight. Plain text exposition format, no dependency:

    deepinfer_gateway_requests_total{api="chat.completions",status="200"} 12
    deepinfer_gateway_request_seconds_bucket{api="messages",le="0.5"} 3
"""

from __future__ import annotations

import threading
from collections import defaultdict

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# HTTP status -> rejection reason label
REASONS = {400: "invalid_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
           413: "too_large", 429: "rate_limited", 500: "internal", 503: "unavailable"}

_HELP = {
    "requests_total": ("counter", "Requests answered, by API and HTTP status"),
    "rejected_total": ("counter", "Requests refused (4xx/5xx before or instead of an answer), by reason"),
    "prompt_tokens_total": ("counter", "Prompt tokens of answered requests, by API"),
    "generation_tokens_total": ("counter", "Generated tokens of answered requests, by API"),
    "finish_total": ("counter", "Finished answers by engine finish reason (stop, length, abort, error)"),
    "stream_errors_total": ("counter", "Streams that ended with an error event after they began"),
    "requests_in_flight": ("gauge", "Requests the gateway is answering now"),
    "engine_alive": ("gauge", "1 while the engine model answers the liveness probe, else 0"),
    "request_seconds": ("histogram", "End-to-end request latency (first byte in to last byte out)"),
    "first_chunk_seconds": ("histogram", "Time to the first response of the ensemble (queue + prefill)"),
}


class GatewayMetrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.counters: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self.gauges: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self.hists: dict[str, dict[tuple, list]] = defaultdict(dict)

    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        with self._lock:
            self.counters[name][tuple(sorted(labels.items()))] += value

    def set(self, name: str, value: float, **labels) -> None:
        with self._lock:
            self.gauges[name][tuple(sorted(labels.items()))] = value

    def add(self, name: str, delta: float, **labels) -> None:
        with self._lock:
            self.gauges[name][tuple(sorted(labels.items()))] += delta

    def observe(self, name: str, seconds: float, **labels) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            h = self.hists[name].setdefault(key, [[0] * len(LATENCY_BUCKETS), 0.0, 0])
            for i, le in enumerate(LATENCY_BUCKETS):
                if seconds <= le:
                    h[0][i] += 1
            h[1] += seconds
            h[2] += 1

    def request_done(self, api: str, status: int, seconds: float) -> None:
        self.inc("requests_total", api=api, status=str(status))
        if status >= 400:
            self.inc("rejected_total", api=api, reason=REASONS.get(status, str(status)))
        self.observe("request_seconds", seconds, api=api)

    def answered(self, api: str, prompt_tokens: int, generation_tokens: int, finish_reason: str) -> None:
        self.inc("prompt_tokens_total", prompt_tokens, api=api)
        self.inc("generation_tokens_total", generation_tokens, api=api)
        self.inc("finish_total", api=api, reason=finish_reason or "unknown")

    def value(self, name: str, **labels) -> float:
        """One series' value (counters and gauges): for tests and the soak's report."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            return self.counters.get(name, {}).get(key, self.gauges.get(name, {}).get(key, 0.0))

    def render(self) -> str:
        lines = []
        with self._lock:
            for name, (kind, doc) in _HELP.items():
                full = f"deepinfer_gateway_{name}"
                lines += [f"# HELP {full} {doc}", f"# TYPE {full} {kind}"]
                series = self.counters.get(name) or self.gauges.get(name) or {}
                for key, v in series.items():
                    lines.append(f"{full}{_labels(key)} {v:g}")
                for key, (counts, total, n) in self.hists.get(name, {}).items():
                    for le, count in zip(LATENCY_BUCKETS, counts):
                        lines.append(f"{full}_bucket{_labels(key + (('le', f'{le:g}'),))} {count}")
                    lines.append(f"{full}_bucket{_labels(key + (('le', '+Inf'),))} {n}")
                    lines.append(f"{full}_sum{_labels(key)} {total:g}")
                    lines.append(f"{full}_count{_labels(key)} {n}")
        return "\n".join(lines) + "\n"


def _labels(key: tuple) -> str:
    if not key:
        return ""
    inner = ",".join(f'{k}="{str(v)}"' for k, v in key)
    return "{" + inner + "}"
