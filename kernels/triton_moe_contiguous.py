"""The MoE's grouped contiguous GEMM on the W8A16 path: every expert's rows in one launch.

    w8a16_grouped_contiguous(x, w, s, counts)   x [P, K] bf16 (FP8-rounded rows sorted by expert,
                                                counts[e] rows of expert e) @ w[e]^T -> [P, N] bf16
    contiguous_tiles(counts, bm)                the row tiles of that layout (device-side, no sync)

Dataflow: grid (N tiles, row tiles); row tile i belongs to expert tile_e[i] and starts at row
tile_row[i] (contiguous_tiles: a tile never spans two experts, tiles past the last exit at once).
Each program walks K in BK steps as triton_gemm.w8a16_gemm_kernel (v1) does: the e4m3 weight tile is
dequantized in registers (x its per-32 pow2 scale: exact in bf16) and fed to a bf16 MMA accumulating
in fp32: the reference's exact products. ROW_SCALE (stacks re-expressed with one f32 scale per row,
select.row_scaled_fp8_weight): the K loop reads no scale and the row scale (pow2) multiplies the fp32
accumulator once at the end (exact).

This replaces the per-expert loop of MoE._routed_loop for prefill-sized steps (one launch per
projection instead of 2-3 per expert, and no host read of the counts). Preconditions (asserted):
K % 32 == 0; w [E, N, K] e4m3; scales [E, N, K/32], [E, ceil(N/32), K/32] (E8M0 bytes or f32) or
[E, N, 1] f32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def w8a16_contiguous_kernel(x_ptr, b_ptr, sb_ptr, c_ptr, tile_e_ptr, tile_row_ptr, seg_end_ptr, N, K,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SB_ROWS: tl.constexpr,
                            ROW_SCALE: tl.constexpr, NUM_STAGES: tl.constexpr, UPCAST: tl.constexpr):
    """x [P, K] bf16, b [E, N, K] e4m3, sb [E, ceil(N/SB_ROWS), K/32] f32 (or [E, N, 1] with ROW_SCALE)
    -> c [P, N] bf16."""
    pid_n = tl.program_id(0)
    e = tl.load(tile_e_ptr + tl.program_id(1))
    if e < 0:
        return
    row0 = tl.load(tile_row_ptr + tl.program_id(1))
    rm = row0 + tl.arange(0, BM)
    m_ok = rm < tl.load(seg_end_ptr + e)
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    rk = tl.arange(0, BK)
    rs = tl.arange(0, BK // 32)
    e64 = e.to(tl.int64)
    nkb = K // 32
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :]
    b_ptrs = b_ptr + e64 * N * K + rn[:, None].to(tl.int64) * K + rk[None, :]
    if ROW_SCALE:
        sb_base = sb_ptr + e64 * N
    else:
        sb_base = sb_ptr + e64 * ((N + SB_ROWS - 1) // SB_ROWS) * nkb
    sb_ptrs = sb_base + (rn // SB_ROWS)[:, None].to(tl.int64) * nkb + rs[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in tl.range(0, K // BK, num_stages=NUM_STAGES):
        x = tl.load(x_ptrs + kb * BK, mask=m_ok[:, None], other=0.0)
        w = tl.load(b_ptrs + kb * BK, mask=n_ok[:, None], other=0.0)
        if UPCAST:                       # CPU interpreter: its bf16 casts and dots are not the GPU's
            wd = w.to(tl.float32)
            x = x.to(tl.float32)
        else:
            wd = w.to(tl.bfloat16)
        if not ROW_SCALE:
            sb = tl.load(sb_ptrs + kb * (BK // 32), mask=n_ok[:, None], other=0.0)
            wd = tl.reshape(tl.reshape(wd, (BN, BK // 32, 32)) * sb.to(wd.dtype)[:, :, None], (BN, BK))
        acc = tl.dot(x, tl.trans(wd), acc)
    if ROW_SCALE:
        acc = acc * tl.load(sb_base + rn, mask=n_ok, other=0.0)[None, :]
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(c_ptrs, acc.to(tl.bfloat16), mask=m_ok[:, None] & n_ok[None, :])


def contiguous_tiles(counts: torch.Tensor, bm: int, num_rows: int):
    """counts [E] (device) -> (tile_e [T] int32, tile_row [T] int64, seg_end [E] int64), T =
    cdiv(num_rows, bm) + E row tiles at most (num_rows = counts.sum(), known to the caller: no sync).

        rows   |e0 e0 e0 e0 e0|e1 e1|e3 e3 e3 ...      (sorted by expert, e2 empty)
        tiles  [e0    ][e0 ]  [e1 ] [e3    ]...       (bm = 3: a tile never spans two experts;
                                                        tiles past the last: tile_e = -1)"""
    E = counts.numel()
    counts = counts.to(torch.int64)
    seg_end = torch.cumsum(counts, 0)
    per = (counts + bm - 1) // bm
    tile_end = torch.cumsum(per, 0)                                            # [E] inclusive
    i = torch.arange(triton.cdiv(num_rows, bm) + E, device=counts.device)
    e = torch.searchsorted(tile_end, i, right=True)                            # the expert of tile i
    ec = e.clamp(max=E - 1)
    tile_row = (seg_end - counts)[ec] + (i - (tile_end - per)[ec]) * bm
    tile_e = torch.where(e < E, ec, torch.full_like(ec, -1)).to(torch.int32)
    return tile_e, tile_row, seg_end


def contiguous_config(n: int, k: int) -> dict:
    bk = 64 if k % 64 == 0 else 32
    return dict(BM=128, BN=128 if n >= 128 else max(32, triton.next_power_of_2(n)), BK=bk, NUM_STAGES=3,
                num_warps=8)


def w8a16_grouped_contiguous(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, counts: torch.Tensor,
                             cfg: dict | None = None) -> torch.Tensor:
    """x [P, K] bf16 FP8-rounded rows sorted by expert, w [E, N, K] e4m3, s (module docstring), counts
    [E] -> [P, N] bf16, row r through its expert's weight."""
    P, k = x.shape
    E, n, _ = w.shape
    assert k % 32 == 0 and w.shape[2] == k and counts.shape == (E,), (x.shape, w.shape, counts.shape)
    row_scale = s.shape[-1] == 1 and k > 32
    assert not row_scale or (s.dtype == torch.float32 and s.shape[1] == n)
    sb_rows = 1 if s.shape[1] == n else 32
    out = torch.empty(P, n, dtype=torch.bfloat16, device=x.device)
    if P == 0 or n == 0:
        return out
    cfg = dict(cfg or contiguous_config(n, k))
    if INTERPRET:
        cfg["NUM_STAGES"] = 1
    if s.dtype != torch.float32:
        s = (s.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)   # E8M0 -> exact pow2
    tile_e, tile_row, seg_end = contiguous_tiles(counts, cfg["BM"], P)
    grid = (triton.cdiv(n, cfg["BN"]), tile_e.numel())
    w8a16_contiguous_kernel[grid](x.contiguous(), w, s.contiguous(), out, tile_e, tile_row, seg_end, n, k,
                                  SB_ROWS=sb_rows, ROW_SCALE=row_scale, UPCAST=INTERPRET, **cfg)
    return out
