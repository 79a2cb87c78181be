"""The FP8 x FP8 prefill GEMMs (kernels/triton_fp8_prefill.py) against plain torch, on shapes that are
not multiples of the tiles. Run on a GPU by test_fp8_prefill.py, or on a CPU under Triton's
interpreter (TRITON_INTERPRET=1 python tests/kernels/fp8_prefill_checks.py).

Exact checks use ternary data ({-1, 0, 1} activations and weights, random power-of-two scales): every
product and partial sum is exact in fp32, so on a GPU the kernel must give the reference's bits
whatever its summation order (under the interpreter, whose float -> bf16 cast truncates, within one
bf16 ulp). Random-data checks allow one bf16 ulp (the fp32 sum order differs from a single matmul's)."""

from __future__ import annotations

import os
import sys

import torch

from deepinfer.kernels.select import dequant_fp8, row_scaled_fp8_weight
from deepinfer.kernels.triton_fp8_prefill import (fp8_grouped_contiguous, fp8_prefill_gemm, fp8_prefill_linear,
                                                  fp8_prefill_linear_ref)
from deepinfer.kernels.triton_fp8_variants import VARIANTS, fp8_variant_gemm, fp8_variant_grouped_contiguous
from deepinfer.kernels.triton_moe_contiguous import w8a16_grouped_contiguous

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SMALL = dict(BM=32, BN=32, GROUP_M=2, NUM_STAGES=1, num_warps=4) if INTERPRET else None
SMALL_W8 = dict(BM=32, BN=32, BK=64, NUM_STAGES=1, num_warps=4) if INTERPRET else None


def ternary(shape, gen, device):
    return (torch.randint(-1, 2, shape, generator=gen) * 1.0).to(device)


def pow2(shape, lo, hi, gen, device):
    return torch.exp2(torch.randint(lo, hi, shape, generator=gen).float()).to(device)


def e8m0(shape, gen, device):
    return torch.randint(124, 131, shape, generator=gen, dtype=torch.uint8).to(device)


def same(y, r) -> bool:
    """Equal bits on a GPU; within one bf16 ulp under the interpreter (truncating casts)."""
    if not INTERPRET:
        return torch.equal(y, r)
    return bool(((y.float() - r.float()).abs() <= r.float().abs() * 2 ** -7).all())


def ref_gemm(a, sa, b, sb):
    """dequant(a) @ dequant(b)^T in float64 -> bf16 (exact here: ternary values, pow2 scales)."""
    ad = a.double() * sa.double().repeat_interleave(32, -1)
    bd = dequant_fp8(b, sb).double()
    return (ad @ bd.T).to(torch.bfloat16)


