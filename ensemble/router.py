"""Routing across replicas: prefix-aware, least-loaded otherwise, health-checked.

SGLang's model gateway `cache_aware` policy, in our gateway layer: an approximate prefix tree per
replica (here: chained hashes of fixed-size chunks of the routing key, the same idea as the
engine's block hashes), fed by the router's own decisions, plus each replica's load from the
metrics the `deepinfer` model publishes (running, waiting, cache usage, prefix hit rate).

    pick(key):
      healthy replicas only (a replica is down after `max_failures` failed health checks / requests
      in a row, and back on its next good check)
      if the loads are balanced (not both max - min queue > balance_abs and max > balance_rel * min):
          the replica holding the longest cached prefix of the key, if it covers >= min_match chunks
      otherwise, or with no match: the least loaded (queue = running + waiting, then cache usage,
      then the fewest cached chunks)
      then remember the key's chunks as cached on the chosen replica (LRU, max_chunks per replica)

Why not vllm-router / sglang-router in front (checked on their wheels here, sglang-router 0.3.2 and
vllm-router 0.1.17: the routes in their Rust binaries): both proxy /v1/chat/completions,
/v1/completions, /v1/responses and SGLang's /generate, and read load from /get_load or vLLM's
Prometheus names (vllm:num_requests_running); neither has Anthropic's /v1/messages, which our
gateway serves, and neither reads the deepinfer_* metrics. So the policy (small) lives here, beside
the gateway, and router_server.py proxies all three APIs.

The routing key is what shares a prefix across requests: the prompt token ids when the caller has
them, else the request's text in prompt order (system prompt first), chunked by characters.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class ReplicaLoad:
    """One replica's figures from its metrics (deepinfer_* gauges); healthy=False when unreachable."""
    num_running: float = 0.0
    num_waiting: float = 0.0
    cache_usage: float = 0.0
    prefix_hit_rate: float | None = None    # when the replica has a prefix cache
    healthy: bool = True

    @property
    def queue(self) -> float:
        return self.num_running + self.num_waiting


@dataclass
class _Replica:
    name: str
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    in_flight: int = 0                     # routed here and not finished (the router's own count)
    num_routed: int = 0
    failures: int = 0                      # failed checks / requests in a row
    chunks: OrderedDict = field(default_factory=OrderedDict)   # chained chunk hash -> None (LRU)


def chunk_hashes(key: Sequence, chunk: int) -> list[bytes]:
    """Chained hashes of the full chunks of `key` (token ids or characters): hash i covers key[:chunk*(i+1)]."""
    out, h = [], b""
    for i in range(len(key) // chunk):
        part = key[i * chunk:(i + 1) * chunk]
        data = part.encode() if isinstance(part, str) else ",".join(map(str, part)).encode()
        h = hashlib.blake2b(h + data, digest_size=12).digest()
        out.append(h)
    return out


class Router:
    POLICIES = ("prefix", "least_loaded", "round_robin")

    def __init__(self, replicas: Sequence[str], policy: str = "prefix", chunk: int = 64, min_match: int = 1,
                 balance_abs: float = 16, balance_rel: float = 1.5, max_chunks: int = 1 << 16,
                 max_failures: int = 2) -> None:
        if policy not in self.POLICIES:
            raise ValueError(f"policy must be one of {self.POLICIES}, got {policy!r}")
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.policy, self.chunk, self.min_match = policy, chunk, min_match
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.max_chunks, self.max_failures = max_chunks, max_failures
        self.replicas = {name: _Replica(name) for name in replicas}
        self._rr = itertools.cycle(list(replicas))
        self._lock = threading.Lock()

    # what the replicas report ----------------------------------------------------------------
    def update_load(self, name: str, load: ReplicaLoad) -> None:
        with self._lock:
            r = self.replicas[name]
            r.load = load
            r.failures = 0 if load.healthy else r.failures + 1

    def report_failure(self, name: str) -> None:
        """A request to the replica failed (connection refused, stream broke)."""
        with self._lock:
            self.replicas[name].failures += 1

    def healthy(self) -> list[str]:
        return [n for n, r in self.replicas.items() if r.failures < self.max_failures]

    # routing -----------------------------------------------------------------------------------
    def pick(self, key: Sequence, exclude: Sequence[str] = ()) -> str:
        """The replica for a request with this routing key; `exclude`: replicas already tried.
        Raises LookupError when no healthy replica is left."""
        with self._lock:
            live = [self.replicas[n] for n in self.healthy() if n not in exclude]
            if not live:
                raise LookupError("no healthy replica")
            hashes = chunk_hashes(key, self.chunk) if self.policy == "prefix" else []
            r = self._choose(live, hashes)
            r.in_flight += 1
            r.num_routed += 1
            for h in hashes:
                r.chunks[h] = None
                r.chunks.move_to_end(h)
            while len(r.chunks) > self.max_chunks:
                r.chunks.popitem(last=False)
            return r.name

    def done(self, name: str) -> None:
        with self._lock:
            self.replicas[name].in_flight -= 1

    def _choose(self, live: list[_Replica], hashes: list[bytes]) -> _Replica:
        if self.policy == "round_robin":
            names = {r.name for r in live}
            return next(self.replicas[n] for n in self._rr if n in names)
        least = min(live, key=self._load_key)
        if not hashes or not self._balanced(live):
            return least
        best, best_len = least, 0
        for r in live:
            n = self._match(r, hashes)
            if n > best_len or (n == best_len and n and self._load_key(r) < self._load_key(best)):
                best, best_len = r, n
        return best if best_len >= self.min_match else least

    @staticmethod
    def _match(r: _Replica, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in r.chunks:
                break
            n += 1
        return n

    @staticmethod
    def _queue(r: _Replica) -> float:
        # the replica's reported queue lags; the router's own in-flight count does not
        return max(r.load.queue, r.in_flight)

    def _load_key(self, r: _Replica):
        # equal loads: the replica caching less takes a new prefix (spreads prefixes over replicas)
        return self._queue(r), r.load.cache_usage, len(r.chunks)

    def _balanced(self, live: list[_Replica]) -> bool:
        qs = [self._queue(r) for r in live]
        return not (max(qs) - min(qs) > self.balance_abs and max(qs) > self.balance_rel * min(qs))


# Prometheus names the deepinfer model publishes (ensemble/metrics.py) -> ReplicaLoad fields; the hit
# rate comes from the prefix cache's gauge where the replica has one
METRIC_FIELDS = {"deepinfer_num_requests_running": "num_running", "deepinfer_num_requests_waiting": "num_waiting",
                 "deepinfer_cache_usage": "cache_usage", "deepinfer_prefix_cache_hit_rate": "prefix_hit_rate"}


def parse_metrics(text: str) -> ReplicaLoad:
    """A replica's load from its Triton metrics page (the deepinfer_* gauges, summed over labels)."""
    vals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        f = METRIC_FIELDS.get(name)
        if f is not None and "rank=" not in line:
            vals[f] = vals.get(f, 0.0) + float(line.rsplit(" ", 1)[1])
    return ReplicaLoad(**vals)
