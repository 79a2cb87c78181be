"""Per-request cache ownership: one window-ring slot and a block table of paged blocks.

The model's caches (deepinfer/cache/model_caches.py) are of two shapes:
- per running sequence, one ring slot: the window ring of every layer (2 x window positions) and
  the compressor carry-over state. Slots are a fixed pool of max_num_seqs, so a running request
  always has one;
- paged blocks of block_tokens positions (compressed KV and index keys of every source layer),
  one block table per request, shared by all layers.
Engram n-gram history is not cached: the runner reads it from the request's token ids.

Caches are addressed by absolute position, so a rollback (rejected drafts) only lowers the
request's length and frees the blocks past it:

    block_tokens = 4, request computed 0..9 and verifies 3 drafts at 10..12:
    positions  | 0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 |
    blocks       b0        b1        b2          b3     <- allocate_slots(req, 13)
    1 draft accepted -> num_computed_tokens = 11 -> rollback(req, 11) keeps b0..b2, frees b3
"""

from __future__ import annotations

from deepinfer.cache.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_tokens: int, num_ring_slots: int) -> None:
        self.block_tokens = block_tokens
        self.pool = BlockPool(num_blocks)
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

    def allocate_slots(self, req_id: str, num_tokens: int) -> list[int] | None:
        """Make the request's caches cover positions [0, num_tokens).

        Returns the newly appended block ids ([] when none were needed), or None when the pool is
        short (nothing is taken then, the caller preempts someone and retries).
        """
        table = self.block_ids.get(req_id)
        if table is None:
            if not self._free_slots:
                return None
            table = []
        need = self.num_blocks_for(num_tokens) - len(table)
        new = self.pool.allocate(need) if need > 0 else []
        if new is None:
            return None
        if req_id not in self.block_ids:
            self.block_ids[req_id] = table
            self.ring_slot[req_id] = self._free_slots.pop()
        table.extend(new)
        return new

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
        self.pool.free(table)
        self._free_slots.append(self.ring_slot.pop(req_id))

    def check(self) -> None:
        """Exact accounting for tests: every used block belongs to exactly one request."""
        self.pool.check()
        owned = [b for t in self.block_ids.values() for b in t]
        assert len(owned) == len(set(owned)), "a block has two owners"
        assert len(owned) == self.pool.num_used_blocks, (len(owned), self.pool.num_used_blocks)
        assert len(self._free_slots) + len(self.ring_slot) == self.num_ring_slots
