"""kernels/triton_lists.py on the GPU: pool_lists and window_pool equal their references' integers (the
interpreter runs the same checks on the CPU: interpret_checks.check_pool_lists, check_window_pool)."""

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


def check_window_pool(device):
    """The step's window lists in source rows: the reference's integers (ring rows through ring_read, fresh rows
    after the ring, -1 kept), for int64 and int32 lists, widths off a power of two, a step with no ring rows."""
    from deepinfer.kernels import triton_lists
    from deepinfer.kernels.reference import window_pool_ref
    g = torch.Generator().manual_seed(6)
    for T, W, R, ring_rows in ((1, 128, 127, 4096), (6, 130, 300, 2560), (4, 7, 0, 64), (64, 128, 64 * 127, 65536)):
        win = torch.randint(-1, R + T, (T, W), generator=g)
        win[0, :3] = -1
        read = torch.randint(0, ring_rows, (R,), generator=g)
        for dtype in (torch.int64, torch.int32):
            args = (win.to(dtype).to(device), read.to(device), ring_rows, T)
            got, want = triton_lists.window_pool(*args), window_pool_ref(*args)
            assert got.dtype == want.dtype == torch.int32 and torch.equal(got, want), (T, W, R, dtype)


def test_window_pool():
    check_window_pool("cuda")
