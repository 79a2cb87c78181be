"""The MoE's grouped contiguous GEMM in bf16 (select.py's bf16 path for long prefill steps).

    bf16_grouped_contiguous(x, wd, counts)   x [P, K] bf16 rows sorted by expert (counts [E] rows each),
                                             wd [E, N, K] bf16 -> [P, N] bf16: rows of expert e times wd[e]^T

Why bf16 is exact here: the rows are act_quant values (e4m3 times a power of two) and the experts'
weights e4m3 (or e2m1) times E8M0 scales, so both are bf16 values and every product is exact in fp32;
a bf16 tensor-core GEMM adds the release GEMM's very products in fp32 (only the order differs). One
torch._grouped_mm call covers every expert (CUTLASS on SM90: no per-expert launch, no host read of
counts); it runs on a CPU too (a loop inside torch), which the tests use.
"""

from __future__ import annotations

import torch


def bf16_grouped_contiguous(x: torch.Tensor, wd: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 0:
        return torch.empty(0, wd.shape[1], dtype=torch.bfloat16, device=x.device)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)              # group ends, as _grouped_mm wants them
    return torch._grouped_mm(x.contiguous(), wd.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16)

