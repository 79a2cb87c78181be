"""Triton RMSNorm (reference: kernels/reference.py `rms_norm_ref`, the model's RMSNorm.forward).

    rms_norm(x, weight, eps)   y = (weight.float() * (xf * rsqrt(mean(xf^2) + eps))).to(x.dtype),
                               xf = x.float(); one launch instead of ~6 torch kernels
    rms_norm_quant(x, w, eps)  (y, act_quant(y)): the norm and its FP8 rounding per 32 from one launch, for
                               a norm whose consumer rounds its input (a quantized Linear on the dense
                               path); y's bits are rms_norm's (the same tile, so the same row sums) and
                               the rounding is act_quant_kernel's arithmetic, which is exact

Dataflow: one program loads BLOCK_M whole rows [BLOCK_M, BLOCK_D] (BLOCK_D = next_pow2(D), masked),
sums the squares in fp32, scales by 1/D (torch's CUDA mean multiplies by 1/D too), adds eps, takes
rsqrt, multiplies by the row factor and then by the fp32 weight (the reference's order), casts and
stores a new contiguous [..., D]. BLOCK_M depends on D only, so a row's summation order does not
depend on the batch (batch invariant). Not bit-exact against torch: the reduction order differs
and rsqrt is the approximate hardware one on both sides; within 1 bf16 ulp on a few elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_enter
from .reference import rms_norm_ref  # noqa: F401  (the reference this follows)
from .triton_quant import INTERPRET, _pow2_ceil, _to_e4m3

MAX_D = 16384          # one block per row up to here (the model's widest norm is dim = 7168)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, y_ptr, M, D, stride_x, inv_d, eps,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                    q_ptr=None, QUANT: tl.constexpr = False, MANUAL_RNE: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < M) & (cols[None, :] < D)
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_d + eps)                    # [BLOCK_M]
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = w[None, :] * (x * r[:, None])
    tl.store(y_ptr + rows64 * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if QUANT:
        tl.store(q_ptr + rows64 * D + cols[None, :], rows_quant(y, BLOCK_M, BLOCK_D, MANUAL_RNE), mask=mask)


@triton.jit
def rows_quant(y, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, MANUAL_RNE: tl.constexpr):
    """act_quant_kernel's arithmetic on the bf16 rounding of fp32 rows y [BLOCK_M, BLOCK_D] -> bf16 (a norm's
    QUANT tail; masked columns are whole zero groups)."""
    g = tl.reshape(y.to(tl.bfloat16).to(tl.float32), (BLOCK_M, BLOCK_D // 32, 32))
    amax = tl.maximum(tl.max(tl.abs(g), axis=2), 1e-4)
    sc, inv = _pow2_ceil(amax * (1.0 / 448.0))
    q = _to_e4m3(tl.clamp(g * inv[:, :, None], -448.0, 448.0), MANUAL_RNE)
    return tl.reshape(q.to(tl.float32) * sc[:, :, None], (BLOCK_M, BLOCK_D)).to(tl.bfloat16)


def _block_m(block_d: int) -> int:
    """Rows per program: about 4k elements a program for the narrow norms, one row for the wide."""
    return max(1, min(16, 4096 // block_d))


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, quant: bool):
    D = x.shape[-1]
    assert weight.shape == (D,) and D <= MAX_D, (tuple(x.shape), tuple(weight.shape))
    x2 = x if x.dim() == 2 else x.reshape(-1, D)                              # [M, D]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    q = torch.empty_like(y) if quant else None
    if M == 0 or D == 0:
        return y, q
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_M = _block_m(BLOCK_D)
    num_warps = 4 if BLOCK_D * BLOCK_M <= 4096 else 8
    extra = dict(q_ptr=q, QUANT=True, MANUAL_RNE=INTERPRET) if quant else {}
    rms_norm_kernel[(triton.cdiv(M, BLOCK_M),)](x2, weight.contiguous(), y, M, D, x2.stride(0), 1.0 / D, eps,
                                               BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, num_warps=num_warps, **extra,
                                               **pdl_args())
    return y, q


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (float dtype; rows may be strided, the last dim must be contiguous), weight [D]
    -> new contiguous [..., D] in x's dtype."""
    return _launch(x, weight, eps, quant=False)[0]


def quant_shape_ok(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.shape[-1] % 32 == 0 and 0 < x.shape[-1] <= MAX_D


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] bf16, D % 32 == 0 -> (rms_norm(x, weight, eps), act_quant of it), two new [..., D] bf16."""
    assert quant_shape_ok(x), (tuple(x.shape), x.dtype)
    return _launch(x, weight, eps, quant=True)
