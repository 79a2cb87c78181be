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

What compress_members replaces per ratio > 1 source layer: the carry rows' arithmetic (an index, a multiply, two
clamps, an add), two gathers of each of the four sources and two selects: about 12 launches for a few KB.
carry_write replaces two torch `index_put_` launches (15 + 6 us of an H100's batch-64 decode step on the
compressor's branch, which the index scores wait for: 2026-12-07's replayed step). Pure data movement: the
kernels' values are the reference's, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def compress_members_kernel(raw_kv_ptr, raw_sc_ptr, carry_kv_ptr, carry_sc_ptr, rows_ptr, carry_ptr, slots_ptr,
                            gseq_ptr, kv_ptr, sc_ptr, ring_len, D, RATIO: tl.constexpr, BD: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)                                  # member g * RATIO + r
    row = tl.load(rows_ptr + m).to(tl.int64)
    crow = tl.load(slots_ptr + tl.load(gseq_ptr + m // RATIO)).to(tl.int64) * ring_len \
        + tl.maximum(tl.load(carry_ptr + m), 0)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        ok = d < D
        fresh = (d * 0 + row) >= 0                                      # [BD]: this member's source
        from_raw, from_carry = ok & fresh, ok & (fresh == 0)
        kv = tl.where(fresh, tl.load(raw_kv_ptr + tl.maximum(row, 0) * D + d, mask=from_raw, other=0.0),
                      tl.load(carry_kv_ptr + crow * D + d, mask=from_carry, other=0.0))
        sc = tl.where(fresh, tl.load(raw_sc_ptr + tl.maximum(row, 0) * D + d, mask=from_raw, other=0.0),
                      tl.load(carry_sc_ptr + crow * D + d, mask=from_carry, other=0.0))
        tl.store(kv_ptr + m * D + d, kv, mask=ok)
        tl.store(sc_ptr + m * D + d, sc, mask=ok)


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
