"""The MoE's grouped contiguous GEMM straight from packed MXFP4 experts (W4A16): no per-step dequant pass.

    w4a16_grouped_contiguous(x, w, s, rows)   x [P, K] bf16 rows sorted by expert (rows: GroupedRows or
                                              counts [E]), w [E, N, K/2] uint8 in fp4_layout's kernel
                                              layout, s [E, N, K/32] E8M0 bytes (1..128) -> [P, N] bf16
    contiguous_config(rows, experts, n, k)    its launch config

Why: FP4 stacks (expert_format="fp4", the release's default at EP8) ran every prefill-sized MoE step as the
whole stack dequantized to bf16 (0.5 bytes read + 2 written + 2 read again a weight) and one bf16 grouped GEMM.
At a 2,048-token chunk the dequant took longer than the GEMM (H100, 2026-12-06: 64.8 ms of a 40-layer
forward, each chunk paying it again). Here each tile decodes its weights in the registers the wgmma reads
them from (triton_gemm._fp4_tile: the decode kernel's asm), so the stack is read once, half a byte a weight.

Dataflow: grid (N tiles, row tiles of grouped_rows' map: a tile never spans two experts). Swapped tiles: the
BN weight rows are the wgmma's M side (its A operand, fed from registers as decoded), the tile's BM tokens
its N side (read from shared memory), acc [BN, BM] in fp32, stored transposed. Scales: one E8M0 byte a
(row, 32), loaded one K step ahead by hand (too small a copy for the pipeliner). The products are the
release's exact ones (e2m1 x 2^k and the FP8-rounded activations are bf16 values), summed in fp32: the
dequant + bf16 path's values up to summation order.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .grouped_rows import GroupedRows
from .triton_gemm import _fp4_tile

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def w4a16_contiguous_kernel(x_ptr, b_ptr, s_ptr, c_ptr, tiles_ptr, N, K,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr,
                            UPCAST: tl.constexpr, EVEN_N: tl.constexpr = False):
    """x [P, K] bf16, b [E, N, K/2] bytes read as [BN, BK/4] int16 quads, s [E, N, K/32] bytes,
    tiles int32 [T, 3] (first row, row end, expert; expert -1: unused) -> c [P, N] bf16.
    EVEN_N: N % BN == 0, so the weight and scale loads need no row mask (fewer predicates in the K loop)."""
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    e = tl.load(tiles_ptr + t * 3 + 2)
    if e < 0:
        return
    row0 = tl.load(tiles_ptr + t * 3)
    row_end = tl.load(tiles_ptr + t * 3 + 1)
    rm = row0 + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok = rm < row_end
    n_ok = (rn < N) | EVEN_N
    e64 = e.to(tl.int64)
    nkb = K // BK
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * K + tl.arange(0, BK)[None, :]
    w_ptrs = (b_ptr.to(tl.pointer_type(tl.int16)) + e64 * N * (K // 4) + rn[:, None].to(tl.int64) * (K // 4)
              + tl.arange(0, BK // 4)[None, :])
    sc_ptrs = s_ptr + e64 * N * (K // 32) + rn[:, None].to(tl.int64) * (K // 32) + tl.arange(0, BK // 32)[None, :]
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    sc_next = tl.load(sc_ptrs, mask=n_ok[:, None], other=1)
    for kb in tl.range(0, nkb, num_stages=NUM_STAGES):
        x = tl.load(x_ptrs + kb * BK, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs + kb * (BK // 4), mask=n_ok[:, None], other=0)
        sc = sc_next.to(tl.int32) & 0xFF
        # the last step reloads its own bytes rather than read past the row's K range
        sc_next = tl.load(sc_ptrs + tl.minimum(kb + 1, nkb - 1) * (BK // 32), mask=n_ok[:, None], other=1)
        wd = _fp4_tile(w, sc, BN, BK, UPCAST)
        if UPCAST:                      # CPU interpreter: fp32 operands (its bf16 dots are not the GPU's)
            x = x.to(tl.float32)
        acc = tl.dot(wd, tl.trans(x), acc)
    c_ptrs = c_ptr + rm[None, :].to(tl.int64) * N + rn[:, None]
    tl.store(c_ptrs, acc.to(tl.bfloat16), mask=n_ok[:, None] & m_ok[None, :])


def contiguous_config(rows: int, experts: int, n: int, k: int) -> dict:
    """BM tokens x BN weight rows x BK a tile, from the mean rows an expert gets (a tile never spans two
    experts, so tiles taller than that run half empty). H100, 2026-12-06 (perf/bench_fp4_prefill.py, 48
    experts, w13 / w2): 64 rows an expert best at BM 64 / BK 128 (318 / 298 TFLOP/s), 256 at BM 256 / BK 64
    (513 / 475; BM 128: 478 / 466), 1,024 at BM 256 (532 / 505). BK: the largest of those dividing K."""
    per_expert = rows / max(experts, 1)
    bm, bk, stages = (64, 128, 3) if per_expert <= 96 else (128, 64, 4) if per_expert <= 192 else (256, 64, 3)
    while k % bk:
        bk //= 2
    return dict(BM=bm, BN=128 if n > 64 else 64, BK=bk, NUM_STAGES=stages, num_warps=8 if n > 64 else 4)


def w4a16_grouped_contiguous(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, rows: "GroupedRows | torch.Tensor",
                             cfg: dict | None = None) -> torch.Tensor:
    """x [P, K] bf16 rows sorted by expert, w [E, N, K/2] packed MXFP4 (fp4_kernel_layout), s [E, N, K/32]
    E8M0 bytes in 1..128 (fp4_kernel_weight's), rows: GroupedRows (its tile map shared with the layer's
    other GEMM) or counts [E] -> [P, N] bf16, row r through its expert's weight. K % 32 == 0."""
    P, k = x.shape
    E, n = w.shape[0], w.shape[1]
    assert k % 32 == 0 and w.shape[2] * 2 == k and s.shape == (E, n, k // 32), (x.shape, w.shape, s.shape)
    if not isinstance(rows, GroupedRows):
        rows = GroupedRows(rows)
    out = torch.empty(P, n, dtype=torch.bfloat16, device=x.device)
    if P == 0 or n == 0:
        return out
    cfg = dict(cfg or contiguous_config(P, E, n, k))
    if INTERPRET:
        cfg["NUM_STAGES"] = 1
    w8, s8 = w.view(torch.uint8), s.view(torch.uint8)
    assert w8.is_contiguous() and s8.is_contiguous() and w8.data_ptr() % 2 == 0, "FP4 weights are read as int16"
    tiles, t = rows.tiles(cfg["BM"], P)
    grid = (triton.cdiv(n, cfg["BN"]), t)
    w4a16_contiguous_kernel[grid](x.contiguous(), w8, s8, out, tiles, n, k, UPCAST=INTERPRET,
                                  EVEN_N=n % cfg["BN"] == 0, **cfg)
    return out
