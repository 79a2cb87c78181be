"""The exact bf16 dequant of FP8 weights (kernels/triton_dequant.py) and the dense bf16 prefill path of
select.fp8_linear built on it: under Triton's interpreter (CPU) and on the GPU."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from deepinfer.kernels import select  # noqa: E402
from deepinfer.kernels.select import dequant_fp8  # noqa: E402
from deepinfer.kernels.triton_dequant import E8M0_MAX, E8M0_MIN, bf16_exact, dequant_fp8_bf16  # noqa: E402
from fp8_prefill_checks import INTERPRET, e8m0, ref_gemm, same, ternary, pow2  # noqa: E402

# shapes off the kernel's 32 x 128 tiles; (N, K, scale layout)
SHAPES = [(64, 96, "block"), (37, 160, "row32"), (50, 224, "row"), (96, 1280, "block"), (33, 4096, "row32")]


def any_e4m3(shape, gen):
    """Every e4m3 code but the two NaNs (0x7F, 0xFF), subnormals and zeros of both signs included."""
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b)
    return b.view(torch.float8_e4m3fn)


def scales(n, k, layout, gen):
    if layout == "row":                       # one f32 power of two per row (row_scaled_fp8_weight's form)
        return torch.exp2(torch.randint(E8M0_MIN - 127, E8M0_MAX - 127 + 1, (n, 1), generator=gen).float())
    rows = -(-n // 32) if layout == "block" else n
    return torch.randint(E8M0_MIN, E8M0_MAX + 1, (rows, k // 32), generator=gen, dtype=torch.uint8)


def check_dequant_exact(device):
    gen = torch.Generator().manual_seed(0)
    for n, k, layout in SHAPES:
        w, s = any_e4m3((n, k), gen), scales(n, k, layout, gen)
        s[0, 0] = E8M0_MIN if s.dtype == torch.uint8 else 2.0 ** (E8M0_MIN - 127)    # both ends of the rule
        s[-1, -1] = E8M0_MAX if s.dtype == torch.uint8 else 2.0 ** (E8M0_MAX - 127)
        w, s = w.to(device), s.to(device)
        assert bf16_exact(s), (n, k, layout)
        got = dequant_fp8_bf16(w, s)
        want = dequant_fp8(w, s)                                 # exact float32 values
        assert got.dtype == torch.bfloat16 and got.shape == (n, k)
        assert torch.equal(got.float(), want), (n, k, layout, (got.float() - want).abs().max())
    print(f"dequant exact ({len(SHAPES)} shapes, every e4m3 code, scales 2^{E8M0_MIN - 127}..2^{E8M0_MAX - 127}): ok")


def check_rule(device):
    ok = torch.tensor([[E8M0_MIN, E8M0_MAX]], dtype=torch.uint8, device=device)
    assert bf16_exact(ok)
    for bad in (E8M0_MIN - 1, E8M0_MAX + 1, 255):
        assert not bf16_exact(torch.tensor([[127, bad]], dtype=torch.uint8, device=device)), bad
    assert bf16_exact(torch.tensor([[0.25], [8.0]], device=device))
    assert not bf16_exact(torch.tensor([[0.25], [3.0]], device=device))           # not a power of two
    assert not bf16_exact(torch.tensor([[2.0 ** -126]], device=device))            # below the range
    print("bf16 rule: ok")


def check_linear_exact(device):
    """Ternary data with pow2 scales: every partial sum is exact, so the path gives the reference's bits."""
    gen = torch.Generator().manual_seed(1)
    for m, n, k, layout in ((5, 64, 128, "block"), (70, 37, 160, "row32"), (33, 50, 224, "row")):
        x = (ternary((m, k), gen, "cpu") * pow2((m, 1), -2, 3, gen, "cpu")).bfloat16().to(device)
        w = ternary((n, k), gen, "cpu").to(torch.float8_e4m3fn).to(device)
        s = (scales(n, k, layout, gen) if layout == "row" else
             e8m0((-(-n // 32) if layout == "block" else n, k // 32), gen, "cpu")).to(device)
        y = linear(x, w, s)
        sa = torch.ones(m, k // 32, device=device)
        r = ref_gemm(x.float(), sa, w, s)
        assert same(y, r), (m, n, k, layout)
    print("bf16 path exact on ternary data: ok")


def check_linear_random(device, shapes):
    """Random data: within one bf16 ulp of the larger side plus fp32 accumulation error (2^-20 of the sum
    of |products|) of the float64 product of the same exact operands."""
    gen = torch.Generator().manual_seed(2)
    from deepinfer.checkpoint.generator import quant_fp8
    from deepinfer.kernels.reference import act_quant_ref
    for m, n, k in shapes:
        x = torch.randn(m, k, generator=gen).bfloat16().to(device)
        q, s = quant_fp8(torch.randn(n, k, generator=gen) * k ** -0.5)
        q, s = q.to(device), s.view(torch.uint8).to(device)
        y = linear(x, q, s).double()
        xa, wd = act_quant_ref(x).double(), dequant_fp8(q, s).double()
        r, mag = xa @ wd.T, xa.abs() @ wd.abs().T
        bad = (y - r).abs() > torch.maximum(r.abs(), y.abs()) * 2 ** -7 + mag * 2 ** -20 + 1e-30
        assert not bad.any(), (m, n, k, (y - r).abs().max().item(), int(bad.sum()))
    print(f"bf16 path random ({len(shapes)} shapes): ok")


def check_grouped(device):
    """wo_a's grouped GEMM (no activation rounding) on the bf16 path against the float64 einsum of the
    exact weight: 32x32-tile and per-row-of-32 scales, group sizes off the tiles."""
    gen = torch.Generator().manual_seed(3)
    for m, g, n, k, per_row in ((7, 4, 64, 96, False), (300 if not INTERPRET else 9, 8, 48, 160, True)):
        x = torch.randn(m, g, k, generator=gen).bfloat16().to(device)
        w = (torch.randn(g, n, k, generator=gen) * k ** -0.5).to(torch.float8_e4m3fn).to(device)
        s = torch.randint(118, 124, (g, n if per_row else n // 32, k // 32), generator=gen, dtype=torch.uint8).to(device)
        if x.is_cuda:
            saved = select.PREFILL_GEMM
            select.PREFILL_GEMM = "bf16"
            try:
                assert select._bf16_gemm_ok(x.flatten(0, 1), w[0], s[0], m, exact_of=s)
                y = select.grouped_w8a16(x, w, s)
            finally:
                select.PREFILL_GEMM = saved
        else:
            y = select._bf16_grouped(x, w, s)
        xd, wd = x.double(), dequant_fp8(w, s).double()
        r, mag = torch.einsum("tgd,grd->tgr", xd, wd), torch.einsum("tgd,grd->tgr", xd.abs(), wd.abs())
        assert y.shape == (m, g, n) and y.is_contiguous()
        bad = (y.double() - r).abs() > torch.maximum(r.abs(), y.double().abs()) * 2 ** -7 + mag * 2 ** -20 + 1e-30
        assert not bad.any(), (m, g, n, k, per_row, int(bad.sum()))
    print("grouped (wo_a) bf16 path: ok")


def check_moe_contiguous(device):
    """The MoE's grouped contiguous step on the bf16 path (the whole stack dequantized, one grouped GEMM)
    against the float64 per-expert product of the exact operands: empty experts, group sizes off every
    tile, row-scaled (f32 [E, N, 1]) and 32x32-block stacks."""
    gen = torch.Generator().manual_seed(4)
    from deepinfer.kernels.reference import act_quant_ref
    for counts, n, k, per_row in (([5, 0, 70, 1, 0, 33], 48, 160, True), ([0, 129, 0, 2], 96, 256, False),
                                  ([300 if not INTERPRET else 12, 0, 0], 40, 96, True)):
        e, p = len(counts), sum(counts)
        x = act_quant_ref(torch.randn(p, k, generator=gen).bfloat16()).to(device)
        w = (torch.randn(e, n, k, generator=gen) * k ** -0.5).to(torch.float8_e4m3fn).to(device)
        s = (torch.exp2(torch.randint(-12, -4, (e, n, 1), generator=gen).float()) if per_row else
             torch.randint(118, 124, (e, n // 32, k // 32), generator=gen, dtype=torch.uint8)).to(device)
        c = torch.tensor(counts, dtype=torch.int32, device=device)
        if x.is_cuda:
            saved = select.BF16_MOE_MIN_ROWS
            select.BF16_MOE_MIN_ROWS = 1
            try:
                assert select._bf16_grouped_contiguous_ok(x, w, s)
                y = select.grouped_fp8_linear_contiguous(x, w, s, c)
            finally:
                select.BF16_MOE_MIN_ROWS = saved
        else:
            y = select._bf16_grouped_contiguous(x, w, s, c)
        wd = torch.stack([dequant_fp8(w[i], s[i]) for i in range(e)]).double()
        expert = torch.repeat_interleave(torch.arange(e, device=device), c.long())
        xd = x.double()
        r = torch.einsum("pk,pnk->pn", xd, wd[expert])
        mag = torch.einsum("pk,pnk->pn", xd.abs(), wd[expert].abs())
        assert y.shape == (p, n) and y.dtype == torch.bfloat16
        bad = (y.double() - r).abs() > torch.maximum(r.abs(), y.double().abs()) * 2 ** -7 + mag * 2 ** -20 + 1e-30
        assert not bad.any(), (counts, n, k, per_row, int(bad.sum()))
    print("MoE grouped contiguous bf16 path: ok")


def linear(x, w, s):
    """select.fp8_linear on the bf16 path (asserted taken on a GPU); the path's function itself on a CPU,
    where select keeps CPU tensors off it."""
    if x.is_cuda:
        saved = select.PREFILL_GEMM
        select.PREFILL_GEMM = "bf16"
        try:
            assert select._bf16_gemm_ok(x, w, s)
            return select.fp8_linear(x, w, s)
        finally:
            select.PREFILL_GEMM = saved
    return select._bf16_gemm_linear(x, w, s)


def main():
    device = "cpu" if INTERPRET else "cuda"
    check_dequant_exact(device)
    check_rule(device)
    check_linear_exact(device)
    check_grouped(device)
    check_moe_contiguous(device)
    check_linear_random(device, [(40, 96, 256)] if INTERPRET else
                        [(1024, 1792, 5120), (1500, 4096, 1280), (2048, 5120, 8192), (1100, 4608, 5120), (4096, 5120, 2304)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
