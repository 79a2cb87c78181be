"""kernels/triton_norm.py rms_norm_quant: the norm and its act_quant rounding from one launch give the two
kernels' bits (rms_norm's rows, act_quant of them) on strided rows, widths that are and are not powers of two,
and row counts off the tile; select.rms_norm_quant declines a width the rounding cannot group. On the GPU
(-m gpu) and under Triton's interpreter on the CPU (a subprocess: TRITON_INTERPRET is read at import)."""

import os

import pytest
import torch
from kernel_utils import run_under_interpreter

# (rows, width): the model's widths (dim 4096 / 5120 / 7168, q_lora 1024 / 1280 / 1536) and small ones
SHAPES = [(1, 4096), (5, 5120), (64, 1280), (3, 7168), (130, 1536), (17, 96), (33, 64), (2, 32)]


def _case(T, D, device, seed):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(T, D + 64, generator=g) * torch.exp2(torch.randint(-8, 8, (T, 1), generator=g).float())
    wide[:, 40:40 + D:97] *= 300.0                                     # a few large values per row
    x = wide.to(torch.bfloat16)[:, 40:40 + D]                          # a column slice: strided rows
    w = torch.rand(D, generator=g) * 2 + 0.25
    return x.to(device), w.to(device)


def check(device, shapes=SHAPES):
    from deepinfer.kernels import triton_norm, triton_quant
    from deepinfer.kernels.reference import act_quant_ref
    for seed, (T, D) in enumerate(shapes):
        x, w = _case(T, D, device, seed)
        y, q = triton_norm.rms_norm_quant(x, w, 1e-6)
        alone = triton_norm.rms_norm(x, w, 1e-6)
        assert torch.equal(y.view(torch.int16), alone.view(torch.int16)), (T, D)
        assert torch.equal(q.view(torch.int16), triton_quant.act_quant(alone).view(torch.int16)), (T, D)
        assert torch.equal(q.view(torch.int16), act_quant_ref(alone).view(torch.int16)), (T, D)
        assert y.is_contiguous() and q.is_contiguous() and q.shape == x.shape
    # a 3-D input keeps its shape; no rows gives empty outputs
    x, w = _case(6, 256, device, 99)
    y, q = triton_norm.rms_norm_quant(x.view(2, 3, 256), w, 1e-6)
    assert y.shape == q.shape == (2, 3, 256)
    assert torch.equal(q.view(6, 256), triton_quant.act_quant(triton_norm.rms_norm(x, w, 1e-6)))
    y, q = triton_norm.rms_norm_quant(x[:0], w, 1e-6)
    assert y.shape == q.shape == (0, 256)
    assert not triton_norm.quant_shape_ok(x[:, :200]) and not triton_norm.quant_shape_ok(x.float())


def test_rms_norm_quant_reference_form():
    """select.rms_norm_quant's CPU form is rms_norm then act_quant, also for a width act_quant cannot group."""
    from deepinfer.kernels import select
    from deepinfer.kernels.reference import act_quant_ref, rms_norm_ref
    x, w = _case(9, 320, "cpu", 7)
    y, q = select.rms_norm_quant(x, w, 1e-6)
    assert torch.equal(y, rms_norm_ref(x, w, 1e-6)) and torch.equal(q, act_quant_ref(y))
    assert not torch.equal(q, y)                                        # the rounding did something


@pytest.mark.gpu
def test_rms_norm_quant_cuda():
    check("cuda", SHAPES + [(8192, 4096), (2048, 5120), (257, 1280)])


def test_rms_norm_quant_interpreter():
    run_under_interpreter(__file__)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check("cpu")
    print("rms_norm + act_quant: ok")
