"""The ratio > 1 compressor's member rows in one gather (Attention._compress, a decode step's glue).

    compress_members(raw_kv, raw_score, carry_kv, carry_score, member_rows, member_carry, ring_slots,
                     group_seq, ring_len) -> (kv [G, ratio, D], score [G, ratio, D])     (reference:
                                                                           compress_members_ref)
        member (g, r): the step's row member_rows[g, r] of raw_*, or where that is -1 (a position
        before the step) the carry ring's row ring_slots[group_seq[g]] * ring_len + member_carry[g, r]

    carry_write(raw_kv, raw_score, carry_kv, carry_score, ring_write, rows=None)      (reference:
                                                                           carry_write_ref)
        the step's rows (rows: only those of raw_*) into the carry ring's rows ring_write, both tensors in one
        launch, in place

    compress_pool(raw_kv, raw_score, carry_kv, carry_score, member_rows, member_carry, ring_slots, group_seq,
                  ring_len, weight, eps) -> latents [G, D] bf16                       (reference: compress_pool_ref)
        compress_members, the softmax over each group's members (per channel, fp32), the weighted sum, the bf16
        rounding and the RMSNorm in one program a group: the members are read once and [G, ratio, D] is never
        written (before: compress_members, then softmax, multiply, sum, cast and the norm, six launches on the
        compressor's branch that the index scores wait for, ~36 us of an H100's batch-64 decode layer,
        2026-12-07). The softmax and sum follow the reference's order (max, sum of exp(s - max), exp(s - max) /
        sum, products summed over the members in order) and CUDA's expf; rsqrt is the GPU's and the fp32 rounding
        differs in the last bit now and then, which can move the bf16 latent by one ulp and, through the norm's
        scale and the output's rounding, the output by up to three: nearly every element is the reference's
        bits (all but ~1e-5 of them), none further than three ulps.

What compress_members replaces per ratio > 1 source layer: the carry rows' arithmetic (an index, a multiply, two
clamps, an add), two gathers of each of the four sources and two selects: about 12 launches for a few KB.
carry_write replaces two torch `index_put_` launches (15 + 6 us of an H100's batch-64 decode step on the
compressor's branch, which the index scores wait for: 2026-12-07's replayed step). Pure data movement: the
kernels' values are the reference's, bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .triton_moe import _round_bf16

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _member_src(rows_ptr, carry_ptr, slot_row, m, ring_len):
    """(the step's row or -1, the carry ring's row) of member m of a group whose sequence's ring is slot_row."""
    row = tl.load(rows_ptr + m).to(tl.int64)
    return row, slot_row * ring_len + tl.maximum(tl.load(carry_ptr + m), 0)


@triton.jit
def _load_member(raw_ptr, carry_ptr, row, crow, d, ok, D):
    """One member's columns d: the step's row, or the carry ring's row where row is -1."""
    fresh = (d * 0 + row) >= 0
    return tl.where(fresh, tl.load(raw_ptr + tl.maximum(row, 0) * D + d, mask=ok & fresh, other=0.0),
                    tl.load(carry_ptr + crow * D + d, mask=ok & (fresh == 0), other=0.0))