def check_exact_dense(device):
    gen = torch.Generator().manual_seed(0)
    for m, n, k, per_row in ((5, 40, 128, False), (130, 200, 256, True), (64, 96, 384, False), (1, 33, 128, True)):
        a = ternary((m, k), gen, device).to(torch.float8_e4m3fn)
        sa = pow2((m, k // 32), -3, 3, gen, device)
        b = ternary((n, k), gen, device).to(torch.float8_e4m3fn)
        sb = e8m0((n if per_row else -(-n // 32), k // 32), gen, device)
        y = fp8_prefill_gemm(a, sa, b, sb, SMALL)
        r = ref_gemm(a.float(), sa, b, sb)
        assert same(y, r), (m, n, k, per_row, (y.float() - r.float()).abs().max())
        rs = row_scaled_fp8_weight(b, sb) if per_row else None
        if rs is not None:                               # one f32 scale per row (the experts' form)
            assert same(fp8_prefill_gemm(a, sa, *rs, SMALL), r), (m, n, k, "row scale")
    print("exact dense: ok")


def check_exact_variants(device, names=None):
    """Every FP8 x FP8 variant (triton_fp8_variants) on ternary data: 32x32-tile, per-(row, 32) and per-row
    weight scales, M and N not multiples of the tiles, K of 2 to 6 slices, split-K (decode-sized M on a
    GPU: decode_config's split). Under the interpreter on small
    tiles (BN 64: two scale blocks per tile, so BLOCKS' [BM, BN/32, 32] view is exercised)."""
    gen = torch.Generator().manual_seed(4)
    cases = ((5, 40, 64, "tile"), (70, 100, 192, "row32"), (33, 96, 128, "rows"), (64, 130, 128, "tile"))
    if not INTERPRET:
        cases += ((300, 1000, 1280, "tile"), (64, 4608, 5120, "tile"), (128, 2304, 5120, "rows"), (32, 512, 2304, "row32"))
    names = list(names or VARIANTS)
    if INTERPRET:                # the interpreter's tiles are all 32 x 64: one variant per K-loop form
        forms = {}
        for name in names:
            forms.setdefault(tuple(VARIANTS[name][f] for f in ("BLOCKS", "LAG", "TMA")), name)
        names = list(forms.values())
    for name in names:
        # the interpreter: split-K 3 asked (fewer where K is short: split_plan), so split and unsplit walks run
        cfg = dict(VARIANTS[name], BM=32, BN=64, GROUP_M=2, num_warps=4, SPLIT_K=3) if INTERPRET else None
        for m, n, k, scales in cases:
            a = ternary((m, k), gen, device).to(torch.float8_e4m3fn)
            sa = pow2((m, k // 32), -3, 3, gen, device)
            b = ternary((n, k), gen, device).to(torch.float8_e4m3fn)
            sb = e8m0((-(-n // 32) if scales == "tile" else n, k // 32), gen, device)
            r = ref_gemm(a.float(), sa, b, sb)
            if scales == "rows":
                rs = row_scaled_fp8_weight(b, sb)
                assert rs is not None
                b, sb = rs
            y = fp8_variant_gemm(a, sa, b, sb, name, cfg)
            assert same(y, r), (name, m, n, k, scales, (y.float() - r.float()).abs().max())
            if not INTERPRET and m <= 128:                # a measured table's split count instead of the rule's
                y = fp8_variant_gemm(a, sa, b, sb, name, split_k=7)
                assert same(y, r), (name, m, n, k, scales, "split_k 7")
        if not INTERPRET or VARIANTS[name]["LAG"]:       # the interpreter: the lagged loops (TMA or not)
            check_exact_variant_contiguous(device, name, cfg, gen)
    print(f"exact variants, dense and grouped contiguous ({', '.join(names)}): ok")


def check_exact_variant_contiguous(device, name, cfg, gen):
    """The variant's grouped contiguous form: experts with no rows, rows not a multiple of the tile, N not
    a multiple of BN (TMA: the next expert's rows must read as zeros), each scale layout."""
    cases = [(4, 72, 128, [3, 0, 40, 9], "tile"), (3, 64, 192, [0, 0, 70], "row32"), (5, 40, 128, [1, 2, 0, 33, 64], "rows")]
    if not INTERPRET:
        cases += [(6, 320, 512, [0, 200, 1, 129, 0, 300], "tile"), (4, 2304, 1024, [64, 0, 128, 7], "rows")]
    for E, n, k, counts, scales in cases:
        P = sum(counts)
        a = ternary((P, k), gen, device).to(torch.float8_e4m3fn)
        sa = pow2((P, k // 32), -2, 3, gen, device)
        b = ternary((E, n, k), gen, device).to(torch.float8_e4m3fn)
        sb = e8m0((E, -(-n // 32) if scales == "tile" else n, k // 32), gen, device)
        refs, start = [], 0
        for e, c in enumerate(counts):
            refs.append(ref_gemm(a[start:start + c].float(), sa[start:start + c], b[e], sb[e]))
            start += c
        if scales == "rows":
            rs = row_scaled_fp8_weight(b, sb)
            assert rs is not None
            b, sb = rs
        y = fp8_variant_grouped_contiguous(a, sa, b, sb, torch.tensor(counts, device=device), name, cfg)
        start = 0
        for e, c in enumerate(counts):
            assert same(y[start:start + c], refs[e]), (name, E, counts, e, scales)
            start += c


def outside_fp8_mma_bound(y, r, x, q, scale):
    """Where y (the FP8 x FP8 kernel, fp32) differs from r (the reference on the same operands) by more
    than one bf16 ulp of the larger of the two (they may round to either side of a binade edge) plus
    what Hopper's FP8 wgmma drops inside one K=32 slice: its adder keeps ~14 bits, so that error scales
    with the sum of |products| (mag), not |r|. On random data an output near cancellation moves by an ulp
    or two; ternary data stays exact (check_exact_*)."""
    q_abs = q.float().abs().to(q.dtype)
    mag = fp8_prefill_linear_ref(x.abs(), q_abs, scale).float()
    return (y - r).abs() > torch.maximum(r.abs(), y.abs()) * 2 ** -7 + mag * 2 ** -12 + 1e-30


def check_select_variants(device):
    """select.fp8_linear on the measured table (PREFILL_GEMM auto): the table's variant where it names one
    (same values as the W8A16 path: exact products, fp32 sums; within one bf16 ulp), W8A16 where it says
    null or has no row, and a clean decline (logged once, W8A16 values) where K breaks the lagged loop's
    rule (K % 64)."""
    import json
    import tempfile
    from deepinfer.kernels import select
    from deepinfer.checkpoint.generator import quant_fp8
    gen = torch.Generator().manual_seed(5)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "table.json")
        rows = [dict(n=96, k=128, m=32, variant="lag_blocks", split_k=2), dict(n=96, k=128, m=4096, variant=None),
                dict(n=64, k=96, m=32, variant="lag_blocks")]
        with open(path, "w") as f:
            json.dump({"measured": "test", "rows": rows}, f)
        saved = select.PREFILL_GEMM, select.FP8_TABLE_PATH, select.MOE_CONTIGUOUS
        select.PREFILL_GEMM, select.FP8_TABLE_PATH = "auto", path
        try:
            for m, n, k, want in ((40, 96, 128, "lag_blocks"), (16, 96, 128, None), (40, 64, 96, None), (40, 72, 128, None)):
                x = torch.randn(m, k, generator=gen).bfloat16().to(device)
                q, sc = quant_fp8(torch.randn(n, k, generator=gen) * k ** -0.5)
                q, sc = q.to(device), sc.view(torch.uint8).to(device)
                assert select._fp8_variant_for(x, q, sc) == want, (m, n, k, want)
                y = select.fp8_linear(x, q, sc).float()
                r = fp8_prefill_linear_ref(x, q, sc).float()
                bad = outside_fp8_mma_bound(y, r, x, q, sc)
                assert not bad.any(), (m, n, k, (y - r).abs().max().item())
            assert ("fp8_variant_linear[lag_blocks]", "K a multiple of 64 and the W8A16 scale layouts") in select.declined()
            # the MoE's grouped contiguous form on a named variant; where it declines, W8A16's (if on) or the loop
            x = torch.zeros(8, 128, device=device, dtype=torch.bfloat16)
            for gemm, contiguous, k2, want in (("lag_blocks", False, 128, "lag_blocks"), ("lag_blocks", True, 96, "w8a16"),
                                               ("lag_blocks", False, 96, None), ("blocks", False, 96, "blocks"),
                                               ("auto", False, 128, None), ("auto", True, 128, "w8a16")):
                select.PREFILL_GEMM, select.MOE_CONTIGUOUS = gemm, contiguous
                assert select._contiguous_kernel(x, 128, k2) == want, (gemm, contiguous, k2, want)
        finally:
            select.PREFILL_GEMM, select.FP8_TABLE_PATH, select.MOE_CONTIGUOUS = saved
    print("select: table picks and declines: ok")


def check_exact_contiguous(device):
    gen = torch.Generator().manual_seed(1)
    for E, n, k, counts in ((4, 72, 128, [3, 0, 40, 9]), (3, 64, 256, [0, 0, 70]), (5, 40, 128, [1, 2, 0, 33, 64])):
        P = sum(counts)
        a = ternary((P, k), gen, device).to(torch.float8_e4m3fn)
        sa = pow2((P, k // 32), -2, 3, gen, device)
        b = ternary((E, n, k), gen, device).to(torch.float8_e4m3fn)
        sb = e8m0((E, n, k // 32), gen, device)
        cnt = torch.tensor(counts, device=device)
        y = fp8_grouped_contiguous(a, sa, b, sb, cnt, SMALL)
        xb = (a.float() * sa.repeat_interleave(32, -1)).to(torch.bfloat16)       # the W8A16 operand
        rows = row_scaled_fp8_weight(b, sb)
        ys = [("w8a16", w8a16_grouped_contiguous(xb, b, sb, cnt, SMALL_W8))]
        if rows is not None:
            ys.append(("w8a16 row scales", w8a16_grouped_contiguous(xb, *rows, cnt, SMALL_W8)))
        start = 0
        for e, c in enumerate(counts):
            r = ref_gemm(a[start:start + c].float(), sa[start:start + c], b[e], sb[e])
            assert same(y[start:start + c], r), (E, counts, e)
            for name, yw in ys:
                assert same(yw[start:start + c], r), (name, E, counts, e)
            start += c
    print("exact grouped contiguous (FP8 and W8A16): ok")


def check_random_dense(device, shapes):
    gen = torch.Generator().manual_seed(2)
    for m, n, k in shapes:
        from deepinfer.checkpoint.generator import quant_fp8
        x = torch.randn(m, k, generator=gen).bfloat16().to(device)
        q, s = quant_fp8(torch.randn(n, k, generator=gen) * k ** -0.5)
        q, s = q.to(device), s.view(torch.uint8).to(device)
        y = fp8_prefill_linear(x, q, s, SMALL).float()
        r = fp8_prefill_linear_ref(x, q, s).float()
        bad = outside_fp8_mma_bound(y, r, x, q, s)
        assert not bad.any(), (m, n, k, (y - r).abs().max().item(), int(bad.sum()))
    print(f"random dense ({len(shapes)} shapes): ok")


def check_moe_contiguous(device, tokens: int):
    """A MoE layer's grouped contiguous form (moe.MoE._contiguous_experts) against its masked form and
    the per-expert loop on the references, on a 128-wide layer with row-scaled and per-32 stacks."""
    import tempfile
    from pathlib import Path

    from deepinfer.checkpoint.generator import make_checkpoint
    from deepinfer.kernels import select
    from deepinfer.model import moe as moe_mod
    from deepinfer.model.loader import load_model
    tc = dict(hidden_size=128, moe_intermediate_size=128, num_attention_heads=2, head_dim=64, qk_rope_head_dim=16,
              q_lora_rank=64, o_lora_rank=32, o_groups=1, n_routed_experts=7, num_experts_per_tok=3,
              compress_ratios=[0], kv_source_layer_ids=[], index_source_layer_ids=[], index_n_heads=4,
              index_head_dim=32, index_topk=8, candidate_source_layer_id=None, candidate_topk_blocks=0,
              candidate_block_size=0, engram_layer_ids=[], engram_vocab_size=0, engram_n_heads=0, engram_head_dim=0,
              num_nextn_predict_layers=0, dspark_block_size=0, dspark_target_layer_ids=[], hc_mult=4)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, 128, generator=gen).bfloat16().to(device)
    with tempfile.TemporaryDirectory() as d:
        ckpt = make_checkpoint(tc, 5, Path(d) / "moe", progress=False)
        saved = select.PREFILL_GEMM, select.MOE_CONTIGUOUS
        combos = [(False, "fp8"), (True, "fp8"), (False, "w8a16"), (True, "w8a16"), (True, "lag_blocks"),
                  (False, "tma_lag_blocks")]
        for rows, gemm in (combos[::3] if INTERPRET else combos):          # the interpreter: two of four
            select.PREFILL_GEMM, select.MOE_CONTIGUOUS = gemm, True
            ffn = load_model(ckpt, device=device, progress=False, weight_format="fp8", expert_row_scales=rows,
                             fuse_linears=True).layers[0].ffn
            weights, indices = ffn.gate(x, None)
            assert ffn._use_contiguous(x), "the contiguous form declined a 128-wide layer"
            out, slot = ffn._contiguous_experts(x, weights, indices)
            y = select.moe_combine(out, slot, indices, ffn._shared(x)).float()
            ffn.masked = True
            ym = ffn(x).float()
            select.KERNELS = "ref"
            select._fast_ok.cache_clear()
            ffn.masked = False
            yr = ffn(x).float()
            select.KERNELS = "fast"
            select._fast_ok.cache_clear()
            print("masked vs loop", ((ym - yr).abs().mean() / yr.abs().mean()).item())
            for name, other in (("masked", ym), ("reference loop", yr)):
                rel = ((y - other).abs().mean() / other.abs().mean()).item()
                print(name, rows, rel)
                assert rel < (3e-2 if INTERPRET else 2e-3), (name, rows, rel)
            print(f"moe contiguous {gemm} (row scales {rows}): ok")
        select.PREFILL_GEMM, select.MOE_CONTIGUOUS = saved
    assert moe_mod.MASKED_MAX_PAIRS > 0


def main():
    device = "cpu" if INTERPRET else "cuda"
    check_exact_dense(device)
    check_select_variants(device)
    check_exact_contiguous(device)
    check_moe_contiguous(device, 40 if INTERPRET else 3000)
    shapes = [(33, 72, 128), (70, 160, 256)] if INTERPRET else [
        (512, 1280, 5120), (777, 4096, 1280), (1000, 5120, 8192), (4096, 4608, 5120), (8192, 1536, 5120),
        (8192, 5120, 2304), (300, 100, 384), (2048, 4224, 640)]
    check_random_dense(device, shapes)
    return 0


def main_variants():
    """The FP8 x FP8 variants alone (test_fp8_prefill.py runs it under the interpreter: ~15 s)."""
    device = "cpu" if INTERPRET else "cuda"
    check_exact_variants(device)
    check_select_variants(device)
    return 0


if __name__ == "__main__":
    sys.exit(main_variants() if sys.argv[1:] == ["variants"] else main())
