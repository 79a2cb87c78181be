"""Triton mHC (manifold hyper-connection) ops (reference: deepinfer/model/block.py `Block.hc_mixes`,
`hc_pre`, `hc_post`, and kernels/reference.py `hc_split_sinkhorn_ref`).

    hc_mixes_pre(x, fn, scale, base, pre_prev, ...)  one pass over x [T, hc, d]:
        mixes = (x.flat @ fn^T) * rsqrt(mean(x.flat^2) + norm_eps), then pre / post / comb by
        Sinkhorn, and the collapse y = sum_k pre_prev[k] * x[k] (bf16) for the sublayer's input.
    hc_post(y, res, post, comb)  out[j] = post[j] * y + sum_i comb[i, j] * res[i]
    hc_split_sinkhorn(mixes, scale, base, hc, iters, eps)  same contract as the reference.

Dataflow of the mixes kernel: a program owns BT tokens and walks chunks_per_program column chunks
of BK; for each chunk it loads the hc streams once, adds their squares to the norm, their product with
fn's matching columns (fp32-accurate dot: tf32x3, or bf16x3 on fn split into three exact bf16 parts)
to the 24 mixes, and pre_prev-weighted sums to y. A second tiny kernel sums each token's column-range
partials (one tree, fixed by d and the launch constants) and applies the norm; the Sinkhorn pass is a
third on [T, 24] (pre / post / comb live in registers as 16 [BT] vectors); tail "fused" does both in one
launch (hc_reduce_sinkhorn_kernel: the chunk sums in chunk order, then Sinkhorn). A third form, the mixes
kernel's last program of each token tile doing both (an arrival counter a tile: no launch after the mixes),
was measured slower on an H100 (2026-12-05: +0.1-0.28 ms a decode step, a longer critical path than two
small kernels) and removed. mix_variant picks the
launch constants (PREFILL_VARIANT for prefill sizes; perf/bench_mhc_variants.py sweeps them).
"""

from __future__ import annotations

import os
import weakref

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_enter
from .reference import hc_split_sinkhorn_ref  # noqa: F401  (the reference this follows)
from .tensor_version import tensor_version

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

MIX_PAD = 32


@triton.jit
def _mix_dot(acc, xs, xb, fn_ptr, f_off, f_ok, part, PREC: tl.constexpr, SPLIT3: tl.constexpr,
             UPCAST: tl.constexpr):
    """acc + one stream's chunk of x @ fn^T. SPLIT3: fn_ptr holds three bf16 parts (hi, mid, lo, `part`
    apart) summing to fn exactly; bf16 x bf16 products are exact in fp32, so three bf16 MMAs on the raw
    x tile give an fp32 dot's accuracy without converting x. UPCAST: the same sums on fp32 operands
    (the interpreter's matmul reads bf16 as raw uint16). Else PREC is the fp32 dot's input_precision."""
    if SPLIT3:
        t = tl.zeros(acc.shape, tl.float32)
        for p in tl.static_range(2, -1, -1):         # lo, mid, hi: the small parts first
            f = tl.load(fn_ptr + p * part + f_off, mask=f_ok, other=0.0)
            if UPCAST:
                t = tl.dot(xs, tl.trans(f.to(tl.float32)), t, input_precision="ieee")
            else:
                t = tl.dot(xb, tl.trans(f), t)
        acc += t
    else:
        f = tl.load(fn_ptr + f_off, mask=f_ok, other=0.0)
        acc += tl.dot(xs, tl.trans(f), input_precision=PREC)
    return acc


