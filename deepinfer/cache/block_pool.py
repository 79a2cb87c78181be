"""A pool of paged cache blocks: free list and reference counts (nano-vllm's block manager size).

Knows blocks, not models. Reference counts are there for prefix sharing later; today every
block has one owner. Accounting is exact: num_free_blocks + num_used_blocks == num_blocks.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_cnt = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self._ref_cnt[b] = 1
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block returns to the free list at zero."""
        for b in block_ids:
            if self._ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                self._free.append(b)

    def check(self) -> None:
        """Invariant check for tests: free list and ref counts agree."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate block in free list"
        for b in range(self.num_blocks):
            assert (self._ref_cnt[b] == 0) == (b in free), f"block {b}: ref {self._ref_cnt[b]}"
