"""FP8 x FP8 GEMM with per-32 promotion for prefill-sized M (the release GEMM, on FP8 tensor cores).

    fp8_prefill_gemm(a, sa, b, sb)   D[M, N] = sum_kb (A_kb . B_kb^T) * sa[m, kb] * sb[n / R, kb]
    fp8_prefill_linear(x, w, w_scale) act_quant_fp8 (per 32, pow2) + fp8_prefill_gemm, bf16 out
    fp8_prefill_linear_ref           the same in plain torch (select._ref_fp8_linear's values)

Dataflow: a program owns a BM x BN tile and walks K in steps of BK = 128, loading the four 32-wide
slices of A and B of each step (so every global read is a 128-byte row run, where the BK = 32 walk
of triton_gemm.fp8_gemm_kernel reads 32-byte runs), then per slice one FP8 MMA into a fresh fp32
tile, scaled by (activation scale x weight scale, both powers of two: exact) and added in fp32:
the release's promotion every 32 K. Weights: e4m3 with one E8M0 / f32 scale per 32x32 tile
(R = 32) or per (row, 32) (R = 1), or one f32 scale per row over all of K (ROW_SCALE: the FP4
experts re-expressed at load, select.row_scaled_fp8_weight), which leaves one FMA per element and
slice and applies the row scale once in the epilogue.

Preconditions (asserted): K % 128 == 0 (select falls back to W8A16 otherwise), e4m3 operands,
contiguous rows. M and N are masked (any size).

NOTE(perf): H200, 2026-12-02 (perf/bench_fp8_prefill.py, M 8192): 72-74 TFLOP/s, 0.23-0.25x the W8A16
kernel and 0.5x the BK 32 walk: Triton waits on each slice's wgmma before its scale-and-add (4 waits per
128 K in the PTX). Opt-in (select.PREFILL_GEMM); an exact FP8 GEMM near DeepGEMM's rate needs the
promotion overlapped with the next slices' MMAs (two accumulators, warp specialization).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
BK = 128


@triton.jit
def _slice_dot(a_ptrs, b_ptrs, off, m_ok, n_ok, UPCAST: tl.constexpr):
    """One 32-wide K slice: the FP8 MMA of a [BM, 32] and b [BN, 32] into a fresh fp32 tile."""
    a = tl.load(a_ptrs + off, mask=m_ok[:, None], other=0.0)
    b = tl.load(b_ptrs + off, mask=n_ok[:, None], other=0.0)
    if UPCAST:                                   # the interpreter has no FP8 dot
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
    return tl.dot(a, tl.trans(b))


@triton.jit
def fp8_prefill_gemm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, M, N, K,
                            tile_e_ptr, tile_row_ptr, seg_end_ptr,
                            BM: tl.constexpr, BN: tl.constexpr, SB_ROWS: tl.constexpr, ROW_SCALE: tl.constexpr,
                            GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr,
                            UPCAST: tl.constexpr, CONTIGUOUS: tl.constexpr = False):
    """a [M, K] e4m3, sa [M, K/32] f32, b [N, K] e4m3, sb [N/SB_ROWS, K/32] f32 (as_f32_scale) or
    [N, 1] f32 (ROW_SCALE) -> c [M, N] bf16. 1-D grid over tiles, GROUP_M row tiles per column sweep
    (L2 reuse of B). CONTIGUOUS (the MoE's grouped contiguous layout): a's rows are sorted by expert;
    b and sb are stacks [E, N, ...]; grid (N tiles, row tiles): row tile i starts at tile_row[i] and
    belongs to expert tile_e[i] (-1: past the last tile, exits), whose rows end at seg_end[e]."""
    if CONTIGUOUS:
        pid_n = tl.program_id(0)
        e = tl.load(tile_e_ptr + tl.program_id(1))
        if e < 0:
            return
        row0 = tl.load(tile_row_ptr + tl.program_id(1))
        rm = row0 + tl.arange(0, BM)
        m_ok = rm < tl.load(seg_end_ptr + e)
        e64 = e.to(tl.int64)
        b_ptr += e64 * N * K
        if ROW_SCALE:
            sb_ptr += e64 * N
        else:
            sb_ptr += e64 * ((N + SB_ROWS - 1) // SB_ROWS) * (K // 32)
    else:
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        rows_here = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % rows_here
        pid_n = (pid % per_group) // rows_here
        rm = pid_m * BM + tl.arange(0, BM)
        m_ok = rm < M
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    rk = tl.arange(0, 32)
    nkb = K // 32
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * K + rk[None, :]
    b_ptrs = b_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
    sa_ptrs = sa_ptr + rm.to(tl.int64) * nkb
    sb_ptrs = sb_ptr + (rn // SB_ROWS).to(tl.int64) * nkb
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in tl.range(0, nkb, 4, num_stages=NUM_STAGES):
        off = kb * 32
        d0 = _slice_dot(a_ptrs, b_ptrs, off, m_ok, n_ok, UPCAST)
        d1 = _slice_dot(a_ptrs, b_ptrs, off + 32, m_ok, n_ok, UPCAST)
        d2 = _slice_dot(a_ptrs, b_ptrs, off + 64, m_ok, n_ok, UPCAST)
        d3 = _slice_dot(a_ptrs, b_ptrs, off + 96, m_ok, n_ok, UPCAST)
        sa0, sa1, sa2, sa3 = _four(sa_ptrs, kb, m_ok)
        if ROW_SCALE:
            acc += d0 * sa0[:, None]
            acc += d1 * sa1[:, None]
            acc += d2 * sa2[:, None]
            acc += d3 * sa3[:, None]
        else:
            sb0, sb1, sb2, sb3 = _four(sb_ptrs, kb, n_ok)
            acc += d0 * (sa0[:, None] * sb0[None, :])
            acc += d1 * (sa1[:, None] * sb1[None, :])
            acc += d2 * (sa2[:, None] * sb2[None, :])
            acc += d3 * (sa3[:, None] * sb3[None, :])
    if ROW_SCALE:
        acc = acc * tl.load(sb_ptr + rn, mask=n_ok, other=0.0)[None, :]
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(c_ptrs, acc.to(tl.bfloat16), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _four(row_ptrs, kb, ok):
    """The four f32 scales kb .. kb+3 of each row as four vectors: one 16-byte load per row (a
    cp.async the pipeliner streams), split in registers."""
    t = tl.load(row_ptrs[:, None] + kb + tl.arange(0, 4)[None, :], mask=ok[:, None], other=0.0)
    even, odd = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))          # columns (0, 2) and (1, 3)
    s0, s2 = tl.split(even)
    s1, s3 = tl.split(odd)
    return s0, s1, s2, s3


def as_f32_scale(sb: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> f32 powers of two (exact): 4-byte scale rows the pipeliner streams with cp.async
    next to the FP8 tiles, where 1-byte loads stay synchronous global loads in the K loop."""
    if sb.dtype == torch.float32:
        return sb
    return (sb.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)


def prefill_config(m: int, n: int) -> dict:
    """Tile of the K walk: 128 x 128 with 8 warps (two consumer warpgroups' worth of rows), 3 stages
    of the four slices (3 x 32 KB of shared memory)."""
    bn = 128 if n >= 128 else max(32, triton.next_power_of_2(n))
    return dict(BM=128, BN=bn, GROUP_M=8, NUM_STAGES=3, num_warps=8)


def shapes_ok(k: int) -> bool:
    return k % BK == 0


def fp8_prefill_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                     cfg: dict | None = None) -> torch.Tensor:
    """a [M, K] e4m3, sa [M, K/32] f32, b [N, K] e4m3, sb [N/32, K/32] or [N, K/32] (E8M0 bytes or
    f32 pow2), or [N, 1] f32 (one scale per row) -> [M, N] bf16."""
    m, k = a.shape
    n = b.shape[0]
    assert shapes_ok(k) and b.shape[1] == k and sa.shape == (m, k // 32), (a.shape, b.shape, sa.shape)
    row_scale = sb.shape[-1] == 1
    sb_rows = 1 if sb.shape[0] == n else 32
    assert (row_scale and sb.dtype == torch.float32 and sb.shape[0] == n
            or sb.shape[0] in (n, triton.cdiv(n, 32)) and sb.shape[1] == k // 32), (sb.shape, n, k)
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m == 0 or n == 0:
        return c
    cfg = dict(cfg or prefill_config(m, n))
    sb = as_f32_scale(sb)
    grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)
    fp8_prefill_gemm_kernel[grid](a, sa.contiguous(), b, sb.contiguous(), c, m, n, k, c, c, c, SB_ROWS=sb_rows,
                                  ROW_SCALE=row_scale, UPCAST=INTERPRET, **cfg)
    return c


def fp8_grouped_contiguous(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                           counts: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """a [P, K] e4m3 with rows sorted by expert (counts[e] rows of expert e, in order), sa [P, K/32]
    f32, b [E, N, K] e4m3, sb [E, N, K/32] / [E, N/32, K/32] (E8M0 bytes or f32) or [E, N, 1] f32 ->
    [P, N] bf16, row r through its expert's weight. One launch for every expert, no host read."""
    P, k = a.shape
    E, n, _ = b.shape
    assert shapes_ok(k) and b.shape[2] == k and sa.shape == (P, k // 32) and counts.shape == (E,)
    row_scale = sb.shape[-1] == 1
    sb_rows = 1 if sb.shape[1] == n else 32
    c = torch.empty(P, n, dtype=torch.bfloat16, device=a.device)
    if P == 0 or n == 0:
        return c
    cfg = dict(cfg or prefill_config(P, n))
    cfg.pop("GROUP_M", None)
    from .triton_moe_contiguous import contiguous_tiles
    tile_e, tile_row, seg_end = contiguous_tiles(counts, cfg["BM"], P)
    sb = as_f32_scale(sb)
    grid = (triton.cdiv(n, cfg["BN"]), tile_e.numel())
    fp8_prefill_gemm_kernel[grid](a, sa.contiguous(), b, sb.contiguous(), c, P, n, k, tile_e, tile_row, seg_end, SB_ROWS=sb_rows, ROW_SCALE=row_scale,
                                  UPCAST=INTERPRET, CONTIGUOUS=True,
                                  GROUP_M=1, **cfg)
    return c


def fp8_prefill_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """x [..., K] bf16, w [N, K] e4m3, w_scale as fp8_prefill_gemm -> [..., N] bf16: the reference
    Linear for FP8 weights (act_quant per 32, products promoted to fp32 every 32 K)."""
    from .triton_quant import act_quant_fp8
    a, sa = act_quant_fp8(x.reshape(-1, x.shape[-1]))
    return fp8_prefill_gemm(a, sa, w, w_scale, cfg).view(*x.shape[:-1], w.shape[0])


def fp8_prefill_linear_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Plain torch: act_quant_ref(x) @ dequant(w)^T in fp32 -> bf16 (the release GEMM's values up to
    fp32 summation order)."""
    from .reference import act_quant_ref
    from .select import dequant_fp8
    return torch.nn.functional.linear(act_quant_ref(x).float(), dequant_fp8(w, w_scale)).to(torch.bfloat16)
