"""Rows sorted by expert (the MoE's grouped contiguous layout) and their M-tile maps.

    GroupedRows(counts)        counts [E] rows per expert (device), with .tiles(bm, rows) built at most
                               once per tile height: a MoE layer's two projections share one map
    grouped_tiles(counts, bm, rows)   the map itself: int32 [T, 3] of (first row, row end, expert); on
                               CUDA one single-program Triton launch, else grouped_tiles_ref's torch ops
    counts_of(rows_or_counts)  the counts tensor of either form (paths that need no tile map)

Why an object and not a cache: each build is host time (one launch on CUDA, ~15 small torch ops
before) that a 2,048-token prefill chunk cannot hide (H200, 2026-12-03: chunked prefill host-bound); a
layer builds the object once and hands it to both GEMMs, so nothing is keyed on tensor identity or
version counters (inference tensors keep none).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def grouped_tiles(counts: torch.Tensor, bm: int, rows: int) -> tuple[torch.Tensor, int]:
    """(int32 [T, 3] of (first row, row end, expert), T) for `rows` rows sorted by expert, counts[e] rows
    each: the M tiles split at expert boundaries, built on the device with no host sync (CUDA graphs): T
    is the bound ceil(rows / bm) + E, and the tiles past the last used one carry expert -1. On CUDA (or
    under Triton's interpreter) one launch; the torch form is ~15 small ops of host time per map."""
    if counts.is_cuda or INTERPRET:
        return grouped_tiles_triton(counts, bm, rows)
    return grouped_tiles_ref(counts, bm, rows)


@triton.jit
def grouped_tiles_kernel(counts_ptr, out_ptr, E, T, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr):
    """One program: per expert its tile count and first tile (exclusive scans), then per block of BT
    tiles the expert by counting the experts whose tiles end at or before it (searchsorted, right), its
    fields picked by a one-hot sum over the experts (registers cannot be gathered)."""
    e = tl.arange(0, BE)
    cnt = tl.load(counts_ptr + e, mask=e < E, other=0).to(tl.int32)
    per = (cnt + BM - 1) // BM
    end_tile = tl.cumsum(per, 0)
    first_tile = end_tile - per
    start = tl.cumsum(cnt, 0) - cnt
    for t0 in range(0, T, BT):
        idx = t0 + tl.arange(0, BT)
        past = (end_tile[None, :] <= idx[:, None]) & (e[None, :] < E)
        ex = tl.minimum(tl.sum(past.to(tl.int32), 1), E - 1)
        hot = e[None, :] == ex[:, None]
        ft = tl.sum(tl.where(hot, first_tile[None, :], 0), 1)
        st = tl.sum(tl.where(hot, start[None, :], 0), 1)
        n = tl.sum(tl.where(hot, cnt[None, :], 0), 1)
        pe = tl.sum(tl.where(hot, per[None, :], 0), 1)
        local = idx - ft
        ok = idx < T
        tl.store(out_ptr + idx * 3, st + local * BM, mask=ok)
        tl.store(out_ptr + idx * 3 + 1, st + n, mask=ok)
        tl.store(out_ptr + idx * 3 + 2, tl.where(local < pe, ex, -1), mask=ok)


def grouped_tiles_triton(counts: torch.Tensor, bm: int, rows: int) -> tuple[torch.Tensor, int]:
    e = counts.numel()
    t = -(-rows // bm) + e
    out = torch.empty(t, 3, dtype=torch.int32, device=counts.device)
    be = triton.next_power_of_2(max(e, 2))
    bt = max(4, min(128, 8192 // be))           # a [BT, BE] int32 tile of ~8k elements per step
    grouped_tiles_kernel[(1,)](counts, out, e, t, BM=bm, BE=be, BT=bt, num_warps=4)
    return out, t


def grouped_tiles_ref(counts: torch.Tensor, bm: int, rows: int) -> tuple[torch.Tensor, int]:
    """grouped_tiles in torch ops (the CPU path and the kernel's reference)."""
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
