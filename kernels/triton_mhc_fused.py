"""hc_post and the next sublayer's hc_mixes_pre as one pass (issue 15: prefill's mHC traffic).

    hc_post_mixes_pre(y, res, post, comb, fn, scale, base, pre_prev, iters, hc_eps, norm_eps, mean)
        = (out, *hc_mixes_pre(out, fn, scale, base, pre_prev, ...)) with out = hc_post(y, res, post, comb)

Within a block the FFN's mixes read the residual streams the attention's hc_post has just written (and
across blocks the next attention's mixes read the FFN's): two kernels, x [T, 4, d] written and read
back. Here one program computes a [BT, BK] tile of the four output streams from y and the four input
streams, stores it (the residual the next hc_post needs) and feeds the same bf16 tile, still in
registers, to the mixes' sums: x is never read back. Both halves are triton_mhc's own bodies
(_post_stream4, _mix_stream) over the same tiles, so with the same launch constants the results are
those of the two kernels bit for bit; the chunk sums and the Sinkhorn pass are triton_mhc.finish_mixes.
HC 4 only (the release's hc_mult, and the Sinkhorn kernel's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_mhc import INTERPRET, MIX_PAD, _fn_parts, _mix_stream, _post_stream4, finish_mixes, mix_variant


@triton.jit
def hc_post_mixes_pre_kernel(y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, pre_ptr, mixp_ptr, sqp_ptr,
                             x_ptr, mean_ptr, T, d, HC: tl.constexpr, MIX: tl.constexpr, BT: tl.constexpr,
                             BK: tl.constexpr, CH: tl.constexpr, MIXP: tl.constexpr, PREC: tl.constexpr, MEAN: tl.constexpr,
                             SPLIT3: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (T/BT, d/CH), as hc_mixes_pre_kernel. Per BK column chunk: y [BT, BK] and res [BT, 4, BK]
    loaded once, out[:, j] = hc_post's stream j stored in bf16, and that bf16 tile into the mixes'
    sums. Writes out [T, 4, d], the partials mixp / sqp, x = out collapsed with pre_prev [T, d] and
    (MEAN) out averaged over the streams."""
    pid = tl.program_id(0)
    pc = tl.program_id(1)
    rt = pid * BT + tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rj = tl.arange(0, MIXP)
    t_ok = rt < T
    j_ok = rj < MIX
    hd = HC * d
    rt64 = rt.to(tl.int64)
    m = t_ok[:, None]
    sq = tl.zeros((BT,), tl.float32)
    acc = tl.zeros((BT, MIXP), tl.float32)
    for c in range(pc * CH, pc * CH + CH, BK):
        cols = c + rk
        y = tl.load(y_ptr + rt64[:, None] * d + cols[None, :], mask=m, other=0.0).to(tl.float32)
        r0 = tl.load(res_ptr + rt64[:, None] * hd + cols[None, :], mask=m, other=0.0).to(tl.float32)
        r1 = tl.load(res_ptr + rt64[:, None] * hd + (d + cols)[None, :], mask=m, other=0.0).to(tl.float32)
        r2 = tl.load(res_ptr + rt64[:, None] * hd + (2 * d + cols)[None, :], mask=m, other=0.0).to(tl.float32)
        r3 = tl.load(res_ptr + rt64[:, None] * hd + (3 * d + cols)[None, :], mask=m, other=0.0).to(tl.float32)
        xacc = tl.zeros((BT, BK), tl.float32)
        macc = tl.zeros((BT, BK), tl.float32)
        for k in tl.static_range(HC):
            col = k * d + cols
            xb = _post_stream4(y, r0, r1, r2, r3, comb_ptr, post_ptr, rt, t_ok, k).to(tl.bfloat16)
            tl.store(out_ptr + rt64[:, None] * hd + col[None, :], xb, mask=m)
            sq, acc, xacc, macc = _mix_stream(sq, acc, xacc, macc, xb, fn_ptr, pre_ptr, rt, t_ok, rj, j_ok, col,
                                              k, hd, HC, MIX, PREC, MEAN, SPLIT3, UPCAST)
        tl.store(x_ptr + rt64[:, None] * d + cols[None, :], xacc.to(tl.bfloat16), mask=m)
        if MEAN:
            tl.store(mean_ptr + rt64[:, None] * d + cols[None, :], (macc / HC).to(tl.bfloat16), mask=m)
    base = pc.to(tl.int64) * T + rt
    tl.store(mixp_ptr + base[:, None] * MIXP + rj[None, :], acc, mask=m)
    tl.store(sqp_ptr + base, sq, mask=t_ok)


