"""Per-client rate limits of the gateway (`--rate-limit-rpm`, `--max-in-flight-per-client`).

A client is its API key, or its address where the gateway takes no keys. Two limits, each off unless
set: requests per minute, a token bucket holding `rpm` requests (a burst of up to a minute's worth)
refilled continuously; and requests in flight (a stream counts until its last byte). A request over
either is answered 429 in its API's own format with Retry-After: the seconds until the bucket holds a
request again, or 1 for the in-flight limit (a slot frees when any of the client's answers ends).
Only the three API routes count; /health, /metrics and /v1/models never do.

The table of clients is bounded: past MAX_CLIENTS entries, clients idle long enough for a full bucket and
with nothing in flight are forgotten (they would be admitted anyway).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

MAX_CLIENTS = 10_000


@dataclass(frozen=True)
class RateLimits:
    requests_per_minute: float | None = None      # None: no rate limit
    max_in_flight: int | None = None              # None: no in-flight limit

    def __post_init__(self):
        if self.requests_per_minute is not None and not self.requests_per_minute > 0:
            raise ValueError(f"--rate-limit-rpm must be > 0, got {self.requests_per_minute}")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError(f"--max-in-flight-per-client must be >= 1, got {self.max_in_flight}")

    @property
    def enabled(self) -> bool:
        return self.requests_per_minute is not None or self.max_in_flight is not None


@dataclass(frozen=True)
class Refusal:
    retry_after: float      # seconds
    in_flight: bool         # the in-flight limit (else the per-minute rate)


class RateLimiter:
    """admit(client) before a request, release(client) after it (only for admitted requests).
    Single-threaded (the gateway's event loop)."""

    def __init__(self, limits: RateLimits, clock=time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self._buckets: dict[str, tuple[float, float]] = {}       # client -> (tokens, when counted)
        self._in_flight: dict[str, int] = {}

    def admit(self, client: str) -> Refusal | None:
        """None: admitted (a token taken, one more in flight); else why not and when to retry."""
        cap = self.limits.max_in_flight
        if cap is not None and self._in_flight.get(client, 0) >= cap:
            return Refusal(1.0, in_flight=True)
        rpm = self.limits.requests_per_minute
        if rpm is not None:
            tokens = self._tokens(client)
            if tokens < 1.0:
                return Refusal((1.0 - tokens) * 60.0 / rpm, in_flight=False)
            self._buckets[client] = (tokens - 1.0, self.clock())
        self._in_flight[client] = self._in_flight.get(client, 0) + 1
        if len(self._buckets) + len(self._in_flight) > MAX_CLIENTS:
            self._forget_idle()
        return None

    def release(self, client: str) -> None:
        n = self._in_flight.get(client, 0) - 1
        if n > 0:
            self._in_flight[client] = n
        else:
            self._in_flight.pop(client, None)

    def _tokens(self, client: str) -> float:
        rpm = self.limits.requests_per_minute
        tokens, when = self._buckets.get(client, (rpm, self.clock()))
        return min(rpm, tokens + (self.clock() - when) * rpm / 60.0)

    def _forget_idle(self) -> None:
        rpm = self.limits.requests_per_minute
        for client in list(self._buckets):
            if client not in self._in_flight and (rpm is None or self._tokens(client) >= rpm):
                del self._buckets[client]


def retry_after_header(seconds: float) -> str:
    """Whole seconds, rounded up (RFC 9110: delay-seconds), at least 1."""
    return str(max(1, math.ceil(seconds)))
