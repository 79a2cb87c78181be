"""The exact FP8 x FP8 GEMM with per-32 promotion as a warp-specialized CUDA kernel for SM90
(kernels/cuda/fp8_gemm_sm90.cu: TMA producer warpgroup, two wgmma consumer warpgroups, the promotion of
slice s on the CUDA cores while the tensor cores run slice s+1). Same contract and values as
triton_gemm.fp8_gemm on 32x32-block weight scales.

    fp8_gemm_cuda(a, sa, b, sb, out=None)          a [M, K] e4m3, sa [M, K/32] f32, b [N, K] e4m3,
                                                   sb [ceil(N/32), K/32] f32 (or E8M0 bytes) -> [M, N] bf16
    fp8_grouped_contiguous_cuda(a, sa, b, sb, counts)   MoE prefill: rows sorted by expert, b [E, N, K]
    fp8_linear_cuda(x, w, w_scale)                 act_quant_fp8 + fp8_gemm_cuda (select.fp8_linear's form)
    supports(m, n, k, sb) / decline_reason(...)    the shape rules select checks before taking it

Entry points (FORMS): fp8_gemm_sm90_bn128 (two consumer warpgroups, BM 128: M > 64), fp8_gemm_sm90_bm64
(one consumer, BM 64: M <= 64), fp8_gemm_sm90_debug (one consumer waiting on every wgmma before its
promotion: no overlap). DEEPINFER_CUDA_FP8_DEBUG=1 runs every call on the debugging form,
DEEPINFER_CUDA_FP8_FORM=<entry> on that entry: a wrong result the debugging form fixes is in the overlap,
one bm64 fixes is in the two-consumer split, one they all keep is in the pipeline (TMA, barriers,
descriptors) or the promotion.
"""

from __future__ import annotations

import os

import torch

from . import cuda_driver

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "fp8_gemm_sm90.cu")
BK = 128
# entry point -> (BM, BN, stages, threads); must match FP8_GEMM_ENTRY in the .cu
FORMS = {"fp8_gemm_sm90_bn128": (128, 128, 5, 384),
         "fp8_gemm_sm90_bm64": (64, 128, 6, 256),
         "fp8_gemm_sm90_debug": (64, 128, 4, 256)}
DEBUG = os.environ.get("DEEPINFER_CUDA_FP8_DEBUG", "0") == "1"
FORCE = os.environ.get("DEEPINFER_CUDA_FP8_FORM") or None
if FORCE is not None and FORCE not in FORMS:
    raise ValueError(f"DEEPINFER_CUDA_FP8_FORM must be one of {sorted(FORMS)}, got {FORCE!r}")


def form(m: int | None = None) -> str:
    """The entry point for m rows: one consumer warpgroup (BM 64) up to 64 rows (decode), two above;
    FORCE's (DEEPINFER_CUDA_FP8_FORM) or the debugging form (DEEPINFER_CUDA_FP8_DEBUG=1) if set."""
    if FORCE is not None:
        return FORCE
    if DEBUG:
        return "fp8_gemm_sm90_debug"
    return "fp8_gemm_sm90_bm64" if m is not None and m <= 64 else "fp8_gemm_sm90_bn128"


def smem_bytes(name: str) -> int:
    """1024 bytes of alignment slack + the stages' A and B tiles + 2 mbarriers per stage."""
    bm, bn, stages, _ = FORMS[name]
    return 1024 + stages * (bm + bn) * BK + 16 * stages


def _sm90(device) -> bool:
    return torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability(device) == (9, 0)


