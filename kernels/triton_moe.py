"""Triton glue of the masked MoE step (reference: kernels/reference.py `moe_route_ref`,
`moe_dispatch_ref`, `moe_swiglu_quant_ref`, `moe_combine_ref`; model/moe.py `MoE._masked_experts`).

    moe_route(indices, E)          -> counts [E] int32, slot [T*K] int64: pair p's row e*T + rank
                                      (contiguous=True: its place in the stable sort by expert)
    moe_dispatch(x, slot, K, E)    -> xp [E, T, d]: act_quant(x)[p // K] at row slot[p]
    moe_swiglu_quant(gu, slot, ..) -> hp [E, T, inter]: act_quant(bf16(w_p * silu(gate) * up)) at row slot[p]
    moe_combine(out, slot, ..)     -> y [T, d]: fp32 sum of a token's picks in ascending expert id, + shared
    fp8=True (dispatch, swiglu_quant): the rows as e4m3 bytes + their scales transposed [cols / 32, E*T
                                      rounded up to 4] (the CUDA masked FP8 GEMM's input, cuda_fp8_decode)

Replaces ~30 small torch launches per layer (argsort, scatter_add, cumsum, index scatters/gathers,
casts, clamp, silu, act_quant, the K-step add loop) with four; no host read anywhere (CUDA-graph
capturable). Same rounding points as the torch code, so the same bits: act_quant as
triton_quant.act_quant_kernel, IEEE division in silu, libdevice expf (CUDA's expf, what torch's silu
calls) on the GPU. MANUAL (the CPU interpreter): exp in fp64 rounded to fp32, and float->bf16 and
float->e4m3 rounded to nearest even by hand (the interpreter's casts truncate).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .pdl import pdl_args, pdl_enter
from .triton_quant import _pow2_ceil, _to_e4m3
from .reference import moe_combine_ref, moe_dispatch_ref, moe_route_ref, moe_swiglu_quant_ref  # noqa: F401
from .reference import slab_scales_ld

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
QBLOCK = 32          # act_quant block along the last dim


@triton.jit
def _quant_groups(v, BD: tl.constexpr, MANUAL: tl.constexpr, BR: tl.constexpr = 1):
    """v [BR, BD] fp32 -> (e4m3 [BR, BD / 32, 32], pow2 scales [BR, BD / 32]): act_quant_kernel's steps."""
    g = tl.reshape(v, (BR, BD // 32, 32))
    amax = tl.maximum(tl.max(tl.abs(g), axis=2), 1e-4)
    s, inv = _pow2_ceil(amax * (1.0 / 448.0))
    return _to_e4m3(tl.clamp(g * inv[:, :, None], -448.0, 448.0), MANUAL), s


@triton.jit
def _fake_quant(v, BD: tl.constexpr, MANUAL: tl.constexpr, BR: tl.constexpr = 1):
    """v [BR, BD] fp32 -> FP8 e4m3 fake-quantized per 32 with pow2 scales (act_quant_kernel's steps)."""
    q, s = _quant_groups(v, BD, MANUAL, BR)
    return tl.reshape(q.to(tl.float32) * s[:, :, None], (BR, BD))


@triton.jit
def _store_fp8(q, s, rows, cols, pm, ptr, sa_ptr, n, S_LD, BD: tl.constexpr, BR: tl.constexpr):
    """_quant_groups' (q, s) of a [BR, BD] tile into rows `rows` [BR] (int64) of ptr [.., n] at columns `cols`
    [1, BD] (mask pm [BR]): the e4m3 bytes, and the scales transposed into sa_ptr [n / 32, S_LD] at column
    `rows` (the CUDA masked GEMM's token scales)."""
    tl.store(ptr + rows[:, None] * n + cols, tl.reshape(q, (BR, BD)), mask=pm[:, None] & (cols < n))
    sc = (tl.program_id(1) * (BD // 32) + tl.arange(0, BD // 32))[None, :]
    tl.store(sa_ptr + sc.to(tl.int64) * S_LD + rows[:, None], s, mask=pm[:, None] & (sc < n // 32))


@triton.jit
def _round_bf16(v, MANUAL: tl.constexpr):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32."""
    if MANUAL:
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        return b.to(tl.float32, bitcast=True)
    return v.to(tl.bfloat16).to(tl.float32)


@triton.jit
def moe_route_kernel(idx_ptr, counts_ptr, slot_ptr, T, P, E, BLOCK: tl.constexpr, CONTIGUOUS: tl.constexpr = False,
                     PDL: tl.constexpr = False):
    """One program per expert e: a running inclusive cumsum of (idx == e) over the pairs in order
    gives each of e's pairs its rank (token order inside the group). CONTIGUOUS: the row is the pair's
    place in the stable sort by expert, first = the pairs of smaller experts (one more pass over the
    ids) + rank, instead of e * T + rank (the contiguous MoE's slab: no cumsum and gathers after).
    A pick outside [0, E) is dropped (an expert-parallel rank's picks of other ranks' experts): program
    0 gives it slot -1, and no expert counts it."""
    pdl_enter(PDL)
    e = tl.program_id(0)
    first = tl.zeros((), dtype=tl.int64)
    if CONTIGUOUS:
        for start in range(0, P, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            idx = tl.load(idx_ptr + offs, mask=offs < P, other=2147483647)
            first += tl.sum(((idx < e) & (idx >= 0)).to(tl.int64), 0)
    else:
        first = e.to(tl.int64) * T
    if e == 0:
        for start in range(0, P, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            idx = tl.load(idx_ptr + offs, mask=offs < P, other=0)
            tl.store(slot_ptr + offs, tl.full((BLOCK,), -1, tl.int64), mask=(offs < P) & ((idx < 0) | (idx >= E)))
    base = tl.zeros((), dtype=tl.int32)
    for start in range(0, P, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < P
        idx = tl.load(idx_ptr + offs, mask=inb, other=-1)
        hit = (idx == e).to(tl.int32)
        rank = base + tl.cumsum(hit, 0) - 1
        tl.store(slot_ptr + offs, first + rank.to(tl.int64), mask=inb & (hit != 0))
        base += tl.sum(hit, 0)
    tl.store(counts_ptr + e, base)


@triton.jit
def moe_dispatch_kernel(x_ptr, slot_ptr, xp_ptr, d, K, BD: tl.constexpr, MANUAL: tl.constexpr,
                        sa_ptr=None, S_LD=0, FP8: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (t, column chunk): act_quant of x[t] once, stored to the rows of t's K pairs (FP8: as e4m3
    bytes, the scales transposed into sa [d / 32, S_LD] at the rows' columns); a dropped pick (slot -1)
    stores nothing."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)[None, :]
    m = cols < d
    x = tl.load(x_ptr + t.to(tl.int64) * d + cols, mask=m, other=0.0).to(tl.float32)
    if FP8:
        q, s = _quant_groups(x, BD, MANUAL)                     # once; stored to each of the K rows
        for k in range(K):
            r = tl.load(slot_ptr + t * K + k + tl.zeros((1,), tl.int32))
            _store_fp8(q, s, tl.maximum(r, 0), cols, r >= 0, xp_ptr, sa_ptr, d, S_LD, BD, 1)
    else:
        q = _fake_quant(x, BD, MANUAL).to(xp_ptr.dtype.element_ty)
        for k in range(K):
            r = tl.load(slot_ptr + t * K + k + tl.zeros((1,), tl.int32))
            tl.store(xp_ptr + tl.maximum(r, 0)[:, None] * d + cols, q, mask=m & (r >= 0)[:, None])


@triton.jit
def _slab_row(slot, T, stride_e, stride_row):
    """Offset of slab row slot = e*T + rank in an [E, C >= T, N] view (DeepGEMM pads C)."""
    return (slot // T) * stride_e + (slot % T) * stride_row


@triton.jit
def moe_swiglu_quant_kernel(gu_ptr, slot_ptr, w_ptr, hp_ptr, limit, inter, T, P, stride_e, stride_row,
                            HAS_LIMIT: tl.constexpr, BI: tl.constexpr, MANUAL: tl.constexpr,
                            DENSE: tl.constexpr = False, BR: tl.constexpr = 1, sa_ptr=None, S_LD=0,
                            FP8: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (BR pairs, column chunk): pair p at row r = slot[p]: clamped SwiGLU in fp32, times the
    routing weight, rounded to bf16, FP8 fake-quantized per 32 -> hp[r] (a dropped pick, r = -1: nothing).
    DENSE: r = p and weight 1 (the
    shared expert: every row, no routing weight). Several pairs a program and a chunk that divides
    inter: a pair's 2,304 columns were 3 programs of 1,024 lanes, the last a quarter full. FP8: hp holds the
    e4m3 bytes and sa [inter / 32, S_LD] the scales, transposed (column r)."""
    pdl_enter(PDL)
    ps = tl.program_id(0) * BR + tl.arange(0, BR)
    pm = ps < P
    cols = tl.program_id(1) * BI + tl.arange(0, BI)[None, :]
    m = (cols < inter) & pm[:, None]
    if DENSE:
        r = ps.to(tl.int64)
        w = tl.full((BR,), 1.0, tl.float32)
    else:
        r = tl.load(slot_ptr + ps, mask=pm, other=-1)
        pm = pm & (r >= 0)
        m = m & pm[:, None]
        r = tl.maximum(r, 0)
        w = tl.load(w_ptr + ps, mask=pm, other=0.0)
    row = gu_ptr + _slab_row(r, T, stride_e, stride_row)[:, None]
    gate = tl.load(row + cols, mask=m, other=0.0).to(tl.float32)
    up = tl.load(row + inter + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        up = tl.minimum(tl.maximum(up, -limit), limit)
        gate = tl.minimum(gate, limit)
    if MANUAL:
        e = tl.exp((-gate).to(tl.float64)).to(tl.float32)
    else:
        e = libdevice.exp(-gate)
    silu = tl.math.div_rn(gate, 1.0 + e)
    h = _round_bf16(w[:, None] * (silu * up), MANUAL)
    if FP8:
        q, s = _quant_groups(h, BI, MANUAL, BR)
        _store_fp8(q, s, r.to(tl.int64), cols, pm, hp_ptr, sa_ptr, inter, S_LD, BI, BR)
    else:
        q = _fake_quant(h, BI, MANUAL, BR)
        tl.store(hp_ptr + r[:, None] * inter + cols, q.to(hp_ptr.dtype.element_ty), mask=m)


@triton.jit
def moe_combine_kernel(out_ptr, slot_ptr, idx_ptr, shared_ptr, y_ptr, d, T, stride_e, stride_row,
                       K: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr, MANUAL: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Program (t, column chunk): y = 0; y += out[slot] of t's picks in ascending expert id (rank =
    how many of t's picks have a smaller id: the experts are distinct); y += shared[t]; bf16."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    m = cols < d
    ks = tl.arange(0, KP)
    valid = ks < K
    idx = tl.load(idx_ptr + t * K + ks, mask=valid, other=0)
    slots = tl.load(slot_ptr + t * K + ks, mask=valid, other=0)
    smaller = (idx[None, :] < idx[:, None]) & valid[None, :]                 # [KP, KP]
    rank = tl.sum(smaller.to(tl.int32), 1)
    y = tl.zeros((BD,), dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.sum(tl.where(valid & (rank == j), slots, 0), 0)
        y = y + tl.load(out_ptr + _slab_row(r, T, stride_e, stride_row) + cols, mask=m, other=0.0).to(tl.float32)
    y = y + tl.load(shared_ptr + t.to(tl.int64) * d + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + t.to(tl.int64) * d + cols, _round_bf16(y, MANUAL).to(y_ptr.dtype.element_ty), mask=m)


def _chunk(n: int, cap: int = 1024) -> int:
    return min(cap, max(QBLOCK, triton.next_power_of_2(n)))


def _row_tile(n: int, lanes: int = 1024) -> tuple[int, int]:
    """(rows, columns) of a program over rows of n columns (n a multiple of QBLOCK): the widest power of
    two <= lanes that divides n (no masked tail), and as many rows as fill `lanes`."""
    bi = QBLOCK
    while bi * 2 <= lanes and n % (bi * 2) == 0:
        bi *= 2
    return lanes // bi, bi


def moe_route(indices: torch.Tensor, n_experts: int, contiguous: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """indices [T, K] int -> (counts [E] int32, slot [T*K] int64 = e * T + rank of the pair in e, or
    with contiguous the pair's place in the stable sort by expert; -1 for a pick outside [0, E): dropped)."""
    T, _ = indices.shape
    flat = indices.reshape(-1).contiguous()
    counts = torch.empty(n_experts, dtype=torch.int32, device=indices.device)
    slot = torch.empty(flat.numel(), dtype=torch.int64, device=indices.device)
    block = min(4096, triton.next_power_of_2(max(1, flat.numel())))
    moe_route_kernel[(n_experts,)](flat, counts, slot, T, flat.numel(), n_experts, BLOCK=block, CONTIGUOUS=contiguous,
                                   **pdl_args())
    return counts, slot


def moe_dispatch(x: torch.Tensor, slot: torch.Tensor, K: int, n_experts: int, fp8: bool = False,
                 tile: tuple[int, int] | None = None):
    """x [T, d] bf16 -> xp [E, T, d] with row slot[p] = act_quant(x)[p // K]; other rows unset. fp8: (xp as
    e4m3 bytes, the scales transposed [d / 32, slab_scales_ld(E, T)], column = the row; others unset).
    tile: (columns a program, num_warps) (perf/bench_moe_glue.py; default _chunk(d) and 4 warps)."""
    T, d = x.shape
    assert d % QBLOCK == 0 and slot.numel() == T * K
    xp = torch.empty(n_experts, T, d, dtype=torch.float8_e4m3fn if fp8 else x.dtype, device=x.device)
    ld = slab_scales_ld(n_experts, T)
    sa = torch.empty(d // QBLOCK, ld, dtype=torch.float32, device=x.device) if fp8 else None
    if T:
        bd, warps = tile or (_chunk(d), 4)
        moe_dispatch_kernel[(T, triton.cdiv(d, bd))](x.contiguous(), slot, xp, d, K, BD=bd, MANUAL=INTERPRET,
                                                     sa_ptr=sa, S_LD=ld, FP8=fp8, num_warps=warps, **pdl_args())
    return (xp, sa) if fp8 else xp


def moe_swiglu_quant(gu: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor, limit: float,
                     inter: int, fp8: bool = False):
    """gu [E, T, 2 inter] bf16 -> hp [E, T, inter] at the pairs' rows (others unset); fp8: (hp e4m3, its
    scales transposed [inter / 32, slab_scales_ld(E, T)]: the CUDA masked GEMM's input)."""
    E, T, two = gu.shape
    assert two == 2 * inter and inter % QBLOCK == 0 and weights.numel() == slot.numel()
    hp = torch.empty(E, T, inter, dtype=torch.float8_e4m3fn if fp8 else gu.dtype, device=gu.device)
    ld = slab_scales_ld(E, T)
    sa = torch.empty(inter // QBLOCK, ld, dtype=torch.float32, device=gu.device) if fp8 else None
    P = slot.numel()
    if P:
        br, bi = _row_tile(inter)
        w = weights.reshape(-1).float().contiguous()
        gu = gu if gu.stride(-1) == 1 else gu.contiguous()       # DeepGEMM's padded view: read in place
        moe_swiglu_quant_kernel[(triton.cdiv(P, br), triton.cdiv(inter, bi))](
            gu, slot, w, hp, float(limit), inter, T, P, gu.stride(0), gu.stride(1), HAS_LIMIT=limit > 0, BI=bi,
            MANUAL=INTERPRET, BR=br, sa_ptr=sa, S_LD=ld, FP8=fp8, **pdl_args())
    return (hp, sa) if fp8 else hp


def swiglu_quant(gu: torch.Tensor, limit: float, inter: int) -> torch.Tensor:
    """gu [T, 2 inter] bf16 -> hp [T, inter]: moe_swiglu_quant over every row with weight 1 (the shared
    expert: its SwiGLU, bf16 rounding and w2's act_quant in one pass)."""
    T, two = gu.shape
    assert two == 2 * inter and inter % QBLOCK == 0
    hp = gu.new_empty(T, inter)
    if T:
        br, bi = _row_tile(inter)
        gu = gu if gu.stride(-1) == 1 else gu.contiguous()
        moe_swiglu_quant_kernel[(triton.cdiv(T, br), triton.cdiv(inter, bi))](
            gu, gu, gu, hp, float(limit), inter, T, T, 0, gu.stride(0), HAS_LIMIT=limit > 0, BI=bi,
            MANUAL=INTERPRET, DENSE=True, BR=br, **pdl_args())
    return hp


def _combine_tile(T: int, d: int) -> tuple[int, int]:
    """moe_combine's (columns a program, num_warps): 2,048 x 4 warps from 1,024 tokens (perf/bench_moe_glue.py,
    H100, 2026-12-06: 0.215 against 0.236 ms at 8,192 tokens, d 4,096, top-6; same bits); decode steps keep
    1,024-column programs (twice the programs for their few tokens)."""
    return (_chunk(d, 2048), 4) if T >= 1024 else (_chunk(d), 4)


def moe_combine(out: torch.Tensor, slot: torch.Tensor, indices: torch.Tensor, shared: torch.Tensor,
                tile: tuple[int, int] | None = None) -> torch.Tensor:
    """out [E, T, d] bf16 -> y [T, d] bf16: per token, fp32 sum of its picks' rows in ascending
    expert id, plus shared [T, d]. tile: as moe_dispatch's."""
    T, K = indices.shape
    d = out.shape[-1]
    assert out.dim() == 3 and out.shape[1] == T, (tuple(out.shape), T)
    y = torch.empty(T, d, dtype=shared.dtype, device=out.device)
    if T:
        bd, warps = tile or _combine_tile(T, d)
        out = out if out.stride(-1) == 1 else out.contiguous()   # DeepGEMM's padded view: read in place
        moe_combine_kernel[(T, triton.cdiv(d, bd))](out, slot, indices.contiguous(), shared.contiguous(), y, d,
                                                    T, out.stride(0),
                                                    out.stride(1), K=K, KP=triton.next_power_of_2(K), BD=bd,
                                                    MANUAL=INTERPRET, num_warps=warps, **pdl_args())
    return y
