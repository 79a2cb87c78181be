"""Run under TRITON_INTERPRET=1 (CPU): the Triton kernels' logic against the references at tiny
shapes. Exact where the kernel's outputs are exact (quantization); elsewhere within a few bf16
ulps (the interpreter truncates float->bf16 casts where the GPU rounds to nearest)."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"

import torch  # noqa: E402

from kernel_utils import w4a16_exact_case, w8a16_exact_case  # noqa: E402
from deepinfer.kernels import triton_gemm, triton_indexer, triton_mhc, triton_quant, triton_sparse_attn  # noqa: E402
from deepinfer.kernels.reference import (  # noqa: E402
    act_quant_ref, dequant_fp4_ref, fp4_quant_ref, hc_split_sinkhorn_ref, sparse_attn_ref)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _f32_ulps(a, b) -> int:
    """Largest distance in fp32 steps between same-signed a and b."""
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max().item()


def check_router_topk():
    """The MoE router kernel against router_topk_ref: E 48 and 64 (masked lanes), k 6, norm on and off,
    with and without the alt bias (image tokens), temp 1.3 (not a power of two: a true division on
    CPU tensors), a row of exact ties (quantized logits and bias), a tie of 8 over 20 (softplus
    threshold) at the top, a row of exp in the denormals (scores ~1e-20: the 1e-20 counts).
    Indices: the reference's exactly. Weights: bit for bit the reference's selection on the kernel's
    own softplus (MANUAL: exp and log1p in fp64, each rounded to fp32). torch's CPU softplus (SLEEF
    exp and log1p, <= 1 ulp each) differs from that by up to 2 ulp, which the normalization can
    double: within 4 ulp of router_topk_ref, except on the denormal row (an ulp of a denormal exp is
    a large relative step; on the GPU both sides run the same expf)."""
    import numpy as np
    from deepinfer.kernels import triton_router
    from deepinfer.kernels.reference import router_select_ref, router_topk_ref

    def manual_scores(logits, temp):
        x = logits.numpy() / np.float32(temp)
        e = np.exp(x.astype(np.float64)).astype(np.float32).astype(np.float64)
        u = 1.0 + e
        lp = np.where(u == 1.0, e, np.log(u) * (e / np.where(u == 1.0, 1.0, u - 1.0))).astype(np.float32)
        return torch.from_numpy(np.sqrt(np.where(x > 20, x, lp)))

    g = torch.Generator().manual_seed(5)
    T, K, temp, scale = 5, 6, 1.3, 2.5
    for E in (48, 64):
        logits = torch.randn(T, E, generator=g) * 3
        logits[1] = torch.randint(-3, 4, (E,), generator=g) * 0.5             # ties everywhere
        bias = torch.randint(0, 3, (E,), generator=g) * 0.25
        bias[:16] = 0.5
        logits[2] = -5.0
        logits[2, 3:11] = 30.0                                                  # 30 / 1.3 > 20: softplus = x
        logits[3] = -110.0 - 20 * torch.rand(E, generator=g)                   # exp(-85..-100): denormals
        bias_alt = torch.randn(E, generator=g) * 0.1
        alt_mask = torch.tensor([True, False, False, True, True])
        for alt in (False, True):
            kw = dict(bias_alt=bias_alt, alt_mask=alt_mask) if alt else {}
            for norm in (True, False):
                w, i = triton_router.router_topk(logits, bias, K, temp, scale, norm, **kw)
                rw, ri = router_topk_ref(logits, bias, K, temp, scale, norm, **kw)
                sw, si = router_select_ref(manual_scores(logits, temp), bias, K, scale, norm, **kw)
                assert w.shape == (T, K) and w.dtype == torch.float32 and i.dtype == torch.int64
                assert torch.equal(i, ri) and torch.equal(i, si), (E, alt, norm)
                assert torch.equal(w, sw), (E, alt, norm, _f32_ulps(w, sw))
                keep = torch.arange(T) != 3
                assert _f32_ulps(w[keep], rw[keep]) <= 4, (E, alt, norm, _f32_ulps(w[keep], rw[keep]))
        assert torch.equal(i[2], torch.arange(3, 9)), i[2]                     # the tie: lowest ids, in order


def check_w8a16_variants():
    """Every W8A16 variant, dense and masked grouped, E8M0 bytes and f32 scales, per-32x32 and per-row
    scales, split-K on and off, swapped and not: the fp32 partial sums exactly, the bf16 entry points
    within the interpreter's truncation."""
    m, n, k = 5, 64, 256
    for var in triton_gemm.W8A16_VARIANTS:
        for e8m0 in (True, False):
            for rows in (32, 1):
                x, w, s, ref = w8a16_exact_case(1, m, n, k, rows, e8m0, seed=rows + e8m0)
                for split in (1, 3):
                    for swap in (True, False):
                        cfg = dict(VARIANT=var, SPLIT_K=split, SWAP=swap, BM=16, BN=64, BK=128)
                        assert triton_gemm.w8a16_variant(cfg, w, s, k) == var
                        ws = triton_gemm.w8a16_partials(x[0], w[0], s[0], cfg_override=cfg)
                        assert ws.shape == (split, 1, m, n)
                        assert torch.equal(ws.double().sum(0), ref), (var, e8m0, rows, split, swap)
                        y = triton_gemm.w8a16_gemm(x[0], w[0], s[0], cfg_override=cfg)
                        assert rel(y, ref[0]) < 8e-3, (var, e8m0, rows, split, swap, rel(y, ref[0]))
        if var != "v1":                     # BK = 256: two scale words per row and K step
            for e8m0 in (True, False):
                x, w, s, ref = w8a16_exact_case(1, m, n, 512, 1, e8m0, seed=3)
                for swap in (True, False):
                    cfg = dict(VARIANT=var, SPLIT_K=1, SWAP=swap, BM=16, BN=64, BK=256)
                    ws = triton_gemm.w8a16_partials(x[0], w[0], s[0], cfg_override=cfg)
                    assert torch.equal(ws.double().sum(0), ref), (var, e8m0, swap, "BK256")
        # masked grouped: an empty group, a full one, a partial one
        G, mmax = 3, 8
        mm = torch.tensor([5, 0, 8], dtype=torch.int32)
        for e8m0, rows in ((True, 1), (False, 32)):
            x, w, s, ref = w8a16_exact_case(G, mmax, n, k, rows, e8m0, seed=7)
            for split in (1, 2):
                cfg = dict(VARIANT=var, SPLIT_K=split, BK=128)
                ws = triton_gemm.w8a16_partials(x, w, s, mm, cfg_override=cfg).double().sum(0)
                d = triton_gemm.w8a16_grouped_gemm_masked(x, w, s, mm, 4, cfg_override=cfg)
                for g in range(G):
                    r = int(mm[g])
                    assert torch.equal(ws[g, :r], ref[g, :r]), (var, e8m0, split, g)
                    assert not ws[g, r:].any()
                    if r:
                        assert rel(d[g, :r], ref[g, :r]) < 8e-3, (var, e8m0, split, g)


