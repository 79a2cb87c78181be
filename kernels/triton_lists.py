"""Attention index lists in pool coordinates, built in one pass (the decode step's per-layer glue).

    pool_lists(win_pool, win_len, topk, seq_of, block_tables, epb, base) -> [T, Lw + K], win_pool's dtype
        row t: win_pool[t, :win_len[t]], then its compressed picks as pool rows (base + the row of entry
        e in the paged pool: block_tables[seq, e // epb] * epb + e % epb; -1 picks stay -1), then -1.

    window_pool(win_idx, ring_read, ring_rows, num_fresh) -> [T, W] int32
        the step's window lists as rows of the ring, then the fresh rows (reference.window_pool_ref): once a
        step, ~8 torch launches (arange, cat, cast, clamp, gather, compare, where) -> one

What pool_lists replaces per compressed layer (Attention.forward on the in-place attention path): the picks'
block-table lookups (~7 torch kernels), the lists' concatenation and scatter (~5) and the buffer ->
pool row table (~8), about 20 launches for a few KB of int64.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_enter

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def pool_lists_kernel(win_ptr, wlen_ptr, topk_ptr, seq_ptr, bt_ptr, out_ptr, Lw, K, nb, stride_bt, epb, base,
                      BL: tl.constexpr, PDL: tl.constexpr = False):
    """Program t: out[t, j] for j < Lw + K, composed in registers (no overlapping stores)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BL)
    L = Lw + K
    w = tl.load(wlen_ptr + t)
    in_win = j < w
    k = j - w
    in_pick = (k >= 0) & (k < K)
    win = tl.load(win_ptr + t * Lw + j, mask=in_win & (j < Lw), other=-1)
    e = tl.load(topk_ptr + t * K + k, mask=in_pick, other=-1)
    ec = tl.maximum(e, 0)
    s = tl.load(seq_ptr + t)
    col = tl.minimum(ec // epb, nb - 1)
    blk = tl.load(bt_ptr + s * stride_bt + col, mask=in_pick, other=0)
    pick = tl.where(e >= 0, base + tl.maximum(blk, 0) * epb + ec % epb, -1)
    out = tl.where(in_win, win, tl.where(in_pick, pick, -1))
    tl.store(out_ptr + t * L + j, out, mask=j < L)


@triton.jit
def window_pool_kernel(win_ptr, read_ptr, out_ptr, W, R, ring_rows, BW: tl.constexpr):
    """Program t: out[t, j] = -1 (w < 0), ring_read[w] (w < R), else ring_rows + w - R; w = win_idx[t, j]."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BW)
    m = j < W
    w = tl.load(win_ptr + t * W + j, mask=m, other=-1).to(tl.int64)
    in_ring = (w >= 0) & (w < R)
    r = tl.load(read_ptr + tl.where(in_ring, w, 0), mask=m & in_ring, other=0).to(tl.int64)
    out = tl.where(w < 0, -1, tl.where(w < R, r, ring_rows + w - R))
    tl.store(out_ptr + t * W + j, out.to(tl.int32), mask=m)


def window_pool(win_idx: torch.Tensor, ring_read: torch.Tensor, ring_rows: int, num_fresh: int) -> torch.Tensor:
    T, W = win_idx.shape
    out = torch.empty(T, W, dtype=torch.int32, device=win_idx.device)
    if T and W:
        window_pool_kernel[(T,)](win_idx.contiguous(), ring_read.contiguous(), out, W, ring_read.shape[0], ring_rows,
                                 BW=triton.next_power_of_2(W), num_warps=1 if W <= 256 else 4)
    return out


def pool_lists(win_pool: torch.Tensor, win_len: torch.Tensor, topk: torch.Tensor, seq_of: torch.Tensor,
               block_tables: torch.Tensor, epb: int, base: int) -> torch.Tensor:
    T, Lw = win_pool.shape
    K = topk.shape[1]
    # int32 lists (window_pool's) go to sparse_attn as they are: no conversion launch per layer
    out = torch.empty(T, Lw + K, dtype=win_pool.dtype, device=win_pool.device)
    if T:
        bt = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
        pool_lists_kernel[(T,)](win_pool.contiguous(), win_len.contiguous(), topk.contiguous(), seq_of.contiguous(),
                                bt, out, Lw, K, bt.shape[1], bt.stride(0), epb, base,
                                BL=triton.next_power_of_2(Lw + K), num_warps=4, **pdl_args())
    return out
