"""Small-M bf16 x bf16 -> fp32 GEMM (fp32 accumulation): the decode form of model/layers.linear_fp32.

    linear_fp32(x, w)          x [..., K] bf16, w [N, K] bf16 -> [..., N] fp32 = x @ w^T
    linear_fp32_config(n, k)   the launch config: a function of (N, K) and the SM count only

Why: cuBLAS's bf16 -> fp32 GEMM on the MoE router (x [64, 5120] @ gate [384, 5120]^T) launches
about 3 CTAs and no split-K, so 24 us per call on the H200 where the 3.9 MB weight read takes ~1 us.
Here A and B are swapped (the weight's N rows fill the MMA's 64-row side, the tokens are its narrow
side) and K is split so that ~2 waves of CTAs cover the SMs; each split writes its fp32 partial
tile into a workspace [SPLIT_K, M, N] that a second kernel sums in split order (deterministic, no
atomics). bf16 products are exact in fp32, so this is an fp32 GEMM's math, as torch.mm(out_dtype=
torch.float32) and the CPU reference (reference.linear_fp32_ref) compute it.

Batch invariance: tiles, BK and the split count depend on (N, K) only, and BM (the token tile) is
fixed at MAX_M, so a row's partial sums and their order are the same at any M, and at any position
of the row in the batch. Larger M (batch-invariant mode only, kernels/select.py) runs MAX_M rows per
launch: the same tiles, so the same bits.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_gemm import _grid_work, _num_sms, _store_tile, _tile, splitk_reduce_kernel

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_M = 128             # rows per launch: the token tile BM (one M tile per launch)
WAVES = 2               # CTAs per SM the split-K aims for


@triton.jit
def linear_fp32_kernel(x_ptr, w_ptr, c_ptr, M, N, K, SPLIT_K,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr,
                       OUT_F32: tl.constexpr, NUM_STAGES: tl.constexpr, UPCAST: tl.constexpr):
    """x [M, K] bf16, w [N, K] bf16 (both row-major), K % BK == 0. Grid (N/BN, M/BM, SPLIT_K): each
    program accumulates x[BM rows] . w[BN rows]^T over its K-block range in fp32 and stores the tile
    (_store_tile: into the workspace [SPLIT_K, M, N] f32, or straight into c [M, N] f32 when SPLIT_K
    is 1). SWAP: acc is [BN, BM] (w on the MMA's long side), else [BM, BN]."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    g, split, m_lim, nkb, kb0, kb1 = _grid_work(x_ptr, M, K, SPLIT_K, BK, False)
    rm, rn, m_ok, n_ok, acc = _tile(pid_m, pid_n, m_lim, N, BM, BN, SWAP)
    rk = tl.arange(0, BK)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
    for kb in tl.range(kb0, kb1, num_stages=NUM_STAGES):
        x = tl.load(x_ptrs + kb * BK, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs + kb * BK, mask=n_ok[:, None], other=0.0)
        if UPCAST:
            # CPU interpreter: its bf16 dots are wrong and its fp32 dot (OpenBLAS sgemm) sums a column
            # differently by its position in the tile, so multiply and reduce explicitly (fp32, exact
            # from bf16): the same sum for every row, which lets the batch-invariance checks run on a CPU
            x = x.to(tl.float32)
            w = w.to(tl.float32)
            if SWAP:
                acc += tl.sum(w[:, None, :] * x[None, :, :], axis=2)
            else:
                acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        elif SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    _store_tile(c_ptr, acc, rm, rn, m_ok, n_ok, g.to(tl.int64), split, M, N, SPLIT_K, SWAP, OUT_F32)


def linear_fp32_config(n: int, k: int, device) -> dict:
    """Swapped 64 x MAX_M tiles; K split so that the (N tiles x splits) grid is >= WAVES CTAs per SM
    where K allows, no split left empty. Never a function of M (batch invariance)."""
    bk = next(b for b in (128, 64, 32, 16) if k % b == 0)
    nkb = k // bk
    bn = 64
    target = triton.cdiv(WAVES * _num_sms(device), triton.cdiv(n, bn))     # splits wanted
    per = max(1, nkb // target)                                          # K blocks per split
    # NOTE: one K block per program (the router) needs no third buffer; two stages of 48 KB (x 128 x 128,
    # w 64 x 128 bf16) let two programs share an SM, so the whole grid is resident at once
    return dict(BM=MAX_M, BN=bn, BK=bk, SWAP=True, SPLIT_K=triton.cdiv(nkb, per), NUM_STAGES=min(3, per + 1),
                num_warps=4)


def shapes_ok(n: int, k: int) -> bool:
    """K a multiple of 16 (the smallest BK); any N."""
    return k % 16 == 0 and k > 0 and n > 0


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: dict, partials: bool = False):
    """x [m, K] (m <= MAX_M), w [N, K], out [m, N] f32, all contiguous. partials=True: return the fp32
    split-K workspace [SPLIT_K, m, N] unsummed (tests)."""
    m, k = x.shape
    n = w.shape[0]
    split = cfg["SPLIT_K"]
    grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BM"]), split)
    kw = dict(BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], SWAP=cfg["SWAP"], NUM_STAGES=cfg["NUM_STAGES"],
              num_warps=cfg["num_warps"], UPCAST=INTERPRET)
    if split == 1 and not partials:
        linear_fp32_kernel[grid](x, w, out, m, n, k, 1, OUT_F32=True, **kw)
        return out
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device)    # every element written once
    linear_fp32_kernel[grid](x, w, ws, m, n, k, split, OUT_F32=True, **kw)
    if partials:
        return ws
    total = m * n
    splitk_reduce_kernel[(triton.cdiv(total, 256),)](ws, out, split, total, m, n, 1, BLOCK=256, num_warps=2)
    return out


def linear_fp32(x: torch.Tensor, w: torch.Tensor, cfg_override: dict | None = None) -> torch.Tensor:
    """x [..., K] bf16, w [N, K] bf16 (contiguous) -> [..., N] fp32. Rows go MAX_M per launch."""
    k = x.shape[-1]
    n = w.shape[0]
    assert x.dtype == w.dtype == torch.bfloat16 and w.shape[1] == k and w.is_contiguous() and shapes_ok(n, k)
    x2 = x.reshape(-1, k).contiguous()                                   # [M, K]
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)        # [M, N]
    cfg = linear_fp32_config(n, k, x.device)
    cfg.update(cfg_override or {})
    assert k % cfg["BK"] == 0, cfg
    for r0 in range(0, m, MAX_M):
        _launch(x2[r0:r0 + MAX_M], w, out[r0:r0 + MAX_M], cfg)
    return out.view(*x.shape[:-1], n)


def linear_fp32_partials(x: torch.Tensor, w: torch.Tensor, cfg_override: dict | None = None) -> torch.Tensor:
    """Test hook: x [m, K] (m <= MAX_M) -> the fp32 split-K partial sums [SPLIT_K, m, N]."""
    cfg = linear_fp32_config(w.shape[0], x.shape[1], x.device)
    cfg.update(cfg_override or {})
    return _launch(x.contiguous(), w.contiguous(), None, cfg, partials=True)
