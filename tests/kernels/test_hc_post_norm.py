"""kernels/triton_hc_post_norm.py: a sublayer's hc_post and the next sublayer's collapse + RMSNorm (+ act_quant) in
one kernel give the three kernels' bits (hc_post_kernel's streams; the mixes kernel's collapse of them with the
pre-mix; rms_norm_kernel / its QUANT tail on that), at widths that are and are not powers of two and token
counts off the tiles; and stay within a bf16 step of the torch form (Block.hc_post, hc_pre, RMSNorm). On the
GPU (-m gpu) and under Triton's interpreter on the CPU."""

import os

import pytest
import torch
from kernel_utils import run_under_interpreter

# (tokens T, d)
SHAPES = [(6, 256), (3, 64), (17, 1280), (2, 5120), (1, 4096), (5, 192)]


def _case(T, d, device, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(T, d, generator=g) * 3
    res = torch.randn(T, 4, d, generator=g) * torch.exp2(torch.randint(-3, 3, (T, 4, 1), generator=g).float())
    post = torch.rand(T, 4, generator=g) * 2
    comb = torch.rand(T, 4, 4, generator=g)
    pre = torch.rand(T, 4, generator=g) * 2 - 0.5
    w = torch.rand(d, generator=g) + 0.5
    return (y.bfloat16().to(device), res.bfloat16().to(device), post.to(device), comb.to(device), pre.to(device),
            w.to(device))


def _bits(t):
    return t.view(torch.int16)


def check(device, shapes=SHAPES):
    from deepinfer.kernels import triton_mhc, triton_norm
    from deepinfer.kernels.reference import hc_post_ref, hc_pre_ref, rms_norm_ref
    from deepinfer.kernels.triton_hc_post_norm import hc_post_norm, shape_ok
    for seed, (T, d) in enumerate(shapes):
        y, res, post, comb, pre, w = _case(T, d, device, seed)
        for quant in (False, True):
            out, xn, xq, mean = hc_post_norm(y, res, post, comb, pre, w, 1e-6, quant, mean=True)
            # the three kernels it replaces, on the same inputs
            want_out = triton_mhc.hc_post(y, res, post, comb)
            assert torch.equal(_bits(out), _bits(want_out)), (T, d, "streams")
            if d % 64 == 0:          # the mixes kernel's collapse and mean (its 64-wide chunks)
                mix = 24
                _, _, _, coll, want_mean = triton_mhc.hc_mixes_pre(
                    want_out, torch.zeros(mix, 4 * d, device=device), torch.ones(3, device=device),
                    torch.zeros(mix, device=device), pre, 2, 1e-6, 1e-6, mean=True)
                assert torch.equal(_bits(mean), _bits(want_mean)), (T, d, "mean")
            else:
                coll = hc_pre_ref(want_out, pre)
                assert torch.equal(mean, want_out.mean(dim=1)), (T, d, "mean")
            assert len(hc_post_norm(y, res, post, comb, pre, w, 1e-6, quant)) == 3
            if quant:
                want_xn, want_xq = triton_norm.rms_norm_quant(coll, w, 1e-6)
                assert torch.equal(_bits(xq), _bits(want_xq)), (T, d, "act_quant")
            else:
                want_xn = triton_norm.rms_norm(coll, w, 1e-6)
                assert xq is None
            assert torch.equal(_bits(xn), _bits(want_xn)), (T, d, "norm")
        # the torch form: the streams within a bf16 step of their terms' size, the norm of the same streams
        # within a few bf16 steps (fp32 sums in another order, then roundings)
        torch_out = hc_post_ref(y, res, post, comb)
        size = post.unsqueeze(-1) * y.float().abs().unsqueeze(1) + (comb.unsqueeze(-1) * res.float().abs().unsqueeze(2)).sum(1)
        assert ((out.float() - torch_out.float()).abs() <= size * 2 ** -7 + 1e-6).all(), (T, d)
        torch_xn = rms_norm_ref(hc_pre_ref(out, pre), w, 1e-6)
        step = torch_xn.float().abs() * 2 ** -7 + 1e-6
        assert ((xn.float() - torch_xn.float()).abs() <= 3 * step).all(), (T, d)
    assert not shape_ok(y.float(), res, post, comb, pre, w)
    assert not shape_ok(y, res[:, :2], post[:, :2], comb[:, :2, :2], pre[:, :2], w)      # hc 2
    assert not shape_ok(y[:, :-1], res[..., :-1], post, comb, pre, w[:-1], quant=True)   # d % 32 with quant


def test_select_form_is_the_ops_form():
    """select.hc_post_norm off the GPU is hc_post, Block.hc_pre and the norm (with_rounded's), bit for bit."""
    from deepinfer.kernels import select
    from deepinfer.kernels.reference import act_quant_ref, rms_norm_ref
    from deepinfer.model.block import Block
    y, res, post, comb, pre, w = _case(7, 192, "cpu", 4)
    out, xn, xq, mean = select.hc_post_norm(y, res, post, comb, pre, w, 1e-6, quant=True, mean=True)
    want_out = select.hc_post(y, res, post, comb)
    assert torch.equal(out, want_out)
    assert torch.equal(mean, want_out.mean(dim=1))
    assert torch.equal(xn, rms_norm_ref(Block.hc_pre(want_out, pre), w, 1e-6))
    assert torch.equal(xq, act_quant_ref(xn))
    assert select.hc_post_norm(y, res, post, comb, pre, w, 1e-6)[2] is None


@pytest.mark.gpu
def test_hc_post_norm_cuda():
    check("cuda", SHAPES + [(64, 5120), (128, 7168), (513, 5120), (40, 96)])


def test_hc_post_norm_interpreter():
    run_under_interpreter(__file__)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check("cpu")
    print("hc_post + collapse + norm: ok")
