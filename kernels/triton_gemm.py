"""Triton FP8 GEMMs with the release's 32-wide scale blocks (exact against the reference Linear).

    fp8_gemm(a, sa, b, sb)                 D[M, N] = sum_kb (A_kb . B_kb^T) * sa[m, kb] * sb[n/R, kb]
    fp8_grouped_gemm_masked(a, sa, b, sb, masked_m)   the same per group g over rows < masked_m[g]
                                           (DeepGEMM's masked layout: a [G, Mmax, K], d [G, Mmax, N])
    w8a16_gemm(x, b, sb)                   the same products with x already FP8-rounded (bf16 values)
                                           and each weight tile dequantized in registers: a bf16 MMA
                                           accumulating in place (no per-32 promotion); the default
    fp8_linear(x, w, w_scale)              act_quant (per 32, pow2) + w8a16_gemm, bf16 out
    fp4_to_fp8_weight(packed, scale)       MXFP4 expert weight -> e4m3 [N, K] + per-(row, 32) scale:
                                           exact (every e2m1 value is an e4m3 value)

Why not DeepGEMM directly: its SM90 FP8 kernels promote the accumulator once per 128 K with one
activation scale per (row, 128) and one weight scale per 128x128 tile (`BLOCK_K == 128`,
"Only support per-128-channel FP8 scaling"). Our activations carry a scale per 32 and our
weights one per 32x32 tile, so the reference numbers need a promotion every 32 K. Here every
32-wide K step is one tensor-core dot (fp32 out) scaled by sa*sb (powers of two: exact) and added
in fp32: the same products and the same per-32 rounding points as the reference's FP8 GEMM.

Config: small M (decode) swaps A and B so N fills the MMA's 64/128-row side; split-K over a
fixed fp32 workspace (summed in a fixed order) fills the SMs. With batch_invariant=True the tile
shape and split count depend only on (N, K), never on M, so a row's result is the same at any
batch size.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .reference import e8m0_to_float

NUM_SMS_DEFAULT = 132
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _store_tile(c_ptr, acc, rm, rn, m_ok, n_ok, g64, split, M, N, SPLIT_K,
                SWAP: tl.constexpr, OUT_F32: tl.constexpr):
    """The GEMMs' epilogue: acc ([BN, BM] when SWAP, else [BM, BN]) into c. OUT_F32: c is the split-K
    workspace [SPLIT_K, G, M, N] f32 (this program's split slice), else c is [G, M, N] bf16."""
    if OUT_F32:
        c_base = c_ptr + (split.to(tl.int64) * (tl.num_programs(2) // SPLIT_K) + g64) * M * N
    else:
        c_base = c_ptr + g64 * M * N
    if SWAP:
        c_ptrs = c_base + rm[None, :].to(tl.int64) * N + rn[:, None]
        mask = n_ok[:, None] & m_ok[None, :]
    else:
        c_ptrs = c_base + rm[:, None].to(tl.int64) * N + rn[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
    if OUT_F32:
        tl.store(c_ptrs, acc, mask=mask)
    else:
        tl.store(c_ptrs, acc.to(tl.bfloat16), mask=mask)


@triton.jit
def fp8_gemm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, mm_ptr,
                    M, N, K, SPLIT_K,
                    BM: tl.constexpr, BN: tl.constexpr, SB_ROWS: tl.constexpr,
                    SWAP: tl.constexpr, GROUPED: tl.constexpr, OUT_F32: tl.constexpr,
                    NUM_STAGES: tl.constexpr):
    """a [G, M, K] e4m3, sa [G, M, K/32] f32, b [G, N, K] e4m3, sb [G, N/SB_ROWS, K/32] f32.
    Grid (N/BN, M/BM, G*SPLIT_K). OUT_F32: c is the split-K workspace [SPLIT_K, G, M, N] f32,
    else c is [G, M, N] bf16. GROUPED: rows >= mm[g] are skipped (masked layout)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_z = tl.program_id(2)
    g = pid_z // SPLIT_K
    split = pid_z % SPLIT_K
    m_lim = M
    if GROUPED:
        m_lim = tl.load(mm_ptr + g)
    if pid_m * BM >= m_lim:
        return
    nkb = K // 32
    per = tl.cdiv(nkb, SPLIT_K)
    kb0 = split * per
    kb1 = tl.minimum(kb0 + per, nkb)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, 32)
    g64 = g.to(tl.int64)
    m_ok = rm < m_lim
    n_ok = rn < N
    a_ptrs = a_ptr + g64 * M * K + rm[:, None].to(tl.int64) * K + rk[None, :]
    b_ptrs = b_ptr + g64 * N * K + rn[:, None].to(tl.int64) * K + rk[None, :]
    sa_ptrs = sa_ptr + g64 * M * nkb + rm.to(tl.int64) * nkb
    sb_ptrs = sb_ptr + g64 * (N // SB_ROWS) * nkb + (rn // SB_ROWS).to(tl.int64) * nkb
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in tl.range(kb0, kb1, num_stages=NUM_STAGES):
        a = tl.load(a_ptrs + kb * 32, mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptrs + kb * 32, mask=n_ok[:, None], other=0.0)
        sa = tl.load(sa_ptrs + kb, mask=m_ok, other=0.0)
        sb = tl.load(sb_ptrs + kb, mask=n_ok, other=0.0)
        if SWAP:
            acc += tl.dot(b, tl.trans(a)) * (sb[:, None] * sa[None, :])
        else:
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
    _store_tile(c_ptr, acc, rm, rn, m_ok, n_ok, g64, split, M, N, SPLIT_K, SWAP, OUT_F32)


@triton.jit
def w8a16_gemm_kernel(x_ptr, b_ptr, sb_ptr, c_ptr, mm_ptr,
                      M, N, K, SPLIT_K,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SB_ROWS: tl.constexpr,
                      SWAP: tl.constexpr, GROUPED: tl.constexpr, OUT_F32: tl.constexpr,
                      NUM_STAGES: tl.constexpr, UPCAST: tl.constexpr = False, SB_E8M0: tl.constexpr = False):
    """x [G, M, K] bf16 holding FP8-rounded activations (act_quant's fake-quant values: q * 2^e, exact
    in bf16), b [G, N, K] e4m3, sb [G, N/SB_ROWS, K/32] f32 pow2. Each weight tile is dequantized in
    registers (q * s: exact in bf16) and fed to a bf16 MMA accumulating in place in fp32: the same
    exact products as the reference, with no per-32 promotion step. Grid as fp8_gemm_kernel.
    SB_E8M0: sb holds raw E8M0 bytes (1 B per 32 weights instead of 4)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_z = tl.program_id(2)
    g = pid_z // SPLIT_K
    split = pid_z % SPLIT_K
    m_lim = M
    if GROUPED:
        m_lim = tl.load(mm_ptr + g)
    if pid_m * BM >= m_lim:
        return
    nkb = K // BK
    per = tl.cdiv(nkb, SPLIT_K)
    kb0 = split * per
    kb1 = tl.minimum(kb0 + per, nkb)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rs = tl.arange(0, BK // 32)
    g64 = g.to(tl.int64)
    m_ok = rm < m_lim
    n_ok = rn < N
    x_ptrs = x_ptr + g64 * M * K + rm[:, None].to(tl.int64) * K + rk[None, :]
    b_ptrs = b_ptr + g64 * N * K + rn[:, None].to(tl.int64) * K + rk[None, :]
    sb_ptrs = sb_ptr + g64 * (N // SB_ROWS) * (K // 32) + (rn // SB_ROWS)[:, None].to(tl.int64) * (K // 32) + rs[None, :]
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    # NOTE: the weight tile goes through registers for the dequant, so Triton's cp.async pipeliner
    # does not apply (no cp.async in the PTX); explicit register double buffering was measured 1.7x
    # slower on the H200 (run 3), so the loop stays plain.
    for kb in tl.range(kb0, kb1, num_stages=NUM_STAGES):
        x = tl.load(x_ptrs + kb * BK, mask=m_ok[:, None], other=0.0)
        w = tl.load(b_ptrs + kb * BK, mask=n_ok[:, None], other=0.0)
        if SB_E8M0:
            sb = (tl.load(sb_ptrs + kb * (BK // 32), mask=n_ok[:, None], other=0).to(tl.int32) << 23).to(
                tl.float32, bitcast=True)
        else:
            sb = tl.load(sb_ptrs + kb * (BK // 32), mask=n_ok[:, None], other=0.0)
        if UPCAST:                       # CPU interpreter only: its bf16 casts and dots are wrong
            wd = tl.reshape(tl.reshape(w.to(tl.float32), (BN, BK // 32, 32)) * sb[:, :, None], (BN, BK))
            x = x.to(tl.float32)
        else:
            wd = tl.reshape(tl.reshape(w.to(tl.bfloat16), (BN, BK // 32, 32)) * sb.to(tl.bfloat16)[:, :, None],
                            (BN, BK))
        if SWAP:
            acc = tl.dot(wd, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(wd), acc)
    _store_tile(c_ptr, acc, rm, rn, m_ok, n_ok, g64, split, M, N, SPLIT_K, SWAP, OUT_F32)


@triton.jit
def splitk_reduce_kernel(ws_ptr, c_ptr, S, total, BLOCK: tl.constexpr):
    """c[i] = bf16(sum_s ws[s, i]) summed in split order (deterministic)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(S):
        acc += tl.load(ws_ptr + s * total + offs, mask=ok, other=0.0)
    tl.store(c_ptr + offs, acc.to(tl.bfloat16), mask=ok)


def w8a16_config(m: int, n: int, k: int, groups: int, device, batch_invariant: bool = False) -> dict:
    """Decode-sized M (<= 128) swaps A/B so N fills the MMA's long side; split-K fills the SMs.
    batch_invariant: one tile shape for every M and a split count from (N, K) only."""
    bk = 128 if k % 128 == 0 else (64 if k % 64 == 0 else 32)
    nkb = k // bk
    sms = _num_sms(device)
    if batch_invariant:
        swap, bm, bn, warps = False, 64, 128, 4
    elif m <= 128:
        swap, bm, bn = True, max(16, triton.next_power_of_2(m)), 128 if n >= 2048 else 64
        warps = 8 if bm >= 128 else 4
    else:
        swap, bm, bn, warps = False, 128, 128, 8
    tiles = triton.cdiv(n, bn) * groups * (1 if (swap or batch_invariant) else triton.cdiv(m, bm))
    split = 1
    if tiles < 2 * sms:
        split = max(1, min(2 * sms // tiles, nkb // 4, 16))
    return dict(BM=bm, BN=bn, BK=bk, SWAP=swap, SPLIT_K=split, NUM_STAGES=4, num_warps=warps)


def _launch_w8a16(x, b, sb, masked_m, m, n, k, groups, sb_rows, cfg, out=None):
    dev = x.device
    split = cfg["SPLIT_K"]
    grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BM"]), groups * split)
    mm = masked_m if masked_m is not None else sb
    kw = dict(BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], SB_ROWS=sb_rows, SWAP=cfg["SWAP"],
              GROUPED=masked_m is not None, NUM_STAGES=cfg["NUM_STAGES"], num_warps=cfg["num_warps"],
              UPCAST=INTERPRET, SB_E8M0=sb.dtype != torch.float32)
    c = out if out is not None else torch.empty(groups, m, n, dtype=torch.bfloat16, device=dev)
    if split == 1:
        w8a16_gemm_kernel[grid](x, b, sb, c, mm, m, n, k, 1, OUT_F32=False, **kw)
        return c
    ws = (torch.zeros if masked_m is not None else torch.empty)(split, groups, m, n, dtype=torch.float32, device=dev)
    w8a16_gemm_kernel[grid](x, b, sb, ws, mm, m, n, k, split, OUT_F32=True, **kw)
    total = groups * m * n
    splitk_reduce_kernel[(triton.cdiv(total, 1024),)](ws, c, split, total, BLOCK=1024, num_warps=4)
    return c


def _as_scale(sb: torch.Tensor) -> torch.Tensor:
    """f32 pow2 scales pass through; E8M0 (float8_e8m0fnu / uint8) travel as raw bytes."""
    return sb if sb.dtype == torch.float32 else sb.view(torch.uint8)


def w8a16_gemm(x: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, batch_invariant: bool = False,
               cfg_override: dict | None = None) -> torch.Tensor:
    """x [M, K] bf16 (already FP8-rounded by act_quant), b [N, K] e4m3, sb [N/32, K/32] or [N, K/32]
    (f32 pow2 or raw E8M0) -> [M, N] bf16. Same values as fp8_gemm on (act_quant_fp8(x), ...)."""
    m, k = x.shape
    n = b.shape[0]
    sb_rows = n // sb.shape[0]
    assert k % 32 == 0 and sb_rows in (1, 32) and sb.shape[1] == k // 32
    if m == 0:
        return torch.empty(0, n, dtype=torch.bfloat16, device=x.device)
    cfg = w8a16_config(m, n, k, 1, x.device, batch_invariant)
    cfg.update(cfg_override or {})
    return _launch_w8a16(x.contiguous(), b, _as_scale(sb).contiguous(), None, m, n, k, 1, sb_rows, cfg)[0]


def w8a16_grouped_gemm_masked(x: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, masked_m: torch.Tensor,
                              expected_m: int, out: torch.Tensor | None = None,
                              batch_invariant: bool = False, cfg_override: dict | None = None) -> torch.Tensor:
    """Masked grouped form: x [G, Mmax, K] bf16 (FP8-rounded), b [G, N, K] e4m3, sb [G, N/R, K/32]."""
    groups, mmax, k = x.shape
    n = b.shape[1]
    sb_rows = n // sb.shape[1]
    cfg = w8a16_config(expected_m, n, k, groups, x.device, batch_invariant)
    if cfg["SWAP"]:
        cfg["BM"] = max(cfg["BM"], 16)
    cfg.update(cfg_override or {})
    return _launch_w8a16(x.contiguous(), b, _as_scale(sb).contiguous(), masked_m.to(torch.int32), mmax, n, k, groups,
                         sb_rows, cfg, out)


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NUM_SMS_DEFAULT


def gemm_config(m: int, n: int, k: int, groups: int, device, batch_invariant: bool = False) -> dict:
    """Tile shape and split-K. Decode-sized M swaps A/B; split-K only where the (N, G) grid alone
    leaves SMs idle. batch_invariant: the choice ignores m entirely."""
    nkb = k // 32
    if batch_invariant:
        swap, bm, bn = False, 64, 128
    elif m <= 64:
        swap, bm, bn = True, max(16, triton.next_power_of_2(m)), 128 if n >= 4096 else 64
    else:
        swap, bm, bn = False, 128 if m >= 256 else 64, 128
    tiles = triton.cdiv(n, bn) * groups
    split = 1
    if (m <= 64 or batch_invariant) and tiles < 2 * _num_sms(device):
        split = max(1, min(2 * _num_sms(device) // tiles, nkb // 8, 16))
    return dict(BM=bm, BN=bn, SWAP=swap, SPLIT_K=split, NUM_STAGES=4 if swap else 3,
                num_warps=4 if (swap or bm == 64) else 8)


def _launch(a, sa, b, sb, masked_m, m, n, k, groups, sb_rows, cfg, out=None):
    dev = a.device
    split = cfg["SPLIT_K"]
    grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BM"]), groups * split)
    mm = masked_m if masked_m is not None else sa
    kw = dict(BM=cfg["BM"], BN=cfg["BN"], SB_ROWS=sb_rows, SWAP=cfg["SWAP"], GROUPED=masked_m is not None,
              NUM_STAGES=cfg["NUM_STAGES"], num_warps=cfg["num_warps"])
    if split == 1:
        c = out if out is not None else torch.empty(groups, m, n, dtype=torch.bfloat16, device=dev)
        fp8_gemm_kernel[grid](a, sa, b, sb, c, mm, m, n, k, 1, OUT_F32=False, **kw)
        return c
    ws = torch.zeros(split, groups, m, n, dtype=torch.float32, device=dev) if masked_m is not None else \
        torch.empty(split, groups, m, n, dtype=torch.float32, device=dev)
    fp8_gemm_kernel[grid](a, sa, b, sb, ws, mm, m, n, k, split, OUT_F32=True, **kw)
    c = ws.sum(0).to(torch.bfloat16)
    if out is not None:
        out.copy_(c)
        return out
    return c


def fp8_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
             batch_invariant: bool = False) -> torch.Tensor:
    """a [M, K] e4m3, sa [M, K/32] f32, b [N, K] e4m3, sb [N/32, K/32] (32x32 tiles) or [N, K/32]
    (per row) f32 -> [M, N] bf16."""
    m, k = a.shape
    n = b.shape[0]
    assert k % 32 == 0 and b.shape[1] == k and sa.shape == (m, k // 32)
    sb_rows = n // sb.shape[0]
    assert sb_rows in (1, 32) and sb.shape[1] == k // 32 and n % sb_rows == 0
    if m == 0:
        return torch.empty(0, n, dtype=torch.bfloat16, device=a.device)
    cfg = gemm_config(m, n, k, 1, a.device, batch_invariant)
    return _launch(a, sa.contiguous(), b, sb.contiguous(), None, m, n, k, 1, sb_rows, cfg)[0]


def fp8_grouped_gemm_masked(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                            masked_m: torch.Tensor, expected_m: int, out: torch.Tensor | None = None,
                            batch_invariant: bool = False) -> torch.Tensor:
    """a [G, Mmax, K] e4m3, sa [G, Mmax, K/32], b [G, N, K] e4m3, sb [G, N/R, K/32], masked_m [G]
    int32 -> d [G, Mmax, N] bf16. Rows >= masked_m[g] are garbage (unwritten as in DeepGEMM, or
    zero after a split-K reduction): consumers read only the first masked_m[g] rows."""
    groups, mmax, k = a.shape
    n = b.shape[1]
    sb_rows = n // sb.shape[1]
    assert sb_rows in (1, 32) and sa.shape == (groups, mmax, k // 32)
    cfg = gemm_config(expected_m, n, k, groups, a.device, batch_invariant)
    if expected_m > 64 and not batch_invariant:
        cfg = gemm_config(expected_m, n, k, groups, a.device)
    if cfg["SWAP"] and cfg["BM"] < triton.next_power_of_2(max(1, expected_m)):
        cfg["BM"] = triton.next_power_of_2(expected_m)
    return _launch(a, sa.contiguous(), b, sb.contiguous(), masked_m.to(torch.int32), mmax, n, k, groups, sb_rows,
                   cfg, out)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """x [..., K] bf16, w [N, K] e4m3, w_scale [N/32, K/32] f32 (or raw E8M0) -> [..., N] bf16: the
    reference Linear for FP8 weights (act_quant per 32, fp32-accumulated product)."""
    from .triton_quant import act_quant
    y = w8a16_gemm(act_quant(x.reshape(-1, x.shape[-1])), w, w_scale, batch_invariant)
    return y.view(*x.shape[:-1], w.shape[0])


def fp4_to_fp8_weight(packed: torch.Tensor, scale: torch.Tensor, keep_e8m0: bool = False):
    """[N, K/2] e2m1 pairs (element 2j in the low nibble) + E8M0 [N, K/32] -> (e4m3 [N, K], f32
    [N, K/32], or the E8M0 bytes with keep_e8m0). Exact: the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}
    is a subset of e4m3."""
    u = packed.view(torch.uint8)
    grid = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), device=u.device)
    table = torch.cat([grid, -grid]).to(torch.float8_e4m3fn)
    w = torch.stack([table[(u & 15).long()], table[(u >> 4).long()]], -1).flatten(-2)
    return w.contiguous(), (scale.view(torch.uint8).contiguous() if keep_e8m0 else e8m0_to_float(scale).contiguous())
