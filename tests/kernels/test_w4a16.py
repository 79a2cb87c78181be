"""W4A16 on the GPU: packed MXFP4 weights (triton_gemm.fp4_kernel_weight's layout) decoded in the K loop
(triton_gemm._FP4_ASM) against reference.dequant_fp4_ref + a float64 matmul. The PTX itself is checked bit
for bit on the CPU (test_interpret.py, an emulator of its instructions); here the compiled kernel, whose
register layouts and scale broadcast only a GPU runs, on shapes beyond the release's (N, K off every tile)."""

import pytest
import torch

from kernel_utils import rel_err, w4a16_exact_case

pytestmark = pytest.mark.gpu

SHAPES = [(1, 4608, 5120), (16, 5120, 2304), (64, 96, 160), (5, 2112, 288), (128, 1056, 5120), (300, 640, 1024)]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_w4a16_dense_exact(m, n, k):
    """Integer-valued products (w4a16_exact_case): bf16(x @ w^T) bit for bit under select's own config
    (swapped tiles and split-K at decode sizes, plain tiles above 128 rows)."""
    from deepinfer.kernels import triton_gemm
    x, packed, scale, ref = w4a16_exact_case(1, m, n, k, seed=m + n, device="cuda")
    y = triton_gemm.w4a16_gemm(x[0], packed[0].cuda(), scale[0].cuda())
    assert torch.equal(y, ref[0].to(torch.bfloat16))


