"""Per-client rate limits of the gateway (`--rate-limit-rpm`, `--rate-limit-tpm`, `--max-in-flight-per-client`).

A client is its API key, or its address where the gateway takes no keys. Three limits, each off unless
set: requests per minute, a bucket holding `rpm` requests (a burst of up to a minute's worth) refilled
continuously; tokens per minute, a bucket of `tpm` tokens refilled the same way: an admitted request
reserves its estimate at once (the output tokens it asks for at most, plus its prompt's text at ~4
bytes a token: estimate_tokens), so a client's concurrent requests see each other's share before any
answer ends, and the answer's real prompt + generated tokens replace the reservation when it ends (the
prompt's count is known only once the recipe has tokenized it, the output's only at its end; a request
that ends with no answer gives its reservation back); one request may overdraw the bucket and the
client then waits until it is positive again; and requests in flight (a stream counts until its last
byte). A request over any is answered 429 in its API's own format with Retry-After: the
seconds until the bucket admits again, or 1 for the in-flight limit (a slot frees when any of the
client's answers ends). Only the three API routes count; /health, /metrics and /v1/models never do.

The table of clients is bounded: past MAX_CLIENTS entries, clients idle long enough for a full bucket and
with nothing in flight are forgotten (they would be admitted anyway).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass

MAX_CLIENTS = 10_000


@dataclass(frozen=True)
class RateLimits:
    requests_per_minute: float | None = None      # None: no rate limit
    max_in_flight: int | None = None              # None: no in-flight limit
    tokens_per_minute: float | None = None        # None: no token budget

    def __post_init__(self):
        if self.requests_per_minute is not None and not self.requests_per_minute > 0:
            raise ValueError(f"--rate-limit-rpm must be > 0, got {self.requests_per_minute}")
        if self.tokens_per_minute is not None and not self.tokens_per_minute > 0:
            raise ValueError(f"--rate-limit-tpm must be > 0, got {self.tokens_per_minute}")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError(f"--max-in-flight-per-client must be >= 1, got {self.max_in_flight}")

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in (self.requests_per_minute, self.max_in_flight, self.tokens_per_minute))


@dataclass(frozen=True)
class Refusal:
    retry_after: float      # seconds
    limit: str              # "in_flight", "rpm" or "tpm": the limit that refused

    @property
    def in_flight(self) -> bool:
        return self.limit == "in_flight"


class _Bucket:
    """Per-client levels of one per-minute budget: `per_minute` at most, refilled continuously; a
    level may go below zero (a charge larger than what was left)."""

    def __init__(self, per_minute: float, clock) -> None:
        self.per_minute, self.clock = per_minute, clock
        self.levels: dict[str, tuple[float, float]] = {}         # client -> (level, when counted)

    def level(self, client: str) -> float:
        level, when = self.levels.get(client, (self.per_minute, self.clock()))
        return min(self.per_minute, level + (self.clock() - when) * self.per_minute / 60.0)

    def take(self, client: str, amount: float) -> None:
        self.levels[client] = (self.level(client) - amount, self.clock())

    def seconds_until(self, client: str, level: float) -> float:
        return max(0.0, level - self.level(client)) * 60.0 / self.per_minute

    def forget_full(self, keep) -> None:
        for client in list(self.levels):
            if client not in keep and self.level(client) >= self.per_minute:
                del self.levels[client]


# the fields that cap a request's output tokens, per API (Chat Completions' newer name first)
MAX_OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
_DATA_URL = re.compile(rb'"data:[^"]*"')
BYTES_PER_TOKEN = 4


def estimate_tokens(body: bytes) -> int:
    """A request's token reservation: the output cap it asks for (0 where it sets none: the answer's
    tokens are charged when it ends) plus its body's bytes / 4 with inline data URLs (images, files:
    their tokens are not their base64 bytes) left out."""
    try:
        fields = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        fields = None
    caps = [fields[f] for f in MAX_OUTPUT_FIELDS if isinstance(fields, dict)
            and isinstance(fields.get(f), int) and not isinstance(fields[f], bool)]
    out = max(0, caps[0]) if caps else 0
    return out + len(_DATA_URL.sub(b'""', body)) // BYTES_PER_TOKEN


class RateLimiter:
    """admit(client, reserve) before a request, charge(client, tokens, reserved) when its answer ends (or
    refund(client, reserved) where it ends with none), release(client) after it (charge, refund and release
    only for admitted requests). Single-threaded (the gateway's event loop)."""

    def __init__(self, limits: RateLimits, clock=time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        self._requests = _Bucket(rpm, clock) if rpm is not None else None
        self._tokens = _Bucket(tpm, clock) if tpm is not None else None
        self._in_flight: dict[str, int] = {}

    def admit(self, client: str, reserve: int = 0) -> Refusal | None:
        """None: admitted (a request taken from its bucket, `reserve` tokens from the token budget, one more
        in flight); else why not and when to retry (nothing taken)."""
        cap = self.limits.max_in_flight
        if cap is not None and self._in_flight.get(client, 0) >= cap:
            return Refusal(1.0, "in_flight")
        if self._tokens is not None and self._tokens.level(client) <= 0.0:
            return Refusal(max(self._tokens.seconds_until(client, 1.0), 1e-3), "tpm")
        if self._requests is not None:
            if self._requests.level(client) < 1.0:
                return Refusal(self._requests.seconds_until(client, 1.0), "rpm")
            self._requests.take(client, 1.0)
        if self._tokens is not None and reserve > 0:
            self._tokens.take(client, float(reserve))
        self._in_flight[client] = self._in_flight.get(client, 0) + 1
        if sum(len(b.levels) for b in self._budgets()) + len(self._in_flight) > MAX_CLIENTS:
            for b in self._budgets():
                b.forget_full(self._in_flight)
        return None

    def charge(self, client: str, tokens: int, reserved: int = 0) -> None:
        """An admitted request's prompt + generated tokens, when its answer ends, in place of what it reserved."""
        if self._tokens is not None and tokens != reserved:
            self._tokens.take(client, float(max(0, tokens) - reserved))

    def refund(self, client: str, reserved: int) -> None:
        """An admitted request that ended with no answer: its reservation back."""
        self.charge(client, 0, reserved)

    def release(self, client: str) -> None:
        n = self._in_flight.get(client, 0) - 1
        if n > 0:
            self._in_flight[client] = n
        else:
            self._in_flight.pop(client, None)

    def _budgets(self) -> list[_Bucket]:
        return [b for b in (self._requests, self._tokens) if b is not None]


def retry_after_header(seconds: float) -> str:
    """Whole seconds, rounded up (RFC 9110: delay-seconds), at least 1."""
    return str(max(1, math.ceil(seconds)))
