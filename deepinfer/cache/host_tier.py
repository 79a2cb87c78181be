"""The host-memory tier of the prefix cache: cached blocks the device pool takes back are copied to
host memory first, and come back on a later hit (vLLM's CPU offload of prefix-cacheable groups).

    device pool (BlockPool)              host tier (num_slots blocks, LRU)
    idle cached block b, hash h  --evicted by allocate-->  offload b -> slot s, index h -> s
    hit on h (not on the device) <--onload s -> new block b'--  (b' cached under h again)

Two halves, as for window snapshots: HostTierIndex (scheduler side: hash -> slot, LRU, bounded)
and HostBlockStore (runner side: pinned host tensors, asynchronous copies on the current stream).
Copies are values in the SchedulerOutput (outputs.BlockCopy), run in decision order before the
step's forward, so an offload reads a block before its new owner writes it and an onload lands
before anyone reads it.

Why not LMCache or Mooncake Store: both key vLLM/SGLang paged KV of one layout per layer (a
[2, block, heads, dim] page per layer, or MLA's one latent page) through their connector APIs;
our block is a different object (compressed KV and index keys of the few KV-source layers at
their own ratios, 1/ratio entries per token, no window KV), owned by our own block pool. Their
value is the remote/disk tiers and cross-node sharing; a local pinned-DRAM tier is ~100 lines
here. A Mooncake-backed store would replace HostBlockStore's tensors, not this index.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostTierIndex:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._lru: OrderedDict[bytes, int] = OrderedDict()   # hash -> slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self.num_evictions = 0
        self.on_evict = None     # (hash, slot) -> None, before an evicted entry's slot is reused (disk tier)

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, block_hash: bytes) -> int | None:
        slot = self._lru.get(block_hash)
        if slot is not None:
            self._lru.move_to_end(block_hash)
        return slot

    def __contains__(self, block_hash: bytes) -> bool:
        """Held here (a look: the LRU order stays)."""
        return block_hash in self._lru

    def put(self, block_hash: bytes) -> int | None:
        """A slot for this hash's content (the LRU entry's when full); None without slots."""
        if self.num_slots == 0:
            return None
        if self._free:
            slot = self._free.pop()
        else:
            old, slot = self._lru.popitem(last=False)
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(old, slot)
        self._lru[block_hash] = slot
        return slot

    def check(self) -> None:
        slots = list(self._lru.values())
        assert len(slots) == len(set(slots)) and len(slots) + len(self._free) == self.num_slots
        assert not set(slots) & set(self._free)


class HostBlockStore:
    def __init__(self, caches, num_slots: int) -> None:
        self.caches = caches
        pin = caches.window_kv[0].device.type == "cuda"
        host = lambda t: torch.empty((num_slots,) + tuple(t.shape[1:]), dtype=t.dtype,   # noqa: E731
                                     device="cpu", pin_memory=pin)
        self.kv = {s: host(t) for s, t in caches.compressed_kv.items()}
        self.ik = {s: host(t) for s, t in caches.index_k.items()}

    def _pairs(self):
        for s, t in self.kv.items():
            yield t, self.caches.compressed_kv[s]
        for s, t in self.ik.items():
            yield t, self.caches.index_k[s]

    def offload(self, block: int, slot: int) -> None:
        for host, dev in self._pairs():
            host[slot].copy_(dev[block], non_blocking=True)

    def onload(self, slot: int, block: int) -> None:
        for host, dev in self._pairs():
            dev[block].copy_(host[slot], non_blocking=True)


def num_host_slots(engine_args, model_args) -> int:
    """host_cache_bytes / one block's bytes; refuses a size over the host's available memory."""
    n = engine_args.host_cache_bytes
    if not n or not engine_args.enable_prefix_caching:
        return 0
    avail = available_host_bytes()
    if avail is not None and n > avail:
        raise ValueError(f"host_cache_bytes ({n}) is larger than the host's available memory ({avail} bytes)")
    from deepinfer.cache.model_caches import ModelCaches
    per = ModelCaches.bytes_per_block(model_args, engine_args.block_tokens, getattr(torch, engine_args.dtype))
    return n // per


def available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
