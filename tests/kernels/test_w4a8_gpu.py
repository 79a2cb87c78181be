"""W4A8 on the GPU (kernels/triton_w4a8.py): the compiled kernel (its PTX decode, the FP8 wgmma's register A operand
and the permuted activation K order, which only a GPU runs) against the reference. The CPU side (interpreter,
d rule, the PTX emulated, the sm_90a K loop): test_w4a8.py."""

import pytest
import torch

pytestmark = pytest.mark.gpu

SHAPES = [(6, 16, 4608, 5120), (6, 64, 5120, 2304), (3, 8, 96, 160), (4, 40, 200, 320), (2, 132, 1056, 1024)]


def _sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("W4A8 needs an SM90 GPU")


def _operands(G, C, N, K, seed, ternary=False, lo=124):
    """FP4 stack (kernel form) + e4m3 slab with transposed scales; ternary / integer-valued activations
    (every partial sum exact in fp32, so any summation order gives the reference's bits), block bytes lo..128."""
    from deepinfer.kernels import reference as R
    from deepinfer.kernels.fp4_layout import fp4_kernel_weight
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (G, N, K // 2), generator=gen).to(torch.uint8)
    scale = torch.randint(lo, 129, (G, N, K // 32), generator=gen).to(torch.uint8)
    scale[torch.rand(scale.shape, generator=gen) < 0.03] = 0
    x = (torch.randint(-1, 2, (G * C, K), generator=gen) if ternary else
         torch.randint(-4, 5, (G * C, K), generator=gen)).float()
    q, s = R.act_quant_fp8_ref(x)
    ld = R.slab_scales_ld(G, C)
    sat = torch.zeros(K // 32, ld)
    sat[:, :G * C] = s.T
    pk, sk = fp4_kernel_weight(packed, scale)
    w = torch.stack([R.dequant_fp4_ref(packed[i], scale[i]) for i in range(G)]).double()
    ref = torch.einsum("gck,gnk->gcn", x.view(G, C, K).double(), w)
    return q.view(G, C, K).cuda(), sat.cuda(), pk.cuda(), sk.cuda(), ref


@pytest.mark.parametrize("ternary", [True, False])
@pytest.mark.parametrize("G,C,N,K", SHAPES)
def test_w4a8_exact_integer_valued(G, C, N, K, ternary):
    """bf16(x @ w^T) bit for bit on integer-valued data at select's config (split-K where the grid is small),
    with busy and empty experts (masked_m 0 .. C)."""
    _sm90()
    from deepinfer.kernels import triton_w4a8 as tw
    a, sat, pk, sk, ref = _operands(G, C, N, K, seed=N + K + C, ternary=ternary)
    mm = torch.linspace(0, C, G).round().int().flip(0).contiguous()
    for em in (1, max(1, C // 2), C):
        y = tw.w4a8_masked_moe_gemm(a, sat, pk, sk, mm.cuda(), em).cpu()
        for g, r in enumerate(mm.tolist()):
            assert torch.equal(y[g, :r], ref[g, :r].to(torch.bfloat16)), (em, g)


def test_w4a8_random_within_fp8_mma_bound():
    """Random activations (act_quant_fp8 of normals) and MXFP4 experts with block scales spread over 9 binades:
    within the FP8 MMA's accumulation error of the float64 reference, and equal to the FP8 x FP8 reference of an
    FP8 stack of the same values (fp8_masked_moe_gemm_ref) to the same bound."""
    _sm90()
    from deepinfer.kernels import reference as R
    from deepinfer.kernels import triton_w4a8 as tw
    from deepinfer.kernels.fp4_layout import fp4_kernel_weight
    G, C, N, K = 8, 32, 2048, 2304
    gen = torch.Generator().manual_seed(7)
    packed = torch.randint(0, 256, (G, N, K // 2), generator=gen).to(torch.uint8)
    scale = torch.randint(112, 121, (G, N, K // 32), generator=gen).to(torch.uint8)
    x = torch.randn(G * C, K, generator=gen)
    q, s = R.act_quant_fp8_ref(x)
    sat = torch.zeros(K // 32, R.slab_scales_ld(G, C))
    sat[:, :G * C] = s.T
    pk, sk = fp4_kernel_weight(packed, scale)
    mm = torch.randint(0, C + 1, (G,), generator=gen).int()
    y = tw.w4a8_masked_moe_gemm(q.view(G, C, K).cuda(), sat.cuda(), pk.cuda(), sk.cuda(), mm.cuda(), 8).cpu()
    xf = (q.float() * s.repeat_interleave(32, -1)).view(G, C, K).double()
    for g, r in enumerate(mm.tolist()):
        if r:
            ref = xf[g, :r] @ R.dequant_fp4_ref(packed[g], scale[g]).double().T
            err = ((y[g, :r].double() - ref).norm() / ref.norm()).item()
            assert err < 4e-3, (g, err)


def test_w4a8_under_cuda_graph():
    """Captured, then replayed with new masked_m and new activations copied in: the eager result on those inputs
    (no host read of masked_m)."""
    _sm90()
    from deepinfer.kernels import triton_w4a8 as tw
    a, sat, pk, sk, _ = _operands(4, 16, 512, 1024, seed=3)
    a2, sat2, *_ = _operands(4, 16, 512, 1024, seed=4)
    mm = torch.tensor([16, 3, 0, 5], dtype=torch.int32, device="cuda")
    out = tw.w4a8_masked_moe_gemm(a, sat, pk, sk, mm, 4)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = tw.w4a8_masked_moe_gemm(a, sat, pk, sk, mm, 4)
    a.copy_(a2)
    sat.copy_(sat2)
    mm.copy_(torch.tensor([2, 16, 9, 0], dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    want = tw.w4a8_masked_moe_gemm(a, sat, pk, sk, mm, 4)
    for e, r in enumerate(mm.tolist()):
        assert torch.equal(out[e, :r], want[e, :r]), e


def test_w4a8_split_k_and_decline():
    """A small grid takes split-K (the fp32 workspace reduced in split order): the same bits as one split on
    integer-valued data; a stack breaking the d rule raises with the rule."""
    _sm90()
    from deepinfer.kernels import triton_w4a8 as tw
    a, sat, pk, sk, ref = _operands(2, 8, 256, 2048, seed=9)
    mm = torch.tensor([8, 5], dtype=torch.int32, device="cuda")
    y1 = tw.w4a8_masked_moe_gemm(a, sat, pk, sk, mm, 4, cfg_override={"SPLIT_K": 1})
    y4 = tw.w4a8_masked_moe_gemm(a, sat, pk, sk, mm, 4, cfg_override={"SPLIT_K": 4})
    for g, r in enumerate(mm.tolist()):
        assert torch.equal(y1[g, :r], y4[g, :r]) and torch.equal(y1[g, :r].cpu(), ref[g, :r].to(torch.bfloat16))
    sk2 = sk.clone()
    sk2[0, 0, 0] = 128
    sk2[0, 0, 1] = 100
    assert "binades" in tw.w4a8_decline_reason(pk, sk2, pk.device)
    with pytest.raises(ValueError, match="binades"):
        tw.w4a8_masked_moe_gemm(a, sat, pk, sk2, mm, 4)
