"""Triton sparse sink attention (reference: kernels/reference.py `sparse_attn_ref`).

    sparse_attn(q [n, H, D] bf16, kv [M, D] bf16, sink [H] f32, idxs [n, L] int, scale) -> [n, H, D]

Each query attends to its own list of kv rows (K = V = the same latent, MQA over H heads; -1 =
nothing). Dataflow per program (one query, BH heads, one split of the list): walk the list in
blocks of 64 rows (the reference's block), gather the rows, S = q.K^T * scale in fp32, online
softmax with the running max, P = exp(S - m) rounded to bf16 for P.V while the denominator sums P
in fp32. The sink enters the denominator only: out = acc / (l + exp(sink - m)).

Split-KV: the list is cut into a number of splits that depends on L only (never on n), each split
writes (acc, m, l) and a combine pass merges them in split order, so a query's result does not
depend on the batch it is in.

unrope=cis [n, rd/2]: the bf16 output's last rd dims rotated back by conj(cis) where it is stored
(Attention.out's inverse RoPE: triton_rope's arithmetic and roundings, so its bits; one launch a layer less).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_enter
from .reference import sparse_attn_ref  # noqa: F401  (the reference this follows)
from .triton_rope import _rotate

BLOCK_N = 64
# The CPU interpreter (TRITON_INTERPRET=1, used for CPU checks of the kernel logic) mis-multiplies
# bf16 dots; there the operands are upcast to fp32 first (the products are exact either way).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _row_ptrs(kv_ptr, kv1_ptr, kv2_ptr, rows, R0, R1, D: tl.constexpr, SOURCES: tl.constexpr):
    """Row pointers in the sources' joint row space: [0, R0) kv, [R0, R0+R1) kv1, the rest kv2."""
    p = kv_ptr + rows * D
    if SOURCES > 1:
        p = tl.where(rows >= R0, kv1_ptr + (rows - R0) * D, p)
    if SOURCES > 2:
        p = tl.where(rows >= R0 + R1, kv2_ptr + (rows - R0 - R1) * D, p)
    return p


