import pytest
import torch
import triton
import triton.language as tl

from deepinfer.kernels.reference import act_quant_ref, dequant_fp4_ref, dequant_fp8_ref
from deepinfer.kernels.triton_gemm import W8A16_VARIANTS, _dequant_bytes_bf16, _dequant_pair_bf16

from kernel_utils import rand_fp8_weight, rel_err, w8a16_exact_case

pytestmark = pytest.mark.gpu


@pytest.fixture(params=W8A16_VARIANTS)
def w8a16_variant(request, monkeypatch):
    """Runs the test once per W8A16 kernel variant (the module default the entry points use)."""
    from deepinfer.kernels import triton_gemm
    monkeypatch.setattr(triton_gemm, "W8A16_VARIANT", request.param)
    return request.param


def _ref_linear(x, w, s):
    return torch.nn.functional.linear(act_quant_ref(x).float(), dequant_fp8_ref(w, s)).bfloat16()


@pytest.mark.parametrize("m", [1, 16, 64, 100, 512])
@pytest.mark.parametrize("n,k", [(1280, 5120), (512, 5120), (5120, 2304)])
@pytest.mark.parametrize("bi", [False, True])
def test_fp8_linear(m, n, k, bi, w8a16_variant):
    from deepinfer.kernels.triton_gemm import fp8_linear
    w, s = rand_fp8_weight(n, k, "cuda", seed=m + n)
    x = torch.randn(m, k, device="cuda").bfloat16()
    y = fp8_linear(x, w, s, batch_invariant=bi)
    assert rel_err(y, _ref_linear(x, w, s)) < 2e-3


def test_batch_invariant_rows(w8a16_variant):
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
@pytest.mark.parametrize("kind", ["w8a16:v1", "w8a16:v2", "w8a16:v3", "w8a16:v4", "w8a16:v2:e8m0", "w8a16:v3:e8m0",
                                  "w8a16:v4:e8m0", "fp8"])
