"""Triton FP8 GEMMs with the release's 32-wide scale blocks (exact against the reference Linear).

    fp8_gemm(a, sa, b, sb)                 D[M, N] = sum_kb (A_kb . B_kb^T) * sa[m, kb] * sb[n/R, kb]
    fp8_grouped_gemm_masked(a, sa, b, sb, masked_m)   the same per group g over rows < masked_m[g]
                                           (DeepGEMM's masked layout: a [G, Mmax, K], d [G, Mmax, N])
    w8a16_gemm(x, b, sb)                   the same products with x already FP8-rounded (bf16 values)
                                           and each weight tile dequantized in registers: a bf16 MMA
                                           accumulating in place (no per-32 promotion); the default
    fp8_linear(x, w, w_scale)              act_quant (per 32, pow2) + w8a16_gemm, bf16 out
    fp4_to_fp8_weight(packed, scale)       MXFP4 expert weight -> e4m3 [N, K] + per-(row, 32) scale:
                                           exact (every e2m1 value is an e4m3 value)
    w4a16_gemm(x, packed_k, scale)         W8A16's products on MXFP4 weights read packed (half the
    w4a16_grouped_gemm_masked(...)         bytes; fp4_kernel_layout once at load), decoded in registers
                                           (_FP4_ASM); dense and masked MoE

Why not DeepGEMM directly: its SM90 FP8 kernels promote the accumulator once per 128 K with one
activation scale per (row, 128) and one weight scale per 128x128 tile (`BLOCK_K == 128`,
"Only support per-128-channel FP8 scaling"). Our activations carry a scale per 32 and our
weights one per 32x32 tile, so the reference numbers need a promotion every 32 K. Here every
32-wide K step is one tensor-core dot (fp32 out) scaled by sa*sb (powers of two: exact) and added
in fp32: the same products and the same per-32 rounding points as the reference's FP8 GEMM.

W8A16 variants (launch config key VARIANT, default W8A16_VARIANT = $DEEPINFER_W8A16_VARIANT or "auto"):
    v1  the weight tile [BN, BK] is converted e4m3 -> bf16 by Triton (cvt e4m3x2 -> f16x2, then one scalar
        f16 -> bf16 cvt per element: both on the 16/clk/SM conversion pipe) and reshaped to [BN, BK/32, 32]
        for the scale; E8M0 scales are read with byte loads the pipeliner skips (one exposed global load
        per K step).
    v2  w8a16_v2_kernel: the same products, dequantized with integer/bf16x2 ops only (each e4m3 byte
        placed into a bf16 bit pattern, then two exact bf16x2 multiplies: no conversion instruction) and
        scales read as int32 words of 4 E8M0 bytes (or f32 columns), so every load of the loop is a
        pipelined cp.async. SWAP (decode): one K=32 dot per scale block on a [BN, 32] tile read as int16
        pairs; otherwise one dot per BK with the scale tile broadcast to [BN, BK].
    v3  w8a16_v2_kernel with one dot per BK for SWAP too (fewer wgmma waits, a shared-memory shuffle).
    v4  w8a16_pairs_kernel: the rows kernel's load (int16 pairs dequantized in the registers the wgmma A
        fragment reads) with the [BN, BK/32] scale tile broadcast over a [BN, BK/32, 16] view of the pairs:
        one dot per BK and no shared-memory shuffle (sm_90 SASS: no STS/LDSM, 2 barriers per K step where
        v3 has 9). H200 (2026-12-01): 1.10-1.23x v3 at M = 1, 0.98-1.05x at M = 64, where the wgmma work
        is 4x larger and the shuffle was not the limit.
    auto (default): v4 for swapped tiles of at most AUTO_V4_MAX_BM tokens, v3 above.
    perf/ptx_check.py prints what each compiles to for sm_90; perf/bench_kernels.py times them.
    H200 (2026-11-30, `bench_kernels.py --only variants`): v3 is the default, 1.03-1.42x v1 on every
    decode shape but wq_b M64 (0.72x); MoE masked 48 experts w13/w2 at m=8: v1 560/270 us, v2 920/428,
    v3 440/190 (DeepGEMM 313/153, so 0.71/0.80x of it). v2's per-32 dots wait on each wgmma: slowest.

Config: small M (decode) swaps A and B so N fills the MMA's 64/128-row side; split-K over a
fixed fp32 workspace (summed in a fixed order) fills the SMs. With batch_invariant=True the tile
shape and split count depend only on (N, K), never on M, so a row's result is the same at any
batch size.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .fp4_layout import (  # noqa: F401  (the W4A16 entry points' companions)
    FP4_MAX_SCALE_BYTE, FP4_MIN_SCALE_BYTE, fp4_kernel_layout, fp4_kernel_weight, fp4_release_layout, fp4_scales_ok)
from .reference import e8m0_to_float

NUM_SMS_DEFAULT = 132
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
W8A16_VARIANTS = ("v1", "v2", "v3", "v4")
AUTO_V4_MAX_BM = 16          # "auto": v4 for swapped tiles of up to 16 tokens, v3 above (H200, 2026-12-01)
W8A16_VARIANT = os.environ.get("DEEPINFER_W8A16_VARIANT", "auto")


@triton.jit
def _store_tile(c_ptr, acc, rm, rn, m_ok, n_ok, g64, split, M, N, SPLIT_K,
                SWAP: tl.constexpr, OUT_F32: tl.constexpr, TOKEN_MAJOR: tl.constexpr = False):
    """The GEMMs' epilogue: acc ([BN, BM] when SWAP, else [BM, BN]) into c. OUT_F32: c is the split-K
    workspace [SPLIT_K, G, M, N] f32 (this program's split slice), else c is [G, M, N] bf16, or
    [M, G, N] with TOKEN_MAJOR."""
    row_stride = N
    if OUT_F32:
        c_base = c_ptr + (split.to(tl.int64) * (tl.num_programs(2) // SPLIT_K) + g64) * M * N
    elif TOKEN_MAJOR:
        c_base = c_ptr + g64 * N
        row_stride = (tl.num_programs(2) // SPLIT_K) * N
    else:
        c_base = c_ptr + g64 * M * N
    if SWAP:
        c_ptrs = c_base + rm[None, :].to(tl.int64) * row_stride + rn[:, None]
        mask = n_ok[:, None] & m_ok[None, :]
    else:
        c_ptrs = c_base + rm[:, None].to(tl.int64) * row_stride + rn[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
    if OUT_F32:
        tl.store(c_ptrs, acc, mask=mask)
    else:
        tl.store(c_ptrs, acc.to(tl.bfloat16), mask=mask)


@triton.jit
def _grid_work(mm_ptr, M, K, SPLIT_K, BK: tl.constexpr, GROUPED: tl.constexpr):
    """This program's group g, split-K slice, row limit (the group's masked count when GROUPED) and
    K-block range [kb0, kb1) of the nkb blocks: the FP8 / W8A16 kernels' shared grid decomposition."""
    pid_z = tl.program_id(2)
    g = pid_z // SPLIT_K
    split = pid_z % SPLIT_K
    m_lim = M
    if GROUPED:
        m_lim = tl.load(mm_ptr + g)
    nkb = K // BK
    per = tl.cdiv(nkb, SPLIT_K)
    kb0 = split * per
    kb1 = tl.minimum(kb0 + per, nkb)
    return g, split, m_lim, nkb, kb0, kb1