def check_w8a16_rows():
    """The row-scaled W8A16 kernel (one f32 scale per weight row, select.row_scaled_fp8_weight): dense and
    masked grouped, split-K on and off, swapped and not: the fp32 partial sums exactly."""
    from deepinfer.kernels.select import row_scaled_fp8_weight
    m, n, k = 5, 64, 256
    for g, mm in ((1, None), (3, torch.tensor([5, 0, 3], dtype=torch.int32))):
        x, w, s, ref = w8a16_exact_case(g, m, n, k, 1, True, seed=11 + g)
        wr, sr = zip(*(row_scaled_fp8_weight(w[i], s[i]) for i in range(g)))
        wr, sr = torch.stack(wr), torch.stack(sr)
        assert sr.shape == (g, n, 1)
        for split in (1, 3):
            for swap in (True, False):
                cfg = dict(SPLIT_K=split, SWAP=swap, BM=16, BN=64, BK=128)
                if mm is None:
                    ws = triton_gemm.w8a16_partials(x[0], wr[0], sr[0], cfg_override=cfg).double().sum(0)
                    assert torch.equal(ws, ref), (split, swap)
                    y = triton_gemm.w8a16_gemm(x[0], wr[0], sr[0], cfg_override=cfg)
                    assert rel(y, ref[0]) < 8e-3, (split, swap, rel(y, ref[0]))
                else:
                    ws = triton_gemm.w8a16_partials(x, wr, sr, mm, cfg_override=cfg).double().sum(0)
                    for i in range(g):
                        r = int(mm[i])
                        assert torch.equal(ws[i, :r], ref[i, :r]), (split, swap, i)
                        assert not ws[i, r:].any()