@triton.jit
def hc_mixes_pre_kernel(x_ptr, fn_ptr, pre_ptr, mixp_ptr, sqp_ptr, y_ptr, mean_ptr, T, d,
                        HC: tl.constexpr, MIX: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                        CH: tl.constexpr, MIXP: tl.constexpr, PREC: tl.constexpr = "tf32x3",
                        MEAN: tl.constexpr = False, SPLIT3: tl.constexpr = False, UPCAST: tl.constexpr = False,
                        STACKED: tl.constexpr = False, PDL: tl.constexpr = False):
    """Grid (T/BT, d/CH): a program walks CH / BK column chunks of BK (a loop Triton can pipeline when
    num_stages > 1). The fp32 product: 3-pass tf32 (error ~ fp32's), or SPLIT3 (see _mix_dot). x [T, HC, d]
    bf16, fn [MIX, HC*d] f32 (SPLIT3: [3, MIX, HC*d] bf16), pre [T, HC] f32 -> partial mixes
    mixp [d/CH, T, MIXP] and partial squares sqp [d/CH, T] of this column range, y [T, d] bf16; MEAN:
    also mean [T, d] bf16 = x averaged over the HC copies (fp32 sum in copy order, then / HC).
    STACKED (dot "bf16x3n"): SPLIT3's parts loaded as one [4 * MIXP, BK] operand (row p * MIXP + j: part
    p of mix j; masked rows zero), so each stream's chunk is one [BT, BK] x [BK, 4 * MIXP] MMA reading the
    x tile once (SPLIT3's three N = 32 MMAs re-read it from shared memory each), accumulated over the
    program's whole walk; the parts are summed once at the end."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    pc = tl.program_id(1)
    rt = pid * BT + tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rj = tl.arange(0, MIXP)
    t_ok = rt < T
    j_ok = rj < MIX
    hd = HC * d
    sq = tl.zeros((BT,), tl.float32)
    acc = tl.zeros((BT, MIXP), tl.float32)
    rn = tl.arange(0, 4 * MIXP)                       # STACKED: operand row p * MIXP + j = part p of mix j
    rn_row = (rn // MIXP) * MIX + rn % MIXP            # its row of fn's parts [3, MIX, HC*d]
    rn_ok = (rn % MIXP < MIX) & (rn < 3 * MIXP)
    acc4 = tl.zeros((BT, 4 * MIXP), tl.float32)       # the three parts' sums side by side
    for c in range(pc * CH, pc * CH + CH, BK):
        yacc = tl.zeros((BT, BK), tl.float32)
        macc = tl.zeros((BT, BK), tl.float32)
        for k in tl.static_range(HC):
            col = k * d + c + rk
            xb = tl.load(x_ptr + rt[:, None].to(tl.int64) * hd + col[None, :], mask=t_ok[:, None], other=0.0)
            xs = xb.to(tl.float32)
            sq += tl.sum(xs * xs, axis=1)
            if STACKED:
                f = tl.load(fn_ptr + rn_row[:, None].to(tl.int64) * hd + col[None, :], mask=rn_ok[:, None], other=0.0)
                if UPCAST:
                    acc4 = tl.dot(xs, tl.trans(f.to(tl.float32)), acc4, input_precision="ieee")
                else:
                    acc4 = tl.dot(xb, tl.trans(f), acc4)
            else:
                acc = _mix_dot(acc, xs, xb, fn_ptr, rj[:, None].to(tl.int64) * hd + col[None, :], j_ok[:, None],
                               MIX * hd, PREC, SPLIT3, UPCAST)
            pk = tl.load(pre_ptr + rt * HC + k, mask=t_ok, other=0.0)
            yacc += pk[:, None] * xs
            if MEAN:
                macc += xs
        tl.store(y_ptr + rt[:, None].to(tl.int64) * d + (c + rk)[None, :], yacc.to(tl.bfloat16),
                 mask=t_ok[:, None])
        if MEAN:
            tl.store(mean_ptr + rt[:, None].to(tl.int64) * d + (c + rk)[None, :], (macc / HC).to(tl.bfloat16),
                     mask=t_ok[:, None])
    if STACKED:
        acc = tl.sum(tl.reshape(acc4, (BT, 4, MIXP)), axis=1)
    base = pc.to(tl.int64) * T + rt
    tl.store(mixp_ptr + base[:, None] * MIXP + rj[None, :], acc, mask=t_ok[:, None])
    tl.store(sqp_ptr + base, sq, mask=t_ok)


@triton.jit
def _chunk_sums_sinkhorn(mixp_ptr, sqp_ptr, mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, rt, t_ok,
                         T, NC, inv_hd, norm_eps, iters, eps, MIXP: tl.constexpr, HC: tl.constexpr,
                         UNROLL: tl.constexpr):
    """Tokens rt's NC column-chunk partials summed chunk by chunk (a plain loop: the order is fixed by NC,
    whatever layout the compiler picks for T), the norm applied -> mix rows, then the Sinkhorn pass on
    them. UNROLL chunks' loads a turn, issued before their adds (one chunk a turn waits on L2 once per
    chunk); the adds stay in chunk order, and a masked chunk past NC adds +0.0 to a sum that started at
    +0.0 (no bit changes)."""
    rj = tl.arange(0, MIXP)
    acc = tl.zeros((rt.shape[0], MIXP), tl.float32)
    sq = tl.zeros((rt.shape[0],), tl.float32)
    rt64 = rt.to(tl.int64)
    for c0 in range(0, NC, UNROLL):
        for u in tl.static_range(UNROLL):
            row = (c0 + u) * T + rt64
            ok = t_ok & (rt64 * 0 + (c0 + u) < NC)           # (a tensor compare: the interpreter masks no Python bool)
            acc += tl.load(mixp_ptr + row[:, None] * MIXP + rj[None, :], mask=ok[:, None], other=0.0)
            sq += tl.load(sqp_ptr + row, mask=ok, other=0.0)
    rs = 1.0 / tl.sqrt_rn(sq * inv_hd + norm_eps)
    tl.store(mix_ptr + rt[:, None] * MIXP + rj[None, :], acc * rs[:, None], mask=t_ok[:, None])
    tl.debug_barrier()                      # the rows just written, read back by other threads of this program
    _sinkhorn_rows(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, rt, t_ok, iters, eps, MIXP, HC)


@triton.jit
def _comb_in(mix_ptr, base_ptr, rt, t_ok, stride, s2, E: tl.constexpr, HC: tl.constexpr):
    """Comb logit E (row E // 4, column E % 4) of BT tokens: scale * mixes + base."""
    v = tl.load(mix_ptr + rt * stride + 2 * HC + E, mask=t_ok, other=0.0)
    return v * s2 + tl.load(base_ptr + 2 * HC + E)


@triton.jit
def _norm4(a, b, c, d, eps):
    t = a + b + c + d + eps
    return a / t, b / t, c / t, d / t


@triton.jit
def hc_mix_reduce_kernel(mixp_ptr, sqp_ptr, mix_ptr, T, NC, inv_hd, norm_eps,
                         NCP: tl.constexpr, MIXP: tl.constexpr, PDL: tl.constexpr = False):
    """Program t: the NC column-chunk partials of token t [NC, MIXP] and its squares summed (one
    tree over the chunks: the order depends on d only), times rsqrt(mean square + norm_eps) ->
    mix [T, MIXP]. One coalesced tile load per token instead of a serial walk over the chunks
    inside the Sinkhorn kernel (there: 69 us per call at T=64, 12% of the decode step)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    rc = tl.arange(0, NCP)
    rj = tl.arange(0, MIXP)
    ok = rc < NC
    part = tl.load(mixp_ptr + (rc[:, None].to(tl.int64) * T + t) * MIXP + rj[None, :], mask=ok[:, None], other=0.0)
    sq = tl.sum(tl.load(sqp_ptr + rc.to(tl.int64) * T + t, mask=ok, other=0.0), axis=0)
    rs = 1.0 / tl.sqrt_rn(sq * inv_hd + norm_eps)
    tl.store(mix_ptr + t * MIXP + rj, tl.sum(part, axis=0) * rs)


@triton.jit
def hc_sinkhorn_kernel(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, iters, eps, stride,
                       HC: tl.constexpr, BT: tl.constexpr, PDL: tl.constexpr = False):
    """mix [T, 24] (row stride `stride`) -> pre [T, 4], post [T, 4], comb [T, 4, 4] (HC == 4)."""
    pdl_enter(PDL)
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    _sinkhorn_rows(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, rt, rt < T, iters, eps, stride, HC)


@triton.jit
def hc_reduce_sinkhorn_kernel(mixp_ptr, sqp_ptr, mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr,
                              T, NC, inv_hd, norm_eps, iters, eps,
                              MIXP: tl.constexpr, HC: tl.constexpr, BT: tl.constexpr, UNROLL: tl.constexpr):
    """hc_mix_reduce_kernel and hc_sinkhorn_kernel as one launch (the mixes' "fused" tail): a program
    sums BT tokens' column-chunk partials in chunk order, applies the norm, writes the mixes to `mix`
    and runs the Sinkhorn pass on them (_chunk_sums_sinkhorn). One launch fewer per
    sublayer: at decode sizes the two kernels are launch-bound."""
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    _chunk_sums_sinkhorn(mixp_ptr, sqp_ptr, mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, rt, rt < T,
                         T, NC, inv_hd, norm_eps, iters, eps, MIXP, HC, UNROLL)


@triton.jit
def _sinkhorn_rows(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, rt, t_ok, iters, eps, stride,
                   HC: tl.constexpr):
    """The Sinkhorn pass of tokens rt: row softmax + eps, a column pass, then (iters-1) x (row, column),
    each normalization dividing by (sum + eps). The 16 comb entries are 16 [BT] vectors, so every
    row / column sum is three plain adds in one thread."""
    rh = tl.arange(0, 8)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    # pre / post: [BT, 8] block of the first 8 mixes
    m8 = tl.load(mix_ptr + rt[:, None] * stride + rh[None, :], mask=t_ok[:, None], other=0.0)
    b8 = tl.load(base_ptr + rh)
    is_pre = rh < HC
    z = m8 * tl.where(is_pre, s0, s1)[None, :] + b8[None, :]
    sg = tl.sigmoid(z)
    pp = tl.where(is_pre[None, :], sg + eps, 2.0 * sg)
    col = tl.where(is_pre, rh, rh - HC)
    tl.store(pre_ptr + rt[:, None] * HC + col[None, :], pp, mask=t_ok[:, None] & is_pre[None, :])
    tl.store(post_ptr + rt[:, None] * HC + col[None, :], pp, mask=t_ok[:, None] & (rh >= HC)[None, :])
    # comb: 16 vectors c{i}{j} (written out: no Python lists inside the kernel)
    c00 = _comb_in(mix_ptr, base_ptr, rt, t_ok, stride, s2, 0, HC)
    c01 = _comb_in(mix_ptr, base_ptr, rt, t_ok, stride, s2, 1, HC)
    c02 = _comb_in(mix_ptr, base_ptr, rt, t_ok, stride, s2, 2, HC)
    c03 = _comb_in(mix_ptr, base_ptr, rt, t_ok, stride, s2, 3, HC)
    c10 = _comb_in(mix_ptr, base_ptr, rt, t_ok, stride, s2, 4, HC)
    c11 = _comb_in(mix_ptr, base_ptr, rt, t_ok, stride, s2, 5, HC)
    c12 = _comb_in(mix_ptr, base_ptr, rt, t_ok, stride, s2, 6, HC)
    c13 = _comb_in(mix_ptr, base_ptr, rt, t_ok, stride, s2, 7, HC)
    c20 = _comb_in(mix_ptr, base_ptr, rt, t_ok, stride, s2, 8, HC)
    c21 = _comb_in(mix_ptr, base_ptr, rt, t_ok, stride, s2, 9, HC)
    c22 = _comb_in(mix_ptr, base_ptr, rt, t_ok, stride, s2, 10, HC)
    c23 = _comb_in(mix_ptr, base_ptr, rt, t_ok, stride, s2, 11, HC)
    c30 = _comb_in(mix_ptr, base_ptr, rt, t_ok, stride, s2, 12, HC)
    c31 = _comb_in(mix_ptr, base_ptr, rt, t_ok, stride, s2, 13, HC)
    c32 = _comb_in(mix_ptr, base_ptr, rt, t_ok, stride, s2, 14, HC)
    c33 = _comb_in(mix_ptr, base_ptr, rt, t_ok, stride, s2, 15, HC)
    # row softmax + eps
    m0 = tl.maximum(tl.maximum(c00, c01), tl.maximum(c02, c03))
    m1 = tl.maximum(tl.maximum(c10, c11), tl.maximum(c12, c13))
    m2 = tl.maximum(tl.maximum(c20, c21), tl.maximum(c22, c23))
    m3 = tl.maximum(tl.maximum(c30, c31), tl.maximum(c32, c33))
    c00, c01, c02, c03 = _norm4(tl.exp(c00 - m0), tl.exp(c01 - m0), tl.exp(c02 - m0), tl.exp(c03 - m0), 0.0)
    c10, c11, c12, c13 = _norm4(tl.exp(c10 - m1), tl.exp(c11 - m1), tl.exp(c12 - m1), tl.exp(c13 - m1), 0.0)
    c20, c21, c22, c23 = _norm4(tl.exp(c20 - m2), tl.exp(c21 - m2), tl.exp(c22 - m2), tl.exp(c23 - m2), 0.0)
    c30, c31, c32, c33 = _norm4(tl.exp(c30 - m3), tl.exp(c31 - m3), tl.exp(c32 - m3), tl.exp(c33 - m3), 0.0)
    c00, c01, c02, c03 = c00 + eps, c01 + eps, c02 + eps, c03 + eps
    c10, c11, c12, c13 = c10 + eps, c11 + eps, c12 + eps, c13 + eps
    c20, c21, c22, c23 = c20 + eps, c21 + eps, c22 + eps, c23 + eps
    c30, c31, c32, c33 = c30 + eps, c31 + eps, c32 + eps, c33 + eps
    c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, eps)
    c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, eps)
    c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, eps)
    c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, eps)
    for _ in range(iters - 1):
        c00, c01, c02, c03 = _norm4(c00, c01, c02, c03, eps)
        c10, c11, c12, c13 = _norm4(c10, c11, c12, c13, eps)
        c20, c21, c22, c23 = _norm4(c20, c21, c22, c23, eps)
        c30, c31, c32, c33 = _norm4(c30, c31, c32, c33, eps)
        c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, eps)
        c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, eps)
        c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, eps)
        c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, eps)
    tl.store(comb_ptr + rt * 16 + 0, c00, mask=t_ok)
    tl.store(comb_ptr + rt * 16 + 1, c01, mask=t_ok)
    tl.store(comb_ptr + rt * 16 + 2, c02, mask=t_ok)
    tl.store(comb_ptr + rt * 16 + 3, c03, mask=t_ok)
    tl.store(comb_ptr + rt * 16 + 4, c10, mask=t_ok)
    tl.store(comb_ptr + rt * 16 + 5, c11, mask=t_ok)
    tl.store(comb_ptr + rt * 16 + 6, c12, mask=t_ok)
    tl.store(comb_ptr + rt * 16 + 7, c13, mask=t_ok)
    tl.store(comb_ptr + rt * 16 + 8, c20, mask=t_ok)
    tl.store(comb_ptr + rt * 16 + 9, c21, mask=t_ok)
    tl.store(comb_ptr + rt * 16 + 10, c22, mask=t_ok)
    tl.store(comb_ptr + rt * 16 + 11, c23, mask=t_ok)
    tl.store(comb_ptr + rt * 16 + 12, c30, mask=t_ok)
    tl.store(comb_ptr + rt * 16 + 13, c31, mask=t_ok)
    tl.store(comb_ptr + rt * 16 + 14, c32, mask=t_ok)
    tl.store(comb_ptr + rt * 16 + 15, c33, mask=t_ok)


@triton.jit
def expand_stream(y, r0, r1, r2, r3, c0, c1, c2, c3, pj):
    """Stream j of hc_post (HC == 4): pj * y + sum_i c_i * r_i in fp32, in one order of explicit FMAs. Left to the
    compiler, each `acc + c * r` may fuse either product, and which one differs between kernels (the fused
    hc_post_norm's PTX fused the other product for half its elements, 2026-12-07): kernels that must agree bit
    for bit share this."""
    acc = c0 * r0
    acc = tl.fma(c1, r1, acc)
    acc = tl.fma(c2, r2, acc)
    acc = tl.fma(c3, r3, acc)
    return tl.fma(pj, y, acc)


@triton.jit
def hc_post_kernel(y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, T, d,
                   HC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False):
    """out[t, j] = post[t, j] * y[t] + sum_i comb[t, i, j] * res[t, i] (fp32, bf16 out). HC == 4 (the
    release): the four residual tiles are loaded once and held (a loop over j reloads each one HC times),
    the sums in expand_stream's explicit FMAs; any other HC takes that loop."""
    pdl_enter(PDL)
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    rt = pid_t * BT + tl.arange(0, BT)
    rd = pid_d * BD + tl.arange(0, BD)
    t_ok = rt < T
    m = t_ok[:, None] & (rd < d)[None, :]
    rt64 = rt.to(tl.int64)
    y = tl.load(y_ptr + rt64[:, None] * d + rd[None, :], mask=m, other=0.0).to(tl.float32)
    if HC == 4:
        r0 = tl.load(res_ptr + (rt64[:, None] * HC + 0) * d + rd[None, :], mask=m, other=0.0).to(tl.float32)
        r1 = tl.load(res_ptr + (rt64[:, None] * HC + 1) * d + rd[None, :], mask=m, other=0.0).to(tl.float32)
        r2 = tl.load(res_ptr + (rt64[:, None] * HC + 2) * d + rd[None, :], mask=m, other=0.0).to(tl.float32)
        r3 = tl.load(res_ptr + (rt64[:, None] * HC + 3) * d + rd[None, :], mask=m, other=0.0).to(tl.float32)
    for j in tl.static_range(HC):
        pj = tl.load(post_ptr + rt * HC + j, mask=t_ok, other=0.0)
        if HC == 4:
            cb = comb_ptr + rt * (HC * HC) + j
            o = expand_stream(y, r0, r1, r2, r3, tl.load(cb, mask=t_ok, other=0.0)[:, None],
                              tl.load(cb + HC, mask=t_ok, other=0.0)[:, None],
                              tl.load(cb + 2 * HC, mask=t_ok, other=0.0)[:, None],
                              tl.load(cb + 3 * HC, mask=t_ok, other=0.0)[:, None], pj[:, None])
        else:
            acc = tl.zeros((BT, BD), tl.float32)
            for i in tl.static_range(HC):
                r = tl.load(res_ptr + (rt64[:, None] * HC + i) * d + rd[None, :], mask=m, other=0.0).to(tl.float32)
                acc += tl.load(comb_ptr + rt * (HC * HC) + i * HC + j, mask=t_ok, other=0.0)[:, None] * r
            o = pj[:, None] * y + acc
        tl.store(out_ptr + (rt64[:, None] * HC + j) * d + rd[None, :], o.to(tl.bfloat16), mask=m)


def _sinkhorn_outputs(T, hc, dev):
    """pre [T, hc], post [T, hc], comb [T, hc, hc] (fp32) for the Sinkhorn kernels to fill."""
    assert hc == 4 or T == 0, "the Sinkhorn kernels are written for hc_mult 4"
    pre = torch.empty(T, hc, dtype=torch.float32, device=dev)
    return pre, torch.empty_like(pre), torch.empty(T, hc, hc, dtype=torch.float32, device=dev)


def _sinkhorn_launch(mix, stride, scale, base, T, hc, iters, eps):
    pre, post, comb = _sinkhorn_outputs(T, hc, mix.device)
    if T:
        bt = 128
        hc_sinkhorn_kernel[(triton.cdiv(T, bt),)](mix, scale.float().contiguous(), base.float().contiguous(),
                                                  pre, post, comb, T, iters, float(eps), stride, HC=hc, BT=bt,
                                                  num_warps=4, **pdl_args())
    return pre, post, comb


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                      eps: float):
    """Same contract as hc_split_sinkhorn_ref (mixes [..., (2+hc)*hc] fp32)."""
    lead = mixes.shape[:-1]
    m = mixes.reshape(-1, mixes.shape[-1]).float().contiguous()
    pre, post, comb = _sinkhorn_launch(m, m.shape[1], scale, base, m.shape[0], hc, iters, eps)
    return pre.view(*lead, hc), post.view(*lead, hc), comb.view(*lead, hc, hc)


# Launch constants of hc_mixes_pre at T >= 1,024 (not batch_invariant), merged over today's defaults
# (bt 64, bk 128, 4 warps, 1 stage, 1 chunk per program, tf32x3). Set from the H200 sweep
# (perf/bench_mhc_variants.py prints "best: {...}" per T); empty = the measured-before behaviour.
# H200, 2026-12-03 (perf/bench_mhc_variants.py, d 5120, whole wrapper): the bf16x3 dot on today's tiles
# 0.553 -> 0.242 ms at T 8192 (2.28x), 0.156 -> 0.080 at T 2048 (1.95x; bt 128 / bk 64 / 8 warps / 2 stages /
# 2 chunks 0.077). Decode sizes too: T 512 0.050 -> 0.031 (bt 64), T 64 0.016 -> 0.013. Their CUDA graphs
# read the fn parts cached by the eager warm-up before capture (_fn_parts).
# H200, 2026-12-04 (evening; perf/bench_mhc_variants.py --dots bf16x3n, round 36, then an unmasked stacked
# copy of the parts; the masked load of the same parts in the model, round 37: decode 4.91 vs 4.96 ms): one N = 128
# operand, bt 64 / bk 64, at decode sizes: T 64 / 128 0.0136 / 0.0169 -> 0.0122 / 0.0155 ms (the
# batch-64 decode step 4.95 -> 4.90 ms at bt 16, same run); T 2048 0.0814 -> 0.0815 at bt 64 / bk 64 (0.0854 at
# bk 128); T 8192 0.230 -> 0.226 on the prefill tiles (the 40-layer prefill level, within its run-to-run noise).
PREFILL_VARIANT: dict = {"dot": "bf16x3n"}
DECODE_VARIANT: dict = {"dot": "bf16x3n"}

# Tiles by token count (lo <= T <= hi, hi None = no bound), merged before the tables above (so a
# benchmark's override of a table still wins). H200, 2026-12-04 (perf/bench_mhc_variants.py --dots bf16x3
# --bts ... --wide, whole wrapper): T 64 / 128 0.0154 / 0.0179 -> 0.0137 / 0.0161 ms at bt 16 / bk 64 (the
# batch-64 decode step 5.10 -> 5.07 ms, same run; since round 36 bt 64 under bf16x3n, to T 4095); T 8192
# 0.239 -> 0.228 ms at bt 128 / bk 64 / 8 warps / 2 stages / 8 chunks. T 2048's best there (bt 64, 3 stages,
# 10 chunks, 1.18x alone) made the 40-layer chunked prefill slower in its run (718.8 vs 656.5 ms), so it is
# not taken.
SIZE_VARIANTS: list = [(1, 4095, {"bt": 64, "bk": 64}),
                       (4096, None, {"bt": 128, "bk": 64, "num_warps": 8, "num_stages": 2, "chunks_per_program": 8})]

MIX_DOTS = ("tf32x3", "bf16x3", "bf16x3n")
MIX_TAILS = ("split", "fused")   # after the mixes pass: reduce + Sinkhorn kernels, or one kernel doing both


def mix_variant(T: int, d: int, batch_invariant: bool = False, **kw) -> dict:
    """The launch constants of one hc_mixes_pre call: the defaults, then SIZE_VARIANTS' tiles for T, then
    PREFILL_VARIANT (T >= 1,024) or DECODE_VARIANT (not in batch-invariant mode, which keeps one tile and
    dot for every T), then the
    caller's keywords (None = not given). bk falls back to the default where
    it does not divide d, and chunks_per_program to the largest count that tiles d's chunks, so the
    column split (the summation order) follows d and the constants alone, never T."""
    big = T >= 1024 and not batch_invariant
    v = {"bt": 64 if T >= 64 and not batch_invariant else 16, "bk": 128 if d % 128 == 0 else 64,
         "num_warps": 4, "num_stages": 1, "chunks_per_program": 1, "dot": "tf32x3", "tail": "split"}
    if not batch_invariant:
        for lo, hi, tiles in SIZE_VARIANTS:
            if lo <= T and (hi is None or T <= hi):
                v.update(tiles)
        v.update(PREFILL_VARIANT if big else DECODE_VARIANT)
    v.update({k: val for k, val in kw.items() if val is not None})
    unknown = set(v) - {"bt", "bk", "num_warps", "num_stages", "chunks_per_program", "dot", "tail"}
    assert not unknown and v["dot"] in MIX_DOTS and v["tail"] in MIX_TAILS, (unknown, v["dot"], v["tail"])
    if d % v["bk"]:
        v["bk"] = 128 if d % 128 == 0 else 64
    assert d % v["bk"] == 0, "d must be a multiple of 64"
    nk = d // v["bk"]
    v["chunks_per_program"] = max(c for c in range(1, min(v["chunks_per_program"], nk) + 1) if nk % c == 0)
    return v


def bf16_parts(fn: torch.Tensor) -> torch.Tensor:
    """fn (fp32) -> [3, *fn.shape] bf16 hi, mid, lo with hi + mid + lo == fn exactly for 2^-110 <= |fn| <
    bf16's max (each rounding's remainder is exact in fp32 and holds 8 fewer bits; below 2^-110 lo
    lands in bf16's subnormals, off by at most 2^-134)."""
    f = fn.float()
    hi = f.bfloat16()
    r = f - hi.float()
    mid = r.bfloat16()
    return torch.stack((hi, mid, (r - mid.float()).bfloat16())).contiguous()


_PARTS: dict[int, tuple] = {}   # id(fn) -> (weakref to fn, its version, bf16_parts(fn))


def _fn_parts(fn: torch.Tensor) -> torch.Tensor:
    """bf16_parts(fn), cached per weight tensor (1.5x fn's bytes: ~3 MB per site at d 5,120) so the split
    runs once per weight, not per call. Not cached while a CUDA graph is captured: the parts would live
    in the graph's pool, so the graph recomputes them at each replay (the graphs' eager warm-up fills the
    cache first). A weight changed in place is split again into the same tensor, which captured graphs
    read."""
    key, ver = id(fn), tensor_version(fn)
    hit = _PARTS.get(key)
    if hit is not None and hit[0]() is fn:
        if hit[1] != ver:
            hit[2].copy_(bf16_parts(fn))
            _PARTS[key] = (hit[0], ver, hit[2])
        return hit[2]
    parts = bf16_parts(fn)
    if not (fn.is_cuda and torch.cuda.is_current_stream_capturing()):
        _PARTS[key] = (weakref.ref(fn, lambda _, k=key: _PARTS.pop(k, None)), ver, parts)
    return parts


def _tail_unroll(bt: int, num_warps: int) -> int:
    """Chunks a turn of _chunk_sums_sinkhorn's loads: ~64 partial values a thread in flight (bt 16 at 4
    warps: 16 chunks; bt 64: 4)."""
    per_thread = max(1, bt * MIX_PAD // (32 * num_warps))
    return max(1, min(16, 64 // per_thread))


def hc_mixes_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                 pre_prev: torch.Tensor, iters: int, hc_eps: float, norm_eps: float, mean: bool = False,
                 batch_invariant: bool = False, *, bt: int | None = None, bk: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None,
                 chunks_per_program: int | None = None, dot: str | None = None, tail: str | None = None,
                 deferred: bool = False):
    """x [T, hc, d] bf16 -> (pre, post, comb) of this sublayer and y = hc_pre(x, pre_prev) [T, d]
    (mean: and x.mean(dim=1) [T, d] bf16, a DSpark tap, from the same read). Replaces Block.hc_mixes(x)
    followed by Block.hc_pre(x, pre_prev) with one read of x. The column chunks (and so the summation
    order) depend on d and the launch constants only, not on T. batch_invariant: one token tile for
    every T (the tile's MMA shape changes the tf32x3 products' last bits: measured on the H200, a prompt's
    pre-mix moved with what was prefilled beside it when T crossed 1,024), and no PREFILL_VARIANT.
    The keywords pick a variant (mix_variant; None = the default): bt tokens and bk columns per tile,
    chunks_per_program bk-chunks walked by one program, num_warps / num_stages, dot "tf32x3" or
    "bf16x3" (fn split into three exact bf16 parts, bf16 MMAs on x as loaded) or "bf16x3n" (those parts
    loaded as one N = 128 operand: one MMA a stream and chunk); tail "split" (the chunk sums and the
    Sinkhorn pass as two kernels) or "fused" (hc_reduce_sinkhorn_kernel: one).
    deferred: return (tail, y[, mean]) instead, tail() launching the chunk sums and the Sinkhorn pass and
    returning (pre, post, comb): y alone feeds the next kernel, so a caller may run the tail beside it."""
    T, hc, d = x.shape
    mix = fn.shape[0]
    assert fn.shape[1] == hc * d and mix <= MIX_PAD and mix == (2 + hc) * hc
    x = x.contiguous()
    v = mix_variant(T, d, batch_invariant, bt=bt, bk=bk, num_warps=num_warps, num_stages=num_stages,
                    chunks_per_program=chunks_per_program, dot=dot, tail=tail)
    bk = v["bk"]
    ch = bk * v["chunks_per_program"]
    nc = d // ch
    mixp = torch.empty(nc, T, MIX_PAD, dtype=torch.float32, device=x.device)
    sqp = torch.empty(nc, T, dtype=torch.float32, device=x.device)
    y = torch.empty(T, d, dtype=x.dtype, device=x.device)
    avg = torch.empty(T, d, dtype=x.dtype, device=x.device) if mean else y
    if T == 0:
        z = torch.empty(0, hc, device=x.device)
        mixed = (z, z.clone(), torch.empty(0, hc, hc, device=x.device))
        return ((lambda: mixed,) if deferred else mixed) + (y,) + ((avg,) if mean else ())
    split3, stacked = v["dot"] == "bf16x3", v["dot"] == "bf16x3n"
    w = _fn_parts(fn) if split3 or stacked else fn.float().contiguous()
    mixes = torch.empty(T, MIX_PAD, dtype=torch.float32, device=x.device)
    # num_stages 1 (default): one column chunk per program leaves nothing to pipeline, and 3 stages at
    # BT=64 asked 288 KB of shared memory
    hc_mixes_pre_kernel[(triton.cdiv(T, v["bt"]), nc)](x, w, pre_prev.float().contiguous(), mixp, sqp, y, avg, T, d,
                                                       HC=hc, MIX=mix, BT=v["bt"], BK=bk, CH=ch, MIXP=MIX_PAD,
                                                       PREC="ieee" if INTERPRET else "tf32x3", MEAN=mean,
                                                       SPLIT3=split3, UPCAST=INTERPRET, STACKED=stacked,
                                                       num_warps=v["num_warps"], num_stages=v["num_stages"],
                                                       **pdl_args())

    def tail():
        if v["tail"] == "fused":
            pre, post, comb = _sinkhorn_outputs(T, hc, x.device)
            bt = 16
            hc_reduce_sinkhorn_kernel[(triton.cdiv(T, bt),)](mixp, sqp, mixes, scale.float().contiguous(),
                                                             base.float().contiguous(), pre, post, comb, T, nc,
                                                             1.0 / (hc * d), norm_eps, iters, float(hc_eps),
                                                             MIXP=MIX_PAD, HC=hc, BT=bt, UNROLL=_tail_unroll(bt, 4),
                                                             num_warps=4)
        else:
            hc_mix_reduce_kernel[(T,)](mixp, sqp, mixes, T, nc, 1.0 / (hc * d), norm_eps,
                                       NCP=triton.next_power_of_2(nc), MIXP=MIX_PAD, num_warps=4, **pdl_args())
            pre, post, comb = _sinkhorn_launch(mixes, MIX_PAD, scale, base, T, hc, iters, hc_eps)
        return pre, post, comb

    return ((tail,) if deferred else tail()) + (y,) + ((avg,) if mean else ())


def hc_post(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """y [T, d], res [T, hc, d], post [T, hc], comb [T, hc, hc] -> [T, hc, d] in y's dtype."""
    T, hc, d = res.shape
    out = torch.empty_like(res)
    if T:
        bt, bd = 4, 512
        hc_post_kernel[(triton.cdiv(T, bt), triton.cdiv(d, bd))](y.contiguous(), res.contiguous(),
                                                                 post.float().contiguous(), comb.float().contiguous(),
                                                                 out, T, d, HC=hc, BT=bt, BD=bd, num_warps=4,
                                                                 **pdl_args())
    return out


# ---- torch references of the fused contracts (Block's own code, restated in reference.py) ----

from .reference import hc_mixes_pre_ref, hc_post_ref  # noqa: E402,F401
