"""Triton activation quantization (reference: kernels/reference.py `act_quant_ref`, `fp4_quant_ref`).

    act_quant(x)           FP8 e4m3 fake-quant along the last dim, blocks of 32, pow2 scales
    act_quant_fp8(x)       the same rounding, returned as (e4m3 [M, K], fp32 pow2 scales [M, K/32])
                           for the FP8 GEMMs
    fp4_quant(x, 16|32)    FP4 e2m1 fake-quant: block 16 / e4m3 scale (compressed KV), block 32 /
                           pow2 scale (indexer q and keys)

Dataflow: one program loads a [BM, BK] tile, views it [BM, BK/block, block], takes the block amax,
builds the scale exactly as the reference does (pow2 from the float bits; e4m3 scale by an IEEE
division and a round-to-nearest-even cast), rounds, and stores. Every fake-quantized value is
exact in bf16, so the outputs are bit-identical to the torch reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .reference import act_quant_ref, fp4_quant_ref  # noqa: F401  (the references these follow)

try:                     # programmatic dependent launch's trigger (Triton >= 3.3; a no-op where nothing waits on it)
    from triton.language.extra.cuda import gdc_launch_dependents
except ImportError:      # pragma: no cover
    gdc_launch_dependents = None


@triton.jit
def _pow2_ceil(t):
    """2^ceil(log2 t) for t > 0 from the float bits, and its exact inverse."""
    bits = t.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    s = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    return s, inv


@triton.jit
def _rint_half_even(x):
    """round(x) with ties to even for 0 <= x < 2^22."""
    fl = tl.floor(x)
    d = x - fl
    odd = (fl - 2.0 * tl.floor(fl * 0.5)) != 0.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return tl.where(up, fl + 1.0, fl)


@triton.jit
def _e4m3_rne(v):
    """v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32 arithmetic. Used under
    the CPU interpreter, whose float8 cast does not round to nearest; on the GPU the hardware cvt
    (round-to-nearest-even, satfinite) does the same."""
    a = tl.abs(v)
    ex = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    ulp = ((ex - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - (ex - 3)) << 23).to(tl.float32, bitcast=True)
    r = _rint_half_even(a * inv) * ulp
    return tl.where(v < 0, -r, r)


@triton.jit
def _to_e4m3(v, MANUAL: tl.constexpr):
    if MANUAL:
        v = _e4m3_rne(v)
    return v.to(tl.float8e4nv)


@triton.jit
def _e2m1_round(v):
    """Nearest e2m1 value of v (|v| <= 6), ties to the even code (grid step 0.5 / 1 / 2)."""
    a = tl.abs(v)
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    r = _rint_half_even(a / step) * step
    return tl.where(v < 0, -r, r)


@triton.jit
def act_quant_kernel(x_ptr, y_ptr, s_ptr, M, K,
                     BM: tl.constexpr, BK: tl.constexpr, BLOCK: tl.constexpr, FAKE: tl.constexpr,
                     MANUAL_RNE: tl.constexpr = False, S_LD=0, S_T: tl.constexpr = False,
                     PDL: tl.constexpr = False):
    """x [M, K] -> FAKE: y bf16 [M, K] fake-quantized; else y e4m3 [M, K] and s fp32 [M, K/BLOCK]
    (S_T: transposed, s [K/BLOCK, S_LD]). PDL: the next kernel, launched programmatically (the CUDA decode
    GEMM), may start now: it streams its weights and waits for this grid's end before reading y and s."""
    if PDL:
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rk = pid_k * BK + tl.arange(0, BK)
    mask = rm[:, None] < M
    x = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.reshape(x, (BM, BK // BLOCK, BLOCK))
    amax = tl.maximum(tl.max(tl.abs(g), axis=2), 1e-4)
    s, inv = _pow2_ceil(amax * (1.0 / 448.0))
    q = _to_e4m3(tl.clamp(g * inv[:, :, None], -448.0, 448.0), MANUAL_RNE)
    if FAKE:
        out = tl.reshape(q.to(tl.float32) * s[:, :, None], (BM, BK))
        tl.store(y_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], tl.reshape(q, (BM, BK)), mask=mask)
        rs = pid_k * (BK // BLOCK) + tl.arange(0, BK // BLOCK)
        if S_T:
            tl.store(s_ptr + rs[None, :].to(tl.int64) * S_LD + rm[:, None], s, mask=mask)
        else:
            tl.store(s_ptr + rm[:, None].to(tl.int64) * (K // BLOCK) + rs[None, :], s, mask=mask)


@triton.jit
def fp4_quant_kernel(x_ptr, y_ptr, M, K, BM: tl.constexpr, BK: tl.constexpr, BLOCK: tl.constexpr,
                     MANUAL_RNE: tl.constexpr = False):
    """x [M, K] -> y [M, K] FP4 fake-quantized. BLOCK 16: e4m3 scale of max(amax, 6*2^-9) / 6;
    BLOCK 32: pow2 scale of max(amax, 6*2^-126) / 6."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rk = pid_k * BK + tl.arange(0, BK)
    mask = rm[:, None] < M
    offs = rm[:, None].to(tl.int64) * K + rk[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = _fp4_round(x, BM, BK, BLOCK, MANUAL_RNE)
    tl.store(y_ptr + offs, q.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp4_round(x, BM: tl.constexpr, BK: tl.constexpr, BLOCK: tl.constexpr, MANUAL_RNE: tl.constexpr):
    """x [BM, BK] fp32 FP4-rounded in blocks of BLOCK along BK (fp4_quant_kernel's docstring), fp32 out."""
    g = tl.reshape(x, (BM, BK // BLOCK, BLOCK))
    amax = tl.max(tl.abs(g), axis=2)
    if BLOCK == 16:
        s = tl.math.div_rn(tl.maximum(amax, 6.0 * 2.0 ** -9), tl.full(amax.shape, 6.0, tl.float32))
        s = _to_e4m3(s, MANUAL_RNE).to(tl.float32)
        v = tl.math.div_rn(g, tl.broadcast_to(s[:, :, None], g.shape))
    else:
        s, inv = _pow2_ceil(tl.maximum(amax, 6.0 * 2.0 ** -126) * (1.0 / 6.0))
        v = g * inv[:, :, None]
    q = _e2m1_round(tl.clamp(v, -6.0, 6.0)) * s[:, :, None]
    return tl.reshape(q, (BM, BK))


@triton.jit
def _fp4_pack_rows(r, BM: tl.constexpr, D: tl.constexpr):
    """r [BM, D] fp32 on the FP4 grid of 32-blocks with power-of-two scales -> (codes [BM, D / 2] uint8,
    E8M0 scales [BM, D / 32] uint8): reference.fp4_pack_rows_ref's bytes (the scale from the values, the
    sign bit kept for zeros)."""
    g = tl.reshape(r, (BM, D // 32, 32))
    s, inv = _pow2_ceil(tl.maximum(tl.max(tl.abs(g), axis=2), 6.0 * 2.0 ** -126) * (1.0 / 6.0))
    a = tl.abs(g) * inv[:, :, None]
    code = tl.where(a < 2.0, a * 2.0, tl.where(a < 4.0, a + 2.0, a * 0.5 + 4.0)).to(tl.int32)
    code = tl.reshape(code | (((g.to(tl.int32, bitcast=True) >> 31) & 1) << 3), (BM, D // 2, 2))
    lo, hi = tl.split(code)
    return (lo | (hi << 4)).to(tl.uint8), ((s.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)


INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _tiles(K: int, block: int) -> tuple[int, int]:
    assert K % block == 0, f"last dim {K} is not a multiple of the quant block {block}"
    bk = block
    while bk < 256 and K % (2 * bk) == 0:
        bk *= 2
    return max(1, 2048 // bk), bk


def act_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 round trip along the last dim (same values as act_quant_ref, in x's dtype)."""
    if x.numel() == 0:
        return x.clone()
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    M, K = x2.shape
    y = torch.empty_like(x2)
    bm, bk = _tiles(K, block)
    act_quant_kernel[(triton.cdiv(M, bm), K // bk)](x2, y, y, M, K, BM=bm, BK=bk, BLOCK=block, FAKE=True,
                                                     MANUAL_RNE=INTERPRET)
    return y.view(x.shape)


def act_quant_fp8(x: torch.Tensor, block: int = 32, scales_ld: int | None = None,
                  pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 [M, K], fp32 pow2 scales [M, K/block]) with M = prod(leading dims).
    scales_ld (>= M): the scales transposed instead, [K/block, scales_ld], columns past M unset (the CUDA
    decode GEMM's token-scale layout, cuda_fp8_decode). pdl: let a programmatically launched next kernel
    start at once (triggered at the kernel's start)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    M, K = x2.shape
    y = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    if scales_ld is None:
        s = torch.empty(M, K // block, dtype=torch.float32, device=x.device)
    else:      # columns M .. scales_ld - 1 left unset: they scale token columns no GEMM stores (no memset launch)
        assert scales_ld >= M, (scales_ld, M)
        s = torch.empty(K // block, scales_ld, dtype=torch.float32, device=x.device)
    if M:
        bm, bk = _tiles(K, block)
        act_quant_kernel[(triton.cdiv(M, bm), K // bk)](x2, y, s, M, K, BM=bm, BK=bk, BLOCK=block, FAKE=False,
                                                         MANUAL_RNE=INTERPRET, S_LD=scales_ld or 0,
                                                         S_T=scales_ld is not None,
                                                         PDL=pdl and gdc_launch_dependents is not None and not INTERPRET)
    return y, s


def fp4_quant(x: torch.Tensor, block: int) -> torch.Tensor:
    """FP4 round trip along the last dim (same values as fp4_quant_ref, in x's dtype)."""
    assert block in (16, 32)
    if x.numel() == 0:
        return x.clone()
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    M, K = x2.shape
    y = torch.empty_like(x2)
    bm, bk = _tiles(K, block)
    fp4_quant_kernel[(triton.cdiv(M, bm), K // bk)](x2, y, M, K, BM=bm, BK=bk, BLOCK=block,
                                                      MANUAL_RNE=INTERPRET)
    return y.view(x.shape)
