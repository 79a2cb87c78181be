"""The model's last mHC collapse and final RMSNorm in one kernel (Transformer.forward before the head).

    hc_pre_norm(x [T, hc, d] bf16, pre [T, hc] f32, rows [n] int | None, weight [d], eps) -> [n, d] bf16
        = rms_norm(hc_pre(x[rows], pre[rows]), weight, eps): the rows gathered, the hc streams summed with
        their pre-mix weights in fp32 (stream order, the in-layer collapse's form: hc_mixes_pre_kernel's
        `y += p * x`), rounded to bf16, then rms_norm_kernel's arithmetic on rms_norm's tile

Why: in torch this is two gathers, a cast, a product, a sum, a cast and the norm: seven launches a step
for a [B, d] result. Rules: d <= MAX_D, contiguous x and pre; select composes the torch ops elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_enter
from .triton_norm import MAX_D, _block_m


@triton.jit
def hc_pre_norm_kernel(x_ptr, pre_ptr, rows_ptr, w_ptr, y_ptr, n, d, inv_d, eps,
                       HC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ROWS: tl.constexpr,
                       PDL: tl.constexpr = False):
    pdl_enter(PDL)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    r_ok = r < n
    src = tl.load(rows_ptr + r, mask=r_ok, other=0).to(tl.int64) if HAS_ROWS else r.to(tl.int64)
    mask = r_ok[:, None] & (cols[None, :] < d)
    y = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for k in tl.static_range(HC):
        p = tl.load(pre_ptr + src * HC + k, mask=r_ok, other=0.0)
        xs = tl.load(x_ptr + (src[:, None] * HC + k) * d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y += p[:, None] * xs
    y = y.to(tl.bfloat16).to(tl.float32)
    rs = tl.math.rsqrt(tl.sum(y * y, axis=1) * inv_d + eps)                  # rms_norm_kernel's arithmetic
    w = tl.load(w_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)
    out = w[None, :] * (y * rs[:, None])
    tl.store(y_ptr + r.to(tl.int64)[:, None] * d + cols[None, :], out.to(tl.bfloat16), mask=mask)


def shape_ok(x: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 3 and x.dtype == torch.bfloat16 and x.is_contiguous() and 0 < x.shape[-1] <= MAX_D
            and pre.shape == x.shape[:2] and pre.dtype == torch.float32 and pre.is_contiguous()
            and weight.shape == x.shape[-1:])


def hc_pre_norm(x: torch.Tensor, pre: torch.Tensor, rows: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> torch.Tensor:
    assert shape_ok(x, pre, weight), (tuple(x.shape), x.dtype, tuple(pre.shape), pre.dtype)
    T, hc, d = x.shape
    n = T if rows is None else rows.shape[0]
    y = torch.empty(n, d, dtype=torch.bfloat16, device=x.device)
    if n == 0:
        return y
    block_d = triton.next_power_of_2(d)
    block_m = _block_m(block_d)                                   # rms_norm's tile: its row sums
    hc_pre_norm_kernel[(triton.cdiv(n, block_m),)](
        x, pre, x if rows is None else rows.contiguous(), weight.contiguous(), y, n, d, 1.0 / d, eps, HC=hc,
        BLOCK_M=block_m, BLOCK_D=block_d, HAS_ROWS=rows is not None,
        num_warps=4 if block_d * block_m <= 4096 else 8, **pdl_args())
    return y