@triton.jit
def _store_out(o_ptr, t64, H, rh, out, cis_ptr, stride_c, D: tl.constexpr, BH: tl.constexpr, HALF: tl.constexpr,
               FMA: tl.constexpr):
    """out [BH, D] fp32 -> bf16 rows of query t; HALF > 0: the last 2 * HALF dims (adjacent pairs) rotated
    by conj(cis[t]) after the bf16 rounding, each rotated pair rounded to bf16 (rope_kernel, INVERSE)."""
    rd = tl.arange(0, D)
    ptrs = o_ptr + (t64 * H + rh[:, None]) * D + rd[None, :]
    if HALF == 0:
        tl.store(ptrs, out.to(tl.bfloat16))
    else:
        a, b = tl.split(tl.reshape(out.to(tl.bfloat16).to(tl.float32), (BH, D // 2, 2)))
        rp = tl.arange(0, D // 2) - (D // 2 - HALF)                   # pair index in the rope part
        in_rope = rp >= 0
        c = tl.load(cis_ptr + t64 * stride_c + 2 * rp, mask=in_rope, other=1.0)[None, :]
        sn = -tl.load(cis_ptr + t64 * stride_c + 2 * rp + 1, mask=in_rope, other=0.0)[None, :]
        re, im = _rotate(a, b, c, sn, FMA)
        re = tl.where(in_rope[None, :], re.to(tl.bfloat16).to(tl.float32), a)
        im = tl.where(in_rope[None, :], im.to(tl.bfloat16).to(tl.float32), b)
        tl.store(ptrs, tl.reshape(tl.join(re, im), (BH, D)).to(tl.bfloat16))


@triton.jit
def sparse_attn_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, o_ptr, acc_ptr, ml_ptr,
                       n, H, L, blocks_per_split, scale, kv1_ptr, kv2_ptr, R0, R1,
                       cis_ptr, stride_c,
                       D: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
                       UPCAST: tl.constexpr = False, SOURCES: tl.constexpr = 1, HALF: tl.constexpr = 0,
                       FMA: tl.constexpr = False, PDL: tl.constexpr = False):
    """Grid (n, H/BH, num_splits). SPLIT: write unnormalized acc [S, n, H, D] and (m, l) [S, n, H, 2]
    to the workspace; else write the normalized bf16 output with the sink. SOURCES > 1: the rows
    live in up to three tensors (_row_ptrs), read in place."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    rh = hb * BH + tl.arange(0, BH)
    rd = tl.arange(0, D)
    rn = tl.arange(0, BN)
    t64 = t.to(tl.int64)
    q = tl.load(q_ptr + (t64 * H + rh[:, None]) * D + rd[None, :])              # [BH, D] bf16
    m_i = tl.full((BH,), -1e30, tl.float32)
    l_i = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, D), tl.float32)
    b0 = sp * blocks_per_split
    nblk = tl.cdiv(L, BN)
    b1 = tl.minimum(b0 + blocks_per_split, nblk)
    for b in range(b0, b1):
        j = b * BN + rn
        idx = tl.load(idx_ptr + t64 * L + j, mask=j < L, other=-1)
        valid = idx >= 0
        rows = tl.where(valid, idx, 0).to(tl.int64)
        ptrs = _row_ptrs(kv_ptr, kv1_ptr, kv2_ptr, rows, R0, R1, D, SOURCES)
        k = tl.load(ptrs[:, None] + rd[None, :], mask=valid[:, None], other=0.0)     # [BN, D]
        s = _dot(q, tl.trans(k), UPCAST) * scale                                     # [BH, BN] fp32
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(tl.bfloat16), k, UPCAST)
        m_i = m_new
    if SPLIT:
        ws = (sp.to(tl.int64) * n + t64) * H + rh
        tl.store(acc_ptr + ws[:, None] * D + rd[None, :], acc)
        tl.store(ml_ptr + ws * 2, m_i)
        tl.store(ml_ptr + ws * 2 + 1, l_i)
    else:
        sink = tl.load(sink_ptr + rh)
        den = l_i + tl.exp(sink - m_i)
        _store_out(o_ptr, t64, H, rh, acc / den[:, None], cis_ptr, stride_c, D, BH, HALF, FMA)


@triton.jit
def sparse_attn_combine_kernel(acc_ptr, ml_ptr, sink_ptr, o_ptr, n, H, S, cis_ptr, stride_c,
                               D: tl.constexpr, BH: tl.constexpr, HALF: tl.constexpr = 0, FMA: tl.constexpr = False,
                               PDL: tl.constexpr = False):
    """Merge S splits in order: M = max m_s; out = sum acc_s e^(m_s-M) / (sum l_s e^(m_s-M) + e^(sink-M))."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    hb = tl.program_id(1)
    rh = hb * BH + tl.arange(0, BH)
    rd = tl.arange(0, D)
    t64 = t.to(tl.int64)
    m = tl.full((BH,), -1e30, tl.float32)
    for s in range(S):
        ws = (s * n + t64) * H + rh
        m = tl.maximum(m, tl.load(ml_ptr + ws * 2))
    l_tot = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, D), tl.float32)
    for s in range(S):
        ws = (s * n + t64) * H + rh
        c = tl.exp(tl.load(ml_ptr + ws * 2) - m)
        l_tot += tl.load(ml_ptr + ws * 2 + 1) * c
        acc += tl.load(acc_ptr + ws[:, None] * D + rd[None, :]) * c[:, None]
    den = l_tot + tl.exp(tl.load(sink_ptr + rh) - m)
    _store_out(o_ptr, t64, H, rh, acc / den[:, None], cis_ptr, stride_c, D, BH, HALF, FMA)


DEFAULT_BLOCKS_PER_SPLIT = 4     # the batch-invariant rule: splits from L only


def num_splits_for(L: int, blocks_per_split: int = 4) -> int:
    """Splits from the list length only (batch invariance: a query's sums never depend on the batch)."""
    return max(1, triton.cdiv(triton.cdiv(L, BLOCK_N), blocks_per_split))


def blocks_per_split_for(n: int, heads: int, block_h: int, L: int, device) -> int:
    """The default mode's split: never more splits than the batch-invariant rule (DEFAULT_BLOCKS_PER_SPLIT),
    fewer once the batch fills the GPU: the most splits that keep one wave of programs (n queries x head
    groups x splits <= the SM count), rebalanced so the splits walk equal block counts. H200, 2026-12-01,
    L 640 (10 blocks): batch 64 two splits of 5 blocks, 42.3 us where the rule's 4 + 4 + 2 blocks (a
    second, partial wave) take 52.4 (FlashMLA 45.9); batch 128 one split, 54.6 us vs 92.1. Below ~30
    queries more, smaller splits gained 2-3 us (27.6 vs 29.8 at batch 16) but lost at batch 1 (1-block
    splits 35.9 vs 30.5) and moved the release fixture's DSpark draft logits past their limit (1.686 vs
    1.63, a last-bit chaos the other split counts stayed under): small batches keep the rule."""
    nblk = max(1, triton.cdiv(L, BLOCK_N))
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    splits = max(1, min(nblk, sms // max(1, n * (heads // block_h))))
    return max(DEFAULT_BLOCKS_PER_SPLIT, triton.cdiv(nblk, splits))


def sparse_attn(q: torch.Tensor, kv: torch.Tensor | tuple, sink: torch.Tensor, idxs: torch.Tensor, scale: float,
                block: int = BLOCK_N, block_h: int = 64, blocks_per_split: int | None = DEFAULT_BLOCKS_PER_SPLIT,
                num_warps: int = 8, num_stages: int = 2, unrope: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as sparse_attn_ref (block must be 64, the walk granularity). kv may also be a
    tuple of up to three [M_i, D] tensors read in place, idxs then counting rows across them in
    order (the same result as torch.cat(kv), without writing it). blocks_per_split None: chosen by
    the batch's occupancy (blocks_per_split_for; not batch invariant), else fixed (4: batch invariant).
    unrope: cis [n, rd/2] complex64 (unrope_ok): the output's rope dims rotated back (module docstring)."""
    assert block == BLOCK_N
    n, H, D = q.shape
    L = idxs.shape[1]
    if n == 0:
        return torch.empty_like(q)
    if L == 0:
        return torch.zeros_like(q)                         # rotating zeros gives zeros
    if H < 16:                       # the MMA needs 16 rows: pad heads with zeros (small test models)
        qp = torch.nn.functional.pad(q, (0, 0, 0, 16 - H))
        sp = torch.nn.functional.pad(sink.float(), (0, 16 - H))
        return sparse_attn(qp, kv, sp, idxs, scale, block, 16, blocks_per_split, num_warps, num_stages,
                           unrope)[:, :H]
    bh = min(block_h, H)
    assert H % bh == 0 and D == triton.next_power_of_2(D)
    if blocks_per_split is None:
        blocks_per_split = blocks_per_split_for(n, H, bh, L, q.device)
    q = q.contiguous()
    srcs = [t.contiguous() for t in (kv if isinstance(kv, (tuple, list)) else (kv,))]
    assert 1 <= len(srcs) <= 3 and all(t.shape[-1] == D and t.dtype == srcs[0].dtype for t in srcs)
    kv, kv1, kv2 = (srcs + [srcs[0]] * 2)[:3]
    extra = (kv1, kv2, srcs[0].shape[0], srcs[1].shape[0] if len(srcs) > 1 else 0)
    idxs = idxs.to(torch.int32).contiguous()
    sink = sink.float().contiguous()
    out = torch.empty_like(q)
    S = num_splits_for(L, blocks_per_split)
    grid = (n, H // bh, S)
    if unrope is not None:
        assert unrope_ok(q, unrope), (tuple(q.shape), tuple(unrope.shape))
        cf = torch.view_as_real(unrope)                                    # [n, HALF, 2] fp32, a view
        rope = dict(HALF=unrope.shape[-1], FMA=q.is_cuda)
        cis_args = (cf, cf.stride(0))
    else:
        rope, cis_args = {}, (out, 0)
    kw = dict(D=D, BH=bh, BN=BLOCK_N, UPCAST=INTERPRET, SOURCES=len(srcs), num_warps=num_warps,
              num_stages=num_stages)
    if S == 1:
        sparse_attn_kernel[grid](q, kv, idxs, sink, out, out, out, n, H, L, blocks_per_split, float(scale),
                                 *extra, *cis_args, SPLIT=False, **kw, **rope, **pdl_args())
        return out
    acc = torch.empty(S, n, H, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(S, n, H, 2, dtype=torch.float32, device=q.device)
    sparse_attn_kernel[grid](q, kv, idxs, sink, out, acc, ml, n, H, L, blocks_per_split, float(scale),
                             *extra, *cis_args, SPLIT=True, **kw, **pdl_args())
    sparse_attn_combine_kernel[(n, H // bh)](acc, ml, sink, out, n, H, S, *cis_args, D=D, BH=bh,
                                             num_warps=num_warps, **rope, **pdl_args())
    return out


def unrope_ok(q: torch.Tensor, cis: torch.Tensor) -> bool:
    """The epilogue's rotation rules: one complex64 row of rd/2 a query, rd/2 a power of two, rd <= D."""
    half = cis.shape[-1] if cis.dim() == 2 else 0
    return (cis.dtype == torch.complex64 and cis.dim() == 2 and cis.shape[0] == q.shape[0] and half > 0
            and half & (half - 1) == 0 and 2 * half <= q.shape[-1])


def attn_flops(n: int, H: int, L: int, D: int) -> float:
    """QK^T and PV multiply-adds of one call (2 FLOP each)."""
    return 4.0 * n * H * L * D


def attn_bytes(n: int, H: int, L: int, D: int, kv_bytes_per_row: float = None) -> float:
    """Fewest bytes: every gathered row read once per query, q read and out written once."""
    row = kv_bytes_per_row if kv_bytes_per_row is not None else 2 * D
    return n * (L * row + 2 * H * D * 2 + 4 * L)


