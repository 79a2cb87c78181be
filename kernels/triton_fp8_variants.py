"""FP8 x FP8 per-32-promotion GEMM variants for prefill and decode (M >= 32) on SM90: the candidates
perf/bench_fp8_prefill.py --variants measures against W8A16, DeepGEMM and the FP8 / bf16 peaks.

    fp8_variant_gemm(a, sa, b, sb, variant)   D[M, N] = sum_kb (A_kb . B_kb^T) * sa[m, kb] * sb[n / R, kb]
    fp8_variant_grouped_contiguous(...)       the same per expert on the MoE's rows sorted by expert
    VARIANTS                                  name -> launch config (tile, warps, stages, K-loop form)

Same contract and values as triton_fp8_prefill.fp8_prefill_gemm (the release GEMM: one FP8 MMA per 32-wide
K slice into a fresh fp32 tile, scaled by the two power-of-two scales and added in fp32), with the K loop
rebuilt after what the sm_90 compile of that kernel showed (Triton 3.6, offline: perf/ptx_check.py's
compile path; H200, 2026-12-02 it ran 72 TFLOP/s):
  - it held the four slices' products and the accumulator at once (5 x 64 fp32 per thread): 255
    registers, 648 bytes of spill, 129 LDL + 115 STL in the K loop. Here a slice is promoted as soon as it
    is waited on, so at most acc + one or two products are live (LAG below);
  - the scale of every element was sa[m] * sb[n / 32] (one FMUL, then the FFMA: 2 CUDA-core ops per
    element and slice, twice the wgmma's time at the FP8 rate). BLOCKS: the product viewed as
    [BM, BN/32, 32] so the scale is [BM, BN/32] (8 products per thread) and each element takes one FFMA;
  - LAG: two slices per step, the first waited on at once, the second left in flight (its result is
    carried to the next step, which Triton's wgmma pipeliner keeps async after the step's wait 0) while
    the CUDA cores promote the first: the promotion overlaps the next wgmma (sm_90 compile: one
    warp_group_dot_wait {pendings 0} per step, where the 4-slice kernel has four). LAG 2 also promotes
    the carried slice after issuing the next (both under it; 4 live tiles, so BN 64);
  - TMA (tl.make_tensor_descriptor) loads of the A and B slices, and WS: tl.range(warp_specialize=True)
    (a producer warp for the loads, the consumer warpgroups for MMA + promotion) where Triton does it.

Weights: e4m3 with one f32 / E8M0 scale per 32x32 tile (R = 32), per (row, 32) (R = 1, element scales:
BLOCKS does not apply), or one f32 per row (ROW_SCALE, the experts' row-scaled form: one FFMA per
element with the row scale in the epilogue). Preconditions (asserted): K % 64 == 0 (LAG walks two slices),
K % 32 == 0 otherwise; M and N masked. TMA variants need 16-byte row strides (K % 16 == 0, true here).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_fp8_prefill import as_f32_scale

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _load_slice(a_ptrs, b_ptrs, a_desc, b_desc, off, row_a, row_b, m_ok, n_ok, TMA: tl.constexpr):
    """The [BM, 32] A and [BN, 32] B e4m3 tiles of one K slice (TMA: through the descriptors, edges
    zero-filled by the hardware)."""
    if TMA:
        a = a_desc.load([row_a, off])
        b = b_desc.load([row_b, off])
    else:
        a = tl.load(a_ptrs + off, mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptrs + off, mask=n_ok[:, None], other=0.0)
    return a, b


@triton.jit
def _mma(a, b, UPCAST: tl.constexpr):
    if UPCAST:                                   # the interpreter has no FP8 dot
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
    return tl.dot(a, tl.trans(b))


@triton.jit
def _promote(acc, d, sa_ptrs, sb_ptrs, kb, m_ok, sb_ok, BM: tl.constexpr, BN: tl.constexpr,
             ROW_SCALE: tl.constexpr, BLOCKS: tl.constexpr):
    """acc + d * sa[:, kb] * sb[., kb] (exact: powers of two). BLOCKS: sb holds one scale per 32
    columns ([BN/32]) and d is scaled as [BM, BN/32, 32] (one FFMA per element)."""
    sa = tl.load(sa_ptrs + kb, mask=m_ok, other=0.0)
    if ROW_SCALE:
        acc = acc + d * sa[:, None]
    else:
        sb = tl.load(sb_ptrs + kb, mask=sb_ok, other=0.0)
        if BLOCKS:
            s = sa[:, None] * sb[None, :]                                     # [BM, BN/32]
            acc3 = tl.reshape(acc, (BM, BN // 32, 32))
            acc3 = acc3 + tl.reshape(d, (BM, BN // 32, 32)) * s[:, :, None]
            acc = tl.reshape(acc3, (BM, BN))
        else:
            acc = acc + d * (sa[:, None] * sb[None, :])
    return acc


@triton.jit(do_not_specialize=["SPLIT_PER"])
def fp8_variant_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, M, N, K, tile_e_ptr, tile_row_ptr, seg_end_ptr, SPLIT_PER,
                       BM: tl.constexpr, BN: tl.constexpr, SB_ROWS: tl.constexpr, ROW_SCALE: tl.constexpr,
                       GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr, BLOCKS: tl.constexpr, LAG: tl.constexpr,
                       TMA: tl.constexpr, WS: tl.constexpr, UPCAST: tl.constexpr, CONTIGUOUS: tl.constexpr = False):
    """a [M, K] e4m3, sa [M, K/32] f32, b [N, K] e4m3, sb [ceil(N/SB_ROWS), K/32] f32 or [N, 1] f32
    (ROW_SCALE) -> c [M, N] bf16. 1-D grid over tiles, GROUP_M row tiles per column sweep.
    CONTIGUOUS (the MoE's grouped contiguous layout, as triton_fp8_prefill's): a's rows sorted by expert,
    b / sb stacks [E, N, ...]; grid (N tiles, row tiles), row tile i starts at tile_row[i] and belongs
    to expert tile_e[i] (-1: past the last tile), whose rows end at seg_end[e].
    Split-K (decode-sized M, dense only): program (t, s) walks slices [s * SPLIT_PER, + SPLIT_PER) (never
    empty, even for LAG); with more than one split c is the fp32 workspace [splits, M, N], summed in split
    order after. SPLIT_PER is a run-time value (no recompile per shape), c's dtype picks the epilogue."""
    nkb = K // 32
    kb0 = 0
    kb1 = nkb
    if not CONTIGUOUS:
        kb0 = tl.program_id(1) * SPLIT_PER
        kb1 = tl.minimum(kb0 + SPLIT_PER, nkb)
        c_ptr += tl.program_id(1).to(tl.int64) * M * N
    if CONTIGUOUS:
        pid_n = tl.program_id(0)
        e = tl.load(tile_e_ptr + tl.program_id(1))
        if e < 0:
            return
        row_a = tl.load(tile_row_ptr + tl.program_id(1)).to(tl.int32)
        rm = row_a + tl.arange(0, BM)
        m_ok = rm < tl.load(seg_end_ptr + e)
        e64 = e.to(tl.int64)
        b_ptr += e64 * N * K
        if ROW_SCALE:
            sb_ptr += e64 * N
        else:
            sb_ptr += e64 * ((N + SB_ROWS - 1) // SB_ROWS) * nkb
    else:
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        rows_here = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % rows_here
        pid_n = (pid % per_group) // rows_here
        row_a = pid_m * BM
        rm = row_a + tl.arange(0, BM)
        m_ok = rm < M
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    rk = tl.arange(0, 32)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * K + rk[None, :]
    b_ptrs = b_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
    a_desc = a_ptr
    b_desc = b_ptr
    if TMA:      # (CONTIGUOUS: b's rows past this expert's N read as zeros; a's past its rows are masked at the store)
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, 32])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, 32])
    sa_ptrs = sa_ptr + rm.to(tl.int64) * nkb
    if BLOCKS:                                   # one scale per 32 columns (SB_ROWS == 32, BN % 32 == 0)
        rb = pid_n * (BN // 32) + tl.arange(0, BN // 32)
        sb_ptrs = sb_ptr + rb.to(tl.int64) * nkb
        sb_ok = rb < tl.cdiv(N, 32)
    else:
        sb_ptrs = sb_ptr + (rn // SB_ROWS).to(tl.int64) * nkb
        sb_ok = n_ok
    row_b = pid_n * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if LAG:
        # step = two slices: x (waited on at once) and d (left in flight, promoted next step)
        d_prev = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in tl.range(kb0, kb1, 2, num_stages=NUM_STAGES, warp_specialize=WS):
            a0, b0 = _load_slice(a_ptrs, b_ptrs, a_desc, b_desc, kb * 32, row_a, row_b, m_ok, n_ok, TMA)
            x = _mma(a0, b0, UPCAST)
            a1, b1 = _load_slice(a_ptrs, b_ptrs, a_desc, b_desc, kb * 32 + 32, row_a, row_b, m_ok, n_ok, TMA)
            # the previous step's slice (first step: d_prev is zeros, any valid scale column gives + 0)
            kp = tl.maximum(kb - 1, kb0)
            if LAG == 2:        # both promotions under the next wgmma (4 live tiles: for narrow tiles)
                d = _mma(a1, b1, UPCAST)
                acc = _promote(acc, d_prev, sa_ptrs, sb_ptrs, kp, m_ok, sb_ok, BM, BN, ROW_SCALE, BLOCKS)
                d_prev = d
            else:               # d_prev's promotion first (3 live tiles), then x's under the next wgmma
                acc = _promote(acc, d_prev, sa_ptrs, sb_ptrs, kp, m_ok, sb_ok, BM, BN, ROW_SCALE, BLOCKS)
                d_prev = _mma(a1, b1, UPCAST)
            acc = _promote(acc, x, sa_ptrs, sb_ptrs, kb, m_ok, sb_ok, BM, BN, ROW_SCALE, BLOCKS)
        acc = _promote(acc, d_prev, sa_ptrs, sb_ptrs, kb1 - 1, m_ok, sb_ok, BM, BN, ROW_SCALE, BLOCKS)
    else:
        for kb in tl.range(kb0, kb1, num_stages=NUM_STAGES, warp_specialize=WS):
            a0, b0 = _load_slice(a_ptrs, b_ptrs, a_desc, b_desc, kb * 32, row_a, row_b, m_ok, n_ok, TMA)
            acc = _promote(acc, _mma(a0, b0, UPCAST), sa_ptrs, sb_ptrs, kb, m_ok, sb_ok, BM, BN, ROW_SCALE, BLOCKS)
    if ROW_SCALE:
        acc = acc * tl.load(sb_ptr + rn, mask=n_ok, other=0.0)[None, :]
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


_BASE = dict(BM=128, BN=128, GROUP_M=8, NUM_STAGES=4, num_warps=8, BLOCKS=False, LAG=False, TMA=False, WS=False)
# name -> launch config; BLOCKS applies to 32x32-tile weight scales only (quietly off otherwise)
VARIANTS: dict[str, dict] = {
    "seq": dict(_BASE),                                                   # one slice at a time
    "blocks": dict(_BASE, BLOCKS=True),                                   # + [BM, BN/32] scales
    "blocks_bm64": dict(_BASE, BM=64, BLOCKS=True, num_warps=4),          # 2+ CTAs per SM overlap instead
    "blocks_bn256": dict(_BASE, BM=64, BN=256, BLOCKS=True, NUM_STAGES=3),  # two warpgroups side by side in N
    "lag_blocks": dict(_BASE, LAG=True, BLOCKS=True),                     # + the next wgmma in flight
    "lag_blocks_bm64": dict(_BASE, BM=64, LAG=True, BLOCKS=True, num_warps=4),
    "lag2_blocks_bn64": dict(_BASE, BN=64, LAG=2, BLOCKS=True),            # both promotions under the next wgmma
    "tma_blocks": dict(_BASE, BLOCKS=True, TMA=True),
    "tma_lag_blocks": dict(_BASE, LAG=True, BLOCKS=True, TMA=True),
}


def decode_config(variant: str, m: int, n: int, k: int, device, split_k: int | None = None) -> dict:
    """Small M (decode, 32-128 tokens): the variant's K loop on a 64-row tile (one warpgroup) and split-K
    where the output tiles alone leave SMs idle (as the W8A16 decode configs do). split_k (the measured
    table's, kernels/fp8_select_table.json) overrides that rule's count; split_plan keeps every split
    non-empty."""
    from .triton_gemm import _num_sms
    cfg = dict(VARIANTS[variant])
    if m <= 64 and cfg["BM"] > 64:
        cfg.update(BM=64, num_warps=4)
    tiles = triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"])
    sms = _num_sms(device)
    cfg["SPLIT_K"] = max(1, min(sms // tiles, k // 32 // 8, 16)) if tiles < sms else 1
    if split_k is not None:
        cfg["SPLIT_K"] = max(1, min(split_k, k // 32))
    return cfg


def split_plan(nkb: int, split: int, lag: bool) -> tuple[int, int]:
    """(splits, slices per split): no split empty, and an even count per split for the lagged loop."""
    step = 2 if lag else 1
    per = triton.cdiv(triton.cdiv(nkb, split), step) * step
    return triton.cdiv(nkb, per), per


def shapes_ok(k: int, variant: str) -> bool:
    return k % (64 if VARIANTS[variant]["LAG"] else 32) == 0


_ALLOCATOR_SET = False


def _tma_allocator() -> None:
    """Device-side tensor descriptors need a scratch allocation per launch (Triton's allocator hook)."""
    global _ALLOCATOR_SET
    if not _ALLOCATOR_SET:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _ALLOCATOR_SET = True


def fp8_variant_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, variant: str = "lag_blocks",
                     cfg: dict | None = None, split_k: int | None = None) -> torch.Tensor:
    """a [M, K] e4m3, sa [M, K/32] f32, b [N, K] e4m3, sb [ceil(N/32), K/32] or [N, K/32] (E8M0 bytes or
    f32 pow2), or [N, 1] f32 -> [M, N] bf16 (fp8_prefill_gemm's values). cfg overrides the variant's;
    split_k the decode rule's split count."""
    m, k = a.shape
    n = b.shape[0]
    assert shapes_ok(k, variant) and b.shape[1] == k and sa.shape == (m, k // 32), (variant, a.shape, b.shape)
    row_scale = sb.shape[-1] == 1 and k > 32
    sb_rows = 1 if sb.shape[0] == n else 32
    assert (row_scale and sb.dtype == torch.float32 and sb.shape[0] == n
            or sb.shape[0] in (n, triton.cdiv(n, 32)) and sb.shape[1] == k // 32), (sb.shape, n, k)
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m == 0 or n == 0:
        return c
    cfg = _fit(cfg or decode_config(variant, m, n, k, a.device, split_k), sb_rows, row_scale)
    if cfg["TMA"] and a.is_cuda:
        _tma_allocator()
    split, per = split_plan(k // 32, cfg.pop("SPLIT_K", 1), cfg["LAG"])
    grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]), split)
    out = c if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=a.device)
    fp8_variant_kernel[grid](a, sa.contiguous(), b, as_f32_scale(sb).contiguous(), out, m, n, k, c, c, c, per,
                             SB_ROWS=sb_rows, ROW_SCALE=row_scale, UPCAST=INTERPRET, **cfg)
    if split > 1:
        from .triton_gemm import splitk_reduce_kernel
        splitk_reduce_kernel[(triton.cdiv(m * n, 1024),)](out, c, split, m * n, m, n, 1, BLOCK=1024, num_warps=4)
    return c


def _fit(cfg: dict, sb_rows: int, row_scale: bool) -> dict:
    """The variant's switches that apply to this weight's scale layout (and the interpreter's limits)."""
    cfg = dict(cfg)
    cfg["BLOCKS"] = bool(cfg["BLOCKS"]) and sb_rows == 32 and not row_scale
    # per-(row, 32) scales keep an FMUL per element: with a third live tile the lagged loop spills
    # (780 bytes at 128 x 128, sm_90 compile), so those weights take the one-slice loop
    cfg["LAG"] = cfg["LAG"] if (sb_rows == 32 or row_scale) else 0
    if INTERPRET:
        cfg.update(NUM_STAGES=1, WS=False)
    return cfg


def fp8_variant_grouped_contiguous(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                                   counts: torch.Tensor, variant: str = "lag_blocks",
                                   cfg: dict | None = None) -> torch.Tensor:
    """triton_fp8_prefill.fp8_grouped_contiguous on a variant's K loop: a [P, K] e4m3 rows sorted by
    expert (counts [E], device), sa [P, K/32] f32, b [E, N, K] e4m3, sb [E, N, K/32] / [E, N/32, K/32]
    (E8M0 or f32) or [E, N, 1] f32 -> [P, N] bf16. One launch, no host read."""
    from .triton_moe_contiguous import contiguous_tiles
    P, k = a.shape
    E, n, _ = b.shape
    assert shapes_ok(k, variant) and b.shape[2] == k and sa.shape == (P, k // 32) and counts.shape == (E,)
    row_scale = sb.shape[-1] == 1 and k > 32
    sb_rows = 1 if sb.shape[1] == n else 32
    c = torch.empty(P, n, dtype=torch.bfloat16, device=a.device)
    if P == 0 or n == 0:
        return c
    cfg = _fit(cfg or VARIANTS[variant], sb_rows, row_scale)
    cfg.pop("GROUP_M", None)
    cfg.pop("SPLIT_K", None)
    if cfg["TMA"] and a.is_cuda:
        _tma_allocator()
    tile_e, tile_row, seg_end = contiguous_tiles(counts, cfg["BM"], P)
    grid = (triton.cdiv(n, cfg["BN"]), tile_e.numel())
    fp8_variant_kernel[grid](a, sa.contiguous(), b, as_f32_scale(sb).contiguous(), c, P, n, k, tile_e, tile_row,
                             seg_end, 0, SB_ROWS=sb_rows, ROW_SCALE=row_scale, UPCAST=INTERPRET, CONTIGUOUS=True,
                             GROUP_M=1, **cfg)
    return c


def fp8_variant_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, variant: str,
                       split_k: int | None = None) -> torch.Tensor:
    """x [..., K] bf16 -> act_quant_fp8 (per 32, pow2) + fp8_variant_gemm -> [..., N] bf16."""
    from .triton_quant import act_quant_fp8
    a, sa = act_quant_fp8(x.reshape(-1, x.shape[-1]))
    return fp8_variant_gemm(a, sa, w, w_scale, variant, split_k=split_k).view(*x.shape[:-1], w.shape[0])
