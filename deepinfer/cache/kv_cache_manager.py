"""Per-request cache ownership: one window-ring slot and a block table of paged blocks.

The model's caches (deepinfer/cache/model_caches.py) are of two shapes:
- per running sequence, one ring slot: the window ring of every layer (2 x window positions) and
  the compressor carry-over state. Slots are a fixed pool of max_num_seqs, so a running request
  always has one;
- paged blocks of block_tokens positions (compressed KV and index keys of every source layer),
  one block table per request, shared by all layers.
Engram n-gram history is not cached: the runner reads it from the request's token ids.

Prefix caching (enable_prefix_caching): a full block whose tokens are known and computed gets its
chain hash (cache/block_hash.py) registered in the pool (cache_full_blocks); a new request's
longest run of cached blocks (find_cached_blocks) enters its table by reference (allocate_slots
with cached_blocks), so blocks are shared and freed by reference count; an unreferenced cached
block stays findable until the pool needs it (LRU). Only compressed KV and index keys live in
blocks: window rings and the compressor carry are per ring slot and rebuilt on a hit (replay) or
restored from a window snapshot (cache/window_snapshots.py).

    request with a 2-block hit, block_tokens = 4, prompt of 11 tokens:
    positions | 0 1 2 3 | 4 5 6 7 | 8 9 10 |
    blocks      c0        c1        n0       c0, c1 shared (ref + 1), n0 new

Caches are addressed by absolute position, so a rollback (rejected drafts) only lowers the
request's length and frees the blocks past it:

    block_tokens = 4, request computed 0..9 and verifies 3 drafts at 10..12:
    positions  | 0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 |
    blocks       b0        b1        b2          b3     <- allocate_slots(req, 13)
    1 draft accepted -> num_computed_tokens = 11 -> rollback(req, 11) keeps b0..b2, frees b3
"""

from __future__ import annotations

