"""The MoE's combine and the FFN sublayer's mHC expand in one kernel (Block.forward's FFN half: MoE.forward
ends with ops.moe_combine, Block then calls ops.hc_post on its result).

    moe_combine_hc_post(out [E, T, d], slot [T*K], indices [T, K], shared [T, d] bf16,
                        res [n, hc, d] bf16, post [n, hc], comb [n, hc, hc]) -> [n, hc, d] bf16
        = hc_post(moe_combine(out, slot, indices, shared)[:n], res, post, comb) of the two Triton kernels
        (triton_moe, triton_mhc), bit for bit: a token's picks summed in fp32 in ascending expert id, + shared,
        rounded to bf16 (triton_moe._combine_row), then hc_post's fp32 sums on that tile, bf16 out
        (triton_mhc._hc_post_tile). n <= T: the first n tokens (a padded masked step's real ones)

Why: the combine's [T, d] row is read only by hc_post. One launch fewer a layer on the decode step's
critical path, and no [T, d] bf16 round trip through memory. Rules (shape_ok): the two kernels' shapes,
bf16 shared and res; kernels/select.py composes the two kernels elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_enter
from .triton_mhc import _hc_post_tile
from .triton_moe import INTERPRET, _chunk, _combine_row


@triton.jit
def moe_combine_hc_post_kernel(out_ptr, slot_ptr, idx_ptr, shared_ptr, res_ptr, post_ptr, comb_ptr, o_ptr,
                               n, d, T, stride_e, stride_row, K: tl.constexpr, KP: tl.constexpr,
                               HC: tl.constexpr, BD: tl.constexpr, MANUAL: tl.constexpr, PDL: tl.constexpr = False):
    """Program (token t, BD columns): t's combined row (fp32 holding bf16 values, as hc_post_kernel would load
    it back), then hc_post's sums on it as a [1, BD] tile. A token a program, as moe_combine_kernel, whose
    row code this is: the picks' slab rows stay scalars (a first version's [tokens, K] form of the same sums
    made moe_combine 1.8x slower at 256 tokens, H100 2026-12-07)."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    y = _combine_row(out_ptr, slot_ptr, idx_ptr, shared_ptr, t, rd, d, T, stride_e, stride_row, K, KP, BD, MANUAL)
    rt = t + tl.arange(0, 1)
    _hc_post_tile(y[None, :], res_ptr, post_ptr, comb_ptr, o_ptr, rt, rd, rt < n, d, HC, 1, BD)


def shape_ok(out, slot, indices, shared, res, post, comb) -> bool:
    if indices.dim() != 2 or res.dim() != 3:
        return False
    (T, K), (n, hc, d) = indices.shape, res.shape
    return (out.dim() == 3 and out.shape[1:] == (T, d) and slot.numel() == T * K and shared.shape == (T, d)
            and n <= T and post.shape == (n, hc) and comb.shape == (n, hc, hc)
            and shared.dtype == res.dtype == torch.bfloat16)


def moe_combine_hc_post(out: torch.Tensor, slot: torch.Tensor, indices: torch.Tensor, shared: torch.Tensor,
                        res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                        columns: int | None = None) -> torch.Tensor:
    """columns: a program's (a power of two; default triton_moe._chunk(d), at most 1,024); any width gives the same
    bits."""
    assert shape_ok(out, slot, indices, shared, res, post, comb), \
        (tuple(out.shape), tuple(indices.shape), tuple(shared.shape), tuple(res.shape), shared.dtype, res.dtype)
    T, K = indices.shape
    n, hc, d = res.shape
    o = torch.empty_like(res)
    if n:
        bd = columns or _chunk(d)
        out = out if out.stride(-1) == 1 else out.contiguous()   # DeepGEMM's padded view: read in place
        moe_combine_hc_post_kernel[(n, triton.cdiv(d, bd))](
            out, slot.contiguous(), indices.contiguous(), shared.contiguous(), res.contiguous(),
            post.float().contiguous(), comb.float().contiguous(), o, n, d, T, out.stride(0), out.stride(1),
            K=K, KP=triton.next_power_of_2(K), HC=hc, BD=bd, MANUAL=INTERPRET, num_warps=4, **pdl_args())
    return o
