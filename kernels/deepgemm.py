"""DeepGEMM (SM90 build bundled in vllm 0.33.0) behind our weight formats.

Import order (DESIGN.md): `deep_gemm`, then `vllm.third_party.deep_gemm`; None when neither loads.

Scale mapping. DeepGEMM's SM90 FP8 kernels take one activation scale per (row, 128 K) and one
weight scale per 128x128 tile (fp32), and promote the accumulator once per 128 K. Ours are per
(row, 32 K) and per 32x32 tile, all powers of two. The mapping re-expresses each tensor at the
larger block with S128 = max of the covered pow2 scales: q' = e4m3(q * s32 / S128).
  * exact for every element whose shifted value stays an e4m3 normal or exact subnormal; the
    only loss is in elements below ~2^-6 * S128 (|x| < amax_128 / 28672) inside a 32-block whose
    own scale is smaller than the 128-block's; reblock_* report how many elements moved;
  * MXFP4 expert weights are the exception: e2m1 has a 1-bit mantissa, so q * 2^(e - E) is exact
    for any exponent gap up to 14 with E = max(e) - 6 (6 * 2^6 = 384 <= 448): the FP4 -> FP8
    128x128 conversion is exact for all real weights (checked and counted at load).
So DeepGEMM reproduces our weights exactly (FP4 experts) or nearly (FP8 linears) but not our
per-32 activation rounding: the Triton kernels in triton_gemm.py are the exact path and DeepGEMM
the comparison (and an opt-in fast path where its speed wins).
"""

from __future__ import annotations

import torch

from .optional import first_importable


def load():
    """The DeepGEMM module, or None."""
    return first_importable("deep_gemm", "vllm.third_party.deep_gemm")


def _pow2_scale_max(s: torch.Tensor, fr: int, fc: int) -> torch.Tensor:
    """[R, C] pow2 scales -> [R/fr, C/fc] block maxima."""
    r, c = s.shape
    return s.view(r // fr, fr, c // fc, fc).amax(dim=(1, 3))


def reblock_weight_128(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """w [N, K] e4m3 with s [N/32, K/32] (32x32 tiles) or [N, K/32] (per row) pow2 f32 ->
    (w' e4m3 [N, K], S [N/128, K/128] f32, number of elements whose value changed)."""
    n, k = w.shape
    fr = 128 // (n // s.shape[0])
    big = _pow2_scale_max(s, fr, 4)                                      # [N/128, K/128]
    rows = n // s.shape[0]
    s_full = s.repeat_interleave(rows, 0).repeat_interleave(32, 1)
    big_full = big.repeat_interleave(128, 0).repeat_interleave(128, 1)
    exact = w.float() * s_full
    w2 = (exact / big_full).to(torch.float8_e4m3fn)
    changed = int((w2.float() * big_full != exact).sum())
    return w2, big.contiguous(), changed


def fp4_weight_to_fp8_128(w8: torch.Tensor, s_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """FP4-origin weight (e4m3 [N, K] holding e2m1 values, per-(row, 32) pow2 scales) -> DeepGEMM
    128x128 layout with E = max(e) - 6 per tile, so each value moves up to 6 binades up or 8 down."""
    n, k = w8.shape
    big = _pow2_scale_max(s_row, 128, 4) / 64.0                          # 2^(emax - 6)
    s_full = s_row.repeat_interleave(32, 1)
    big_full = big.repeat_interleave(128, 0).repeat_interleave(128, 1)
    exact = w8.float() * s_full
    w2 = (exact / big_full).to(torch.float8_e4m3fn)
    changed = int((w2.float() * big_full != exact).sum())
    return w2, big.contiguous(), changed


def act_reblock_128(q: torch.Tensor, s32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our per-32 activation (e4m3 [M, K], pow2 f32 [M, K/32]) -> per-128 (e4m3, f32 [M, K/128])."""
    m, k = q.shape
    s128 = s32.view(m, k // 128, 4).amax(-1)
    ratio = (s32 / s128.repeat_interleave(4, 1)).repeat_interleave(32, 1)
    return (q.float() * ratio).to(torch.float8_e4m3fn), s128.contiguous()


def fp8_gemm_nt(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """D = A @ B^T with 1x128 / 128x128 scales through DeepGEMM (bf16 out)."""
    dg = load()
    d = out if out is not None else torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16, device=a.device)
    dg.fp8_gemm_nt((a, sa), (b, sb), d)
    return d


def grouped_masked(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, masked_m: torch.Tensor,
                   expected_m: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Masked grouped GEMM: a [G, Mmax, K], sa [G, Mmax, K/128], b [G, N, K], sb [G, N/128, K/128]."""
    dg = load()
    g, mmax, _ = a.shape
    d = out if out is not None else torch.empty(g, mmax, b.shape[1], dtype=torch.bfloat16, device=a.device)
    dg.m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), d, masked_m, expected_m)
    return d


def prepare_sfa(sa: torch.Tensor) -> torch.Tensor:
    """Pre-transform activation scales into DeepGEMM's TMA-aligned MN-major layout, so a timed
    call does not include the transform (falls back to the plain tensor)."""
    dg = load()
    try:
        return dg.get_mn_major_tma_aligned_tensor(sa)
    except Exception:  # noqa: BLE001
        return sa