# Launch constants by token count for the fused kernel (not batch_invariant; merged over mix_variant's,
# lo <= T <= hi). It holds five fp32 [BT, BK] tiles (y and the four residual streams) where the mixes
# kernel holds one, so prefill sizes take a smaller token tile than hc_mixes_pre's.
# Empty until measured: mix_variant's constants, with bt capped at FUSED_MAX_BT.
FUSED_SIZE_VARIANTS: list = []
FUSED_MAX_BT = 64


def fused_variant(T: int, d: int, batch_invariant: bool = False, **kw) -> dict:
    """The fused call's launch constants: mix_variant's for T (batch_invariant: exactly those, so the
    fused call equals the two kernels bit for bit at every T), else bt capped at FUSED_MAX_BT, then
    FUSED_SIZE_VARIANTS, then the caller's keywords."""
    if batch_invariant:
        return mix_variant(T, d, True, **kw)
    v = mix_variant(T, d)
    v["bt"] = min(v["bt"], FUSED_MAX_BT)
    for lo, hi, tiles in FUSED_SIZE_VARIANTS:
        if lo <= T and (hi is None or T <= hi):
            v.update(tiles)
    return mix_variant(T, d, **{**v, **{k: val for k, val in kw.items() if val is not None}})


def hc_post_mixes_pre(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                      fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, pre_prev: torch.Tensor,
                      iters: int, hc_eps: float, norm_eps: float, mean: bool = False,
                      batch_invariant: bool = False, *, bt: int | None = None, bk: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None,
                      chunks_per_program: int | None = None, dot: str | None = None):
    """y [T, d] bf16, res [T, 4, d] bf16, post [T, 4], comb [T, 4, 4] (this sublayer's expand), fn / scale /
    base (the next sublayer's mixes), pre_prev [T, 4] -> (out [T, 4, d], pre, post, comb, x [T, d]
    [, mean]): out = hc_post(y, res, post, comb), the rest hc_mixes_pre(out, ...)'s. The keywords pick
    a variant (fused_variant)."""
    T, hc, d = res.shape
    mix = fn.shape[0]
    assert hc == 4 and y.shape == (T, d) and fn.shape[1] == hc * d and mix == (2 + hc) * hc <= MIX_PAD
    v = fused_variant(T, d, batch_invariant, bt=bt, bk=bk, num_warps=num_warps, num_stages=num_stages,
                      chunks_per_program=chunks_per_program, dot=dot)
    bk = v["bk"]
    ch = bk * v["chunks_per_program"]
    nc = d // ch
    dev = res.device
    out = torch.empty_like(res)
    x = torch.empty(T, d, dtype=res.dtype, device=dev)
    avg = torch.empty(T, d, dtype=res.dtype, device=dev) if mean else x
    if T == 0:
        z = torch.empty(0, hc, device=dev)
        return (out, z, z.clone(), torch.empty(0, hc, hc, device=dev), x) + ((avg,) if mean else ())
    mixp = torch.empty(nc, T, MIX_PAD, dtype=torch.float32, device=dev)
    sqp = torch.empty(nc, T, dtype=torch.float32, device=dev)
    split3 = v["dot"] == "bf16x3"
    w = _fn_parts(fn) if split3 else fn.float().contiguous()
    hc_post_mixes_pre_kernel[(triton.cdiv(T, v["bt"]), nc)](
        y.contiguous(), res.contiguous(), post.float().contiguous(), comb.float().contiguous(), out, w,
        pre_prev.float().contiguous(), mixp, sqp, x, avg, T, d, HC=hc, MIX=mix, BT=v["bt"], BK=bk, CH=ch, MIXP=MIX_PAD,
        PREC="ieee" if INTERPRET else "tf32x3", MEAN=mean, SPLIT3=split3, UPCAST=INTERPRET,
        num_warps=v["num_warps"], num_stages=v["num_stages"])
    pre, post_n, comb_n = finish_mixes(mixp, sqp, hc, d, scale, base, iters, hc_eps, norm_eps)
    return (out, pre, post_n, comb_n, x) + ((avg,) if mean else ())


def hc_post_mixes_pre_ref(y, res, post, comb, fn, scale, base, pre_prev, iters, hc_eps, norm_eps, mean=False):
    """The contract as the two references in sequence."""
    from .reference import hc_mixes_pre_ref, hc_post_ref
    out = hc_post_ref(y, res, post, comb)
    return (out,) + hc_mixes_pre_ref(out, fn, scale, base, pre_prev, iters, hc_eps, norm_eps, mean)
