"""RoPE then FP4 rounding in one pass, optionally scattered into a cache pool (the indexer's queries, the
compressed entries' latents and index keys: Indexer.queries, Attention._compress).

    rope_fp4_quant(x [T, ..., D] bf16, cis [T, rd/2], block 16 | 32, dst=None, pool=None) -> [T, ..., D] bf16
        = fp4_quant(rope(x, cis), block) of the two Triton kernels (triton_rope, triton_quant), bit for bit: the
        rotated pairs rounded to bf16 as rope stores them, then fp4_quant_kernel's block arithmetic; every row
        of x's middle dims (heads) takes its token's cis row
        with pool [R, D] and dst [T] row ids (x 2-D): the rows also stored at pool[dst] (the pool's index_put);
        a uint8 pool [R, fp4_rows_width(D)] (block 32) gets them packed (reference.fp4_pack_rows_ref: the
        indexer's keys, a third of the bytes)

Why: two or three launches a compressed layer and an indexer layer each step for a few KB (H200, 2026-12-04:
RoPE 47 us in 24 calls of a batch-64 step). Rules: D a power of two <= MAX_D, 2 * rd/2 <= D, rd/2 a power of
two, D a multiple of the block; kernels/select.py composes the two kernels elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_enter
from .reference import fp4_rows_width
from .triton_quant import INTERPRET, _fp4_pack_rows, _fp4_round
from .triton_rope import _rotate

MAX_D = 4096


@triton.jit
def rope_fp4_quant_kernel(x_ptr, cis_ptr, y_ptr, dst_ptr, pool_ptr, M, HEADS, stride_c,
                          D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                          FMA: tl.constexpr, MANUAL_RNE: tl.constexpr, HAS_POOL: tl.constexpr,
                          PACKED: tl.constexpr = False, PW: tl.constexpr = 0, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D)
    r_ok = rows < M
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * D + cols[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)
    # RoPE on the last 2 * HALF dims (adjacent pairs), each rotated pair rounded to bf16 (rope_kernel)
    a, b = tl.split(tl.reshape(x, (BLOCK_M, D // 2, 2)))
    rp = tl.arange(0, D // 2) - (D // 2 - HALF)
    in_rope = (rp >= 0)[None, :]
    crow = cis_ptr + (rows // HEADS).to(tl.int64)[:, None] * stride_c + 2 * rp[None, :]
    c = tl.load(crow, mask=r_ok[:, None] & in_rope, other=1.0)
    s = tl.load(crow + 1, mask=r_ok[:, None] & in_rope, other=0.0)
    re, im = _rotate(a, b, c, s, FMA)
    re = tl.where(in_rope, re.to(tl.bfloat16).to(tl.float32), a)
    im = tl.where(in_rope, im.to(tl.bfloat16).to(tl.float32), b)
    z = tl.reshape(tl.join(re, im), (BLOCK_M, D))
    out = _fp4_round(z, BLOCK_M, D, BLOCK, MANUAL_RNE).to(tl.bfloat16)
    tl.store(y_ptr + rows64 * D + cols[None, :], out, mask=r_ok[:, None])
    if HAS_POOL:
        dst = tl.load(dst_ptr + rows, mask=r_ok, other=0).to(tl.int64)[:, None]
        if PACKED:                        # a uint8 pool of PW-byte rows (reference.fp4_pack_rows_ref)
            codes, scales = _fp4_pack_rows(out.to(tl.float32), BLOCK_M, D)
            tl.store(pool_ptr + dst * PW + tl.arange(0, D // 2)[None, :], codes, mask=r_ok[:, None])
            tl.store(pool_ptr + dst * PW + D // 2 + tl.arange(0, D // 32)[None, :], scales, mask=r_ok[:, None])
            pad = D // 2 + D // 32 + tl.arange(0, 16)            # the row's padding to 16 bytes: zeros
            tl.store(pool_ptr + dst * PW + pad[None, :], tl.zeros((BLOCK_M, 16), tl.uint8),
                     mask=r_ok[:, None] & (pad < PW)[None, :])
        else:
            tl.store(pool_ptr + dst * D + cols[None, :], out, mask=r_ok[:, None])


def shape_ok(x: torch.Tensor, cis: torch.Tensor, block: int, dst=None, pool=None) -> bool:
    D, half = x.shape[-1], cis.shape[-1]
    ok = (x.dim() >= 2 and x.dtype == torch.bfloat16 and D & (D - 1) == 0 and max(32, block) <= D <= MAX_D
          and block in (16, 32) and half & (half - 1) == 0 and 0 < 2 * half <= D and cis.dim() == 2
          and cis.dtype == torch.complex64 and cis.shape[0] == x.shape[0])
    if pool is not None:
        packed = pool.dtype == torch.uint8
        ok = ok and (x.dim() == 2 and pool.dim() == 2 and pool.is_contiguous() and dst is not None
                     and dst.shape == (x.shape[0],) and not dst.is_floating_point()
                     and (pool.dtype == torch.bfloat16 and pool.shape[1] == D
                          or packed and block == 32 and pool.shape[1] == fp4_rows_width(D)))
    return ok


def rope_fp4_quant(x: torch.Tensor, cis: torch.Tensor, block: int, dst: torch.Tensor | None = None,
                   pool: torch.Tensor | None = None) -> torch.Tensor:
    assert shape_ok(x, cis, block, dst, pool), (tuple(x.shape), x.dtype, tuple(cis.shape), block)
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    M = x2.shape[0]
    heads = M // max(x.shape[0], 1)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if M == 0:
        return y
    cf = torch.view_as_real(cis)                                              # [T, HALF, 2] fp32, a view
    block_m = max(1, min(16, 2048 // D))
    rope_fp4_quant_kernel[(triton.cdiv(M, block_m),)](
        x2, cf, y, x2 if dst is None else dst.contiguous(), x2 if pool is None else pool, M, heads, cf.stride(0),
        D=D, HALF=cis.shape[-1], BLOCK=block, BLOCK_M=block_m, FMA=x.is_cuda, MANUAL_RNE=INTERPRET,
        HAS_POOL=pool is not None, PACKED=pool is not None and pool.dtype == torch.uint8,
        PW=pool.shape[1] if pool is not None else 0, num_warps=4, **pdl_args())
    return y
