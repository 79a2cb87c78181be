"""kernels/triton_hc_collapse.py: the last mHC collapse + final RMSNorm in one kernel gives rms_norm_kernel's
bits on the collapse the layers' mixes kernel makes (hc_mixes_pre's y, the same `y += p * x` form), over
gathered and all rows, hc 1 / 2 / 4, widths that are and are not powers of two; and stays within a bf16 step
of the torch form (Block.hc_pre then RMSNorm). On the GPU (-m gpu) and under Triton's interpreter on the CPU."""

import os

import pytest
import torch
from kernel_utils import run_under_interpreter

# (rows T, hc, d, gathered rows n or None)
SHAPES = [(6, 4, 256, 3), (70, 4, 1280, None), (5, 2, 96, 5), (9, 1, 512, 2), (33, 4, 5120, 7), (1, 4, 4096, None)]


def _case(T, hc, d, n, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, hc, d, generator=g) * torch.exp2(torch.randint(-4, 4, (T, hc, 1), generator=g).float()))
    pre = torch.rand(T, hc, generator=g) * 2 - 0.5
    rows = None if n is None else torch.randperm(T, generator=g)[:n]
    w = torch.rand(d, generator=g) + 0.5
    return (x.to(torch.bfloat16).to(device), pre.to(device), None if rows is None else rows.to(device),
            w.to(device))


def check(device, shapes=SHAPES):
    from deepinfer.kernels import triton_mhc, triton_norm
    from deepinfer.kernels.reference import rms_norm_ref
    from deepinfer.kernels.triton_hc_collapse import hc_pre_norm, shape_ok
    for seed, (T, hc, d, n) in enumerate(shapes):
        x, pre, rows, w = _case(T, hc, d, n, device, seed)
        got = hc_pre_norm(x, pre, rows, w, 1e-6)
        xs, ps = (x, pre) if rows is None else (x[rows], pre[rows])
        if hc == 4 and d % 64 == 0:      # the layers' collapse (mixes kernel) on the same rows: the same bits
            mix = (2 + hc) * hc
            y = triton_mhc.hc_mixes_pre(xs.contiguous(), torch.zeros(mix, hc * d, device=device),
                                        torch.ones(3, device=device), torch.zeros(mix, device=device),
                                        ps.contiguous(), 2, 1e-6, 1e-6)[3]
            assert torch.equal(got.view(torch.int16), triton_norm.rms_norm(y, w, 1e-6).view(torch.int16)), (T, d)
        torch_form = rms_norm_ref((ps.unsqueeze(-1) * xs.float()).sum(dim=1).to(torch.bfloat16), w, 1e-6)
        step = torch_form.float().abs() * 2 ** -7 + 1e-6          # one bf16 step of the collapse, carried
        assert ((got.float() - torch_form.float()).abs() <= 2 * step).all(), (T, hc, d)
        assert got.shape == (T if rows is None else n, d)
    assert not shape_ok(x.float(), pre, w) and not shape_ok(x, pre.double(), w)


def test_select_form_is_the_torch_form():
    """select.hc_pre_norm off the GPU is RMSNorm(Block.hc_pre(x[rows], pre[rows])), bit for bit."""
    from deepinfer.kernels import select
    from deepinfer.model.block import Block
    from deepinfer.kernels.reference import rms_norm_ref
    x, pre, rows, w = _case(12, 4, 192, 5, "cpu", 3)
    assert torch.equal(select.hc_pre_norm(x, pre, rows, w, 1e-6),
                       rms_norm_ref(Block.hc_pre(x[rows], pre[rows]), w, 1e-6))


@pytest.mark.gpu
def test_hc_pre_norm_cuda():
    check("cuda", SHAPES + [(128, 4, 7168, None), (256, 4, 5120, 64)])


def test_hc_pre_norm_interpreter():
    run_under_interpreter(__file__)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check("cpu")
    print("hc_pre + norm: ok")