def check_w8a16_dense_grouped():
    """Dense grouped W8A16 (every row of every group: wo_a's blocks): partial sums exact, bf16 close."""
    x, w, s, ref = w8a16_exact_case(3, 5, 64, 256, 32, True, seed=21)
    for split in (1, 2):
        cfg = dict(SPLIT_K=split, BK=128)
        assert torch.equal(triton_gemm.w8a16_partials(x, w, s, cfg_override=cfg).double().sum(0), ref), split
        assert rel(triton_gemm.w8a16_grouped_gemm(x, w, s, cfg_override=cfg), ref) < 8e-3, split
        # token-major ([M, G, K] in, [M, G, N] out: wo_a's layout), v3 and v4: the same values
        for var in ("v3", "v4"):
            c = dict(cfg, VARIANT=var)
            a = triton_gemm.w8a16_grouped_gemm(x, w, s, cfg_override=c)
            b = triton_gemm.w8a16_grouped_gemm(x.transpose(0, 1).contiguous(), w, s, cfg_override=c, token_major=True)
            assert torch.equal(b, a.transpose(0, 1)), (split, var)


def check_w4a16():
    """W4A16 (packed MXFP4 weights decoded in the K loop): the fp32 partial sums exactly, dense and masked
    grouped, swapped and not, split-K on and off, BK 128 / 64 / 32 and N, K off the tiles (N 96, K 160)."""
    for g, m, n, k, mm in ((1, 5, 96, 256, None), (3, 7, 64, 160, torch.tensor([7, 0, 2], dtype=torch.int32))):
        x, packed, scale, ref = w4a16_exact_case(g, m, n, k, seed=31 + g)
        for split in (1, 3):
            for swap in (True, False):
                for bk in (32, 64, 128):
                    if k % bk:
                        continue
                    cfg = dict(SPLIT_K=split, SWAP=swap, BM=16, BN=64, BK=bk)
                    args = (x[0], packed[0], scale[0]) if mm is None else (x, packed, scale, mm)
                    ws = triton_gemm.w8a16_partials(*args, cfg_override=cfg, fp4=True).double().sum(0)
                    for i in range(g):
                        r = m if mm is None else int(mm[i])
                        assert torch.equal(ws[i, :r], ref[i, :r]), (g, split, swap, bk, i)
                        assert not ws[i, r:].any()
        if mm is None:
            y = triton_gemm.w4a16_gemm(x[0], packed[0], scale[0])
            assert rel(y, ref[0]) < 8e-3, rel(y, ref[0])
        else:
            y = triton_gemm.w4a16_grouped_gemm_masked(x, packed, scale, mm, 4)
            for i in range(g):
                r = int(mm[i])
                assert rel(y[i, :r], ref[i, :r]) < 8e-3 if r else True
    # the FP4 stacks' prefill dequant (the GEMM's own decode): every weight of the release, N / K off its tiles
    from deepinfer.kernels.triton_dequant import dequant_fp4_bf16
    for n, k in ((64, 512), (37, 96), (5, 1056)):
        gen = torch.Generator().manual_seed(n)
        packed = torch.randint(0, 256, (n, k // 2), generator=gen).to(torch.uint8)
        scale = torch.randint(2, 129, (n, k // 32), generator=gen).to(torch.uint8)
        scale[0, 0] = 0
        pk, sk = triton_gemm.fp4_kernel_weight(packed, scale)
        assert torch.equal(dequant_fp4_bf16(pk, sk).float(), dequant_fp4_ref(packed, scale)), (n, k)


def check_w4a16_contiguous():
    """The FP4 stacks' prefill GEMM (triton_fp4_contiguous): rows sorted by expert, empty experts, an expert's
    rows split over tiles and ending mid-tile, N and K off the tiles; integer-valued operands, so every fp32
    sum is exact and the output is x @ w^T cast to bf16 bit for bit at every tile shape (BM 64 / 128, BN 64 /
    128, BK 32 / 64 / 128; the interpreter's cast truncates where the GPU's rounds to nearest)."""
    from deepinfer.kernels.triton_fp4_contiguous import w4a16_grouped_contiguous
    counts = torch.tensor([70, 0, 3, 129, 0], dtype=torch.int32)
    p = int(counts.sum())
    for n, k in ((96, 256), (200, 160), (128, 128)):          # (128, 128): N a multiple of BN (EVEN_N)
        xg, packed, scale, _ = w4a16_exact_case(5, p, n, k, seed=n + k)
        x = xg[0]                                        # one row set, each row through its own expert
        w = torch.stack([dequant_fp4_ref(triton_gemm.fp4_release_layout(packed[i]), scale[i]) for i in range(5)])
        expert = torch.repeat_interleave(torch.arange(5), counts.long())
        ref = torch.einsum("pk,pnk->pn", x.double(), w[expert].double()).float()
        ref = (ref.view(torch.int32) & ~0xFFFF).view(torch.float32)           # truncated to bf16
        for cfg in (None, dict(BM=64, BN=64, BK=32, NUM_STAGES=1, num_warps=4),
                    dict(BM=128, BN=128, BK=64 if k % 64 == 0 else 32, NUM_STAGES=1, num_warps=8)):
            y = w4a16_grouped_contiguous(x, packed, scale, counts, cfg)
            assert torch.equal(y.float(), ref), (n, k, cfg)


def check_bf16_skinny():
    """The skinny GEMM on bf16-held weights (BF16W): integer-valued operands, so every fp32 sum is exact:
    the bf16 output (no split) and the fp32 output (split-K summed by the reduce kernel) equal the float64
    product; M, N, K off the tiles, the tiles select.py's table holds."""
    g = torch.Generator().manual_seed(31)
    for m, n, k in ((1, 70, 64), (5, 200, 96), (33, 130, 1280)):
        x = torch.randint(-3, 4, (m, k), generator=g).bfloat16()
        w = torch.randint(-3, 4, (n, k), generator=g).bfloat16()
        ref = x.double() @ w.double().T
        for cfg in ({}, {"BN": 128, "BK": 128, "NUM_STAGES": 3}, {"BN": 64, "BK": 64, "NUM_STAGES": 4},
                    {"SPLIT_K": 3}, {"BM": 16, "num_warps": 4}):     # BM 16: M over several token tiles
            if k % cfg.get("BK", 32):
                continue
            y32 = triton_gemm.bf16_skinny_linear(x, w, cfg, out_dtype=torch.float32)
            assert y32.dtype == torch.float32 and torch.equal(y32.double(), ref), (m, n, k, cfg)
            if cfg.get("SPLIT_K", 1) == 1 and k <= 256:      # bf16 out without a split: the store rounds
                assert torch.equal(triton_gemm.bf16_skinny_linear(x, w, {**cfg, "SPLIT_K": 1}), ref.bfloat16())


def check_sparse_attn_unrope(q, kv, sink, idx):
    """sparse_attn(unrope=cis): the inverse RoPE in the store gives triton_rope's bits on the output, split
    (the combine kernel's store) and whole, 16 heads and 4 padded to 16, rope widths 8 / 16 / 32 of 64."""
    from deepinfer.kernels import triton_rope
    g = torch.Generator().manual_seed(3)
    for half in (4, 8, 16):
        ang = torch.rand(q.shape[0], half, generator=g) * 6.28
        cis = torch.polar(torch.ones_like(ang), ang)
        for heads, bps in ((16, 2), (16, 8), (4, 2)):
            qh, sh = q[:, :heads].contiguous(), sink[:heads]
            plain = triton_sparse_attn.sparse_attn(qh, kv, sh, idx, 0.125, block_h=16, blocks_per_split=bps)
            want = triton_rope.rope(plain.clone(), cis, inverse=True, inplace=True)
            got = triton_sparse_attn.sparse_attn(qh, kv, sh, idx, 0.125, block_h=16, blocks_per_split=bps,
                                                 unrope=cis)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (half, heads, bps)
            assert not torch.equal(got, plain)
    assert not triton_sparse_attn.unrope_ok(q, cis[:1]) and not triton_sparse_attn.unrope_ok(q, cis[:, :3])


def check_pool_lists():
    """A decode layer's lists in pool rows: the kernel gives the reference's integers (window part with
    pads inside, picks through the block tables with -1 picks and unallocated blocks, -1 tail), in the
    window lists' dtype (int64, or int32 as StepMetadata.window_pool makes them)."""
    from deepinfer.kernels import triton_lists
    from deepinfer.kernels.reference import pool_lists_ref
    g = torch.Generator().manual_seed(5)
    for T, Lw, K, epb in ((1, 8, 6, 4), (5, 128, 24, 16), (7, 3, 1, 2)):
        win_len = torch.randint(0, Lw + 1, (T,), generator=g)
        win = torch.randint(0, 1000, (T, Lw), generator=g)
        win = torch.where(torch.arange(Lw)[None, :] < win_len[:, None], win, -1)
        win[0, 0] = -1
        topk = torch.randint(-1, 5 * epb, (T, K), generator=g)
        bt = torch.randint(-1, 40, (3, 4), generator=g)
        seq = torch.randint(0, 3, (T,), generator=g)
        for dtype in (torch.int64, torch.int32):     # int32: StepMetadata.window_pool's lists
            got = triton_lists.pool_lists(win.to(dtype), win_len, topk, seq, bt, epb, 5000)
            want = pool_lists_ref(win.to(dtype), win_len, topk, seq, bt, epb, 5000)
            assert got.dtype == want.dtype == dtype and torch.equal(got, want), (T, Lw, K, dtype)
    from test_triton_lists import check_window_pool
    check_window_pool("cpu")


def main():
    torch.manual_seed(0)
    x = (torch.randn(5, 256) * torch.exp(2 * torch.randn(5, 1))).bfloat16()
    assert torch.equal(triton_quant.act_quant(x), act_quant_ref(x))
    # the decode GEMM's transposed token scales: the same values, [K/32, ld] (columns past the rows unset)
    q, s = triton_quant.act_quant_fp8(x)
    qt, st = triton_quant.act_quant_fp8(x, scales_ld=16)
    assert torch.equal(qt.view(torch.uint8), q.view(torch.uint8)) and st.shape == (256 // 32, 16)
    assert torch.equal(st[:, :5], s.T)
    for b in (16, 32):
        assert torch.equal(triton_quant.fp4_quant(x, b), fp4_quant_ref(x, b))
    # grouped masked GEMM on FP4-origin experts, split-K path (fp32 workspace, no bf16 truncation)
    G, mmax, n, k = 2, 4, 64, 512
    packed = torch.randint(0, 256, (G, n, k // 2), dtype=torch.uint8)
    sc = torch.randint(120, 125, (G, n, k // 32), dtype=torch.uint8)
    ws = [triton_gemm.fp4_to_fp8_weight(packed[g], sc[g]) for g in range(G)]
    w8, s8 = torch.stack([a for a, _ in ws]), torch.stack([b for _, b in ws])
    xa = torch.randn(G, mmax, k).bfloat16()
    q, s = triton_quant.act_quant_fp8(xa.view(-1, k))
    d = triton_gemm.fp8_grouped_gemm_masked(q.view(G, mmax, k), s.view(G, mmax, k // 32), w8, s8,
                                            torch.tensor([3, 4], dtype=torch.int32), 4)
    for g, r in ((0, 3), (1, 4)):
        ref = torch.nn.functional.linear(act_quant_ref(xa[g, :r]).float(), dequant_fp4_ref(packed[g], sc[g]))
        assert rel(d[g, :r], ref) < 5e-3, rel(d[g, :r], ref)
    # sparse attention with splits and a fully masked query
    qa = torch.randn(2, 16, 64).bfloat16()
    kv = torch.randn(300, 64).bfloat16()
    sink = torch.randn(16)
    idx = torch.randint(-1, 300, (2, 300))
    idx[1] = -1
    o = triton_sparse_attn.sparse_attn(qa, kv, sink, idx, 0.125, block_h=16, blocks_per_split=2)
    r = sparse_attn_ref(qa, kv, sink, idx, 0.125)
    assert rel(o, r) < 2e-2 and torch.equal(o[1], r[1])
    # the same rows held in three tensors, read in place: the same bits as the concatenated buffer
    parts = (kv[:100], kv[100:101], kv[101:])
    o3 = triton_sparse_attn.sparse_attn(qa, parts, sink, idx, 0.125, block_h=16, blocks_per_split=2)
    assert torch.equal(o3, o), (o3.float() - o.float()).abs().max()
    o2 = triton_sparse_attn.sparse_attn(qa, (kv[:7], kv[7:]), sink, idx, 0.125, block_h=16, blocks_per_split=2)
    assert torch.equal(o2, o)
    # the default mode's occupancy split (other split points: close, not bitwise)
    oa = triton_sparse_attn.sparse_attn(qa, kv, sink, idx, 0.125, block_h=16, blocks_per_split=None)
    assert rel(oa, r) < 2e-2
    check_sparse_attn_unrope(qa, kv, sink, idx)
    # mHC: hc_post for every stream count (the release's 4 holds its residual tiles; others loop)
    for hc in (1, 2, 4):
        yp, rp = torch.randn(5, 96).bfloat16(), torch.randn(5, hc, 96).bfloat16()
        pp, cp = torch.rand(5, hc), torch.rand(5, hc, hc)
        assert rel(triton_mhc.hc_post(yp, rp, pp, cp), triton_mhc.hc_post_ref(yp, rp, pp, cp)) < 1e-2, hc
    scale, base = torch.rand(3) + 0.5, torch.randn(24) * 0.3
    for d in (256, 1280):       # 2 and 10 column-chunk partials (10: a masked tail in the chunk sum)
        xh = torch.randn(3, 4, d).bfloat16()
        fn = torch.randn(24, 4 * d) * 0.05 * (256 / d) ** 0.5
        pre_prev = torch.rand(3, 4)
        got = triton_mhc.hc_mixes_pre(xh, fn, scale, base, pre_prev, 20, 1e-6, 1e-20)
        ref = triton_mhc.hc_mixes_pre_ref(xh, fn, scale, base, pre_prev, 20, 1e-6, 1e-20)
        for a, b in zip(got[:3], ref[:3]):
            assert (a - b).abs().max() < 1e-5, d
        assert rel(got[3], ref[3]) < 1e-2
        *same, mean = triton_mhc.hc_mixes_pre(xh, fn, scale, base, pre_prev, 20, 1e-6, 1e-20, mean=True)
        assert all(torch.equal(a, b) for a, b in zip(same, got)) and rel(mean, xh.mean(dim=1)) < 1e-2, d
        one = triton_mhc.hc_mixes_pre(xh[:1], fn, scale, base, pre_prev[:1], 20, 1e-6, 1e-20)
        assert all(torch.equal(a[:1], b) for a, b in zip(got, one)), d      # a token's bits: not the batch's
        # deferred (Block.mixes_pre runs the tail beside the norm): the collapse at once, the mixes when called
        tail, y_first = triton_mhc.hc_mixes_pre(xh, fn, scale, base, pre_prev, 20, 1e-6, 1e-20, deferred=True)
        assert torch.equal(y_first, got[3]) and all(torch.equal(a, b) for a, b in zip(tail(), got[:3])), d
    mixes = torch.randn(3, 24)
    for a, b in zip(triton_mhc.hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6),
                    hc_split_sinkhorn_ref(mixes, scale, base, 4, 20, 1e-6)):
        assert (a - b).abs().max() < 1e-5
    # indexer
    qi = fp4_quant_ref(torch.randn(2, 32, 128).bfloat16(), 32)
    ki = fp4_quant_ref(torch.randn(150, 128).bfloat16(), 32)
    wi = (torch.randn(2, 32) * 0.02).bfloat16()
    lens = torch.tensor([20, 150])
    a, b = triton_indexer.index_scores(qi, wi, ki, lens), triton_indexer.index_scores_ref(qi, wi, ki, lens)
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin) and rel(a[fin], b[fin]) < 2e-2
    # per-token key ranges (decode batch, each token over its own sequence's keys)
    pool = fp4_quant_ref(torch.randn(2 * 150, 128).bfloat16(), 32)
    a = triton_indexer.index_scores(qi, wi, pool, lens, key_start=torch.tensor([0, 150]), num_keys=150)
    b0 = triton_indexer.index_scores_ref(qi[:1], wi[:1], pool[:150], lens[:1])
    b1 = triton_indexer.index_scores_ref(qi[1:], wi[1:], pool[150:], lens[1:])
    b = torch.cat([b0, b1])
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin) and rel(a[fin], b[fin]) < 2e-2
    # the model's batch form (select.index_scores_paged): keys [B, E, ID], each token its sequence's
    from deepinfer.kernels.reference import index_scores_paged_ref
    seq_of, row_in_seq = torch.tensor([0, 1]), torch.tensor([0, 0])
    a = triton_indexer.index_scores(qi, wi, pool, lens, key_start=seq_of * 150, num_keys=150)
    b = index_scores_paged_ref(qi, wi, pool.view(2, 150, 128), seq_of, row_in_seq, 1, lens)
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin) and rel(a[fin], b[fin]) < 2e-2
    # keys read in place through a row table (select.index_scores_pool): the gathered copy's bits
    rows = torch.randperm(2 * 150).view(2, 150)
    a = triton_indexer.index_scores(qi, wi, pool, lens, key_start=seq_of * 150, num_keys=150, rows=rows.flatten())
    g = triton_indexer.index_scores(qi, wi, pool[rows].flatten(0, 1), lens, key_start=seq_of * 150, num_keys=150)
    assert torch.equal(a, g)
    # keys read through the block tables (select.index_scores_pool): the row table's bits, every form
    # (per-token blocks, the decode form's runs of blocks, prefill runs); unallocated blocks (-1) and
    # entries past the table's width read what reference.block_rows_ref says
    from deepinfer.kernels.reference import block_rows_ref
    epb, E3, nblocks = 16, 150, 23
    pool3 = fp4_quant_ref(torch.randn(nblocks * epb, 128).bfloat16(), 32)
    bt = torch.randperm(nblocks)[:2 * 8].view(2, 8)   # 8 blocks of 16 = 128 < 150: the last column repeats
    bt[1, 3] = -1
    table_rows = block_rows_ref(bt, epb, torch.arange(E3).expand(2, -1))
    for kw in (dict(blocks_per_program=0), dict(), dict(runs=(torch.zeros(0, dtype=torch.int32),) * 2
                                                          + (torch.arange(2, dtype=torch.int32),))):
        want = triton_indexer.index_scores(qi, wi, pool3, lens, key_start=seq_of * E3, num_keys=E3,
                                           rows=table_rows.flatten(), **kw)
        got = triton_indexer.index_scores(qi, wi, pool3, lens, key_start=seq_of, num_keys=E3, block_table=bt,
                                          entries_per_block=epb, **kw)
        assert torch.equal(got, want), kw
    cu2 = [0, 20, 37]                            # two prompts' queries in runs (RUN_MIN 16) over their keys
    q2 = fp4_quant_ref(torch.randn(37, 32, 128).bfloat16(), 32)
    w2 = (torch.randn(37, 32) * 0.02).bfloat16()
    s2 = torch.tensor([0] * 20 + [1] * 17)
    l2 = torch.randint(1, E3 + 1, (37,))
    runs2 = tuple(torch.from_numpy(x) for x in triton_indexer.query_runs(cu2))
    want = triton_indexer.index_scores(q2, w2, pool3, l2, key_start=s2 * E3, num_keys=E3, rows=table_rows.flatten(),
                                       runs=runs2)
    got = triton_indexer.index_scores(q2, w2, pool3, l2, key_start=s2, num_keys=E3, block_table=bt,
                                      entries_per_block=epb, runs=runs2)
    assert torch.equal(got, want)
    # the select form: key_start the sequence times key_start_scale in the kernel, int32 lens as they are
    for ln in (lens, lens.to(torch.int32)):
        for r in (None, rows.flatten()):
            want = a if r is not None else triton_indexer.index_scores(qi, wi, pool, lens, key_start=seq_of * 150,
                                                                       num_keys=150)
            got = triton_indexer.index_scores(qi, wi, pool, ln, key_start=seq_of, key_start_scale=150, num_keys=150,
                                              rows=r)
            assert torch.equal(got, want), (ln.dtype, r is None)
    # W8A16 GEMM with raw E8M0 expert scales (grouped, masked)
    xq = triton_quant.act_quant(xa.view(-1, k)).view(G, mmax, k)
    w8e, s8e = zip(*[triton_gemm.fp4_to_fp8_weight(packed[g], sc[g], keep_e8m0=True) for g in range(G)])
    d2 = triton_gemm.w8a16_grouped_gemm_masked(xq, torch.stack(w8e), torch.stack(s8e),
                                               torch.tensor([3, 4], dtype=torch.int32), 4)
    for g, r in ((0, 3), (1, 4)):
        ref = torch.nn.functional.linear(act_quant_ref(xa[g, :r]).float(), dequant_fp4_ref(packed[g], sc[g]))
        assert rel(d2[g, :r], ref) < 8e-3, rel(d2[g, :r], ref)
    check_w8a16_variants()
    check_w8a16_rows()
    check_w8a16_dense_grouped()
    check_w4a16()
    check_w4a16_contiguous()
    check_bf16_skinny()
    check_pool_lists()
    check_router_topk()
    print("interpret checks passed")


if __name__ == "__main__":
    sys.exit(main())
