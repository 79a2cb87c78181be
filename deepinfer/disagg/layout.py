"""CacheLayout: where one request's state lives in ModelCaches, as runs of bytes.

Two kinds of region (model_caches.py):

    per ring slot   window_kv[layer] (DSpark layers included), carry_kv[src], carry_score[src]:
                    [slots, RING, row] -> the rows of positions p live at [slot, p % RING]
    per block       compressed_kv[src], index_k[src]: [blocks, entries, row] -> block b is contiguous

A request with positions 0..n-1 in the caches needs, to go on from position n, only the ring rows a
later step reads, and its blocks:

    window_kv       the last WINDOW = RING / 2 positions (a query at p >= n reads p - WINDOW + 1 .. p)
    carry (ratio r) the positions of the unfinished group, n - n % r .. n - 1 (the group's later
                    members arrive fresh; every finished group is already an entry in the pool)

The positions kept are at most two runs of ring rows (position p lives at row p % RING):

    RING = 8, keep 4, n = 5:  positions 1..4  -> rows 1..4
    RING = 8, keep 4, n = 10: positions 6..9  -> rows 6..7 and 0..1

The runs of the same request on two instances pair up one to one (same layout, same order), so a
transfer is a list of (address, length) pairs on each side.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Region:
    name: str
    tensor: torch.Tensor            # [slots | blocks, rows, row_width]
    per_slot: bool                  # True: indexed by ring slot; False: by block id
    ratio: int = 0                  # a compressor carry's ratio (keeps n % ratio rows); 0: a window ring

    @property
    def row_bytes(self) -> int:
        return self.tensor.shape[2] * self.tensor.element_size()

    @property
    def item_bytes(self) -> int:    # one slot's rows or one block
        return self.tensor.shape[1] * self.row_bytes


def ring_runs(num_tokens: int, ring_len: int, keep: int | None = None) -> list[tuple[int, int]]:
    """(first ring row, number of rows) runs holding positions max(0, n - keep)..n-1 (keep defaults
    to the whole ring, at most RING): one run, or two where the positions wrap past the ring's end."""
    keep = ring_len if keep is None else min(keep, ring_len)
    start = max(0, num_tokens - keep)
    count = num_tokens - start
    if count <= 0:
        return []
    if count == ring_len:            # every row, as one run
        return [(0, ring_len)]
    first = start % ring_len
    if first + count <= ring_len:
        return [(first, count)]
    return [(first, ring_len - first), (0, first + count - ring_len)]


class CacheLayout:
    def __init__(self, caches) -> None:
        self.ring_len, self.block_tokens = caches.ring_len, caches.block_tokens
        regions = [Region(f"window.{i}", t, True) for i, t in enumerate(caches.window_kv)]
        regions += [Region(f"carry_kv.{s}", t, True, caches.ratios[s]) for s, t in sorted(caches.carry_kv.items())]
        regions += [Region(f"carry_score.{s}", t, True, caches.ratios[s])
                    for s, t in sorted(caches.carry_score.items())]
        regions += [Region(f"compressed_kv.{s}", t, False) for s, t in sorted(caches.compressed_kv.items())]
        regions += [Region(f"index_k.{s}", t, False) for s, t in sorted(caches.index_k.items())]
        self.regions = regions
        device = caches.window_kv[0].device
        self.mem_type = "VRAM" if device.type == "cuda" else "DRAM"
        self.dev_id = (device.index or 0) if device.type == "cuda" else 0
        self._bases: list[int] | None = None     # a mirror's: the other process's addresses

    def describe(self) -> dict:
        """Plain data from which another process rebuilds this layout (CacheLayout.mirror)."""
        return {"ring_len": self.ring_len, "block_tokens": self.block_tokens, "mem_type": self.mem_type,
                "dev_id": self.dev_id, "regions": [(r.name, tuple(r.tensor.shape), str(r.tensor.dtype).split(".")[-1],
                                                    r.per_slot, r.ratio) for r in self.regions],
                "base_addrs": self.base_addrs()}

    @classmethod
    def mirror(cls, desc: dict) -> "CacheLayout":
        """The layout of another process's caches (a rank worker's, from its describe()): meta tensors of
        the same shapes, that process's addresses; runs, sizes and the signature as there."""
        self = cls.__new__(cls)
        self.ring_len, self.block_tokens = desc["ring_len"], desc["block_tokens"]
        self.mem_type, self.dev_id = desc["mem_type"], desc["dev_id"]
        self.regions = [Region(name, torch.empty(shape, dtype=getattr(torch, dtype), device="meta"), per_slot, ratio)
                        for name, shape, dtype, per_slot, ratio in desc["regions"]]
        self._bases = list(desc["base_addrs"])
        return self

    @property
    def signature(self) -> str:
        """Equal on two instances iff their runs of one request pair up (shapes past dim 0, dtypes)."""
        desc = [self.ring_len, self.block_tokens] + [
            [r.name, r.per_slot, list(r.tensor.shape[1:]), str(r.tensor.dtype)] for r in self.regions]
        return hashlib.sha1(json.dumps(desc).encode()).hexdigest()[:16]

    def base_addrs(self) -> list[int]:
        if self._bases is not None:
            return list(self._bases)
        return [r.tensor.data_ptr() for r in self.regions]

    def registrations(self) -> list[tuple[int, int, int, str]]:
        """Whole tensors, for NIXL registration: (address, bytes, device id, "")."""
        return [(r.tensor.data_ptr(), r.tensor.numel() * r.tensor.element_size(), self.dev_id, "")
                for r in self.regions]

    def kept_rows(self, region: Region, num_tokens: int) -> list[tuple[int, int]]:
        """The ring runs of a per-slot region that a request of n positions needs (module docstring)."""
        keep = num_tokens % region.ratio if region.ratio else self.ring_len // 2
        return ring_runs(num_tokens, self.ring_len, keep)

    def runs(self, num_tokens: int, ring_slot: int, block_ids, base_addrs=None,
             window: bool = True, dev_id: int | None = None) -> list[tuple[int, int, int]]:
        """(address, bytes, device id) of every run of one request; base_addrs, dev_id: another instance's
        region addresses (the same layout) and GPU, default this one's; window=False: the blocks only."""
        bases = base_addrs if base_addrs is not None else self.base_addrs()
        dev = self.dev_id if dev_id is None else dev_id
        num_blocks = -(-num_tokens // self.block_tokens)
        out = []
        for r, base in zip(self.regions, bases):
            if r.per_slot:
                if not window:
                    continue
                slot = base + ring_slot * r.item_bytes
                out += [(slot + first * r.row_bytes, count * r.row_bytes, dev)
                        for first, count in self.kept_rows(r, num_tokens)]
            else:
                out += [(base + int(b) * r.item_bytes, r.item_bytes, dev) for b in block_ids[:num_blocks]]
        return out

    def num_bytes(self, num_tokens: int, window: bool = True) -> tuple[int, int]:
        """(window ring + carry bytes, compressed-KV + index-key bytes) one request of n tokens moves."""
        num_blocks = -(-num_tokens // self.block_tokens)
        ring = sum(count * r.row_bytes for r in self.regions if r.per_slot and window
                   for _, count in self.kept_rows(r, num_tokens))
        return ring, sum(num_blocks * r.item_bytes for r in self.regions if not r.per_slot)
