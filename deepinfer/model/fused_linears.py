"""Linears that read the same input, run as one GEMM (FP8 release format only).

wq_a and wkv both project the attention input; the shared expert's w1 and w3 both project the FFN
input. Two GEMMs each quantize the same rows and stream a narrow weight; one GEMM over the stacked
weight quantizes once and fills the GPU better (decode: N 1024 + 512 -> 1536). The stacked weight
replaces the originals: each Linear keeps views of its rows, so the per-Linear paths and the memory
stay as they were."""

from __future__ import annotations

import torch

from .layers import Linear


def fuse_fp8_linears(linears: list[Linear]) -> Linear | None:
    """One Linear over the stacked FP8 weight (its outputs: each Linear's, in order), every Linear's
    `fp8` re-pointed at its rows and marked `fused` (kernels/deepgemm.py converts only the stacked
    one); None where they cannot share one weight (not all FP8, different K, scale layouts that
    differ or do not split at a Linear's boundary)."""
    if len(linears) < 2 or any(lin.fp8 is None for lin in linears):
        return None
    ws = [lin.fp8[0] for lin in linears]
    ss = [lin.fp8[1] for lin in linears]
    if len({w.shape[1] for w in ws}) != 1 or len({(s.dtype, s.shape[1]) for s in ss}) != 1:
        return None
    per_row = all(s.shape[0] == w.shape[0] for w, s in zip(ws, ss))
    per_tile = all(w.shape[0] % 32 == 0 and s.shape[0] * 32 == w.shape[0] for w, s in zip(ws, ss))
    if not (per_row or per_tile):
        return None
    w, s = torch.cat(ws), torch.cat(ss)
    sizes = [x.shape[0] for x in ws]
    r = 32 if per_tile and not per_row else 1          # weight rows per scale row
    start = 0
    for lin, n in zip(linears, sizes):
        lin.fp8 = (w[start:start + n], s[start // r:(start + n) // r])
        lin.fused = True
        start += n
    with torch.device("meta"):
        out = Linear(w.shape[1], w.shape[0])
    out.fp8, out.weight, out.quantized = (w, s), torch.empty(0, device=w.device), True
    return out
