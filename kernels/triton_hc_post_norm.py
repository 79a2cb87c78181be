"""A sublayer's mHC expand and the next sublayer's collapse and RMSNorm in one kernel (Block.expand_into: between
the attention and the FFN, and from one block's FFN into the next block's attention).

    hc_post_norm(y, res, post, comb, pre, weight, eps, quant=False, mean=False)
        -> (out [T, hc, d], xn [T, d], xq [T, d] or None[, mean [T, d]])
        out = hc_post(y, res, post, comb)                  hc_post_kernel's arithmetic (triton_mhc.expand_stream)
        xn  = rms_norm(hc_pre(out, pre), weight, eps)      the collapse as hc_mixes_pre_kernel makes it (`y += p * x`
                                                           over the rounded streams in stream order, then bf16),
                                                           then rms_norm_kernel's arithmetic on rms_norm's tile
        xq  = act_quant(xn) (quant)                        rms_norm_kernel's QUANT tail
        mean = out.mean over the streams (mean=True)       hc_mixes_pre_kernel's MEAN (a DSpark tap)

Why: between the two sublayers the decode step ran hc_post, the mixes kernel (for its collapse) and the norm
one after the other on the critical path, three latency-bound launches of a few microseconds each for [B, d]
rows. The collapse needs only the previous sublayer's pre-mix, known before hc_post, so the streams are
collapsed and normed in registers as they are made; the mixes' fn products (and their tail), needed only
after the sublayer, run on a side stream (Block.expand_into). The same bits as the three kernels: elementwise sums in
their order, and the norm's row sums on rms_norm's tile (BLOCK_M rows of BLOCK_D = next_pow2(d), its warps).

Rules (shape_ok): hc 4, d <= MAX_D, bf16 y / res, fp32 post / comb / pre; select composes the ops elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_enter
from .triton_mhc import expand_stream
from .triton_norm import MAX_D, _block_m, rows_quant
from .triton_quant import INTERPRET

HC = 4


@triton.jit
def hc_post_norm_kernel(y_ptr, res_ptr, post_ptr, comb_ptr, pre_ptr, w_ptr, out_ptr, xn_ptr, T, d, inv_d, eps,
                        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, q_ptr=None, QUANT: tl.constexpr = False,
                        MANUAL_RNE: tl.constexpr = False, mean_ptr=None, MEAN: tl.constexpr = False,
                        PDL: tl.constexpr = False):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    r_ok = rows < T
    mask = r_ok[:, None] & (cols[None, :] < d)
    rt64 = rows.to(tl.int64)[:, None]
    yv = tl.load(y_ptr + rt64 * d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r0 = tl.load(res_ptr + (rt64 * 4 + 0) * d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r1 = tl.load(res_ptr + (rt64 * 4 + 1) * d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r2 = tl.load(res_ptr + (rt64 * 4 + 2) * d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r3 = tl.load(res_ptr + (rt64 * 4 + 3) * d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    macc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for j in tl.static_range(4):
        # hc_post_kernel's stream j: the same explicit FMAs (expand_stream)
        cb = comb_ptr + rows * 16 + j
        pj = tl.load(post_ptr + rows * 4 + j, mask=r_ok, other=0.0)
        oj = expand_stream(yv, r0, r1, r2, r3, tl.load(cb, mask=r_ok, other=0.0)[:, None],
                           tl.load(cb + 4, mask=r_ok, other=0.0)[:, None],
                           tl.load(cb + 8, mask=r_ok, other=0.0)[:, None],
                           tl.load(cb + 12, mask=r_ok, other=0.0)[:, None], pj[:, None]).to(tl.bfloat16)
        tl.store(out_ptr + (rt64 * 4 + j) * d + cols[None, :], oj, mask=mask)
        # the collapse over the stored (bf16) streams, hc_mixes_pre_kernel's `yacc += pk * xs`
        pk = tl.load(pre_ptr + rows * 4 + j, mask=r_ok, other=0.0)
        x += pk[:, None] * oj.to(tl.float32)
        if MEAN:
            macc += oj.to(tl.float32)
    if MEAN:        # the mixes kernel's mean over the streams: an fp32 sum in stream order, then / 4
        tl.store(mean_ptr + rt64 * d + cols[None, :], (macc / 4).to(tl.bfloat16), mask=mask)
    x = x.to(tl.bfloat16).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_d + eps)                    # rms_norm_kernel's arithmetic
    w = tl.load(w_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)
    xn = w[None, :] * (x * r[:, None])
    tl.store(xn_ptr + rt64 * d + cols[None, :], xn.to(tl.bfloat16), mask=mask)
    if QUANT:   # rms_norm_kernel's QUANT tail
        tl.store(q_ptr + rt64 * d + cols[None, :], rows_quant(xn, BLOCK_M, BLOCK_D, MANUAL_RNE), mask=mask)


def shape_ok(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor,
             weight: torch.Tensor, quant: bool = False) -> bool:
    if res.dim() != 3:
        return False
    T, hc, d = res.shape
    return (hc == HC and 0 < d <= MAX_D and (not quant or d % 32 == 0)
            and y.dtype == res.dtype == torch.bfloat16 and y.shape == (T, d) and weight.shape == (d,)
            and post.shape == (T, hc) and pre.shape == (T, hc) and comb.shape == (T, hc, hc)
            and post.dtype == pre.dtype == comb.dtype == torch.float32)


def hc_post_norm(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor,
                 weight: torch.Tensor, eps: float, quant: bool = False, mean: bool = False):
    """-> (out [T, hc, d] bf16, xn [T, d] bf16, xq [T, d] bf16 or None[, out's mean over the streams [T, d] bf16
    (mean: a DSpark tap, the mixes kernel's MEAN)]); see the module docstring."""
    assert shape_ok(y, res, post, comb, pre, weight, quant), (tuple(y.shape), tuple(res.shape), y.dtype)
    T, hc, d = res.shape
    out = torch.empty_like(res)
    xn = torch.empty_like(y)
    xq = torch.empty_like(y) if quant else None
    mo = (torch.empty_like(y),) if mean else ()
    if T == 0:
        return (out, xn, xq, *mo)
    block_d = triton.next_power_of_2(d)
    block_m = _block_m(block_d)                                   # rms_norm's tile: its row sums
    extra = dict(q_ptr=xq, QUANT=True, MANUAL_RNE=INTERPRET) if quant else {}
    if mean:
        extra.update(mean_ptr=mo[0], MEAN=True)
    hc_post_norm_kernel[(triton.cdiv(T, block_m),)](
        y.contiguous(), res.contiguous(), post.contiguous(), comb.contiguous(), pre.contiguous(),
        weight.contiguous(), out, xn, T, d, 1.0 / d, eps, BLOCK_M=block_m, BLOCK_D=block_d,
        num_warps=4 if block_d * block_m <= 4096 else 8, **extra, **pdl_args())
    return (out, xn, xq, *mo)
