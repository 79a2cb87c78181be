import pytest
import torch

from deepinfer.kernels.reference import act_quant_ref, fp4_quant_ref

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(1, 5120), (64, 1280), (257, 512), (3, 7, 128), (4096, 2304)])
def test_act_quant_bit_exact(shape):
    from deepinfer.kernels.triton_quant import act_quant, act_quant_fp8
    x = (torch.randn(shape, device="cuda") * torch.exp(3 * torch.randn(*shape[:-1], 1, device="cuda"))).bfloat16()
    x.view(-1)[:40] = 0                      # an all-zero block hits the 1e-4 amax floor
    ref = act_quant_ref(x)
    assert torch.equal(act_quant(x), ref)
    q, s = act_quant_fp8(x)
    deq = (q.float().view(-1, shape[-1] // 32, 32) * s[..., None]).view(ref.shape).bfloat16()
    assert torch.equal(deq, ref)


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("shape", [(1, 512), (33, 512), (64, 32, 128)])
def test_fp4_quant_bit_exact(shape, block):
    """Rows spread over ~10 binades, within the block-16 scale's range: an amax above 6 * 448 makes the
    reference's e4m3 cast NaN where the kernel's saturating cvt gives 448 (an unbounded spread reached it
    now and then at the largest shape: a flaky failure in the H200 run of 2026-12-01)."""
    from deepinfer.kernels.triton_quant import fp4_quant
    g = torch.Generator(device="cuda").manual_seed(sum(shape) + block)
    spread = torch.exp(2 * torch.randn(*shape[:-1], 1, device="cuda", generator=g)).clamp_max(300)
    x = (torch.randn(shape, device="cuda", generator=g) * spread).bfloat16()
    assert torch.equal(fp4_quant(x, block), fp4_quant_ref(x, block))
