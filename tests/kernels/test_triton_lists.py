"""kernels/triton_lists.py on the GPU: pool_lists equals its reference's integers (the interpreter runs the
same check on the CPU: interpret_checks.check_pool_lists)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T,Lw,K,epb", [(1, 128, 512, 64), (64, 128, 512, 64), (128, 128, 512, 32), (9, 5, 3, 2)])
def test_pool_lists(T, Lw, K, epb):
    from deepinfer.kernels.reference import pool_lists_ref
    from deepinfer.kernels.triton_lists import pool_lists
    g = torch.Generator().manual_seed(T + K)
    win_len = torch.randint(0, Lw + 1, (T,), generator=g)
    win = torch.where(torch.arange(Lw)[None, :] < win_len[:, None], torch.randint(0, 10**6, (T, Lw), generator=g), -1)
    topk = torch.randint(-1, 8192, (T, K), generator=g)
    bt = torch.randint(-1, 4000, (T, 8192 // epb + 1), generator=g)
    seq = torch.arange(T)
    for dtype in (torch.int64, torch.int32):         # int32: StepMetadata.window_pool's lists
        args = [t.cuda() for t in (win.to(dtype), win_len, topk, seq, bt)]
        got, want = pool_lists(*args, epb, 123456), pool_lists_ref(*args, epb, 123456)
        assert got.dtype == want.dtype == dtype and torch.equal(got, want)
