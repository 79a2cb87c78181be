"""FP8 weights dequantized to bf16, exactly, for the prefill's dense linears on cuBLAS.

    dequant_fp8_bf16(w, w_scale, out)   [N, K] e4m3 + E8M0 bytes per 32x32 tile [N/32, K/32] or per
                                        (row, 32) [N, K/32], or f32 pow2 per row [N, 1] -> bf16 [N, K]
    bf16_exact(w_scale)                 whether every w * scale of this weight is a bf16 value
    dequant_fp4_bf16(packed_k, scale)   MXFP4 in triton_gemm.fp4_kernel_layout [N, K/2] + E8M0 per (row, 32)
                                        (fp4_kernel_weight's bytes, 1..128) -> bf16 [N, K]: the FP4-held
                                        expert stacks for the prefill's bf16 grouped GEMM (2.5 bytes of
                                        traffic per weight where the FP8 stacks' dequant moves 3)

Why: an e4m3 value has 4 significant bits and an E8M0 scale is a power of two, so w * scale fits
bf16's 8 bits whenever its exponent is in bf16's range; act_quant's activations are e4m3 values times
powers of two as well (its scale is at least 2^-22). A bf16 tensor-core GEMM of those exact values
multiplies the same products as the release's FP8 GEMM (each exact in fp32) and adds them in fp32:
the per-32 promotion has nothing left to do, only the order of the additions differs (as it does
between any two GEMM tilings). On SM90 cuBLAS's bf16 GEMM runs at ~0.5 of the FP8 peak (743-800
TFLOP/s at M 8192, H200, 2026-12-02), where an FP8 kernel promoting every 32 K reached 330-605: the
promotion FMAs on the CUDA cores, not the tensor cores, set its pace. The weight is dequantized per
call into a scratch buffer (3 bytes of traffic per weight element: small next to an M >= 1024 GEMM).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_gemm import INTERPRET, _fp4_tile

# w * 2^(e - 127) for every e4m3 w (|w| <= 448 < 2^9, smallest step 2^-9) is a normal bf16 value
# (smallest 2^-126, largest finite just under 2^128) when 2^(e - 127) is in [2^-117, 2^118]; subnormal
# results are left out on purpose (a GPU may flush them). Real scales sit near 2^-8..2^-14.
E8M0_MIN, E8M0_MAX = 10, 245


@triton.jit
def dequant_fp8_kernel(w_ptr, s_ptr, out_ptr, N, K, s_stride_n, s_stride_k,
                       S_ROWS: tl.constexpr, ROW_SCALE: tl.constexpr, F32_SCALE: tl.constexpr,
                       EVEN: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    ok = (rn[:, None] < N) & (rk[None, :] < K)
    off = rn.to(tl.int64)[:, None] * K + rk[None, :]      # int64: a whole expert stack passes 2^31 elements
    if EVEN:
        b = tl.load(w_ptr + off)
    else:
        b = tl.load(w_ptr + off, mask=ok, other=0)
    # the hardware conversion: every e4m3 value (subnormals included, >= 2^-9) is a normal fp32
    v = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    srow = (rn // S_ROWS) * s_stride_n
    if ROW_SCALE:                                         # one scale per row: a [BN] vector
        if F32_SCALE:
            s = tl.load(s_ptr + srow, mask=rn < N, other=1.0)
        else:
            e = tl.load(s_ptr + srow, mask=rn < N, other=127).to(tl.int32) & 0xFF
            s = (e << 23).to(tl.float32, bitcast=True)    # 2^(e - 127), normal for e in [1, 254]
        v = v * s[:, None]
    else:                                                 # one scale per (row group, 32 columns)
        kb = tl.program_id(1) * (BK // 32) + tl.arange(0, BK // 32)
        s_off = srow[:, None] + kb[None, :] * s_stride_k
        s_ok = (rn[:, None] < N) & (kb[None, :] * 32 < K)
        if F32_SCALE:
            s = tl.load(s_ptr + s_off, mask=s_ok, other=1.0)
        else:
            e = tl.load(s_ptr + s_off, mask=s_ok, other=127).to(tl.int32) & 0xFF
            s = (e << 23).to(tl.float32, bitcast=True)
        v = tl.reshape(tl.reshape(v, (BN, BK // 32, 32)) * s[:, :, None], (BN, BK))
    if EVEN:
        tl.store(out_ptr + off, v.to(tl.bfloat16))
    else:
        tl.store(out_ptr + off, v.to(tl.bfloat16), mask=ok)


@triton.jit
def dequant_fp4_kernel(w_ptr, s_ptr, out_ptr, N, K, EVEN: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       UPCAST: tl.constexpr):
    """One [BN, BK] tile: int16 quads decoded by the W4A16 GEMM's own _fp4_tile (same bits), stored bf16."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    kq = tl.program_id(1) * (BK // 4) + tl.arange(0, BK // 4)
    kb = tl.program_id(1) * (BK // 32) + tl.arange(0, BK // 32)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    row = rn.to(tl.int64)[:, None]
    if EVEN:
        w = tl.load(w_ptr + row * (K // 4) + kq[None, :])
        sc = tl.load(s_ptr + row * (K // 32) + kb[None, :])
    else:
        w = tl.load(w_ptr + row * (K // 4) + kq[None, :], mask=(rn[:, None] < N) & (kq[None, :] < K // 4), other=0)
        sc = tl.load(s_ptr + row * (K // 32) + kb[None, :], mask=(rn[:, None] < N) & (kb[None, :] < K // 32),
                     other=1)
    v = _fp4_tile(w, sc.to(tl.int32) & 0xFF, BN, BK, UPCAST).to(tl.bfloat16)
    off = row * K + rk[None, :]
    if EVEN:
        tl.store(out_ptr + off, v)
    else:
        tl.store(out_ptr + off, v, mask=(rn[:, None] < N) & (rk[None, :] < K))


# (BN, BK, num_warps): perf/bench_dequant.py --fp4-tiles on an H100, 2026-12-06 (round98), the 48-expert stacks:
# w13 1.086 ms (0.88 of copy) / w2 0.572 (0.84) against 1.126 / 0.622 at 32x512x4 (same bits)
FP4_TILE = (32, 1024, 8)


def dequant_fp4_bf16(packed_k: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None,
                     tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """packed_k [N, K/2] uint8 (fp4_kernel_layout), scale [N, K/32] E8M0 bytes in 1..128 -> bf16 [N, K]."""
    n, k = packed_k.shape[0], packed_k.shape[1] * 2
    assert k % 32 == 0 and scale.shape == (n, k // 32), (tuple(packed_k.shape), tuple(scale.shape))
    out = torch.empty(n, k, dtype=torch.bfloat16, device=packed_k.device) if out is None else out
    bn, bk, warps = tile or FP4_TILE
    bk = min(bk, triton.next_power_of_2(k))
    dequant_fp4_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        packed_k.contiguous().view(torch.int16), scale.contiguous().view(torch.uint8), out, n, k,
        EVEN=n % bn == 0 and k % bk == 0, BN=bn, BK=bk, UPCAST=INTERPRET,
        num_warps=warps)
    return out


def _layout(n: int, k: int, w_scale: torch.Tensor) -> tuple[int, int]:
    """(rows, columns) of the weight that share one scale."""
    if w_scale.shape[-1] == 1 and k > 32:
        return 1, k
    return n // w_scale.shape[0], 32


# (BN, BK, num_warps) of the dequant's tiles: perf/bench_dequant.py on the H200, 2026-12-03 (afternoon), a
# 48-expert w13 stack on the hardware e4m3 conversion: 0.916 ms row-scaled, 0.918 in 32x32 blocks (0.91 of
# copy bandwidth; the integer-built kernel took 1.265 / 1.676), w2 0.503 / 0.501 (0.83; 64x256x8 0.486 on
# blocks)
TILE = (32, 512, 4)


def dequant_fp8_bf16(w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor | None = None,
                     tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    n, k = w.shape
    rows, cols = _layout(n, k, w_scale)
    f32 = w_scale.dtype == torch.float32
    s = w_scale if f32 else w_scale.view(torch.uint8)
    out = torch.empty(n, k, dtype=torch.bfloat16, device=w.device) if out is None else out
    bn, bk, warps = tile or TILE
    assert bk % 32 == 0, "BK must hold whole 32-column scale blocks"
    dequant_fp8_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        w.view(torch.uint8), s, out, n, k, s.stride(0), s.stride(1) if s.shape[1] > 1 else 0,
        S_ROWS=rows, ROW_SCALE=cols >= k, F32_SCALE=f32, EVEN=n % bn == 0 and k % bk == 0,
        BN=bn, BK=bk, num_warps=warps)
    return out


def bf16_exact(w_scale: torch.Tensor) -> bool:
    """Every w * scale of a weight with these scales is a bf16 value (one reduction and a host read:
    callers cache the verdict per weight)."""
    if w_scale.dtype == torch.float32:
        m, e = torch.frexp(w_scale)
        return bool(((m.abs() == 0.5) & (e - 1 >= E8M0_MIN - 127) & (e - 1 <= E8M0_MAX - 127)).all())
    b = w_scale.view(torch.uint8)
    return bool(((b >= E8M0_MIN) & (b <= E8M0_MAX)).all())