@triton.jit
def compress_members_kernel(raw_kv_ptr, raw_sc_ptr, carry_kv_ptr, carry_sc_ptr, rows_ptr, carry_ptr, slots_ptr,
                            gseq_ptr, kv_ptr, sc_ptr, ring_len, D, RATIO: tl.constexpr, BD: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)                                  # member g * RATIO + r
    row, crow = _member_src(rows_ptr, carry_ptr, tl.load(slots_ptr + tl.load(gseq_ptr + m // RATIO)).to(tl.int64),
                            m, ring_len)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        ok = d < D
        tl.store(kv_ptr + m * D + d, _load_member(raw_kv_ptr, carry_kv_ptr, row, crow, d, ok, D), mask=ok)
        tl.store(sc_ptr + m * D + d, _load_member(raw_sc_ptr, carry_sc_ptr, row, crow, d, ok, D), mask=ok)


def compress_members(raw_kv: torch.Tensor, raw_score: torch.Tensor, carry_kv: torch.Tensor, carry_score: torch.Tensor,
                     member_rows: torch.Tensor, member_carry: torch.Tensor, ring_slots: torch.Tensor,
                     group_seq: torch.Tensor, ring_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """raw_* [T, D] and carry_* [slots * ring_len, D] fp32 (contiguous rows), member_rows / member_carry
    [G, ratio], ring_slots [B], group_seq [G] -> (kv, score) [G, ratio, D] fp32."""
    G, ratio = member_rows.shape
    D = raw_kv.shape[-1]
    srcs = [t.contiguous() for t in (raw_kv, raw_score, carry_kv, carry_score)]
    assert all(t.dtype == srcs[0].dtype and t.shape[-1] == D for t in srcs), [t.shape for t in srcs]
    kv = torch.empty(G, ratio, D, dtype=raw_kv.dtype, device=raw_kv.device)
    sc = torch.empty_like(kv)
    if G:
        compress_members_kernel[(G * ratio,)](*srcs, member_rows.contiguous(), member_carry.contiguous(),
                                              ring_slots.contiguous(), group_seq.contiguous(), kv, sc, ring_len, D,
                                              RATIO=ratio, BD=min(1024, triton.next_power_of_2(D)), num_warps=4)
    return kv, sc


@triton.jit
def carry_write_kernel(raw_kv_ptr, raw_sc_ptr, carry_kv_ptr, carry_sc_ptr, dst_ptr, src_ptr, D,
                       HAS_SRC: tl.constexpr, BD: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)                                  # the i-th row written
    dst = tl.load(dst_ptr + i).to(tl.int64)
    if HAS_SRC:
        src = tl.load(src_ptr + i).to(tl.int64)
    else:
        src = i
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        ok = d < D
        tl.store(carry_kv_ptr + dst * D + d, tl.load(raw_kv_ptr + src * D + d, mask=ok), mask=ok)
        tl.store(carry_sc_ptr + dst * D + d, tl.load(raw_sc_ptr + src * D + d, mask=ok), mask=ok)


def carry_write(raw_kv: torch.Tensor, raw_score: torch.Tensor, carry_kv: torch.Tensor, carry_score: torch.Tensor,
                ring_write: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """carry_*[ring_write[i]] = raw_*[rows[i] if rows is not None else i] for both tensors; raw_* [T, D],
    carry_* [slots * ring_len, D] fp32 with contiguous rows (written in place: the caches' own views)."""
    D = raw_kv.shape[-1]
    raws = [t.contiguous() for t in (raw_kv, raw_score)]
    assert all(t.is_contiguous() and t.dtype == raws[0].dtype and t.shape[-1] == D for t in (carry_kv, carry_score)), \
        (carry_kv.shape, carry_score.shape)
    n = ring_write.shape[0]
    assert rows.shape == (n,) if rows is not None else raw_kv.shape[0] == n, (raw_kv.shape, n)
    if n:
        dst = ring_write.contiguous()
        carry_write_kernel[(n,)](*raws, carry_kv, carry_score, dst, dst if rows is None else rows.contiguous(), D,
                                 HAS_SRC=rows is not None, BD=min(1024, triton.next_power_of_2(D)), num_warps=4)


@triton.jit
def _exp(x, MANUAL: tl.constexpr):
    """CUDA's expf (what torch's softmax calls), not the approximate exp2 tl.exp lowers to; float64 under the
    interpreter."""
    if MANUAL:
        return tl.exp(x.to(tl.float64)).to(tl.float32)
    return libdevice.exp(x)


@triton.jit
def compress_pool_kernel(raw_kv_ptr, raw_sc_ptr, carry_kv_ptr, carry_sc_ptr, rows_ptr, carry_ptr, slots_ptr,
                         gseq_ptr, w_ptr, out_ptr, ring_len, D, inv_d, eps, RATIO: tl.constexpr, BD: tl.constexpr,
                         MANUAL: tl.constexpr = False):
    """MANUAL (the interpreter): exp in float64 and round-to-nearest bf16 by hand (its casts truncate)."""
    g = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    ok = d < D
    slot_row = tl.load(slots_ptr + tl.load(gseq_ptr + g)).to(tl.int64)
    # pass 1: the max score over the members, per channel
    mx = tl.full([BD], float("-inf"), tl.float32)
    for r in range(RATIO):
        row, crow = _member_src(rows_ptr, carry_ptr, slot_row, g * RATIO + r, ring_len)
        mx = tl.maximum(mx, _load_member(raw_sc_ptr, carry_sc_ptr, row, crow, d, ok, D))
    # pass 2: the softmax's denominator
    den = tl.zeros([BD], tl.float32)
    for r in range(RATIO):
        row, crow = _member_src(rows_ptr, carry_ptr, slot_row, g * RATIO + r, ring_len)
        den += _exp(_load_member(raw_sc_ptr, carry_sc_ptr, row, crow, d, ok, D) - mx, MANUAL)
    # pass 3: kv weighted by exp(s - max) / den, summed over the members in order
    acc = tl.zeros([BD], tl.float32)
    for r in range(RATIO):
        row, crow = _member_src(rows_ptr, carry_ptr, slot_row, g * RATIO + r, ring_len)
        p = _exp(_load_member(raw_sc_ptr, carry_sc_ptr, row, crow, d, ok, D) - mx, MANUAL) / den
        acc += _load_member(raw_kv_ptr, carry_kv_ptr, row, crow, d, ok, D) * p
    # the bf16 latent, RMS-normed (triton_norm.rms_norm_kernel's arithmetic)
    y = tl.where(ok, _round_bf16(acc, MANUAL), 0.0)
    rs = tl.math.rsqrt(tl.sum(y * y, axis=0) * inv_d + eps)
    w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + g * D + d, _round_bf16(w * (y * rs), MANUAL).to(tl.bfloat16), mask=ok)


MAX_POOL_D = 4096       # one row a program, in registers


def compress_pool(raw_kv: torch.Tensor, raw_score: torch.Tensor, carry_kv: torch.Tensor, carry_score: torch.Tensor,
                  member_rows: torch.Tensor, member_carry: torch.Tensor, ring_slots: torch.Tensor,
                  group_seq: torch.Tensor, ring_len: int, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """raw_* [T, D] and carry_* [slots * ring_len, D] fp32 (contiguous rows), member_rows / member_carry [G, ratio],
    ring_slots [B], group_seq [G], weight [D] -> the normed latents [G, D] bf16."""
    G, ratio = member_rows.shape
    D = raw_kv.shape[-1]
    srcs = [t.contiguous() for t in (raw_kv, raw_score, carry_kv, carry_score)]
    assert all(t.dtype == torch.float32 and t.shape[-1] == D for t in srcs) and weight.shape == (D,) \
        and D <= MAX_POOL_D, ([t.shape for t in srcs], weight.shape)
    out = torch.empty(G, D, dtype=torch.bfloat16, device=raw_kv.device)
    if G:
        BD = triton.next_power_of_2(D)
        compress_pool_kernel[(G,)](*srcs, member_rows.contiguous(), member_carry.contiguous(), ring_slots.contiguous(),
                                   group_seq.contiguous(), weight.contiguous(), out, ring_len, D, 1.0 / D, eps,
                                   RATIO=ratio, BD=BD, MANUAL=INTERPRET, num_warps=4 if BD <= 1024 else 8)
    return out
