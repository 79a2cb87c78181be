"""hc_post fused with the next sublayer's mixes (kernels/triton_mhc_fused.py) on the GPU: against the two
kernels it replaces at the same launch constants (the residual streams and the collapsed input bit for
bit, the mixes within fp32 rounding of the MMA's operand path), against the two references, at decode and
prefill sizes and the model's width; batch-invariant rows. The CPU side: interpret_checks.check_mhc_fused."""

import pytest
import torch

from kernel_utils import rel_err


def _case(T, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    y, res = r(T, d).bfloat16(), r(T, 4, d).bfloat16()
    post = torch.rand(T, 4, device="cuda", generator=g) * 2
    comb = torch.rand(T, 4, 4, device="cuda", generator=g)
    fn = r(24, 4 * d) * 0.01
    scale, base = torch.rand(3, device="cuda", generator=g) + 0.5, r(24) * 0.3
    pre_prev = torch.rand(T, 4, device="cuda", generator=g)
    return y, res, post, comb, fn, scale, base, pre_prev


@pytest.mark.gpu
@pytest.mark.parametrize("T,d", [(1, 5120), (64, 5120), (300, 5120), (2048, 5120), (8192, 5120), (77, 256)])
@pytest.mark.parametrize("mean", [False, True])
def test_fused_equals_the_two_kernels(T, d, mean):
    from deepinfer.kernels import triton_mhc, triton_mhc_fused
    y, res, post, comb, fn, scale, base, pre_prev = _case(T, d)
    got = triton_mhc_fused.hc_post_mixes_pre(y, res, post, comb, fn, scale, base, pre_prev, 20, 1e-6, 1e-20, mean)
    out = triton_mhc.hc_post(y, res, post, comb)
    two = triton_mhc.hc_mixes_pre(out, fn, scale, base, pre_prev, 20, 1e-6, 1e-20, mean,
                                  **triton_mhc_fused.fused_variant(T, d))
    assert torch.equal(got[0], out)
    assert torch.equal(got[4], two[3])
    if mean:
        assert torch.equal(got[5], two[4])
    for a, b in zip(got[1:4], two[:3]):
        assert (a - b).abs().max().item() < 1e-5
    ref = triton_mhc_fused.hc_post_mixes_pre_ref(y, res, post, comb, fn, scale, base, pre_prev, 20, 1e-6, 1e-20)
    for a, b in zip(got[1:4], ref[1:4]):
        assert (a - b).abs().max().item() < 1e-4
    assert rel_err(got[0], ref[0]) < 1e-2 and rel_err(got[4], ref[4]) < 1e-2


@pytest.mark.gpu
def test_fused_batch_invariant_rows():
    """Batch-invariant mode: a token's outputs do not depend on the rows beside it."""
    from deepinfer.kernels import triton_mhc_fused
    args = _case(300, 5120, seed=1)
    whole = triton_mhc_fused.hc_post_mixes_pre(*args, 20, 1e-6, 1e-20, batch_invariant=True)
    part = triton_mhc_fused.hc_post_mixes_pre(*(a[:17] if a.shape[0] == 300 else a for a in args), 20, 1e-6,
                                              1e-20, batch_invariant=True)
    for a, b in zip(whole, part):
        assert torch.equal(a[:17], b)
