"""Window snapshots, the scheduler's half: which finished sequence's per-slot state sits in which
snapshot slot, found by the tokens it covers (report 3.2.1: SWA state lives only in a short-lived
pool). Knows no tensors; the runner copies (cache/snapshot_store.py).

A snapshot taken when a request ends covers positions [0, C), C = its tokens - 1 (the last
sampled token was never run): the window rings of every layer (DSpark blocks included), the
compressor carry, and the partial tail block k = C // B (its compressed entries and index keys).
Blocks 0..k-1 are in the prefix cache under their chain hashes. A later request hits it when its
tokens start with the same C tokens:

    new prompt | block 0 .. block k-1 (cached, hash h_(k-1)) | tail: tokens[kB:C] | new tokens ...
    key        = (h_(k-1), or the salt's root when k = 0)      + tail tokens equal
    then positions [0, C) need no compute at all: exact, no replay

Bounded: num_slots snapshots, least recently used reused first; an entry older than ttl_s is
never served (the report's TTL of minutes).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Snapshot:
    slot: int
    parent: bytes              # hash of block k-1 (or the chain root when k == 0)
    num_tokens: int            # C: positions [0, C) covered
    tail: tuple[int, ...]      # token ids at positions k*B .. C-1
    created: float


class SnapshotIndex:
    def __init__(self, num_slots: int, block_tokens: int, ttl_s: float = 300.0, clock=time.monotonic) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots, self.block_tokens, self.ttl_s = num_slots, block_tokens, ttl_s
        self._clock = clock
        self._lru: OrderedDict[int, Snapshot] = OrderedDict()    # slot -> snapshot, oldest use first
        self._by_parent: dict[bytes, dict[int, Snapshot]] = {}   # parent hash -> slot -> snapshot
        self._free = list(range(num_slots - 1, -1, -1))
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def add(self, parent: bytes, num_tokens: int, tail: tuple[int, ...]) -> int | None:
        """A slot for a new snapshot (the LRU one is reused when none is free); None when the
        pool has no slots. The same (parent, tokens) snapshot replaces the older one."""
        if self.num_slots == 0:
            return None
        for snap in list(self._by_parent.get(parent, {}).values()):
            if snap.num_tokens == num_tokens and snap.tail == tail:
                self._drop(snap.slot)
        self._expire()
        if self._free:
            slot = self._free.pop()
        else:
            slot = next(iter(self._lru))
            self._drop(slot)
            self._free.pop()
            self.num_evictions += 1
        snap = Snapshot(slot, parent, num_tokens, tuple(tail), self._clock())
        self._lru[slot] = snap
        self._by_parent.setdefault(parent, {})[slot] = snap
        return slot

    def find(self, parent: bytes, tokens, start: int, max_tokens: int) -> Snapshot | None:
        """The longest live snapshot under `parent` whose tail equals tokens[start:C], C <= max_tokens."""
        best = None
        now = self._clock()
        for snap in self._by_parent.get(parent, {}).values():
            if now - snap.created > self.ttl_s or snap.num_tokens > max_tokens:
                continue
            if best is not None and snap.num_tokens <= best.num_tokens:
                continue
            if tuple(tokens[start:snap.num_tokens]) == snap.tail:
                best = snap
        if best is not None:
            self._lru.move_to_end(best.slot)
        return best

    def _expire(self) -> None:
        now = self._clock()
        for slot, snap in list(self._lru.items()):
            if now - snap.created > self.ttl_s:
                self._drop(slot)

    def _drop(self, slot: int) -> None:
        snap = self._lru.pop(slot)
        siblings = self._by_parent[snap.parent]
        del siblings[slot]
        if not siblings:
            del self._by_parent[snap.parent]
        self._free.append(slot)