def test_grouped_masked_fp4_experts(expected_m, kind, monkeypatch):
    from deepinfer.kernels import triton_gemm
    from deepinfer.kernels.triton_gemm import fp4_to_fp8_weight, fp8_grouped_gemm_masked, w8a16_grouped_gemm_masked
    from deepinfer.kernels.triton_quant import act_quant, act_quant_fp8
    if kind != "fp8":
        monkeypatch.setattr(triton_gemm, "W8A16_VARIANT", kind.split(":")[1])
    G, mmax, n, k = 6, 64, 512, 1024
    packed = torch.randint(0, 256, (G, n, k // 2), dtype=torch.uint8, device="cuda")
    sc = torch.randint(118, 124, (G, n, k // 32), dtype=torch.uint8, device="cuda")
    ws = [fp4_to_fp8_weight(packed[g], sc[g], keep_e8m0=kind.endswith("e8m0")) for g in range(G)]
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


# --- W8A16 variants: exact products, bit for bit --------------------------------------------------------

@pytest.mark.parametrize("variant", W8A16_VARIANTS)
@pytest.mark.parametrize("e8m0", [True, False])
@pytest.mark.parametrize("rows", [32, 1])
@pytest.mark.parametrize("m,bi,split", [(1, False, None), (64, False, None), (64, False, 1), (128, False, None),
                                        (300, False, None), (64, True, None)])
def test_w8a16_variants_exact(variant, e8m0, rows, m, bi, split):
    """Dense w8a16_gemm, every variant: the bf16 output equals bf16(x @ v^T) exactly (decode/swap and
    non-swap tiles, split-K chosen by the config or off, batch-invariant tiles), and so do the fp32
    split-K partial sums."""
    from deepinfer.kernels import triton_gemm
    n, k = 1280, 5120
    x, w, s, ref = w8a16_exact_case(1, m, n, k, rows, e8m0, seed=m + rows, device="cuda")
    cfg = dict(VARIANT=variant) if split is None else dict(VARIANT=variant, SPLIT_K=split)
    full = triton_gemm.w8a16_config(m, n, k, 1, x.device, bi)
    full.update(cfg)
    assert triton_gemm.w8a16_variant(full, w[0], s[0], k) == variant
    y = triton_gemm.w8a16_gemm(x[0], w[0], s[0], batch_invariant=bi, cfg_override=cfg)
    assert torch.equal(y, ref[0].float().bfloat16())
    ws = triton_gemm.w8a16_partials(x[0], w[0], s[0], cfg_override=cfg)
    assert torch.equal(ws.double().sum(0)[0], ref[0])


@pytest.mark.parametrize("variant", W8A16_VARIANTS)
@pytest.mark.parametrize("e8m0,rows", [(True, 1), (False, 1), (True, 32), (False, 32)])
@pytest.mark.parametrize("expected_m,split", [(4, None), (32, None), (32, 1)])
def test_w8a16_grouped_masked_variants_exact(variant, e8m0, rows, expected_m, split):
    """Masked grouped form, every variant, with empty groups: rows < masked_m[g] are bf16(x @ v^T) exactly."""
    from deepinfer.kernels import triton_gemm
    G, mmax, n, k = 6, 64, 512, 1024
    x, w, s, ref = w8a16_exact_case(G, mmax, n, k, rows, e8m0, seed=expected_m + rows, device="cuda")
    mm = torch.tensor([0, 3, 64, 0, 17, 1], dtype=torch.int32, device="cuda")
    cfg = dict(VARIANT=variant) if split is None else dict(VARIANT=variant, SPLIT_K=split)
    d = torch.empty((G, mmax, n), device="cuda", dtype=torch.bfloat16)
    triton_gemm.w8a16_grouped_gemm_masked(x, w, s, mm, expected_m, out=d, cfg_override=cfg)
    for g in range(G):
        r = int(mm[g])
        assert torch.equal(d[g, :r], ref[g, :r].float().bfloat16()), g


@pytest.mark.parametrize("expected_m,split", [(4, None), (8, None), (32, None), (32, 2), (300, None)])
def test_w8a16_rows_kernel_exact_and_equal_to_v3(expected_m, split):
    """Row-scaled weights (select.row_scaled_fp8_weight) through w8a16_pairs_kernel (ROW_SCALE): rows < masked_m[g] are
    bf16(x @ v^T) exactly (dense too), and on FP4-origin experts the output equals v3's on the per-32
    form bit for bit (same products, the pow2 row factor outside the sum)."""
    from deepinfer.kernels import triton_gemm
    from deepinfer.kernels.select import row_scaled_fp8_weight
    G, mmax, n, k = 6, 320, 512, 1024
    x, w, s, ref = w8a16_exact_case(G, mmax, n, k, 1, True, seed=expected_m, device="cuda")
    wr, sr = row_scaled_fp8_weight(w, s)
    mm = torch.tensor([0, 3, 64, 0, 17, 300], dtype=torch.int32, device="cuda")
    cfg = {} if split is None else dict(SPLIT_K=split)
    d = triton_gemm.w8a16_grouped_gemm_masked(x, wr, sr, mm, expected_m, cfg_override=cfg)
    for g in range(G):
        r = int(mm[g])
        assert torch.equal(d[g, :r], ref[g, :r].float().bfloat16()), g
    y = triton_gemm.w8a16_gemm(x[5, :expected_m], wr[5], sr[5], cfg_override=cfg)
    assert torch.equal(y, ref[5, :expected_m].float().bfloat16())
    # FP4-origin experts on random activations: the same bits as v3 on the per-32 stack
    packed = torch.randint(0, 256, (G, n, k // 2), dtype=torch.uint8, device="cuda")
    sc = torch.randint(116, 126, (G, n, k // 32), dtype=torch.uint8, device="cuda")
    w8, s8 = zip(*(triton_gemm.fp4_to_fp8_weight(packed[g], sc[g], keep_e8m0=True) for g in range(G)))
    w8, s8 = torch.stack(w8), torch.stack(s8)
    wr, sr = row_scaled_fp8_weight(w8, s8)
    xq = triton_quant_act(torch.randn(G, mmax, k, device="cuda").bfloat16())
    a = triton_gemm.w8a16_grouped_gemm_masked(xq, wr, sr, mm, expected_m, cfg_override=cfg)
    b = triton_gemm.w8a16_grouped_gemm_masked(xq, w8, s8, mm, expected_m, cfg_override=dict(cfg, VARIANT="v3"))
    for g in range(G):
        r = int(mm[g])
        assert torch.equal(a[g, :r], b[g, :r]), g


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("variant", ["v3", "v4"])
def test_w8a16_dense_grouped_wo_a(m, variant):
    """wo_a's shape through select.grouped_w8a16 (dense grouped W8A16, no act rounding): exact on integer
    data in both layouts ([G, M, K] and token-major [M, G, K], split-K on and off), and close to the bf16
    einsum of the dequantized blocks (fp32 sums in another order)."""
    from deepinfer.kernels import select, triton_gemm
    x, w, s, ref = w8a16_exact_case(8, m, 1024, 4096, 32, True, seed=2 + m, device="cuda")
    want = ref.float().bfloat16()
    for cfg in (dict(VARIANT=variant), dict(VARIANT=variant, SPLIT_K=1)):
        assert torch.equal(triton_gemm.w8a16_grouped_gemm(x, w, s, cfg_override=cfg), want)
        got = triton_gemm.w8a16_grouped_gemm(x.transpose(0, 1).contiguous(), w, s, cfg_override=cfg, token_major=True)
        assert torch.equal(got, want.transpose(0, 1))
    o = torch.randn(m, 8, 4096, device="cuda").bfloat16()
    got = select.grouped_w8a16(o, w, s)
    want = torch.einsum("tgd,grd->tgr", o, select.dequant_fp8(w, s).bfloat16())
    assert rel_err(got, want) < 2e-3


def triton_quant_act(x):
    from deepinfer.kernels.triton_quant import act_quant
    return act_quant(x)


@triton.jit
def _dequant_probe_kernel(w2_ptr, w_ptr, s_ptr, lo_ptr, hi_ptr, d_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(s_ptr + offs)
    lo, hi = _dequant_pair_bf16(tl.load(w2_ptr + offs), s)
    tl.store(lo_ptr + offs, lo)
    tl.store(hi_ptr + offs, hi)
    tl.store(d_ptr + offs, _dequant_bytes_bf16(tl.load(w_ptr + offs), s))


def test_w8a16_dequant_asm_every_byte():
    """The v2/v3 dequant PTX on the GPU: every int16 (two e4m3 bytes) and every byte, each element with its
    own pow2 scale, against torch's e4m3 -> float * scale -> bf16, bit for bit (finite bytes; e4m3 NaN
    bytes are not weights). Catches a flushed subnormal or a scale paired with the wrong byte."""
    v = torch.arange(65536, dtype=torch.int32, device="cuda").repeat(4)
    w2 = v.to(torch.int16)                                            # wraps: the same 16 bits
    w = (v & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn)
    s = torch.exp2((torch.arange(v.numel(), device="cuda") % 61 - 40).float()).bfloat16()
    lo, hi, d = (torch.empty(v.numel(), dtype=torch.bfloat16, device="cuda") for _ in range(3))
    _dequant_probe_kernel[(v.numel() // 1024,)](w2, w, s, lo, hi, d, BLOCK=1024, num_warps=4)

    def expect(byte):
        return (byte.to(torch.uint8).view(torch.float8_e4m3fn).float() * s.float()).bfloat16()

    for got, byte in ((lo, v & 0xFF), (hi, (v >> 8) & 0xFF), (d, v & 0xFF)):
        finite = (byte & 0x7F) != 0x7F
        assert torch.equal(got[finite].view(torch.int16), expect(byte)[finite].view(torch.int16))