from deepinfer.cache.block_pool import BlockPool
from deepinfer.outputs import BlockCopy


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_tokens: int, num_ring_slots: int,
                 enable_prefix_caching: bool = False, host_tier=None, disk_tier=None) -> None:
        self.block_tokens = block_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.host = host_tier                     # HostTierIndex (cache/host_tier.py) or None
        self.block_copies: list[BlockCopy] = []   # host-tier copies decided since the last take
        self.num_onloads = self.num_offloads = 0
        if host_tier is not None:
            self.pool.on_evict = self._offload
        self.disk = disk_tier                     # DiskTierIndex (cache/disk_tier.py) under the host tier, or None
        self.num_spills = self.num_disk_onloads = 0
        if disk_tier is not None:
            host_tier.on_evict = self._spill
        self.num_hashed: dict[str, int] = {}      # req_id -> leading blocks of its table registered by hash
        self.num_ring_slots = num_ring_slots
        self._free_slots = list(range(num_ring_slots - 1, -1, -1))
        self.block_ids: dict[str, list[int]] = {}  # req_id -> block table
        self.ring_slot: dict[str, int] = {}        # req_id -> ring slot

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_tokens)

    def can_fit_alone(self, num_tokens: int) -> bool:
        return self.num_blocks_for(num_tokens) <= self.pool.num_blocks

    def allocate_slots(self, req_id: str, num_tokens: int, cached_blocks: list[int] | None = None) -> list[int] | None:
        """Make the request's caches cover positions [0, num_tokens).

        cached_blocks (a request's first allocation only): its prefix hit, shared by reference; they
        lead the table. Returns the newly allocated block ids ([] when none were needed), or None
        when the pool is short (nothing is taken then, the caller preempts someone and retries).
        """
        table = self.block_ids.get(req_id)
        cached = list(cached_blocks or [])
        if table is None:
            if not self._free_slots:
                return None
            table = []
        elif cached:
            raise RuntimeError(f"request {req_id} already holds blocks: a prefix hit comes first")
        need = self.num_blocks_for(num_tokens) - len(table) - len(cached)
        # idle cached blocks of the hit stop counting as free once referenced
        idle_hits = sum(1 for b in cached if self.pool.ref_count(b) == 0)
        if max(need, 0) > self.pool.num_free_blocks - idle_hits:
            return None
        self.pool.touch(cached)
        new = self.pool.allocate(need) if need > 0 else []
        if req_id not in self.block_ids:
            self.block_ids[req_id] = table
            self.ring_slot[req_id] = self._free_slots.pop()
            self.num_hashed[req_id] = len(cached)
        table.extend(cached)
        table.extend(new)
        return new

    # prefix caching ------------------------------------------------------------------------------
    def find_cached_blocks(self, block_hashes: list[bytes], max_blocks: int) -> list[int]:
        """The blocks of the longest cached prefix of a hash chain (at most max_blocks)."""
        hit = []
        for h in block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def tiered_run(self, block_hashes: list[bytes], start: int, max_blocks: int) -> int:
        """How many blocks of the chain from `start` (past the device hit) the host / disk tiers hold in a
        row: what an admission's onload would bring back. A look: no LRU moves, nothing copied."""
        if self.host is None:
            return 0
        n = 0
        for h in block_hashes[start:max_blocks]:
            if h not in self.host and (self.disk is None or h not in self.disk):
                break
            n += 1
        return n

    def cache_full_blocks(self, req_id: str, block_hashes: list[bytes], num_tokens: int) -> None:
        """Register the request's blocks that are full and written below position num_tokens (the
        caller passes min(computed, known) tokens) under their chain hashes."""
        if not self.enable_prefix_caching or req_id not in self.block_ids:
            return
        table = self.block_ids[req_id]
        done = self.num_hashed[req_id]
        upto = min(num_tokens // self.block_tokens, len(block_hashes), len(table))
        for k in range(done, upto):
            self.pool.cache(table[k], block_hashes[k])
        self.num_hashed[req_id] = max(done, upto)

    # host tier -----------------------------------------------------------------------------------
    def _offload(self, block: int, block_hash: bytes) -> None:
        """An idle cached block is being taken back: its content goes to the host tier first."""
        if self.host.get(block_hash) is not None:
            return                      # the host holds it already (it came from there)
        slot = self.host.put(block_hash)
        if slot is not None:
            self.block_copies.append(BlockCopy("offload", block, slot))
            self.num_offloads += 1

    def _spill(self, block_hash: bytes, slot: int) -> None:
        """The host tier reuses this slot: its block goes to the disk tier first."""
        drops = self.disk.put(block_hash)
        if drops is None:
            return                      # a file holds it already, or the tier has no room
        self.block_copies += [BlockCopy("disk_drop", -1, -1, h.hex()) for h in drops]
        self.block_copies.append(BlockCopy("spill", -1, slot, block_hash.hex()))
        self.num_spills += 1

    def _onload_from_disk(self, block_hash: bytes) -> int | None:
        """A device block holding the disk tier's copy of this hash (read before the next step), or None."""
        if self.disk is None or not self.disk.has(block_hash):
            return None
        new = self.pool.allocate(1)
        if new is None:
            return None
        if not self.disk.has(block_hash):    # making room spilled enough to drop it: give the block back
            self.pool.free(new)
            return None
        self.block_copies.append(BlockCopy("disk_onload", new[0], -1, block_hash.hex()))
        self.num_disk_onloads += 1
        return new[0]

    def onload(self, block_hashes: list[bytes], max_blocks: int) -> int:
        """Bring the host tier's blocks that extend the device hit back into the pool (as idle
        cached blocks, copied before the next step); -> how many. The device hit and the blocks
        brought in stay referenced meanwhile, so making room never evicts them."""
        if self.host is None:
            return 0
        held = self.find_cached_blocks(block_hashes, max_blocks)
        self.pool.touch(held)
        n0 = len(held)
        for h in block_hashes[n0:max_blocks]:
            slot = self.host.get(h)
            new = self.pool.allocate(1) if slot is not None else None
            if new is not None:
                self.block_copies.append(BlockCopy("onload", new[0], slot))
            else:
                b = self._onload_from_disk(h)
                if b is None:
                    break
                new = [b]
            self.pool.cache(new[0], h)
            held.append(new[0])
        self.pool.free(held)
        self.num_onloads += len(held) - n0
        return len(held) - n0

    def take_block_copies(self) -> list[BlockCopy]:
        copies, self.block_copies = self.block_copies, []
        return copies

    def forget_blocks(self, req_id: str) -> None:
        """Unregister the blocks only this request references (their content came from a step that
        failed): nothing will be served from them."""
        for b in self.block_ids.get(req_id, []):
            if self.pool.ref_count(b) == 1:
                self.pool.uncache(b)

    def rollback(self, req_id: str, num_tokens: int) -> None:
        """Free the blocks past position num_tokens - 1 (rejected draft positions)."""
        table = self.block_ids[req_id]
        keep = self.num_blocks_for(num_tokens)
        if keep < len(table):
            self.pool.free(table[keep:])
            del table[keep:]

    def free(self, req_id: str) -> None:
        """Release everything the request owns (finish, abort, preemption). Idempotent."""
        table = self.block_ids.pop(req_id, None)
        if table is None:
            return
        self.num_hashed.pop(req_id, None)
        self.pool.free(table)
        self._free_slots.append(self.ring_slot.pop(req_id))

    def check(self) -> None:
        """Exact accounting for tests: a block's reference count is the number of tables holding it
        (one without prefix caching), and only referenced blocks are used."""
        self.pool.check()
        from collections import Counter
        owners = Counter(b for t in self.block_ids.values() for b in t)
        for b, n in owners.items():
            assert self.pool.ref_count(b) == n, f"block {b}: ref {self.pool.ref_count(b)}, in {n} tables"
        if not self.enable_prefix_caching:
            assert all(n == 1 for n in owners.values()), "a block has two owners"
        assert len(owners) == self.pool.num_used_blocks, (len(owners), self.pool.num_used_blocks)
        assert len(self._free_slots) + len(self.ring_slot) == self.num_ring_slots
