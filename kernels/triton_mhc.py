"""Triton mHC (manifold hyper-connection) ops (reference: deepinfer/model/block.py `Block.hc_mixes`,
`hc_pre`, `hc_post`, and kernels/reference.py `hc_split_sinkhorn_ref`).

    hc_mixes_pre(x, fn, scale, base, pre_prev, ...)  one pass over x [T, hc, d]:
        mixes = (x.flat @ fn^T) * rsqrt(mean(x.flat^2) + norm_eps), then pre / post / comb by
        Sinkhorn, and the collapse y = sum_k pre_prev[k] * x[k] (bf16) for the sublayer's input.
    hc_post(y, res, post, comb)  out[j] = post[j] * y + sum_i comb[i, j] * res[i]
    hc_split_sinkhorn(mixes, scale, base, hc, iters, eps)  same contract as the reference.

Dataflow of the mixes kernel: a program owns BT tokens and walks the d columns in chunks of BK;
for each chunk it loads the hc streams once, adds their squares to the norm, their product with
fn's matching columns (fp32 dot, IEEE) to the 24 mixes, and pre_prev-weighted sums to y. The
Sinkhorn pass is a second tiny kernel on [T, 24] (pre / post / comb live in registers as
[BT, 4] and [BT, 4, 4] tensors).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .reference import hc_split_sinkhorn_ref  # noqa: F401  (the reference this follows)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

MIX_PAD = 32


@triton.jit
def hc_mixes_pre_kernel(x_ptr, fn_ptr, pre_ptr, mixp_ptr, sqp_ptr, y_ptr, T, d,
                        HC: tl.constexpr, MIX: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                        CH: tl.constexpr, MIXP: tl.constexpr, PREC: tl.constexpr = "tf32x3"):
    """Grid (T/BT, d/CH). The fp32 product uses 3-pass tf32 (error ~ fp32's) on the tensor cores. x [T, HC, d] bf16, fn [MIX, HC*d] f32, pre [T, HC] f32 -> partial mixes
    mixp [d/CH, T, MIXP] and partial squares sqp [d/CH, T] of this column chunk, y [T, d] bf16."""
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
    for c in range(pc * CH, pc * CH + CH, BK):
        yacc = tl.zeros((BT, BK), tl.float32)
        for k in tl.static_range(HC):
            col = k * d + c + rk
            xs = tl.load(x_ptr + rt[:, None].to(tl.int64) * hd + col[None, :], mask=t_ok[:, None],
                         other=0.0).to(tl.float32)
            sq += tl.sum(xs * xs, axis=1)
            f = tl.load(fn_ptr + rj[:, None].to(tl.int64) * hd + col[None, :], mask=j_ok[:, None], other=0.0)
            acc += tl.dot(xs, tl.trans(f), input_precision=PREC)
            pk = tl.load(pre_ptr + rt * HC + k, mask=t_ok, other=0.0)
            yacc += pk[:, None] * xs
        tl.store(y_ptr + rt[:, None].to(tl.int64) * d + (c + rk)[None, :], yacc.to(tl.bfloat16),
                 mask=t_ok[:, None])
    base = pc.to(tl.int64) * T + rt
    tl.store(mixp_ptr + base[:, None] * MIXP + rj[None, :], acc, mask=t_ok[:, None])
    tl.store(sqp_ptr + base, sq, mask=t_ok)


@triton.jit
def hc_sinkhorn_kernel(mix_ptr, sqp_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, iters, eps,
                       NC, inv_hd, norm_eps,
                       HC: tl.constexpr, BT: tl.constexpr, MIXP: tl.constexpr, PARTIAL: tl.constexpr):
    """mix [T, (2+HC)*HC] -> pre [T, HC], post [T, HC], comb [T, HC, HC] (row softmax + eps, a column
    pass, then (iters-1) x (row, column), each normalization dividing by (sum + eps)).
    PARTIAL: mix holds NC column-chunk partials [NC, T, MIXP] summed here in chunk order, and
    scaled by rsqrt(sum(sqp) / (HC*d) + norm_eps)."""
    MIX: tl.constexpr = (2 + HC) * HC
    pid = tl.program_id(0)
    rt = pid * BT + tl.arange(0, BT)
    t_ok = rt < T
    rh = tl.arange(0, HC)
    cij = rh[:, None] * HC + rh[None, :]                                     # [HC, HC]
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    if PARTIAL:
        m_pre = tl.zeros((BT, HC), tl.float32)
        m_post = tl.zeros((BT, HC), tl.float32)
        m_c = tl.zeros((BT, HC, HC), tl.float32)
        sq = tl.zeros((BT,), tl.float32)
        for c in range(NC):
            row = c * T + rt
            m_pre += tl.load(mix_ptr + row[:, None] * MIXP + rh[None, :], mask=t_ok[:, None], other=0.0)
            m_post += tl.load(mix_ptr + row[:, None] * MIXP + HC + rh[None, :], mask=t_ok[:, None], other=0.0)
            m_c += tl.load(mix_ptr + row[:, None, None] * MIXP + 2 * HC + cij[None, :, :],
                           mask=t_ok[:, None, None], other=0.0)
            sq += tl.load(sqp_ptr + row, mask=t_ok, other=0.0)
        rs = 1.0 / tl.sqrt_rn(sq * inv_hd + norm_eps)
        m_pre = m_pre * rs[:, None]
        m_post = m_post * rs[:, None]
        m_c = m_c * rs[:, None, None]
    else:
        m_pre = tl.load(mix_ptr + rt[:, None] * MIX + rh[None, :], mask=t_ok[:, None], other=0.0)
        m_post = tl.load(mix_ptr + rt[:, None] * MIX + HC + rh[None, :], mask=t_ok[:, None], other=0.0)
        m_c = tl.load(mix_ptr + rt[:, None, None] * MIX + 2 * HC + cij[None, :, :], mask=t_ok[:, None, None],
                      other=0.0)
    pre = tl.sigmoid(m_pre * s0 + tl.load(base_ptr + rh)[None, :]) + eps
    post = 2.0 * tl.sigmoid(m_post * s1 + tl.load(base_ptr + HC + rh)[None, :])
    c = m_c * s2 + tl.load(base_ptr + 2 * HC + cij)[None, :, :]
    c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
    c = c / tl.sum(c, axis=2)[:, :, None] + eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    tl.store(pre_ptr + rt[:, None] * HC + rh[None, :], pre, mask=t_ok[:, None])
    tl.store(post_ptr + rt[:, None] * HC + rh[None, :], post, mask=t_ok[:, None])
    tl.store(comb_ptr + rt[:, None, None] * (HC * HC) + cij[None, :, :], c, mask=t_ok[:, None, None])


@triton.jit
def hc_post_kernel(y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, T, d,
                   HC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """out[t, j] = post[t, j] * y[t] + sum_i comb[t, i, j] * res[t, i] (fp32, bf16 out)."""
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    rt = pid_t * BT + tl.arange(0, BT)
    rd = pid_d * BD + tl.arange(0, BD)
    t_ok = rt < T
    m = t_ok[:, None] & (rd < d)[None, :]
    rt64 = rt.to(tl.int64)
    y = tl.load(y_ptr + rt64[:, None] * d + rd[None, :], mask=m, other=0.0).to(tl.float32)
    for j in tl.static_range(HC):
        acc = tl.zeros((BT, BD), tl.float32)
        for i in tl.static_range(HC):
            r = tl.load(res_ptr + (rt64[:, None] * HC + i) * d + rd[None, :], mask=m, other=0.0).to(tl.float32)
            cij = tl.load(comb_ptr + rt * (HC * HC) + i * HC + j, mask=t_ok, other=0.0)
            acc += cij[:, None] * r
        pj = tl.load(post_ptr + rt * HC + j, mask=t_ok, other=0.0)
        tl.store(out_ptr + (rt64[:, None] * HC + j) * d + rd[None, :], (pj[:, None] * y + acc).to(tl.bfloat16), mask=m)


def _sinkhorn_launch(mix, sqp, scale, base, T, hc, iters, eps, nc=0, inv_hd=0.0, norm_eps=0.0):
    dev = mix.device
    pre = torch.empty(T, hc, dtype=torch.float32, device=dev)
    post = torch.empty_like(pre)
    comb = torch.empty(T, hc, hc, dtype=torch.float32, device=dev)
    if T:
        bt = 32
        hc_sinkhorn_kernel[(triton.cdiv(T, bt),)](mix, sqp, scale.float().contiguous(), base.float().contiguous(),
                                                  pre, post, comb, T, iters, float(eps), nc, float(inv_hd),
                                                  float(norm_eps), HC=hc, BT=bt, MIXP=MIX_PAD, PARTIAL=nc > 0,
                                                  num_warps=4)
    return pre, post, comb


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                      eps: float):
    """Same contract as hc_split_sinkhorn_ref (mixes [..., (2+hc)*hc] fp32)."""
    lead = mixes.shape[:-1]
    m = mixes.reshape(-1, mixes.shape[-1]).float().contiguous()
    pre, post, comb = _sinkhorn_launch(m, m, scale, base, m.shape[0], hc, iters, eps)
    return pre.view(*lead, hc), post.view(*lead, hc), comb.view(*lead, hc, hc)


def hc_mixes_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                 pre_prev: torch.Tensor, iters: int, hc_eps: float, norm_eps: float):
    """x [T, hc, d] bf16 -> (pre, post, comb) of this sublayer and y = hc_pre(x, pre_prev) [T, d].
    Replaces Block.hc_mixes(x) followed by Block.hc_pre(x, pre_prev) with one read of x. The column
    chunks (and so the summation order) depend on d only, not on T."""
    T, hc, d = x.shape
    mix = fn.shape[0]
    assert fn.shape[1] == hc * d and mix <= MIX_PAD and mix == (2 + hc) * hc
    x = x.contiguous()
    bk = 128 if d % 128 == 0 else 64
    ch = bk
    assert d % ch == 0
    nc = d // ch
    mixp = torch.empty(nc, T, MIX_PAD, dtype=torch.float32, device=x.device)
    sqp = torch.empty(nc, T, dtype=torch.float32, device=x.device)
    y = torch.empty(T, d, dtype=x.dtype, device=x.device)
    if T == 0:
        z = torch.empty(0, hc, device=x.device)
        return z, z.clone(), torch.empty(0, hc, hc, device=x.device), y
    bt = 16
    hc_mixes_pre_kernel[(triton.cdiv(T, bt), nc)](x, fn.float().contiguous(), pre_prev.float().contiguous(), mixp, sqp,
                                                  y, T, d, HC=hc, MIX=mix, BT=bt, BK=bk, CH=ch, MIXP=MIX_PAD,
                                                  PREC="ieee" if INTERPRET else "tf32x3", num_warps=4)
    pre, post, comb = _sinkhorn_launch(mixp, sqp, scale, base, T, hc, iters, hc_eps, nc, 1.0 / (hc * d), norm_eps)
    return pre, post, comb, y


def hc_post(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """y [T, d], res [T, hc, d], post [T, hc], comb [T, hc, hc] -> [T, hc, d] in y's dtype."""
    T, hc, d = res.shape
    out = torch.empty_like(res)
    if T:
        bt, bd = 4, 512
        hc_post_kernel[(triton.cdiv(T, bt), triton.cdiv(d, bd))](y.contiguous(), res.contiguous(),
                                                                 post.float().contiguous(), comb.float().contiguous(),
                                                                 out, T, d, HC=hc, BT=bt, BD=bd, num_warps=4)
    return out


# ---- torch references of the fused contracts (Block's own code, restated for tests) ------------

def hc_mixes_pre_ref(x, fn, scale, base, pre_prev, iters, hc_eps, norm_eps):
    xf = x.flatten(1).float()
    rs = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    mixes = torch.nn.functional.linear(xf, fn.float()) * rs
    pre, post, comb = hc_split_sinkhorn_ref(mixes, scale, base, x.shape[1], iters, hc_eps)
    y = (pre_prev.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)
    return pre, post, comb, y


def hc_post_ref(y, res, post, comb):
    out = post.unsqueeze(-1) * y.unsqueeze(-2) + (comb.unsqueeze(-1) * res.unsqueeze(-2)).sum(dim=1)
    return out.to(y.dtype)