def decline_reason(m: int, n: int, k: int, sb: torch.Tensor, device=None) -> str | None:
    """None where the CUDA kernel takes an [m, k] x [n, k]^T call with weight scales sb, else the rule it
    breaks: an SM90 GPU and nvcc, K a multiple of 32 (which keeps TMA's rows 16-byte aligned), one f32 /
    E8M0 scale per 32x32 weight block (per-row scales are not implemented)."""
    if device is not None and not _sm90(device):
        return "an SM90 GPU (sm_90a wgmma and TMA)"
    if cuda_driver.find_nvcc() is None:
        return "nvcc to compile it (CUDA_HOME or PATH)"
    if k <= 0 or k % 32:
        return "K a multiple of 32"
    if sb.dim() != 2 or sb.shape != (-(-n // 32), k // 32) or (n > 1 and sb.shape[0] == n):
        return "one weight scale per 32x32 block ([ceil(N/32), K/32])"
    if sb.dtype not in (torch.float32, torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
        return "f32 or E8M0 weight scales"
    return None


def supports(m: int, n: int, k: int, sb: torch.Tensor, device=None) -> bool:
    return decline_reason(m, n, k, sb, device) is None


def _f32_scale(s: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> f32 powers of two (exact); f32 as is."""
    if s.dtype == torch.float32:
        return s.contiguous()
    return (s.view(torch.uint8).to(torch.int32) << 23).view(torch.float32).contiguous()


def _check_operands(a, sa, b, k):
    assert a.dtype == torch.float8_e4m3fn and b.dtype == torch.float8_e4m3fn, (a.dtype, b.dtype)
    assert a.is_cuda and a.device == b.device, (a.device, b.device)
    assert k % 32 == 0 and sa.shape == (a.shape[0], k // 32) and sa.dtype == torch.float32, (sa.shape, sa.dtype, k)
    for t in (a, b):                         # TMA: 16-byte aligned base and row stride
        assert t.data_ptr() % 16 == 0, "TMA needs 16-byte aligned operands"


def fp8_gemm_cuda(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                  out: torch.Tensor | None = None, *, entry: str | None = None) -> torch.Tensor:
    """a [M, K] e4m3, sa [M, K/32] f32, b [N, K] e4m3, sb [ceil(N/32), K/32] f32 or E8M0 -> [M, N] bf16:
    per output, the sum over K/32 slices of (fp32 slice sum of the e4m3 products) * sa * sb. entry: one
    of FORMS (the benchmark times them side by side), else form(M)."""
    m, k = a.shape
    n = b.shape[0]
    assert b.shape[1] == k, (a.shape, b.shape)
    reason = decline_reason(m, n, k, sb)
    if reason is not None:
        raise ValueError(f"fp8_gemm_cuda needs {reason}: a {tuple(a.shape)}, b {tuple(b.shape)}, sb {tuple(sb.shape)}")
    a, b = a.contiguous(), b.contiguous()
    sa = sa.contiguous()
    _check_operands(a, sa, b, k)
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16 and out.is_contiguous(), (out.shape, out.dtype)
    assert out.data_ptr() % 4 == 0, "out must be 4-byte aligned (bf16 pair stores)"
    if m == 0 or n == 0:
        return out
    name = entry or form(m)
    bm, bn, _, threads = FORMS[name]
    smem = smem_bytes(name)
    kern = cuda_driver.kernel(SRC, name, smem, a.device.index)
    ta = cuda_driver.tensor_map_2d(a, BK, bm)
    tb = cuda_driver.tensor_map_2d(b, BK, bn)
    tiles_m = -(-m // bm)
    kern.launch(tiles_m * -(-n // bn), threads, smem, [ta, tb, sa, _f32_scale(sb), out, None, m, n, k, tiles_m])
    return out


def grouped_tiles(counts: torch.Tensor, bm: int, rows: int) -> tuple[torch.Tensor, int]:
    """(int32 [T, 3] of (first row, row end, expert), T) for `rows` rows sorted by expert, counts[e] rows
    each: the M tiles split at expert boundaries, built on the device with no host sync (CUDA graphs): T
    is the bound ceil(rows / bm) + E, and the tiles past the last used one carry expert -1."""
    counts = counts.to(torch.int64)
    e = counts.numel()
    dev = counts.device
    starts = torch.cumsum(counts, 0) - counts
    per = (counts + bm - 1) // bm                                   # tiles per expert
    first_tile = torch.cumsum(per, 0) - per
    t = -(-rows // bm) + e
    idx = torch.arange(t, device=dev)
    ex = torch.searchsorted(first_tile + per, idx, right=True).clamp(max=e - 1)   # the expert of tile idx
    local = idx - first_tile[ex]
    row0 = starts[ex] + local * bm
    end = starts[ex] + counts[ex]
    used = local < per[ex]
    tiles = torch.stack([row0, end, torch.where(used, ex, torch.full_like(ex, -1))], 1).to(torch.int32)
    return tiles.contiguous(), t


def fp8_grouped_contiguous_cuda(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                                counts: torch.Tensor) -> torch.Tensor:
    """a [P, K] e4m3 with rows sorted by expert (counts[e] rows of expert e, in order), sa [P, K/32] f32,
    b [E, N, K] e4m3, sb [E, ceil(N/32), K/32] f32 or E8M0 -> [P, N] bf16 (each row against its expert)."""
    p, k = a.shape
    E, n, _ = b.shape
    assert b.shape[2] == k and counts.shape == (E,), (a.shape, b.shape, counts.shape)
    reason = decline_reason(p, n, k, sb[0] if sb.dim() == 3 else sb)
    if reason is not None or sb.dim() != 3 or sb.shape[0] != E:
        raise ValueError(f"fp8_grouped_contiguous_cuda needs {reason or 'sb [E, ceil(N/32), K/32]'}")
    a, b2 = a.contiguous(), b.contiguous().view(E * n, k)
    sa = sa.contiguous()
    _check_operands(a, sa, b2, k)
    out = torch.empty(p, n, dtype=torch.bfloat16, device=a.device)
    if p == 0 or n == 0:
        return out
    name = form()
    bm, bn, _, threads = FORMS[name]
    smem = smem_bytes(name)
    tiles, t = grouped_tiles(counts, bm, p)
    kern = cuda_driver.kernel(SRC, name, smem, a.device.index)
    ta = cuda_driver.tensor_map_2d(a, BK, bm)
    tb = cuda_driver.tensor_map_2d(b2, BK, bn)
    kern.launch(t * -(-n // bn), threads, smem, [ta, tb, sa, _f32_scale(sb), out, tiles, p, n, k, t])
    return out


def fp8_linear_cuda(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16, w [N, K] e4m3, w_scale [ceil(N/32), K/32] -> [..., N] bf16: act_quant per 32
    (pow2 scales) + fp8_gemm_cuda (triton_fp8_prefill.fp8_prefill_linear's values)."""
    from .triton_quant import act_quant_fp8
    a, sa = act_quant_fp8(x.reshape(-1, x.shape[-1]))
    return fp8_gemm_cuda(a, sa, w, w_scale).view(*x.shape[:-1], w.shape[0])
