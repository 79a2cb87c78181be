"""kernels/batch_invariant.py: row results independent of the batch (CPU torch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels.batch_invariant import batch_invariant_mode


def _rows_differ(f, x, row=3, sizes=(1, 2, 7, 16, 33)) -> list[int]:
    """Batch sizes at which row `row` of f(batch) differs from f(that row alone)."""
    alone = f(x[row:row + 1])[0]
    bad = []
    for m in sizes:
        y = x[:max(m, 1)].clone()
        y[m // 2] = x[row]
        if not torch.equal(f(y)[m // 2], alone):
            bad.append(m)
    return bad


def test_plain_cpu_fp32_linear_is_not_batch_invariant():
    """The measured reason for the mode (MKL/oneDNN: GEMV at M=1, blocked GEMM otherwise)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(1024, 256, generator=g), torch.randn(40, 256, generator=g)
    assert _rows_differ(lambda a: F.linear(a, w), x)


def test_linear_einsum_mm_bmm_invariant_in_mode():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1024, 256, generator=g)
    x = torch.randn(40, 256, generator=g)
    keys = torch.randn(50, 64, generator=g)
    q = torch.randn(40, 4, 64, generator=g)
    wo = torch.randn(2, 8, 64, generator=g)
    o = torch.randn(40, 2, 64, generator=g)
    with torch.inference_mode(), batch_invariant_mode():
        assert not _rows_differ(lambda a: F.linear(a, w, None), x)
        assert not _rows_differ(lambda a: a @ w.T, x)
        assert not _rows_differ(lambda a: torch.addmm(torch.ones(1024), a, w.T), x)
        assert not _rows_differ(lambda a: torch.einsum("nhd,ed->nhe", a, keys), q)
        assert not _rows_differ(lambda a: torch.einsum("tgd,grd->tgr", a, wo), o)
        y = F.linear(x, w)
    assert torch.allclose(y, F.linear(x, w), atol=1e-4)   # same math, other rounding order
