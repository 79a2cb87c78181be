import pytest
import torch

from deepinfer.kernels.reference import act_quant_ref, dequant_fp4_ref, dequant_fp8_ref

from kernel_utils import rand_fp8_weight, rel_err

pytestmark = pytest.mark.gpu


def _ref_linear(x, w, s):
    return torch.nn.functional.linear(act_quant_ref(x).float(), dequant_fp8_ref(w, s)).bfloat16()


@pytest.mark.parametrize("m", [1, 16, 64, 100, 512])
@pytest.mark.parametrize("n,k", [(1280, 5120), (512, 5120), (5120, 2304)])
@pytest.mark.parametrize("bi", [False, True])
def test_fp8_linear(m, n, k, bi):
    from deepinfer.kernels.triton_gemm import fp8_linear
    w, s = rand_fp8_weight(n, k, "cuda", seed=m + n)
    x = torch.randn(m, k, device="cuda").bfloat16()
    y = fp8_linear(x, w, s, batch_invariant=bi)
    assert rel_err(y, _ref_linear(x, w, s)) < 2e-3


def test_batch_invariant_rows():
    """batch_invariant=True: a row's output does not depend on how many rows are in the batch."""
    from deepinfer.kernels.triton_gemm import fp8_linear
    w, s = rand_fp8_weight(1280, 5120, "cuda")
    x = torch.randn(128, 5120, device="cuda").bfloat16()
    full = fp8_linear(x, w, s, batch_invariant=True)
    for m in (1, 7, 64):
        assert torch.equal(fp8_linear(x[:m], w, s, batch_invariant=True), full[:m])


@pytest.mark.parametrize("m,n,k", [(1, 1280, 5120), (64, 5120, 2304), (300, 512, 1280)])
def test_fp8xfp8_gemm_per32_promotion(m, n, k):
    """The FP8 x FP8 kernel (tensor-core dot per 32 K, scaled and added in fp32)."""
    from deepinfer.kernels.reference import e8m0_to_float
    from deepinfer.kernels.triton_gemm import fp8_gemm
    from deepinfer.kernels.triton_quant import act_quant_fp8
    w, s = rand_fp8_weight(n, k, "cuda", seed=7)
    x = torch.randn(m, k, device="cuda").bfloat16()
    q, sa = act_quant_fp8(x)
    assert rel_err(fp8_gemm(q, sa, w, e8m0_to_float(s)), _ref_linear(x, w, s)) < 2e-3


@pytest.mark.parametrize("expected_m", [4, 32])
@pytest.mark.parametrize("kind", ["w8a16", "fp8"])
def test_grouped_masked_fp4_experts(expected_m, kind):
    from deepinfer.kernels.triton_gemm import fp4_to_fp8_weight, fp8_grouped_gemm_masked, w8a16_grouped_gemm_masked
    from deepinfer.kernels.triton_quant import act_quant, act_quant_fp8
    G, mmax, n, k = 6, 64, 512, 1024
    packed = torch.randint(0, 256, (G, n, k // 2), dtype=torch.uint8, device="cuda")
    sc = torch.randint(118, 124, (G, n, k // 32), dtype=torch.uint8, device="cuda")
    ws = [fp4_to_fp8_weight(packed[g], sc[g]) for g in range(G)]
    w8, s8 = torch.stack([a for a, _ in ws]), torch.stack([b for _, b in ws])
    x = torch.randn(G, mmax, k, device="cuda").bfloat16()
    q, s = act_quant_fp8(x.view(-1, k))
    mm = torch.randint(0, 2 * expected_m, (G,), device="cuda").clamp_max(mmax).int()
    d = torch.empty((G, mmax, n), device="cuda", dtype=torch.bfloat16)
    if kind == "fp8":
        fp8_grouped_gemm_masked(q.view(G, mmax, k), s.view(G, mmax, k // 32), w8, s8, mm, expected_m, out=d)
    else:
        w8a16_grouped_gemm_masked(act_quant(x), w8, s8, mm, expected_m, out=d)
    for g in range(G):
        r = int(mm[g])
        if r:
            ref = torch.nn.functional.linear(act_quant_ref(x[g, :r]).float(), dequant_fp4_ref(packed[g], sc[g]))
            assert rel_err(d[g, :r], ref) < 2e-3
