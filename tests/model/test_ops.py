"""Op-level checks of the reference semantics with identical inputs: the mistakes the end-to-end
fixture rule cannot see (sink, YaRN, KV FP8 rounding, FP4 rounding, Sinkhorn order, candidate
blocks with the pinned newest block, Reindex masking, blockwise softmax rounding). Each op is
compared with a naive, loop-based restatement of the rule written here."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer import kernels as K
from deepinfer.model.attention import index_topk, select_candidate_blocks, window_lists

E4M3_MAX = 448.0


def naive_pow2_scale(amax: float, qmax: float, floor: float) -> float:
    x = max(amax, floor) * (1.0 / qmax) if qmax == 448.0 else max(amax, floor) * float(torch.tensor(1 / 6.0))
    x = float(torch.tensor(x, dtype=torch.float32))
    m, e = math.frexp(x)                          # x = m * 2^e, m in [0.5, 1)
    return 2.0 ** (e - 1) if m == 0.5 else 2.0 ** e


def test_act_quant_is_fp8_per_32_with_pow2_scale():
    torch.manual_seed(0)
    x = (torch.randn(4, 96) * torch.logspace(-6, 3, 96)).to(torch.bfloat16)
    x[1, :32] = 0                                 # all-zero block: amax floored at 1e-4
    got = K.act_quant_ref(x)
    for r in range(4):
        for b in range(3):
            blk = x[r, 32 * b:32 * b + 32].float()
            s = naive_pow2_scale(blk.abs().max().item(), 448.0, 1e-4)
            want = (blk / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
            assert torch.equal(got[r, 32 * b:32 * b + 32].float(), want.to(torch.bfloat16).float())
    # a block whose amax is exactly 448 * 2^k keeps scale 2^k (no spurious step up)
    y = torch.zeros(1, 32)
    y[0, 0] = 448.0 * 4
    y[0, 1] = 4 * 2 ** -9                         # the smallest e4m3 subnormal at scale 4; lost at scale 8
    assert K.act_quant_ref(y)[0, 0] == 448.0 * 4 and K.act_quant_ref(y)[0, 1] == 4 * 2 ** -9


def naive_e2m1(v: float) -> float:
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    a = min(abs(v), 6.0)
    dists = [abs(a - g) for g in grid]
    best = min(dists)
    cands = [i for i, d in enumerate(dists) if d == best]
    i = cands[0] if len(cands) == 1 else [c for c in cands if c % 2 == 0][0]    # tie -> even code
    return math.copysign(grid[i], v)


def test_e2m1_round_nearest_ties_to_even_code():
    vals = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.9, 0.26, 2.49, 6.0, -0.75, -5.0, -2.5, 0.0])
    got = K.e2m1_round(vals)
    want = torch.tensor([naive_e2m1(v) for v in vals.tolist()])
    assert torch.equal(got, want)


@pytest.mark.parametrize("block", [16, 32])
def test_fp4_quant_scales(block):
    torch.manual_seed(1)
    x = (torch.randn(3, 64) * 3).to(torch.bfloat16)
    got = K.fp4_quant_ref(x, block).float()
    for r in range(3):
        for b in range(64 // block):
            blk = x[r, block * b:block * (b + 1)].float()
            amax = blk.abs().max().item()
            if block == 16:       # e4m3 scale of max(amax, 6*2^-9) / 6
                s = torch.tensor(max(amax, 6 * 2 ** -9) / 6, dtype=torch.float32).to(torch.float8_e4m3fn).float().item()
            else:                 # power of two
                s = naive_pow2_scale(amax, 6.0, 6 * 2 ** -126)
            want = torch.tensor([naive_e2m1(min(max(v / s, -6), 6)) * s for v in blk.tolist()])
            assert torch.equal(got[r, block * b:block * (b + 1)], want.to(torch.bfloat16).float()), (r, b)


def test_fp8_and_fp4_weight_dequant_layout():
    codes = torch.tensor([[0x21, 0xF9]], dtype=torch.uint8).view(torch.int8)   # low nibble = even element
    scale = torch.tensor([[128]], dtype=torch.uint8)                            # 2^1
    w = K.dequant_fp4_ref(torch.cat([codes] + [torch.zeros(1, 14, dtype=torch.int8)], 1), scale)
    assert w[0, :4].tolist() == [1.0, 2.0, -1.0, -12.0]   # 0x1->0.5, 0x2->1.0, 0x9->-0.5, 0xF->-6.0 (x2)
    wf8 = torch.full((40, 40), 1.0).to(torch.float8_e4m3fn)
    s = torch.tensor([[127, 128], [126, 130]], dtype=torch.uint8)
    d = K.dequant_fp8_ref(wf8, s)
    assert d[0, 0] == 1 and d[0, 39] == 2 and d[39, 0] == 0.5 and d[39, 39] == 8


def test_e2m1_decode_covers_every_code_without_a_table():
    """e2m1_values (graph-capturable: no host table) gives E2M1_GRID's value for all 16 codes, bit 3 the
    sign (code 8 is -0.0), and every packed byte decodes to its two nibbles in order."""
    from deepinfer.kernels.reference import E2M1_GRID, e2m1_values
    codes = torch.arange(16, dtype=torch.uint8)
    want = torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID))
    got = e2m1_values(codes)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    allbytes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 256)
    w = K.dequant_fp4_ref(allbytes, torch.full((1, 16), 127, dtype=torch.uint8))      # scale 2^0
    assert torch.equal(w.view(256, 2), torch.stack([want[torch.arange(256) & 15], want[torch.arange(256) >> 4]], 1))


def naive_sparse_attn(q, kv, sink, idx, scale, block=64):
    """Loop restatement of the kernel: blocks of 64 in list order, running max, P rounded to bf16
    for P.V, fp32 P summed in the denominator, exp(sink - m) added at the end."""
    n, H, D = q.shape
    out = torch.zeros(n, H, D)
    for i in range(n):
        for h in range(H):
            m, den, acc = -math.inf, 0.0, torch.zeros(D)
            ids = idx[i].tolist()
            for b0 in range(0, len(ids), block):
                blk = [j for j in ids[b0:b0 + block] if j >= 0]
                if not blk:
                    continue
                s = torch.stack([(q[i, h].float() * kv[j].float()).sum() * scale for j in blk])
                m_new = max(m, s.max().item())
                alpha = math.exp(m - m_new) if m > -math.inf else 0.0
                p = torch.exp(s - m_new)
                den = den * alpha + p.sum().item()
                acc = acc * alpha + (p.to(torch.bfloat16).float()[:, None] * kv[blk].float()).sum(0)
                m = m_new
            out[i, h] = acc / (den + math.exp(sink[h].item() - m)) if m > -math.inf else 0
    return out


def test_sparse_attn_matches_kernel_rounding():
    torch.manual_seed(2)
    n, H, D, M = 3, 2, 16, 150
    q = (torch.randn(n, H, D) * 2).to(torch.bfloat16)
    kv = torch.randn(M, D).to(torch.bfloat16)
    sink = torch.randn(H)
    idx = torch.randint(0, M, (n, 140))
    idx[0, :70] = -1
    idx[1, 100:] = -1
    got = K.sparse_attn_ref(q.float(), kv, sink, idx, D ** -0.5)      # fp32 q: output not rounded
    want = naive_sparse_attn(q, kv, sink, idx, D ** -0.5)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    # rounding of P is relative to the RUNNING max: a one-shot softmax differs measurably
    s = torch.einsum("nhd,nld->nhl", q.float(), kv[idx.clamp_min(0)].float()) * D ** -0.5
    s = s.masked_fill(idx[:, None] < 0, -math.inf)
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    oneshot = torch.einsum("nhl,nld->nhd", p.bfloat16().float(), kv[idx.clamp_min(0)].float())
    oneshot = oneshot / (p.sum(-1, keepdim=True) + torch.exp(sink[None, :, None] - m))
    assert (got - want).abs().max() < (oneshot - want).abs().max() + 1e-6


def test_sink_only_in_denominator():
    D = 8
    q = torch.zeros(1, 1, D, dtype=torch.bfloat16)            # all scores 0 -> m = 0
    kv = torch.ones(4, D, dtype=torch.bfloat16) * 2
    for sink in (-3.0, 0.0, 2.0):
        o = K.sparse_attn_ref(q, kv, torch.tensor([sink]), torch.tensor([[0, 1, 2, 3]]), 1.0)
        want = 2 * 4 / (4 + math.exp(sink))
        assert abs(o[0, 0, 0].item() - want) < 1e-2 * want


def test_yarn_frequencies():
    dim, orig, base, factor = 16, 65536, 160000.0, 16.0
    plain = K.rope_freqs_ref(dim, 2, 0, base, factor, 32, 1)
    yarn = K.rope_freqs_ref(dim, 2, orig, base, factor, 32, 1)
    f_plain = torch.angle(plain[1]).double()
    f_yarn = torch.angle(yarn[1]).double()

    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), dim - 1)
    for i in range(dim // 2):
        inv = 1.0 / base ** (2 * i / dim)
        ramp = min(max((i - low) / max(high - low, 1e-3), 0), 1)
        want = inv / factor * ramp + inv * (1 - ramp)
        assert abs(f_yarn[i].item() - want) < 1e-6 * max(want, 1e-3), i
    assert torch.allclose(f_plain[:1], f_yarn[:1])          # high-frequency dims untouched
    assert f_yarn[-1] < f_plain[-1] / 2                      # low-frequency dims stretched


def test_rope_adjacent_pairs_and_inverse():
    x = torch.arange(8, dtype=torch.float32).view(1, 8)
    cis = torch.polar(torch.ones(1, 2), torch.tensor([[math.pi / 2, math.pi]]))
    y = K.rope_ref(x, cis)                      # last 4 dims: pairs (4,5) and (6,7)
    assert torch.allclose(y[0, :4], x[0, :4])
    assert torch.allclose(y[0, 4:], torch.tensor([-5.0, 4.0, -6.0, -7.0]), atol=1e-5)
    assert torch.allclose(K.rope_ref(y, cis, inverse=True), x, atol=1e-5)


def test_sinkhorn_order_ends_on_columns():
    torch.manual_seed(3)
    hc, iters, eps = 4, 20, 1e-6
    mixes, scale, base = torch.randn(5, (2 + hc) * hc), torch.rand(3) + 0.5, torch.randn((2 + hc) * hc)
    pre, post, comb = K.hc_split_sinkhorn_ref(mixes, scale, base, hc, iters, eps)
    for t in range(5):
        m = mixes[t]
        c = [[math.exp(m[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j]) for j in range(hc)]
             for i in range(hc)]
        c = [[v / sum(row) + eps for v in row] for row in c]                     # row softmax + eps
        col = lambda c: [[c[i][j] / (sum(c[k][j] for k in range(hc)) + eps) for j in range(hc)] for i in range(hc)]  # noqa
        row = lambda c: [[c[i][j] / (sum(c[i]) + eps) for j in range(hc)] for i in range(hc)]  # noqa
        c = col(c)
        for _ in range(iters - 1):
            c = col(row(c))
        assert torch.allclose(comb[t], torch.tensor(c), atol=1e-6)
        want_pre = torch.sigmoid(m[:hc] * scale[0] + base[:hc]) + eps
        assert torch.allclose(pre[t], want_pre) and torch.allclose(post[t], 2 * torch.sigmoid(m[hc:2 * hc] * scale[1] + base[hc:2 * hc]))
    assert torch.allclose(comb.sum(-2), torch.ones(5, hc), atol=1e-5)             # columns normalized last


def test_candidate_blocks_pin_the_newest_block():
    # 20 entries, blocks of 4; the query sees 18 entries: newest block (16..19) has low scores
    s = torch.arange(20, 0, -1, dtype=torch.float32).view(1, 20)
    lens = torch.tensor([18])
    s = s.masked_fill(torch.arange(20) >= 18, -math.inf)
    keep = select_candidate_blocks(s, lens, 2, 4)
    assert keep[0, 16] and keep[0, 17]                        # pinned although it scores lowest
    assert keep[0, :4].all() and not keep[0, 4:16].any()      # plus the best other block only
    # fewer reachable blocks than topk: unreachable (-inf) blocks are not kept
    s2 = torch.zeros(1, 20).masked_fill(torch.arange(20) >= 6, -math.inf)
    keep2 = select_candidate_blocks(s2, torch.tensor([6]), 4, 4)
    assert keep2[0, :8].all() and not keep2[0, 8:].any()


def test_reindex_picks_only_inside_candidates():
    torch.manual_seed(4)
    score = torch.randn(2, 40)
    lens = torch.tensor([40, 40])
    cand = torch.zeros(2, 40, dtype=torch.bool)
    cand[:, 8:16] = True
    cand[:, 32:40] = True
    picks = index_topk(score, lens, 10, cand)
    assert (picks >= 0).all() and cand.gather(1, picks).all()
    free = index_topk(score, lens, 10)
    assert not cand.gather(1, free).all()                    # without the mask it would pick elsewhere
    # unreachable picks come back -1
    short = index_topk(score.masked_fill(torch.arange(40) >= 5, -math.inf), torch.tensor([5, 5]), 8)
    assert (short[:, 5:] == -1).all() and (short[:, :5] >= 0).all()


def test_window_lists_layouts():
    pre = window_lists(0, 5, 4, 0, "cpu")          # prefill layout: valid first, pads after
    assert pre.tolist()[0] == [0, -1, -1, -1] and pre.tolist()[4] == [1, 2, 3, 4]
    dec = window_lists(2, 1, 4, 0, "cpu")          # decode layout: pads first (ring still filling)
    assert dec.tolist() == [[-1, 0, 1, 2]]


def test_caches_hold_rounded_values(bf16_model):
    """Window KV is FP8-rounded over all head_dim dims (RoPE part included); compressed KV is FP4
    with 16-wide e4m3 scales, index keys FP4 with 32-wide pow2 scales (idempotent re-rounding)."""
    from deepinfer.model.simple import SequenceRunner
    torch.manual_seed(5)
    model, args = bf16_model, bf16_model.args
    ids = torch.randint(0, 1000, (40,)).tolist()
    r = SequenceRunner(model, 64)
    r.step(ids)
    c = r.caches
    for layer in (0, 2, 6):
        ring = c.window_kv[layer][0, :40].float()
        assert torch.equal(K.act_quant_ref(ring), ring)
        assert not torch.equal(ring, ring.bfloat16().float() * 0)
    for src in args.kv_source_layers:
        n = 40 // args.compress_ratios[src]
        kv = c.read_entries(c.compressed_kv, src, r.block_table[0], n).float()
        ik = c.read_entries(c.index_k, src, r.block_table[0], n).float()
        assert torch.equal(K.fp4_quant_ref(kv, 16), kv) and kv.abs().sum() > 0
        assert torch.equal(K.fp4_quant_ref(ik, 32), ik) and ik.abs().sum() > 0
