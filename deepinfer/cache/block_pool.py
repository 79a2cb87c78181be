"""A pool of paged cache blocks: free list, reference counts, and the content hashes of cached blocks.

Knows blocks and hashes, not models (nano-vllm's block manager shape). A block is in one of
three states:

    referenced   ref >= 1: in some request's block table (shared when a prefix was reused)
    cached idle  ref == 0 but holds the content of a hashed full block: kept for a later hit,
                 in LRU order, and taken back (its hash dropped) only when nothing free is left
    free         ref == 0 and holds nothing anyone can find

Accounting is exact: num_free_blocks (free + cached idle, what allocate can hand out) +
num_used_blocks (referenced) == num_blocks. Without prefix caching nothing is ever hashed and the
pool is a plain free list.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._idle: OrderedDict[int, None] = OrderedDict()   # cached idle blocks, least recently used first
        self._ref_cnt = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}                   # block -> content hash (cached blocks)
        self._block_of: dict[bytes, int] = {}                  # content hash -> block
        self.num_evictions = 0                                 # cached blocks taken back by allocate
        self.on_evict = None            # (block, hash) -> None, before the block is handed out (host tier)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._idle)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash (referenced or idle)."""
        return len(self._hash_of)

    @property
    def num_idle_cached_blocks(self) -> int:
        return len(self._idle)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block: int) -> int:
        return self._ref_cnt[block]

    # allocation ---------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, or None (and nothing taken) when fewer are free. Plain free blocks go
        first; then the least recently used cached idle blocks, whose hashes are dropped."""
        if n > self.num_free_blocks:
            return None
        ids = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._idle.popitem(last=False)
                h = self._hash_of.pop(b)
                del self._block_of[h]
                self.num_evictions += 1
                if self.on_evict is not None:
                    self.on_evict(b, h)
            self._ref_cnt[b] = 1
            ids.append(b)
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """One more reference to each (cached) block: a prefix hit. An idle block leaves the LRU."""
        for b in block_ids:
            if self._ref_cnt[b] == 0:
                if b not in self._idle:
                    raise RuntimeError(f"block {b} is free, not cached: it cannot be shared")
                del self._idle[b]
            self._ref_cnt[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block. At zero a cached block becomes idle (most recently
        used end), any other block free. Pass a table in position order: it is released tail
        first, so a sequence's last blocks are evicted before its first ones (the shared head)."""
        for b in reversed(block_ids):
            if self._ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                if b in self._hash_of:
                    self._idle[b] = None
                else:
                    self._free.append(b)

    # content hashes -----------------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash)

    def cache(self, block: int, block_hash: bytes) -> bool:
        """Make a referenced, fully written block findable by its hash. False (nothing changes)
        when that content is cached in another block already, or this block holds another hash."""
        if self._ref_cnt[block] <= 0:
            raise RuntimeError(f"block {block} is not referenced: only a written block can be cached")
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        return True

    def uncache(self, block: int) -> None:
        """Forget a block's content (e.g. written by a step that failed). Idempotent."""
        h = self._hash_of.pop(block, None)
        if h is None:
            return
        del self._block_of[h]
        if self._idle.pop(block, 0) is None:   # it was idle: now plainly free
            self._free.append(block)

    def clear_cache(self) -> int:
        """Forget every cached idle block (reset_prefix_cache); -> how many were dropped."""
        n = len(self._idle)
        for b in list(self._idle):
            self.uncache(b)
        return n

    def check(self) -> None:
        """Invariant check for tests: free list, LRU, ref counts and hash maps agree."""
        free, idle = set(self._free), set(self._idle)
        assert len(free) == len(self._free), "duplicate block in free list"
        assert not free & idle, "a block is both free and cached idle"
        for b in range(self.num_blocks):
            ref = self._ref_cnt[b]
            assert ref >= 0, f"block {b}: ref {ref}"
            assert (ref == 0) == (b in free or b in idle), f"block {b}: ref {ref}"
            assert (b in idle) <= (b in self._hash_of), f"idle block {b} has no hash"
            assert not (b in free and b in self._hash_of), f"free block {b} still has a hash"
        assert len(self._hash_of) == len(self._block_of)
        for b, h in self._hash_of.items():
            assert self._block_of[h] == b
