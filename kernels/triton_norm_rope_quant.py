"""The attention's KV row in one pass: RMSNorm, RoPE on its last rope dims, act_quant (Attention.qkv).

    norm_rope_quant(x, weight, eps, cis) -> [T, D] bf16
        = act_quant(rope(rms_norm(x, weight, eps), cis)) of the three Triton kernels (triton_norm,
        triton_rope, triton_quant), bit for bit: the same fp32 arithmetic and the same bf16 roundings
        between the steps (the norm's output, the rotated pairs), in one program per BLOCK_M rows
    norm_rope_quant(..., ring=(ring [R, D] bf16, rows [T] int)): each row also stored at ring[rows[t]]
        (the window ring's write, Attention.forward, without its index_put launch)

Why: at decode the three kernels are three launches a layer of a few microseconds each, for a [B, 512]
row block (H200, 2026-12-04: RMSNorm 65 us in 33 calls, RoPE 47 in 24, act_quant 63 in 47 of a batch-64
step). The norm's row sum runs on rms_norm_kernel's tile ([BLOCK_M, D] rows of its BLOCK_M, 4 warps), so
its order, and the bits that follow, are the unfused kernels'. Rules: D a power of two of at most 4096
(one tile a row), rope dims 2 * HALF <= D with HALF a power of two, D % 32 == 0; kernels/select.py
composes the three kernels elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_enter
from .triton_norm import _block_m
from .triton_quant import INTERPRET, _pow2_ceil, _to_e4m3
from .triton_rope import _rotate

MAX_D = 4096


@triton.jit
def norm_rope_quant_kernel(x_ptr, w_ptr, cis_ptr, y_ptr, M, stride_x, stride_c, inv_d, eps,
                           D: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, FMA: tl.constexpr,
                           MANUAL_RNE: tl.constexpr, ring_ptr=None, ring_rows_ptr=None, RING: tl.constexpr = False,
                           PDL: tl.constexpr = False):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D)
    rm = (rows < M)[:, None]
    rows64 = rows.to(tl.int64)[:, None]
    # RMSNorm (rms_norm_kernel's arithmetic), rounded to bf16 as its output is
    x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=rm, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_d + eps)
    w = tl.load(w_ptr + cols).to(tl.float32)
    y = (w[None, :] * (x * r[:, None])).to(tl.bfloat16).to(tl.float32)
    # RoPE on the last 2 * HALF dims (adjacent pairs), each rotated pair rounded to bf16
    a, b = tl.split(tl.reshape(y, (BLOCK_M, D // 2, 2)))                 # [BLOCK_M, D / 2]
    rp = tl.arange(0, D // 2) - (D // 2 - HALF)                          # pair index in the rope part
    in_rope = (rp >= 0)[None, :]
    crow = cis_ptr + rows64 * stride_c + 2 * rp[None, :]
    c = tl.load(crow, mask=rm & in_rope, other=1.0)
    s = tl.load(crow + 1, mask=rm & in_rope, other=0.0)
    re, im = _rotate(a, b, c, s, FMA)
    re = tl.where(in_rope, re.to(tl.bfloat16).to(tl.float32), a)
    im = tl.where(in_rope, im.to(tl.bfloat16).to(tl.float32), b)
    z = tl.reshape(tl.join(re, im), (BLOCK_M, D))
    # act_quant (act_quant_kernel's arithmetic): e4m3 per 32 with a pow2 scale, back to bf16
    g = tl.reshape(z, (BLOCK_M, D // 32, 32))
    amax = tl.maximum(tl.max(tl.abs(g), axis=2), 1e-4)
    sc, inv = _pow2_ceil(amax * (1.0 / 448.0))
    q = _to_e4m3(tl.clamp(g * inv[:, :, None], -448.0, 448.0), MANUAL_RNE)
    out = tl.reshape(q.to(tl.float32) * sc[:, :, None], (BLOCK_M, D)).to(tl.bfloat16)
    tl.store(y_ptr + rows64 * D + cols[None, :], out, mask=rm)
    if RING:
        dst = tl.load(ring_rows_ptr + rows, mask=rows < M, other=0).to(tl.int64)[:, None]
        tl.store(ring_ptr + dst * D + cols[None, :], out, mask=rm)


def shape_ok(x: torch.Tensor, cis: torch.Tensor) -> bool:
    D, half = x.shape[-1], cis.shape[-1]
    return (x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(-1) == 1 and D & (D - 1) == 0
            and 32 <= D <= MAX_D and half & (half - 1) == 0 and 2 * half <= D and cis.dim() == 2
            and cis.shape[0] == x.shape[0])


def ring_ok(x: torch.Tensor, ring: tuple | None) -> bool:
    """The ring write's rules: a contiguous bf16 ring [R, D] and one row id a row."""
    if ring is None:
        return True
    t, rows = ring
    return (t.dtype == torch.bfloat16 and t.dim() == 2 and t.shape[1] == x.shape[-1] and t.is_contiguous()
            and rows.shape == (x.shape[0],) and not rows.is_floating_point())


def norm_rope_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, cis: torch.Tensor,
                    ring: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, D] bf16 (rows may be strided), weight [D], cis [T, rd/2] complex64 -> a new [T, D] bf16;
    ring (ring [R, D], rows [T]): also written at those ring rows."""
    assert shape_ok(x, cis) and ring_ok(x, ring), (tuple(x.shape), x.dtype, tuple(cis.shape))
    M, D = x.shape
    y = torch.empty(M, D, dtype=torch.bfloat16, device=x.device)
    if M == 0:
        return y
    cf = torch.view_as_real(cis)                                              # [T, HALF, 2] fp32, a view
    block_m = _block_m(D)                                                     # rms_norm's tile: its row sums
    norm_rope_quant_kernel[(triton.cdiv(M, block_m),)](
        x, weight.contiguous(), cf, y, M, x.stride(0), cf.stride(0), 1.0 / D, eps, D=D, HALF=cis.shape[-1],
        BLOCK_M=block_m, FMA=x.is_cuda, MANUAL_RNE=INTERPRET, num_warps=4 if D * block_m <= 4096 else 8,
        **({} if ring is None else dict(ring_ptr=ring[0], ring_rows_ptr=ring[1].contiguous(), RING=True)), **pdl_args())
    return y
