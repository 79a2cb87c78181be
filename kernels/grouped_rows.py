"""Rows sorted by expert (the MoE's grouped contiguous layout) and their M-tile maps.

    GroupedRows(counts)        counts [E] rows per expert (device), with .tiles(bm, rows) built at most
                               once per tile height: a MoE layer's two projections share one map
    grouped_tiles(counts, bm, rows)   the map itself: int32 [T, 3] of (first row, row end, expert)
    counts_of(rows_or_counts)  the counts tensor of either form (paths that need no tile map)

Why an object and not a cache: the map costs ~15 small torch ops of host time per build, which a
2,048-token prefill chunk cannot hide (H200, 2026-12-03: chunked prefill host-bound); a layer builds the
object once and hands it to both GEMMs, so nothing is keyed on tensor identity or version counters
(inference tensors keep none).
"""

from __future__ import annotations

import torch


def grouped_tiles(counts: torch.Tensor, bm: int, rows: int) -> tuple[torch.Tensor, int]:
    """(int32 [T, 3] of (first row, row end, expert), T) for `rows` rows sorted by expert, counts[e] rows
    each: the M tiles split at expert boundaries, built on the device with no host sync (CUDA graphs): T
    is the bound ceil(rows / bm) + E, and the tiles past the last used one carry expert -1."""
    counts = counts.to(torch.int64)
    e = counts.numel()
    dev = counts.device
    starts = torch.cumsum(counts, 0) - counts
    per = (counts + bm - 1) // bm                                   # tiles per expert
    first_tile = torch.cumsum(per, 0) - per
    t = -(-rows // bm) + e
    idx = torch.arange(t, device=dev)
    ex = torch.searchsorted(first_tile + per, idx, right=True).clamp(max=e - 1)   # the expert of tile idx
    local = idx - first_tile[ex]
    row0 = starts[ex] + local * bm
    end = starts[ex] + counts[ex]
    used = local < per[ex]
    tiles = torch.stack([row0, end, torch.where(used, ex, torch.full_like(ex, -1))], 1).to(torch.int32)
    return tiles.contiguous(), t


class GroupedRows:
    def __init__(self, counts: torch.Tensor):
        self.counts = counts
        self._maps: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}

    def tiles(self, bm: int, rows: int) -> tuple[torch.Tensor, int]:
        key = (bm, rows)
        if key not in self._maps:
            self._maps[key] = grouped_tiles(self.counts, bm, rows)
        return self._maps[key]


def counts_of(rows: "GroupedRows | torch.Tensor") -> torch.Tensor:
    return rows.counts if isinstance(rows, GroupedRows) else rows