@triton.jit
def _tile(pid_m, pid_n, m_lim, N, BM: tl.constexpr, BN: tl.constexpr, SWAP: tl.constexpr):
    """This program's rows rm and columns rn, their in-range masks, and its zero fp32 accumulator
    ([BN, BM] when SWAP, else [BM, BN]): the GEMM kernels' shared tile prologue."""
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    return rm, rn, rm < m_lim, rn < N, acc


@triton.jit
def _x_rows(x_ptr, g64, rm, M, K, SPLIT_K, TOKEN_MAJOR: tl.constexpr):
    """Row pointers [BM, 1] of group g's activations: x [G, M, K], or [M, G, K] with TOKEN_MAJOR (wo_a's
    per-token head groups read in place, no transposing copy)."""
    if TOKEN_MAJOR:
        return x_ptr + g64 * K + rm[:, None].to(tl.int64) * ((tl.num_programs(2) // SPLIT_K) * K)
    return x_ptr + g64 * M * K + rm[:, None].to(tl.int64) * K


@triton.jit
def fp8_gemm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, mm_ptr,
                    M, N, K, SPLIT_K,
                    BM: tl.constexpr, BN: tl.constexpr, SB_ROWS: tl.constexpr,
                    SWAP: tl.constexpr, GROUPED: tl.constexpr, OUT_F32: tl.constexpr,
                    NUM_STAGES: tl.constexpr):
    """a [G, M, K] e4m3, sa [G, M, K/32] f32, b [G, N, K] e4m3, sb [G, N/SB_ROWS, K/32] f32.
    Grid (N/BN, M/BM, G*SPLIT_K). OUT_F32: c is the split-K workspace [SPLIT_K, G, M, N] f32,
    else c is [G, M, N] bf16. GROUPED: rows >= mm[g] are skipped (masked layout)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    g, split, m_lim, nkb, kb0, kb1 = _grid_work(mm_ptr, M, K, SPLIT_K, 32, GROUPED)
    if pid_m * BM >= m_lim:
        return
    rm, rn, m_ok, n_ok, acc = _tile(pid_m, pid_n, m_lim, N, BM, BN, SWAP)
    rk = tl.arange(0, 32)
    g64 = g.to(tl.int64)
    a_ptrs = a_ptr + g64 * M * K + rm[:, None].to(tl.int64) * K + rk[None, :]
    b_ptrs = b_ptr + g64 * N * K + rn[:, None].to(tl.int64) * K + rk[None, :]
    sa_ptrs = sa_ptr + g64 * M * nkb + rm.to(tl.int64) * nkb
    sb_ptrs = sb_ptr + g64 * (N // SB_ROWS) * nkb + (rn // SB_ROWS).to(tl.int64) * nkb
    for kb in tl.range(kb0, kb1, num_stages=NUM_STAGES):
        a = tl.load(a_ptrs + kb * 32, mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptrs + kb * 32, mask=n_ok[:, None], other=0.0)
        sa = tl.load(sa_ptrs + kb, mask=m_ok, other=0.0)
        sb = tl.load(sb_ptrs + kb, mask=n_ok, other=0.0)
        if SWAP:
            acc += tl.dot(b, tl.trans(a)) * (sb[:, None] * sa[None, :])
        else:
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
    _store_tile(c_ptr, acc, rm, rn, m_ok, n_ok, g64, split, M, N, SPLIT_K, SWAP, OUT_F32)


@triton.jit
def w8a16_gemm_kernel(x_ptr, b_ptr, sb_ptr, c_ptr, mm_ptr,
                      M, N, K, SPLIT_K,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SB_ROWS: tl.constexpr,
                      SWAP: tl.constexpr, GROUPED: tl.constexpr, OUT_F32: tl.constexpr,
                      NUM_STAGES: tl.constexpr, UPCAST: tl.constexpr = False, SB_E8M0: tl.constexpr = False,
                      TOKEN_MAJOR: tl.constexpr = False):
    """x [G, M, K] bf16 holding FP8-rounded activations (act_quant's fake-quant values: q * 2^e, exact
    in bf16), b [G, N, K] e4m3, sb [G, N/SB_ROWS, K/32] f32 pow2. Each weight tile is dequantized in
    registers (q * s: exact in bf16) and fed to a bf16 MMA accumulating in place in fp32: the same
    exact products as the reference, with no per-32 promotion step. Grid as fp8_gemm_kernel.
    SB_E8M0: sb holds raw E8M0 bytes (1 B per 32 weights instead of 4)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    g, split, m_lim, nkb, kb0, kb1 = _grid_work(mm_ptr, M, K, SPLIT_K, BK, GROUPED)
    if pid_m * BM >= m_lim:
        return
    rm, rn, m_ok, n_ok, acc = _tile(pid_m, pid_n, m_lim, N, BM, BN, SWAP)
    rk = tl.arange(0, BK)
    rs = tl.arange(0, BK // 32)
    g64 = g.to(tl.int64)
    x_ptrs = _x_rows(x_ptr, g64, rm, M, K, SPLIT_K, TOKEN_MAJOR) + rk[None, :]
    b_ptrs = b_ptr + g64 * N * K + rn[:, None].to(tl.int64) * K + rk[None, :]
    sb_ptrs = sb_ptr + g64 * (N // SB_ROWS) * (K // 32) + (rn // SB_ROWS)[:, None].to(tl.int64) * (K // 32) + rs[None, :]
    # NOTE: the weight tile goes through registers for the dequant, so Triton's cp.async pipeliner
    # does not apply (no cp.async in the PTX); explicit register double buffering was measured 1.7x
    # slower on the H200 (run 3), so the loop stays plain.
    for kb in tl.range(kb0, kb1, num_stages=NUM_STAGES):
        x = tl.load(x_ptrs + kb * BK, mask=m_ok[:, None], other=0.0)
        w = tl.load(b_ptrs + kb * BK, mask=n_ok[:, None], other=0.0)
        if SB_E8M0:
            sb = (tl.load(sb_ptrs + kb * (BK // 32), mask=n_ok[:, None], other=0).to(tl.int32) << 23).to(
                tl.float32, bitcast=True)
        else:
            sb = tl.load(sb_ptrs + kb * (BK // 32), mask=n_ok[:, None], other=0.0)
        if UPCAST:                       # CPU interpreter only: its bf16 casts and dots are wrong
            wd = tl.reshape(tl.reshape(w.to(tl.float32), (BN, BK // 32, 32)) * sb[:, :, None], (BN, BK))
            x = x.to(tl.float32)
        else:
            wd = tl.reshape(tl.reshape(w.to(tl.bfloat16), (BN, BK // 32, 32)) * sb.to(tl.bfloat16)[:, :, None],
                            (BN, BK))
        if SWAP:
            acc = tl.dot(wd, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(wd), acc)
    _store_tile(c_ptr, acc, rm, rn, m_ok, n_ok, g64, split, M, N, SPLIT_K, SWAP, OUT_F32, TOKEN_MAJOR)


# ---------------------------------------------------------------------------------------------------
# W8A16 v2: dequantization without the conversion pipe, every loop load pipelined.
#
# An e4m3 byte b = s eeee mmm placed as the bf16 bit pattern (b & 0x80) << 8 | (b & 0x7f) << 4 is the
# bf16 value w * 2^-120 for every e4m3 w: the exponent bias moves from 7 to 127 and subnormals stay
# subnormal (m/8 * 2^-6 -> m/8 * 2^-126). Multiplying by 2^120 then gives w (exact: |w| <= 448) and by
# the pow2 scale s gives w * s, the same bf16 value as v1's `w.to(bf16) * s.to(bf16)`. On sm_90 that is
# a PRMT (spread two bytes into 16-bit lanes with their sign replicated), SHL, AND and two bf16x2
# multiplies per two weights: ALU/FMA-pipe instructions, where v1 spends 1.5 conversion-pipe
# instructions (16/clk/SM) per weight. The PTX is in the two helpers below; _dequant_pair_ref is the
# same arithmetic in plain Triton ops (fp32) for the CPU interpreter, which cannot run inline asm.


# The PTX of the two dequant helpers (module constants so that tests/kernels/test_interpret.py can run
# the very same text through a small PTX emulator on the CPU, over every byte value).
# Pair form, pack=1: $2 = one int16 (two e4m3 bytes), $3 = its bf16 scale; $0/$1 = low/high byte * s.
_PAIR_ASM = tl.constexpr("""
{
.reg .b32 t, c, u;
mov.b32 c, 0x7B807B80;
cvt.u32.u16 t, $2;
prmt.b32 t, t, 0, 0x9180;
shl.b32 t, t, 4;
and.b32 t, t, 0x87F087F0;
mul.rn.bf16x2 t, t, c;
mov.b32 u, {$3, $3};
mul.rn.bf16x2 t, t, u;
mov.b32 {$0, $1}, t;
}
""")
# Byte form, pack=4: $2 = four e4m3 bytes, $3/$4 = bf16x2 scales of bytes 0,1 / 2,3; $0/$1 = bf16x2 out.
_BYTES_ASM = tl.constexpr("""
{
.reg .b32 lo, hi, c;
mov.b32 c, 0x7B807B80;
prmt.b32 lo, $2, 0, 0x9180;
prmt.b32 hi, $2, 0, 0xB3A2;
shl.b32 lo, lo, 4;
shl.b32 hi, hi, 4;
and.b32 lo, lo, 0x87F087F0;
and.b32 hi, hi, 0x87F087F0;
mul.rn.bf16x2 lo, lo, c;
mul.rn.bf16x2 hi, hi, c;
mul.rn.bf16x2 $0, lo, $3;
mul.rn.bf16x2 $1, hi, $4;
}
""")


@triton.jit
def _dequant_pair_bf16(w2, s):
    """w2 int16 = two e4m3 weights (k = 2i in the low byte, 2i + 1 in the high byte), s bf16 pow2 scale
    of the same shape -> (lo, hi) bf16 weights * s."""
    return tl.inline_asm_elementwise(asm=_PAIR_ASM, constraints="=h,=h,h,h", args=[w2, s],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)


@triton.jit
def _dequant_bytes_bf16(w, s):
    """w e4m3 (any layout), s bf16 pow2 of the same shape -> bf16 w * s (four weights per asm block)."""
    return tl.inline_asm_elementwise(asm=_BYTES_ASM, constraints="=r,=r,r,r,r",
                                     args=[w.to(tl.uint8, bitcast=True), s], dtype=tl.bfloat16, is_pure=True,
                                     pack=4)


_P120 = tl.constexpr(2.0 ** 120)


@triton.jit
def _e4m3_bits_f32(b):
    """int32 byte (0..255) -> fp32 w * 2^-120 by the same bit placement as the asm (the CPU reference)."""
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 4)
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _dequant_pair_ref(w2, s):
    """_dequant_pair_bf16 in fp32 with plain Triton ops (interpreter): (lo, hi) = bytes * 2^120 * s."""
    b = w2.to(tl.int32) & 0xFFFF
    lo = _e4m3_bits_f32(b & 0xFF) * _P120 * s
    hi = _e4m3_bits_f32(b >> 8) * _P120 * s
    return lo, hi


@triton.jit
def _e8m0_scale(e, UPCAST: tl.constexpr):
    """E8M0 byte (int32 0..255) -> 2^(e - 127): bf16 (GPU) or fp32 (interpreter); 0 -> 0, 255 -> inf,
    as the fp32 decode of v1."""
    if UPCAST:
        return (e << 23).to(tl.float32, bitcast=True)
    else:
        return (e << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def w8a16_v2_kernel(x_ptr, b_ptr, sb_ptr, c_ptr, mm_ptr,
                    M, N, K, SPLIT_K,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SB_ROWS: tl.constexpr,
                    SWAP: tl.constexpr, GROUPED: tl.constexpr, OUT_F32: tl.constexpr,
                    NUM_STAGES: tl.constexpr, UPCAST: tl.constexpr = False, SB_E8M0: tl.constexpr = False,
                    PER32: tl.constexpr = True, TOKEN_MAJOR: tl.constexpr = False):
    """w8a16_gemm_kernel's contract and products (x FP8-rounded bf16, b e4m3, sb pow2 f32 or raw E8M0),
    K % 128 == 0 and BK % 128 == 0 (E8M0 scales are read as int32 words of 4 bytes; the row stride
    K // 32 is written as (K // BK) * (BK // 32) so that the compiler can prove 4-byte alignment).
    PER32: one K=32 dot per scale block, the weights read as [BN, 16] int16 pairs and the scale a [BN]
    column (SWAP). Else one dot per BK, the [BN, BK] e4m3 tile scaled by a [BN, BK/32] scale tile
    broadcast to [BN, BK]. Either way: loads -> integer/bf16x2 dequant -> bf16 wgmma, fp32 in place."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    g, split, m_lim, nkb, kb0, kb1 = _grid_work(mm_ptr, M, K, SPLIT_K, BK, GROUPED)
    if pid_m * BM >= m_lim:
        return
    rm, rn, m_ok, n_ok, acc = _tile(pid_m, pid_n, m_lim, N, BM, BN, SWAP)
    g64 = g.to(tl.int64)
    srow = g64 * (N // SB_ROWS) + (rn // SB_ROWS).to(tl.int64)          # scale row of each weight row
    if SB_E8M0:
        sw_ptrs = sb_ptr.to(tl.pointer_type(tl.int32)) + srow * (nkb * (BK // 128))
    else:
        s_ptrs = sb_ptr + srow * (nkb * (BK // 32))
    if PER32:
        r32 = tl.arange(0, 32)
        r16 = tl.arange(0, 16)
        x_ptrs = _x_rows(x_ptr, g64, rm, M, K, SPLIT_K, TOKEN_MAJOR) + r32[None, :]
        w_ptrs = (b_ptr.to(tl.pointer_type(tl.int16)) + g64 * N * (K // 2) + rn[:, None].to(tl.int64) * (K // 2)
                  + r16[None, :])
        for kb in tl.range(kb0, kb1, num_stages=NUM_STAGES):
            for j in tl.static_range(BK // 32):
                x = tl.load(x_ptrs + (kb * BK + j * 32), mask=m_ok[:, None], other=0.0)
                w2 = tl.load(w_ptrs + (kb * (BK // 2) + j * 16), mask=n_ok[:, None], other=0)
                if SB_E8M0:
                    if j % 4 == 0:
                        word = tl.load(sw_ptrs + (kb * (BK // 128) + j // 4), mask=n_ok, other=0)
                    s = _e8m0_scale((word >> (8 * (j % 4))) & 0xFF, UPCAST)
                else:
                    s = tl.load(s_ptrs + (kb * (BK // 32) + j), mask=n_ok, other=0.0)
                    if not UPCAST:
                        s = s.to(tl.bfloat16)
                s = tl.broadcast_to(s[:, None], (BN, 16))
                if UPCAST:                   # CPU interpreter: the same bit arithmetic in fp32
                    lo, hi = _dequant_pair_ref(w2, s)
                    x = x.to(tl.float32)
                else:
                    lo, hi = _dequant_pair_bf16(w2, s)
                wd = tl.reshape(tl.join(lo, hi), (BN, 32))
                if SWAP:
                    acc = tl.dot(wd, tl.trans(x), acc)
                else:
                    acc = tl.dot(x, tl.trans(wd), acc)
    else:
        rk = tl.arange(0, BK)
        rc = tl.arange(0, BK // 32)
        x_ptrs = _x_rows(x_ptr, g64, rm, M, K, SPLIT_K, TOKEN_MAJOR) + rk[None, :]
        w_ptrs = b_ptr + g64 * N * K + rn[:, None].to(tl.int64) * K + rk[None, :]
        if SB_E8M0:
            rw = tl.arange(0, BK // 128)
            sc_ptrs = sw_ptrs[:, None] + rw[None, :]               # [BN, BK/128] int32 words
        else:
            sc_ptrs = s_ptrs[:, None] + rc[None, :]
        for kb in tl.range(kb0, kb1, num_stages=NUM_STAGES):
            x = tl.load(x_ptrs + kb * BK, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs + kb * BK, mask=n_ok[:, None], other=0.0)
            if SB_E8M0:
                word = tl.load(sc_ptrs + kb * (BK // 128), mask=n_ok[:, None], other=0)
                e = (word[:, :, None] >> (8 * tl.arange(0, 4))[None, None, :]) & 0xFF
                sc = _e8m0_scale(tl.reshape(e, (BN, BK // 32)), UPCAST)
            else:
                sc = tl.load(sc_ptrs + kb * (BK // 32), mask=n_ok[:, None], other=0.0)
                if not UPCAST:
                    sc = sc.to(tl.bfloat16)
            s = tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, BK // 32, 32)), (BN, BK))
            if UPCAST:
                wd = w.to(tl.float32) * s
                x = x.to(tl.float32)
            else:
                wd = _dequant_bytes_bf16(w, s)
            if SWAP:
                acc = tl.dot(wd, tl.trans(x), acc)
            else:
                acc = tl.dot(x, tl.trans(wd), acc)
    _store_tile(c_ptr, acc, rm, rn, m_ok, n_ok, g64, split, M, N, SPLIT_K, SWAP, OUT_F32, TOKEN_MAJOR)


# ---------------------------------------------------------------------------------------------------
# W8A16 with one scale per row (FP4 experts): MXFP4 experts re-expressed as e4m3 w' = w * 2^(e - E_row)
# with one pow2 scale 2^E_row per weight row (exact while a row's block exponents span <= 14:
# rows_scaled_fp8_weight). Nothing in the K loop depends on a scale: the dequant is the byte placement
# and one bf16x2 multiply by 2^120 per two weights, and the row scale multiplies the fp32 result once.
# Same exact bf16 products (up to the pow2 factor 2^E_row, moved out of the sum), same fp32 accumulation.
# The weights are read as int16 pairs: each pair's dequant yields the two adjacent-K bf16 values that
# one register of the wgmma A fragment holds, so the tile goes from shared memory straight into that
# layout (sm_90 PTX, perf/ptx_check.py: no shared-memory shuffle, 4 SASS instructions per weight where
# v3 spends 5 and 8 barriers per K step).
_PAIR_ASM_NOSCALE = tl.constexpr("""
{
.reg .b32 t, c;
mov.b32 c, 0x7B807B80;
cvt.u32.u16 t, $2;
prmt.b32 t, t, 0, 0x9180;
shl.b32 t, t, 4;
and.b32 t, t, 0x87F087F0;
mul.rn.bf16x2 t, t, c;
mov.b32 {$0, $1}, t;
}
""")


@triton.jit
def _e4m3_pair_to_bf16(w2):
    """int16 = two e4m3 weights (k = 2i low byte, 2i + 1 high byte) -> (lo, hi) bf16."""
    return tl.inline_asm_elementwise(asm=_PAIR_ASM_NOSCALE, constraints="=h,=h,h", args=[w2],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)


# ---------------------------------------------------------------------------------------------------
# W4A16: MXFP4 weights read packed and dequantized in the registers the wgmma A fragment reads, like the
# e4m3 pairs. The bf16 A fragment gives a thread, per row and k16 slice, the k pairs (2c, 2c+1) and
# (2c+8, 2c+9), c = lane % 4. fp4_kernel_layout repacks each slice's 16 nibbles once at load so that one
# int16 holds exactly those four: byte 2c = k[2c] | k[2c+8] << 4, byte 2c+1 = k[2c+1] | k[2c+9] << 4
# (stored byte j = k[j] | k[j+8] << 4). One 16-bit shared load then feeds four weights with no byte
# packing (the release's layout, element 2i in byte i's low nibble, cost 71 LDS and 186 PRMT per
# 128 x 128 tile a thread: 6.2 SASS instructions a weight, 0.33-0.37 of copy; perf/ptx_check.py).
# The decode: a nibble s eem placed as the bf16 bit pattern s << 15 | eem << 6 is the bf16 value
# w * 2^-126 for every e2m1 w (e2m1's bias 1 moves to 127; its one subnormal, 0.5, lands on bf16's
# subnormal 2^-127); one exact bf16x2 multiply by 2^(k - 1) then gives w * 2^(k - 127) for the block's
# E8M0 byte k (1 <= k <= 128: scales up to 2; byte 0 -> 0 as the reference decodes it). Per int16: a PRMT
# spreads the two bytes into 16-bit lanes [b0 b0 | b1 b1]; per output pair an AND, an IMAD by 2^6 + 2^12
# (low nibbles; 2^2 + 2^8 for high) that moves the three magnitude bits and the sign into place at once
# (the two shifted copies do not overlap), an AND and the scale multiply: 9 instructions per 4 weights.
# $4 = the int16, $5 = the block scale as bf16x2 (both halves equal); $0,$1 = k 2c, 2c+1; $2,$3 = 2c+8, 2c+9.
_FP4_ASM = tl.constexpr("""
{
.reg .b32 a, t, lo, hi;
cvt.u32.u16 a, $4;
prmt.b32 a, a, 0, 0x1100;
and.b32 t, a, 0x000F000F;
mul.lo.u32 t, t, 4160;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 lo, t, $5;
and.b32 t, a, 0x00F000F0;
mul.lo.u32 t, t, 260;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 hi, t, $5;
mov.b32 {$0, $1}, lo;
mov.b32 {$2, $3}, hi;
}
""")
_P126 = tl.constexpr(2.0 ** 126)


@triton.jit
def _fp4_scale(k, UPCAST: tl.constexpr):
    """E8M0 byte k (int32, 1..128: fp4_kernel_weight maps byte 0 away) -> the multiplier of the FP4 decode:
    bf16 2^(k - 1) in both halves of an int32 ((k + 126) << 7, twice: one IMAD), as the asm's bit
    placement is w * 2^-126; or fp32 2^(k - 127) for the interpreter's decode."""
    if UPCAST:
        return (k << 23).to(tl.float32, bitcast=True)
    return k * 0x800080 + 0x3F003F00


@triton.jit
def _fp4_quad_bf16(w, s):
    """w int16 = four e2m1 weights in fp4_kernel_layout, s from _fp4_scale -> bf16 weights at
    k = 2c, 2c+1, 2c+8, 2c+9 of their k16 slice, times the block scale."""
    return tl.inline_asm_elementwise(asm=_FP4_ASM, constraints="=h,=h,=h,=h,h,r", args=[w, s],
                                     dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                                     is_pure=True, pack=1)


@triton.jit
def _fp4_nibbles_ref(b, s):
    """One byte's two e2m1 nibbles in fp32 with plain Triton ops (interpreter): the asm's bit placement one
    format up (s << 31 | eem << 22 is w * 2^-126 in fp32), times 2^126, times s (fp32 2^(k - 127))."""
    lo = ((((b & 0x08) << 28) | ((b & 0x07) << 22)).to(tl.float32, bitcast=True) * _P126) * s
    hi = ((((b & 0x80) << 24) | ((b & 0x70) << 18)).to(tl.float32, bitcast=True) * _P126) * s
    return lo, hi


@triton.jit
def _fp4_quad_ref(w, s):
    """_fp4_quad_bf16 in fp32 (interpreter)."""
    u = w.to(tl.int32)
    lo0, hi0 = _fp4_nibbles_ref(u & 0xFF, s)
    lo1, hi1 = _fp4_nibbles_ref((u >> 8) & 0xFF, s)
    return lo0, lo1, hi0, hi1


@triton.jit
def _fp4_tile(w, sc, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr):
    """[BN, BK/4] int16 (fp4_kernel_layout) + [BN, BK/32] E8M0 bytes (int32) -> the [BN, BK] weight tile in
    natural K order: the four outputs of slice s, lane c go to k = 16s + 8h + 2c + j (h: low / high pair,
    j: k parity)."""
    s3 = _fp4_scale(tl.reshape(tl.broadcast_to(sc[:, :, None, None], (BN, BK // 32, 2, 4)), (BN, BK // 16, 4)),
                    UPCAST)                                 # each int16's block scale
    w3 = tl.reshape(w, (BN, BK // 16, 4))
    if UPCAST:
        o0, o1, o2, o3 = _fp4_quad_ref(w3, s3)
    else:
        o0, o1, o2, o3 = _fp4_quad_bf16(w3, s3)
    q = tl.join(tl.join(o0, o1), tl.join(o2, o3))           # [BN, S, 4 (c), 2 (j), 2 (h)]
    return tl.reshape(tl.permute(q, (0, 1, 4, 2, 3)), (BN, BK))


@triton.jit
def w8a16_pairs_kernel(x_ptr, b_ptr, s_ptr, c_ptr, mm_ptr,
                       M, N, K, SPLIT_K,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SB_ROWS: tl.constexpr,
                       SWAP: tl.constexpr, GROUPED: tl.constexpr, OUT_F32: tl.constexpr,
                       NUM_STAGES: tl.constexpr, UPCAST: tl.constexpr = False, SB_E8M0: tl.constexpr = False,
                       ROW_SCALE: tl.constexpr = False, TOKEN_MAJOR: tl.constexpr = False,
                       FP4: tl.constexpr = False, BF16W: tl.constexpr = False):
    """x [G, M, K] bf16 (FP8-rounded activations), b [G, N, K] e4m3 read as [BN, BK/2] int16 pairs, each
    pair dequantized in the register the wgmma A fragment reads it from (no shared-memory shuffle):
        ROW_SCALE (the rows kernel): s [G, N] f32 pow2 row scales; nothing in the K loop depends on a
            scale, c = (x . b^T) * s, the scale applied to the fp32 result in the epilogue.
        else (v4): w8a16_v2_kernel's scales per (SB_ROWS rows, 32 columns), f32 pow2 or raw E8M0 bytes;
            the pairs viewed as [BN, BK/32, 16] so that the [BN, BK/32] scale tile broadcasts over the
            pairs of its block (each thread's k16 slice sits in one scale block).
        FP4 (W4A16): b [G, N, K/2] MXFP4 bytes in fp4_kernel_layout read as [BN, BK/4] int16 quads with E8M0
            scales per (row, 32) [G, N, K/32], decoded by _fp4_tile into the natural K order.
        BF16W: b [G, N, K] bf16 (dense weights held in bf16), read as they are: the skinny decode GEMM
            (bf16_skinny_linear) on the same swapped tiles, split-K and pipeline.
    The same exact bf16 products with fp32 accumulation either way. Grid as fp8_gemm_kernel."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    g, split, m_lim, nkb, kb0, kb1 = _grid_work(mm_ptr, M, K, SPLIT_K, BK, GROUPED)
    if pid_m * BM >= m_lim:
        return
    rm, rn, m_ok, n_ok, acc = _tile(pid_m, pid_n, m_lim, N, BM, BN, SWAP)
    rk = tl.arange(0, BK)
    g64 = g.to(tl.int64)
    if not ROW_SCALE:
        srow = g64 * (N // SB_ROWS) + (rn // SB_ROWS).to(tl.int64)
        # [BN, BK/32] scale tile (E8M0 bytes or f32), read in the layout the 3-D view below gives its rows
        sc_ptrs = s_ptr + srow[:, None] * (nkb * (BK // 32)) + tl.arange(0, BK // 32)[None, :]
    x_ptrs = _x_rows(x_ptr, g64, rm, M, K, SPLIT_K, TOKEN_MAJOR) + rk[None, :]
    WPR: tl.constexpr = 1 if BF16W else (4 if FP4 else 2)   # weights per load element: bf16, e4m3 pairs, fp4 quads
    w_ptrs = ((b_ptr if BF16W else b_ptr.to(tl.pointer_type(tl.int16))) + g64 * N * (K // WPR)
              + rn[:, None].to(tl.int64) * (K // WPR) + tl.arange(0, BK // WPR)[None, :])
    if FP4:
        sc_next = tl.load(sc_ptrs + tl.minimum(kb0, kb1 - 1) * (BK // 32), mask=n_ok[:, None], other=0)
    for kb in tl.range(kb0, kb1, num_stages=NUM_STAGES):
        x = tl.load(x_ptrs + kb * BK, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs + kb * (BK // WPR), mask=n_ok[:, None], other=0)
        if BF16W:
            wd = w.to(tl.float32) if UPCAST else w
        elif FP4:
            # the scale bytes are too small a copy for the pipeliner: loaded one K step ahead by hand
            sc = sc_next.to(tl.int32) & 0xFF
            # (the last step reloads its own bytes rather than read past the split's K range)
            sc_next = tl.load(sc_ptrs + tl.minimum(kb + 1, kb1 - 1) * (BK // 32), mask=n_ok[:, None], other=0)
            wd = _fp4_tile(w, sc, BN, BK, UPCAST)
        elif ROW_SCALE:
            if UPCAST:                   # CPU interpreter: the same bit arithmetic in fp32
                lo, hi = _dequant_pair_ref(w, 1.0)
            else:
                lo, hi = _e4m3_pair_to_bf16(w)
        else:
            sc = tl.load(sc_ptrs + kb * (BK // 32), mask=n_ok[:, None], other=0)
            if SB_E8M0:
                sc = _e8m0_scale(sc.to(tl.int32) & 0xFF, UPCAST)
            elif not UPCAST:
                sc = sc.to(tl.bfloat16)
            w3 = tl.reshape(w, (BN, BK // 32, 16))
            s3 = tl.broadcast_to(sc[:, :, None], (BN, BK // 32, 16))
            if UPCAST:
                lo, hi = _dequant_pair_ref(w3, s3)
            else:
                lo, hi = _dequant_pair_bf16(w3, s3)
        if UPCAST:
            x = x.to(tl.float32)
        if not (FP4 or BF16W):
            wd = tl.reshape(tl.join(lo, hi), (BN, BK))
        if SWAP:
            acc = tl.dot(wd, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(wd), acc)
    if ROW_SCALE:
        sr = tl.load(s_ptr + g64 * N + rn, mask=n_ok, other=0.0)
        if SWAP:
            acc = acc * sr[:, None]
        else:
            acc = acc * sr[None, :]
    _store_tile(c_ptr, acc, rm, rn, m_ok, n_ok, g64, split, M, N, SPLIT_K, SWAP, OUT_F32, TOKEN_MAJOR)


@triton.jit
def splitk_reduce_kernel(ws_ptr, c_ptr, S, total, M, N, G, BLOCK: tl.constexpr, TOKEN_MAJOR: tl.constexpr = False):
    """c[i] = sum_s ws[s, i] summed in split order (deterministic), in c's dtype (bf16 for the FP8
    GEMMs, fp32 for triton_linear_fp32). TOKEN_MAJOR: ws is [S, G, M, N] and c [M, G, N]."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(S):
        acc += tl.load(ws_ptr + s * total + offs, mask=ok, other=0.0)
    dst = offs
    if TOKEN_MAJOR:
        g, r = offs // (M * N), offs % (M * N)
        dst = (r // N) * (G * N) + g * N + r % N
    tl.store(c_ptr + dst, acc.to(c_ptr.dtype.element_ty), mask=ok)


def w8a16_config(m: int, n: int, k: int, groups: int, device, batch_invariant: bool = False,
                 row_scaled: bool = False) -> dict:
    """Decode-sized M (<= 128) swaps A/B so N fills the MMA's long side; split-K fills the SMs.
    batch_invariant: one tile shape for every M and a split count from (N, K) only. row_scaled
    (w8a16_pairs_kernel, ROW_SCALE) with swapped tiles: BN = 64, 1.05-1.16x BN = 128 on the masked MoE GEMMs
    at m = 1 and 8 (H200, 2026-12-01, earlier run), where the extra CTAs keep more loads in flight."""
    bk = 128 if k % 128 == 0 else (64 if k % 64 == 0 else 32)
    nkb = k // bk
    sms = _num_sms(device)
    if batch_invariant:
        swap, bm, bn, warps = False, 64, 128, 4
    elif m <= 128:
        swap, bm, bn = True, max(16, triton.next_power_of_2(m)), 128 if n >= 2048 and not row_scaled else 64
        warps = 8 if bm >= 128 else 4
    else:
        swap, bm, bn, warps = False, 128, 128, 8
    tiles = triton.cdiv(n, bn) * groups * (1 if (swap or batch_invariant) else triton.cdiv(m, bm))
    split = 1
    if tiles < 2 * sms:
        split = max(1, min(2 * sms // tiles, nkb // 4, 16))
    # 3 stages: 1.0-1.5x 4 stages on every decode linear (H200, 2026-12-01, earlier run, bench_kernels --only variants)
    return dict(BM=bm, BN=bn, BK=bk, SWAP=swap, SPLIT_K=split, NUM_STAGES=3, num_warps=warps)


def w8a16_variant(cfg: dict, b: torch.Tensor, sb: torch.Tensor, k: int) -> str:
    """The W8A16 kernel a launch runs: cfg["VARIANT"] (else W8A16_VARIANT); v2/v3 need K and BK multiples
    of 128 and 2-byte / 4-byte aligned weights / E8M0 scales (int16 and int32 views), else v1."""
    variant = cfg.get("VARIANT", W8A16_VARIANT)
    if variant == "auto":
        variant = "v4" if cfg["SWAP"] and cfg["BM"] <= AUTO_V4_MAX_BM else "v3"
    if variant not in W8A16_VARIANTS:
        raise ValueError(f"unknown W8A16 variant {variant!r} (one of {W8A16_VARIANTS} or 'auto')")
    if variant != "v1" and (k % 128 or cfg["BK"] % 128 or b.data_ptr() % 2
                            or (sb.dtype != torch.float32 and sb.data_ptr() % 4)):
        return "v1"
    return variant


def _launch_w8a16(x, b, sb, masked_m, m, n, k, groups, sb_rows, cfg, out=None, partials=False, token_major=False,
                  fp4=False, bf16w=False):
    """partials=True: return the fp32 split-K workspace [SPLIT_K, G, M, N] instead of reducing it (tests:
    its sum is exact on integer-valued data, on the GPU and in the interpreter alike). token_major: x is
    [M, G, K] and the result [M, G, N] (dense groups only)."""
    dev = x.device
    split = cfg["SPLIT_K"]
    grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BM"]), groups * split)
    mm = masked_m if masked_m is not None else sb
    kw = dict(BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], SB_ROWS=sb_rows, SWAP=cfg["SWAP"],
              GROUPED=masked_m is not None, NUM_STAGES=cfg["NUM_STAGES"], num_warps=cfg["num_warps"],
              UPCAST=INTERPRET, SB_E8M0=sb.dtype != torch.float32, TOKEN_MAJOR=token_major)
    if bf16w:                                          # bf16 weights, no scales (sb unused)
        kernel = w8a16_pairs_kernel
        kw.update(BF16W=True, SB_E8M0=False)
    elif fp4:                                          # packed MXFP4 bytes, E8M0 per (row, 32)
        kernel = w8a16_pairs_kernel
        kw.update(FP4=True, SB_E8M0=True)
    elif _is_row_scale(sb, k):                         # one scale per row: select.row_scaled_fp8_weight
        assert sb.dtype == torch.float32 and sb_rows == 1
        kernel = w8a16_pairs_kernel
        kw.update(ROW_SCALE=True, SB_E8M0=False)
    elif w8a16_variant(cfg, b, sb, k) == "v1":
        kernel = w8a16_gemm_kernel
    elif w8a16_variant(cfg, b, sb, k) == "v4":
        kernel = w8a16_pairs_kernel
    else:
        kernel = w8a16_v2_kernel
        kw["PER32"] = w8a16_variant(cfg, b, sb, k) == "v2" and cfg["SWAP"]
    c = out if out is not None else torch.empty(*((m, groups) if token_major else (groups, m)), n,
                                                 dtype=torch.bfloat16, device=dev)
    if split == 1 and not partials:
        kernel[grid](x, b, sb, c, mm, m, n, k, 1, OUT_F32=False, **kw)
        return c
    ws = (torch.zeros if masked_m is not None else torch.empty)(split, groups, m, n, dtype=torch.float32, device=dev)
    kernel[grid](x, b, sb, ws, mm, m, n, k, split, OUT_F32=True, **kw)
    if partials:
        return ws
    total = groups * m * n
    splitk_reduce_kernel[(triton.cdiv(total, 1024),)](ws, c, split, total, m, n, groups, BLOCK=1024,
                                                      TOKEN_MAJOR=token_major, num_warps=4)
    return c


def _is_row_scale(sb: torch.Tensor, k: int) -> bool:
    """One scale per weight row over the whole K (w8a16_pairs_kernel with ROW_SCALE), not per 32 columns."""
    return sb.shape[-1] == 1 and k > 32


def _as_scale(sb: torch.Tensor) -> torch.Tensor:
    """f32 pow2 scales pass through; E8M0 (float8_e8m0fnu / uint8) travel as raw bytes."""
    return sb if sb.dtype == torch.float32 else sb.view(torch.uint8)


def w8a16_gemm(x: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, batch_invariant: bool = False,
               cfg_override: dict | None = None) -> torch.Tensor:
    """x [M, K] bf16 (already FP8-rounded by act_quant), b [N, K] e4m3, sb [N/32, K/32] or [N, K/32]
    (f32 pow2 or raw E8M0) -> [M, N] bf16. Same values as fp8_gemm on (act_quant_fp8(x), ...)."""
    m, k = x.shape
    n = b.shape[0]
    sb_rows = n // sb.shape[0]
    assert k % 32 == 0 and sb_rows in (1, 32) and sb.shape[1] in (k // 32, 1)
    if m == 0:
        return torch.empty(0, n, dtype=torch.bfloat16, device=x.device)
    cfg = w8a16_config(m, n, k, 1, x.device, batch_invariant, row_scaled=_is_row_scale(sb, k))
    cfg.update(cfg_override or {})
    return _launch_w8a16(x.contiguous(), b, _as_scale(sb).contiguous(), None, m, n, k, 1, sb_rows, cfg)[0]


def w8a16_grouped_gemm_masked(x: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, masked_m: torch.Tensor,
                              expected_m: int, out: torch.Tensor | None = None,
                              batch_invariant: bool = False, cfg_override: dict | None = None) -> torch.Tensor:
    """Masked grouped form: x [G, Mmax, K] bf16 (FP8-rounded), b [G, N, K] e4m3, sb [G, N/R, K/32]."""
    groups, mmax, k = x.shape
    n = b.shape[1]
    sb_rows = n // sb.shape[1]
    cfg = w8a16_config(expected_m, n, k, groups, x.device, batch_invariant, row_scaled=_is_row_scale(sb, k))
    if cfg["SWAP"]:
        cfg["BM"] = max(cfg["BM"], 16)
    cfg.update(cfg_override or {})
    return _launch_w8a16(x.contiguous(), b, _as_scale(sb).contiguous(), masked_m.to(torch.int32), mmax, n, k, groups,
                         sb_rows, cfg, out)


def w8a16_grouped_gemm(x: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, batch_invariant: bool = False,
                       cfg_override: dict | None = None, token_major: bool = False) -> torch.Tensor:
    """Dense grouped form (every row of every group): x [G, M, K] bf16 (any bf16 values: the products
    are exact either way), b [G, N, K] e4m3, sb [G, N/32, K/32] or [G, N, K/32] -> [G, M, N] bf16.
    token_major: x [M, G, K] -> [M, G, N] (read and written in place: no transposing copies).
    The block-diagonal wo_a runs here on its FP8 weight (half the bytes of the bf16 einsum)."""
    groups, n = b.shape[:2]
    m, k = x.shape[0 if token_major else 1], x.shape[2]
    assert x.shape[1 if token_major else 0] == groups
    cfg = w8a16_config(m, n, k, groups, x.device, batch_invariant, row_scaled=_is_row_scale(sb, k))
    cfg.update(cfg_override or {})
    return _launch_w8a16(x.contiguous(), b, _as_scale(sb).contiguous(), None, m, n, k, groups, n // sb.shape[1], cfg,
                         token_major=token_major)


def bf16_skinny_linear(x: torch.Tensor, w: torch.Tensor, cfg_override: dict | None = None,
                       out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [M, K] bf16, w [N, K] bf16 -> [M, N] out_dtype (bf16, or fp32 for the head's logits): x @ w^T with
    fp32 accumulation (bf16 products are exact in fp32, so any summation order computes the reference's
    fp32 GEMM up to its order), for decode-sized M on the W8A16 kernels' swapped tiles (the weight rows
    fill the MMA's long side) with split-K filling the SMs. K must be a multiple of 32 (the K tile is not
    masked)."""
    m, k = x.shape
    n = w.shape[0]
    assert k % 32 == 0 and w.shape[1] == k and x.dtype == w.dtype == torch.bfloat16, (tuple(x.shape), tuple(w.shape))
    assert out_dtype in (torch.bfloat16, torch.float32)
    if m == 0:
        return torch.empty(0, n, dtype=out_dtype, device=x.device)
    cfg = w8a16_config(m, n, k, 1, x.device, row_scaled=True)
    cfg.update(cfg_override or {})
    args = (x.contiguous(), w.contiguous(), x, None, m, n, k, 1, 1, cfg)
    if out_dtype == torch.bfloat16:
        return _launch_w8a16(*args, bf16w=True)[0]
    ws = _launch_w8a16(*args, partials=True, bf16w=True)        # fp32 [SPLIT_K, 1, M, N]
    if cfg["SPLIT_K"] == 1:
        return ws.view(m, n)
    c = torch.empty(m, n, dtype=torch.float32, device=x.device)
    splitk_reduce_kernel[(triton.cdiv(m * n, 1024),)](ws, c, cfg["SPLIT_K"], m * n, m, n, 1, BLOCK=1024, num_warps=4)
    return c


def _fp4_args(packed_k: torch.Tensor, scale: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    assert k % 32 == 0 and packed_k.shape[-1] * 2 == k and scale.shape[-1] == k // 32 \
        and scale.shape[-2] == packed_k.shape[-2], (tuple(packed_k.shape), tuple(scale.shape), k)
    b, s = packed_k.view(torch.uint8).contiguous(), scale.view(torch.uint8).contiguous()
    assert b.data_ptr() % 2 == 0, "FP4 weights are read as int16"
    return b, s


def w4a16_gemm(x: torch.Tensor, packed_k: torch.Tensor, scale: torch.Tensor, cfg_override: dict | None = None
               ) -> torch.Tensor:
    """x [M, K] bf16 (FP8-rounded activations, or any bf16), packed_k [N, K/2] MXFP4 bytes in
    fp4_kernel_layout, scale [N, K/32] E8M0 -> [M, N] bf16: the exact products of x and the release
    weights (reference.dequant_fp4_ref of fp4_release_layout(packed_k)), fp32 accumulated. The caller
    checks fp4_scales_ok once."""
    m, k = x.shape
    n = packed_k.shape[0]
    b, s = _fp4_args(packed_k, scale, k)
    if m == 0:
        return torch.empty(0, n, dtype=torch.bfloat16, device=x.device)
    cfg = w8a16_config(m, n, k, 1, x.device, row_scaled=True)      # BN 64, as the masked form
    cfg.update(cfg_override or {})
    return _launch_w8a16(x.contiguous(), b, s, None, m, n, k, 1, 1, cfg, fp4=True)[0]


def w4a16_grouped_gemm_masked(x: torch.Tensor, packed_k: torch.Tensor, scale: torch.Tensor, masked_m: torch.Tensor,
                              expected_m: int, out: torch.Tensor | None = None,
                              cfg_override: dict | None = None) -> torch.Tensor:
    """The masked MoE form on packed MXFP4 experts: x [G, Mmax, K] bf16, packed_k [G, N, K/2] in
    fp4_kernel_layout, scale [G, N, K/32] E8M0, masked_m [G] -> [G, Mmax, N] bf16 (rows >= masked_m[g]
    not written). Half the weight bytes of the FP8 stacks (w8a16_grouped_gemm_masked) for the same products."""
    groups, mmax, k = x.shape
    n = packed_k.shape[1]
    b, s = _fp4_args(packed_k, scale, k)
    # swapped tiles of BN 64 as the row-scaled form: at BN 128 ptxas serializes the K loop's wgmmas
    # (C7515: each waits for the last; perf/ptx_check.py)
    cfg = w8a16_config(expected_m, n, k, groups, x.device, row_scaled=True)
    if cfg["SWAP"]:
        cfg["BM"] = max(cfg["BM"], 16)
    cfg.update(cfg_override or {})
    return _launch_w8a16(x.contiguous(), b, s, masked_m.to(torch.int32), mmax, n, k, groups, 1, cfg, out, fp4=True)


def w8a16_partials(x: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, masked_m: torch.Tensor | None = None,
                   cfg_override: dict | None = None, fp4: bool = False) -> torch.Tensor:
    """Test hook: the W8A16 kernel's fp32 split-K partial sums [SPLIT_K, G, M, N] (no bf16 rounding).
    x [M, K] with b [N, K] (G = 1), or x [G, Mmax, K] with b [G, N, K] and masked_m [G]. fp4: b is packed
    MXFP4 [.., N, K/2] in fp4_kernel_layout with E8M0 sb [.., N, K/32] (the W4A16 form)."""
    grouped = x.dim() == 3
    x3, b3, s3 = (x, b, sb) if grouped else (x[None], b[None], sb[None])
    groups, m, k = x3.shape
    n = b3.shape[1]
    cfg = w8a16_config(m, n, k, groups, x.device, row_scaled=fp4 or _is_row_scale(s3, k))
    cfg.update(cfg_override or {})
    mm = masked_m.to(torch.int32) if masked_m is not None else None
    if fp4:
        b3, s3 = _fp4_args(b3, s3, k)
    return _launch_w8a16(x3.contiguous(), b3, _as_scale(s3).contiguous(), mm, m, n, k, groups,
                         1 if fp4 else n // s3.shape[1], cfg, partials=True, fp4=fp4)


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NUM_SMS_DEFAULT


def gemm_config(m: int, n: int, k: int, groups: int, device, batch_invariant: bool = False) -> dict:
    """Tile shape and split-K. Decode-sized M swaps A/B; split-K only where the (N, G) grid alone
    leaves SMs idle. batch_invariant: the choice ignores m entirely."""
    nkb = k // 32
    if batch_invariant:
        swap, bm, bn = False, 64, 128
    elif m <= 64:
        swap, bm, bn = True, max(16, triton.next_power_of_2(m)), 128 if n >= 4096 else 64
    else:
        swap, bm, bn = False, 128 if m >= 256 else 64, 128
    tiles = triton.cdiv(n, bn) * groups
    split = 1
    if (m <= 64 or batch_invariant) and tiles < 2 * _num_sms(device):
        split = max(1, min(2 * _num_sms(device) // tiles, nkb // 8, 16))
    return dict(BM=bm, BN=bn, SWAP=swap, SPLIT_K=split, NUM_STAGES=4 if swap else 3,
                num_warps=4 if (swap or bm == 64) else 8)


def _launch(a, sa, b, sb, masked_m, m, n, k, groups, sb_rows, cfg, out=None):
    dev = a.device
    split = cfg["SPLIT_K"]
    grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BM"]), groups * split)
    mm = masked_m if masked_m is not None else sa
    kw = dict(BM=cfg["BM"], BN=cfg["BN"], SB_ROWS=sb_rows, SWAP=cfg["SWAP"], GROUPED=masked_m is not None,
              NUM_STAGES=cfg["NUM_STAGES"], num_warps=cfg["num_warps"])
    if split == 1:
        c = out if out is not None else torch.empty(groups, m, n, dtype=torch.bfloat16, device=dev)
        fp8_gemm_kernel[grid](a, sa, b, sb, c, mm, m, n, k, 1, OUT_F32=False, **kw)
        return c
    ws = torch.zeros(split, groups, m, n, dtype=torch.float32, device=dev) if masked_m is not None else \
        torch.empty(split, groups, m, n, dtype=torch.float32, device=dev)
    fp8_gemm_kernel[grid](a, sa, b, sb, ws, mm, m, n, k, split, OUT_F32=True, **kw)
    c = ws.sum(0).to(torch.bfloat16)
    if out is not None:
        out.copy_(c)
        return out
    return c


def fp8_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
             batch_invariant: bool = False) -> torch.Tensor:
    """a [M, K] e4m3, sa [M, K/32] f32, b [N, K] e4m3, sb [N/32, K/32] (32x32 tiles) or [N, K/32]
    (per row) f32 -> [M, N] bf16."""
    m, k = a.shape
    n = b.shape[0]
    assert k % 32 == 0 and b.shape[1] == k and sa.shape == (m, k // 32)
    sb_rows = n // sb.shape[0]
    assert sb_rows in (1, 32) and sb.shape[1] == k // 32 and n % sb_rows == 0
    if m == 0:
        return torch.empty(0, n, dtype=torch.bfloat16, device=a.device)
    cfg = gemm_config(m, n, k, 1, a.device, batch_invariant)
    return _launch(a, sa.contiguous(), b, sb.contiguous(), None, m, n, k, 1, sb_rows, cfg)[0]


def fp8_grouped_gemm_masked(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                            masked_m: torch.Tensor, expected_m: int, out: torch.Tensor | None = None,
                            batch_invariant: bool = False) -> torch.Tensor:
    """a [G, Mmax, K] e4m3, sa [G, Mmax, K/32], b [G, N, K] e4m3, sb [G, N/R, K/32], masked_m [G]
    int32 -> d [G, Mmax, N] bf16. Rows >= masked_m[g] are garbage (unwritten as in DeepGEMM, or
    zero after a split-K reduction): consumers read only the first masked_m[g] rows."""
    groups, mmax, k = a.shape
    n = b.shape[1]
    sb_rows = n // sb.shape[1]
    assert sb_rows in (1, 32) and sa.shape == (groups, mmax, k // 32)
    cfg = gemm_config(expected_m, n, k, groups, a.device, batch_invariant)
    if expected_m > 64 and not batch_invariant:
        cfg = gemm_config(expected_m, n, k, groups, a.device)
    if cfg["SWAP"] and cfg["BM"] < triton.next_power_of_2(max(1, expected_m)):
        cfg["BM"] = triton.next_power_of_2(expected_m)
    return _launch(a, sa.contiguous(), b, sb.contiguous(), masked_m.to(torch.int32), mmax, n, k, groups, sb_rows,
                   cfg, out)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """x [..., K] bf16, w [N, K] e4m3, w_scale [N/32, K/32] f32 (or raw E8M0) -> [..., N] bf16: the
    reference Linear for FP8 weights (act_quant per 32, fp32-accumulated product)."""
    from .triton_quant import act_quant
    y = w8a16_gemm(act_quant(x.reshape(-1, x.shape[-1])), w, w_scale, batch_invariant)
    return y.view(*x.shape[:-1], w.shape[0])


def fp4_to_fp8_weight(packed: torch.Tensor, scale: torch.Tensor, keep_e8m0: bool = False):
    """[N, K/2] e2m1 pairs (element 2j in the low nibble) + E8M0 [N, K/32] -> (e4m3 [N, K], f32
    [N, K/32], or the E8M0 bytes with keep_e8m0). Exact: the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}
    is a subset of e4m3."""
    u = packed.view(torch.uint8)
    grid = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), device=u.device)
    table = torch.cat([grid, -grid]).to(torch.float8_e4m3fn)
    w = torch.stack([table[(u & 15).long()], table[(u >> 4).long()]], -1).flatten(-2)
    return w.contiguous(), (scale.view(torch.uint8).contiguous() if keep_e8m0 else e8m0_to_float(scale).contiguous())