@pytest.mark.parametrize("expected_m", [1, 4, 16, 64])
def test_w4a16_masked_matches_reference(expected_m):
    """The masked MoE form on random MXFP4 experts (every nibble, scales 2^-10..2^0) and act_quant-rounded
    activations: within fp32-summation error of the float64 reference (rows past masked_m are the masked
    layout's padding: the split-K reduce writes them as zeros, as the FP8 form does)."""
    from deepinfer.kernels import triton_gemm
    from deepinfer.kernels.reference import act_quant_ref, dequant_fp4_ref
    g, n, k = 6, 1024, 2304
    gen = torch.Generator().manual_seed(expected_m)
    packed = torch.randint(0, 256, (g, n, k // 2), generator=gen).to(torch.uint8)
    scale = torch.randint(117, 128, (g, n, k // 32), generator=gen).to(torch.uint8)
    mmax = max(expected_m * 2, 4)
    x = act_quant_ref(torch.randn(g, mmax, k, generator=gen).bfloat16())
    mm = torch.randint(0, mmax + 1, (g,), generator=gen).to(torch.int32)
    pk, sk = triton_gemm.fp4_kernel_weight(packed, scale)
    y = triton_gemm.w4a16_grouped_gemm_masked(x.cuda(), pk.cuda(), sk.cuda(), mm.cuda(), expected_m)
    for i in range(g):
        r = int(mm[i])
        ref = x[i, :r].double() @ dequant_fp4_ref(packed[i], scale[i]).double().T
        if r:
            assert rel_err(y[i, :r].cpu(), ref) < 4e-3


def test_w4a16_under_cuda_graph():
    """Captured and replayed (the decode step's graphs) with new inputs copied in: the eager result."""
    from deepinfer.kernels import triton_gemm
    x, packed, scale, _ = w4a16_exact_case(4, 8, 512, 1024, seed=3, device="cuda")
    packed, scale = packed.cuda(), scale.cuda()
    mm = torch.tensor([8, 3, 0, 5], dtype=torch.int32, device="cuda")
    xs = x.clone()
    triton_gemm.w4a16_grouped_gemm_masked(xs, packed, scale, mm, 4)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = triton_gemm.w4a16_grouped_gemm_masked(xs, packed, scale, mm, 4)
    x2 = torch.randint(-4, 5, x.shape, device="cuda").bfloat16()
    xs.copy_(x2)
    g.replay()
    want = triton_gemm.w4a16_grouped_gemm_masked(x2, packed, scale, mm, 4)
    for i, r in enumerate(mm.tolist()):
        assert torch.equal(y[i, :r], want[i, :r])


def test_fp4_scales_ok_declines_large_block_scales():
    from deepinfer.kernels import triton_gemm
    s = torch.full((4, 8), 120, dtype=torch.uint8, device="cuda")
    assert triton_gemm.fp4_scales_ok(s)
    s[2, 3] = 129
    assert not triton_gemm.fp4_scales_ok(s)
    s[2, 3] = 1                      # 0.5 * 2^-126 would be a subnormal bf16
    assert not triton_gemm.fp4_scales_ok(s)


@pytest.mark.parametrize("n,k", [(4608, 5120), (5120, 2304), (37, 96), (300, 1056)])
def test_dequant_fp4_matches_reference(n, k):
    """The FP4 stacks' prefill dequant (triton_dequant.dequant_fp4_bf16) gives every release weight bit for
    bit (zero blocks, scales 2^-125..2, N and K off its tiles)."""
    from deepinfer.kernels import triton_gemm
    from deepinfer.kernels.reference import dequant_fp4_ref
    from deepinfer.kernels.triton_dequant import dequant_fp4_bf16
    gen = torch.Generator().manual_seed(n + k)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen).to(torch.uint8)
    scale = torch.randint(2, 129, (n, k // 32), generator=gen).to(torch.uint8)
    scale[torch.rand(scale.shape, generator=gen) < 0.02] = 0
    pk, sk = triton_gemm.fp4_kernel_weight(packed, scale)
    got = dequant_fp4_bf16(pk.cuda(), sk.cuda())
    assert torch.equal(got.float().cpu(), dequant_fp4_ref(packed, scale))


CONTIGUOUS_CFGS = [None, dict(BM=64, BN=64, BK=32, NUM_STAGES=3, num_warps=4),
                   dict(BM=128, BN=128, BK=64, NUM_STAGES=4, num_warps=8),
                   dict(BM=256, BN=128, BK=64, NUM_STAGES=3, num_warps=8),
                   dict(BM=128, BN=64, BK=128, NUM_STAGES=3, num_warps=4)]


@pytest.mark.parametrize("cfg", CONTIGUOUS_CFGS)
@pytest.mark.parametrize("n,k", [(200, 256), (4608, 5120), (96, 160)])
def test_w4a16_contiguous_exact(cfg, n, k):
    """The FP4 stacks' prefill GEMM (triton_fp4_contiguous: packed bytes decoded in the K loop) on integer-valued
    operands: bf16(x @ w^T) bit for bit, each row through its own expert (empty experts, an expert's rows over
    several tiles and ending mid-tile, N and K off the tiles)."""
    from deepinfer.kernels import triton_gemm
    from deepinfer.kernels.reference import dequant_fp4_ref
    from deepinfer.kernels.triton_fp4_contiguous import w4a16_grouped_contiguous
    if cfg is not None and k % cfg["BK"]:
        pytest.skip("BK must divide K")
    counts = torch.tensor([70, 0, 3, 300, 0, 129], dtype=torch.int32)
    e, p = counts.numel(), int(counts.sum())
    xg, packed, scale, _ = w4a16_exact_case(e, p, n, k, seed=n + k)
    w = torch.stack([dequant_fp4_ref(triton_gemm.fp4_release_layout(packed[i]), scale[i]) for i in range(e)])
    expert = torch.repeat_interleave(torch.arange(e), counts.long())
    ref = torch.cat([xg[0][expert == i].double() @ w[i].double().T for i in range(e)]).to(torch.bfloat16)
    y = w4a16_grouped_contiguous(xg[0].cuda(), packed.cuda(), scale.cuda(), counts.cuda(), cfg)
    assert torch.equal(y.cpu(), ref)


@pytest.mark.parametrize("w4a16_max_rows", [None, 0])
@pytest.mark.parametrize("rows", [300, 20000])
def test_fp4_stacks_contiguous_form(rows, w4a16_max_rows, monkeypatch):
    """The MoE's grouped contiguous form on FP4 stacks (select.grouped_fp8_linear_contiguous with uint8
    weights: up to FP4_W4A16_MAX_ROWS_PER_EXPERT rows an expert the W4A16 contiguous GEMM, else the stack
    dequantized by dequant_fp4_bf16 and one bf16 grouped GEMM; max rows 0: always the latter) against a float64
    reference expert by expert (empty experts, rows off every tile)."""
    from deepinfer.kernels import select, triton_gemm
    from deepinfer.kernels.reference import act_quant_ref, dequant_fp4_ref
    if w4a16_max_rows is not None:
        monkeypatch.setattr(select, "FP4_W4A16_MAX_ROWS_PER_EXPERT", w4a16_max_rows)
    e, n, k = 6, 512, 1024
    gen = torch.Generator().manual_seed(rows)
    packed = torch.randint(0, 256, (e, n, k // 2), generator=gen).to(torch.uint8)
    scale = torch.randint(117, 124, (e, n, k // 32), generator=gen).to(torch.uint8)
    pk, sk = triton_gemm.fp4_kernel_weight(packed, scale)
    pick = torch.multinomial(torch.tensor([3., 0, 1, 2, 1, 3]), rows, replacement=True, generator=gen)
    counts = torch.bincount(pick, minlength=e).to(torch.int32)
    x = act_quant_ref(torch.randn(rows, k, generator=gen).bfloat16())
    y = select.grouped_fp8_linear_contiguous(x.cuda(), pk.cuda(), sk.cuda(), counts.cuda()).cpu()
    start = 0
    for i, c in enumerate(counts.tolist()):
        if c:
            ref = x[start:start + c].double() @ dequant_fp4_ref(packed[i], scale[i]).double().T
            assert rel_err(y[start:start + c], ref) < 4e-3, i
        start += c
