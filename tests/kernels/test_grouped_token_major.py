"""select.grouped_mm_token_major (wo_a's block-diagonal GEMM): the einsum "tgd,grd->tgr" (bit for bit on a
CPU, which keeps the einsum; on a GPU within the GEMM's rounding, written token-major by the GEMM with no
transposing copy), and token by token in batch-invariant mode."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import select
from deepinfer.kernels.batch_invariant import batch_invariant_mode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,g,n,k", [(1, 2, 8, 16), (7, 4, 24, 48), (70, 8, 32, 96), (129, 3, 40, 56)])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_equals_the_einsum(m, g, n, k, dtype, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator().manual_seed(m * 31 + g)
    x = torch.randn(m, g, k, generator=gen).to(dtype).to(device)
    w = torch.randn(g, n, k, generator=gen).to(dtype).to(device)
    y = select.grouped_mm_token_major(x, w)
    want = torch.einsum("tgd,grd->tgr", x, w)
    assert y.shape == (m, g, n) and y.is_contiguous() and y.dtype == dtype
    if device == "cpu":
        assert torch.equal(y, want)
    else:       # cuBLAS may pick another kernel for the strided output: one rounding of the output
        torch.testing.assert_close(y.float(), want.float(), rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-5 * k)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_token_major_view_of_the_step(device):
    """The attention hands a view ([T, H, D] flattened and regrouped): same bits as a contiguous copy."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    o = torch.randn(9, 8, 12, device=device)
    x = o.flatten(1).unflatten(-1, (4, -1))
    w = torch.randn(4, 5, 24, device=device)
    assert torch.equal(select.grouped_mm_token_major(x, w), select.grouped_mm_token_major(x.contiguous(), w))


def test_batch_invariant_mode_rows_alone():
    """In batch-invariant mode a token's rows do not depend on the tokens beside it."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(33, 4, 64, generator=gen)
    w = torch.randn(4, 48, 64, generator=gen)
    with batch_invariant_mode():
        whole = select.grouped_mm_token_major(x, w)
        one = select.grouped_mm_token_major(x[5:6], w)
    assert torch.equal(whole[5:6], one)
