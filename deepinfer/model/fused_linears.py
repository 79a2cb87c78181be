"""Linears that read the same input, run as one GEMM: FP8 release weights, or dense linears held in
the compute dtype (EngineArgs.dense_weights="bf16", CUDA's default).

wq_a and wkv both project the attention input; the shared expert's w1 and w3 both project the FFN
input. Two GEMMs each quantize the same rows and stream a narrow weight; one GEMM over the stacked
weight quantizes once and fills the GPU better (decode: N 1024 + 512 -> 1536), and the shared expert's
SwiGLU then runs as one fused kernel (MoE._shared) instead of ~8 torch passes over [T, 2 x 2304] fp32
(the 40-layer H200 prefill profile, 2026-12-03, held ~15 ms of them while dense weights went unfused).
The stacked weight replaces the originals: each Linear keeps views of its rows, so the per-Linear
paths and the memory stay as they were."""

from __future__ import annotations

import torch

from .layers import Linear

# the Linears the model fuses (Attention.fuse_input_linears, MoE.fuse_input_linears), by the tail of their
# tensors' names: one call over the stacked weight, [sum of N, K]
FUSED_GROUPS = (("attn.wq_a.weight", "attn.wkv.weight"),
                ("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"))


def _stack_fp8(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, list] | None:
    """(stacked e4m3 weight, stacked scales, each pair's views of them) of FP8 (weight, scales) pairs that can
    share one weight: the same K and scale dtype / columns, scales per row or per 32-row tile that split at
    every pair's boundary; None otherwise."""
    ws = [w for w, _ in pairs]
    ss = [s for _, s in pairs]
    if len({w.shape[1] for w in ws}) != 1 or len({(s.dtype, s.shape[1]) for s in ss}) != 1:
        return None
    per_row = all(s.shape[0] == w.shape[0] for w, s in zip(ws, ss))
    per_tile = all(w.shape[0] % 32 == 0 and s.shape[0] * 32 == w.shape[0] for w, s in zip(ws, ss))
    if not (per_row or per_tile):
        return None
    w, s = torch.cat(ws), torch.cat(ss)
    r = 32 if per_tile and not per_row else 1          # weight rows per scale row
    views, start = [], 0
    for own in ws:
        n = own.shape[0]
        views.append((w[start:start + n], s[start // r:(start + n) // r]))
        start += n
    return w, s, views


def fuse_fp8_linears(linears: list[Linear]) -> Linear | None:
    """One Linear over the stacked FP8 weight (its outputs: each Linear's, in order), every Linear's
    `fp8` re-pointed at its rows and marked `fused` (kernels/deepgemm.py converts only the stacked
    one); None where they cannot share one weight (not all FP8, different K, scale layouts that
    differ or do not split at a Linear's boundary)."""
    if len(linears) < 2 or any(lin.fp8 is None for lin in linears):
        return None
    stacked = _stack_fp8([lin.fp8 for lin in linears])
    if stacked is None:
        return None
    w, s, views = stacked
    for lin, view in zip(linears, views):
        lin.fp8 = view
        lin.fused = True
    with torch.device("meta"):
        out = Linear(w.shape[1], w.shape[0])
    out.fp8, out.weight, out.quantized = (w, s), torch.empty(0, device=w.device), True
    return out


def fuse_dense_linears(linears: list[Linear]) -> Linear | None:
    """One Linear over the stacked dense weight (same K, dtype, device and act rounding), every Linear's
    `weight` re-pointed at its rows; None where any is not a plain dense Linear."""
    if len(linears) < 2 or any(lin.fp8 is not None or lin.fp8_blocks is not None or lin.packed is not None
                               or lin.weight.dim() != 2 or lin.weight.numel() == 0 for lin in linears):
        return None
    ws = [lin.weight for lin in linears]
    if len({(w.shape[1], w.dtype, w.device) for w in ws}) != 1 or len({lin.quantized for lin in linears}) != 1:
        return None
    # the FP8 copies of bf16-held weights (dense_weights="bf16+fp8") stack alongside, or are all dropped
    copies = _stack_fp8([lin.fp8_decode for lin in linears]) \
        if all(lin.fp8_decode is not None for lin in linears) else None
    w = torch.cat(ws)
    start = 0
    for i, (lin, own) in enumerate(zip(linears, ws)):
        lin.weight = w[start:start + own.shape[0]]
        lin.fp8_decode = copies[2][i] if copies is not None else None
        start += own.shape[0]
    with torch.device("meta"):
        out = Linear(w.shape[1], w.shape[0])
    out.weight, out.quantized = w, linears[0].quantized
    out.fp8_decode = copies[:2] if copies is not None else None
    return out


def fuse_linears(linears: list[Linear]) -> Linear | None:
    """fuse_fp8_linears, else fuse_dense_linears: None where the Linears share no weight form."""
    return fuse_fp8_linears(linears) or fuse_dense_linears(linears)
