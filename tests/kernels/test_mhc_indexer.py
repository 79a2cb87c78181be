import os
import subprocess
import sys

import pytest
import torch

from deepinfer.kernels.reference import fp4_quant_ref, hc_split_sinkhorn_ref

from kernel_utils import rel_err


@pytest.mark.gpu
@pytest.mark.parametrize("T,d", [(1, 5120), (64, 5120), (300, 5120), (2048, 256)])
def test_hc_mixes_pre(T, d):
    """T >= 1024 takes BT=64 (once out of shared memory on the H200: the small preset's prefill)."""
    from deepinfer.kernels.triton_mhc import hc_mixes_pre, hc_mixes_pre_ref
    hc = 4
    x = torch.randn(T, hc, d, device="cuda").bfloat16()
    fn = torch.randn(24, hc * d, device="cuda") * 0.01
    scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda") * 0.3
    pre_prev = torch.rand(T, hc, device="cuda")
    out = hc_mixes_pre(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20)
    ref = hc_mixes_pre_ref(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20)
    for a, b in zip(out[:3], ref[:3]):
        assert (a - b).abs().max().item() < 1e-4
    assert rel_err(out[3], ref[3]) < 1e-3


@pytest.mark.gpu
def test_hc_mixes_pre_batch_invariant_rows():
    """batch_invariant: a token's outputs are the same bits in a 17-token call and a 1,317-token one
    (the default mode's taller tile at T >= 1,024 changes them)."""
    from deepinfer.kernels.triton_mhc import hc_mixes_pre
    hc, d, T = 4, 256, 1317
    x = torch.randn(T, hc, d, device="cuda").bfloat16()
    fn = torch.randn(24, hc * d, device="cuda") * 0.01
    scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda") * 0.3
    pre_prev = torch.rand(T, hc, device="cuda")
    whole = hc_mixes_pre(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20, batch_invariant=True)
    part = hc_mixes_pre(x[:17], fn, scale, base, pre_prev[:17], 20, 1e-6, 1e-20, batch_invariant=True)
    for a, b in zip(whole, part):
        assert torch.equal(a[:17], b)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 1500])
def test_hc_mixes_pre_mean_tap(T):
    """mean=True: the same four outputs, plus x.mean(dim=1) (the DSpark tap) bit for bit."""
    from deepinfer.kernels.triton_mhc import hc_mixes_pre
    hc, d = 4, 5120
    x = torch.randn(T, hc, d, device="cuda").bfloat16()
    fn = torch.randn(24, hc * d, device="cuda") * 0.01
    scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda") * 0.3
    pre_prev = torch.rand(T, hc, device="cuda")
    plain = hc_mixes_pre(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20)
    *same, mean = hc_mixes_pre(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20, mean=True)
    for a, b in zip(same, plain):
        assert torch.equal(a, b)
    assert torch.equal(mean, x.mean(dim=1))


@pytest.mark.gpu
def test_sinkhorn_and_post():
    from deepinfer.kernels.triton_mhc import hc_post, hc_post_ref, hc_split_sinkhorn
    scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda")
    for T in (1, 31, 100, 257):                     # off the kernel's 128-token tile; against fp64
        mixes = torch.randn(T, 24, device="cuda") * 3
        exact = hc_split_sinkhorn_ref(mixes.double(), scale.double(), base.double(), 4, 20, 1e-6)
        for a, b in zip(hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6), exact):
            assert (a.double() - b).abs().max().item() < 1e-5, T
    T, d = 64, 5120
    y = torch.randn(T, d, device="cuda").bfloat16()
    res = torch.randn(T, 4, d, device="cuda").bfloat16()
    _, post, comb = hc_split_sinkhorn_ref(torch.randn(T, 24, device="cuda"), scale, base, 4, 20, 1e-6)
    assert rel_err(hc_post(y, res, post, comb), hc_post_ref(y, res, post, comb)) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("n,E", [(1, 4096), (64, 2048), (3, 333)])
def test_index_scores(n, E):
    from deepinfer.kernels.triton_indexer import index_scores, index_scores_ref
    q = fp4_quant_ref(torch.randn(n, 32, 128, device="cuda").bfloat16(), 32)
    k = fp4_quant_ref(torch.randn(E, 128, device="cuda").bfloat16(), 32)
    w = (torch.randn(n, 32, device="cuda") * 0.02).bfloat16()
    lens = torch.randint(1, E + 1, (n,), device="cuda")
    out, ref = index_scores(q, w, k, lens), index_scores_ref(q, w, k, lens)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), fin)
    assert rel_err(out[fin], ref[fin]) < 5e-3
    # the top-k picks agree (ties aside)
    kk = min(512, E)
    a = out.float().topk(kk, -1).values
    b = ref.float().topk(kk, -1).values
    assert rel_err(a[torch.isfinite(b)], b[torch.isfinite(b)]) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("B,E", [(1, 4096), (64, 2048), (3, 333)])
def test_index_scores_pool_reads_keys_in_place(B, E):
    """select.index_scores_pool: keys read through a row table (the model's decode path) give the
    bits of the same kernel on the gathered [B, E, ID] copy, and the reference's values."""
    from deepinfer.kernels.reference import index_scores_paged_ref
    from deepinfer.kernels.triton_indexer import index_scores
    pool = fp4_quant_ref(torch.randn(B * E + 7, 128, device="cuda").bfloat16(), 32)
    rows = torch.randperm(B * E + 7, device="cuda")[:B * E].view(B, E)
    q = fp4_quant_ref(torch.randn(B, 32, 128, device="cuda").bfloat16(), 32)
    w = (torch.randn(B, 32, device="cuda") * 0.02).bfloat16()
    lens = torch.randint(1, E + 1, (B,), device="cuda")
    seq_of = torch.arange(B, device="cuda")
    paged = index_scores(q, w, pool, lens, key_start=seq_of * E, num_keys=E, rows=rows.flatten())
    gathered = index_scores(q, w, pool[rows].flatten(0, 1), lens, key_start=seq_of * E, num_keys=E)
    assert torch.equal(paged, gathered)
    ref = index_scores_paged_ref(q, w, pool[rows], seq_of, torch.zeros_like(seq_of), 1, lens)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(paged), fin)
    assert rel_err(paged[fin], ref[fin]) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("B,E,epb", [(1, 4096, 64), (64, 2048, 32), (3, 333, 16)])
def test_index_scores_pool_reads_through_block_tables(B, E, epb):
    """select.index_scores_pool (the model's path): keys read through the block tables, the rows computed
    in the kernel, give the row table's bits (reference.block_rows_ref), with unallocated blocks and a
    table narrower than E; int32 and int64 lens alike."""
    from deepinfer.kernels.reference import block_rows_ref, fp4_pack_rows_ref
    from deepinfer.kernels.select import index_scores_pool
    from deepinfer.kernels.triton_indexer import index_scores
    width = max(1, (E - 1) // epb)                 # one column short: the last one serves the tail
    nblocks = B * width + 5
    pool = fp4_quant_ref(torch.randn(nblocks * epb, 128, device="cuda").bfloat16(), 32)
    bt = torch.randperm(nblocks, device="cuda")[:B * width].view(B, width)
    bt[0, 0] = -1
    q = fp4_quant_ref(torch.randn(B, 32, 128, device="cuda").bfloat16(), 32)
    w = (torch.randn(B, 32, device="cuda") * 0.02).bfloat16()
    lens = torch.randint(1, E + 1, (B,), device="cuda")
    seq_of = torch.arange(B, device="cuda")
    rows = block_rows_ref(bt, epb, torch.arange(E, device="cuda").expand(B, -1))
    want = index_scores(q, w, pool, lens, key_start=seq_of * E, num_keys=E, rows=rows.flatten())
    for ln in (lens, lens.to(torch.int32)):
        got = index_scores_pool(q, w, pool, bt, epb, E, seq_of, torch.zeros_like(seq_of), 1, ln)
        assert torch.equal(got, want)
    packed = fp4_pack_rows_ref(pool)                 # the cache's form: packed FP4 rows, the same bits
    assert torch.equal(index_scores_pool(q, w, packed, bt, epb, E, seq_of, torch.zeros_like(seq_of), 1, lens), want)


# ---- hc_mixes_pre launch variants (triton_mhc.mix_variant; perf/bench_mhc_variants.py times them) ----

VARIANTS = [
    {"dot": "bf16x3"},
    {"chunks_per_program": 2, "dot": "tf32x3", "bt": 32},
    {"bt": 32, "bk": 64, "chunks_per_program": 4, "num_stages": 2, "dot": "bf16x3"},
    {"bt": 64, "bk": 64, "chunks_per_program": 4, "num_stages": 3, "dot": "tf32x3"},
    {"bt": 128, "bk": 64, "num_warps": 8, "chunks_per_program": 2, "num_stages": 2, "dot": "bf16x3"},
    {"dot": "bf16x3n"},
    {"bt": 16, "bk": 64, "chunks_per_program": 4, "num_stages": 2, "dot": "bf16x3n"},
    {"bt": 128, "bk": 64, "num_warps": 8, "chunks_per_program": 8, "num_stages": 2, "dot": "bf16x3n"},
    {"bt": 64, "bk": 64, "dot": "bf16x3n", "tail": "fused"},
    {"bt": 128, "bk": 64, "num_warps": 8, "chunks_per_program": 8, "num_stages": 2, "dot": "bf16x3n", "tail": "fused"},
]


def _mhc_case(T, d, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, 4, d, device=device, generator=g).bfloat16()
    fn = torch.randn(24, 4 * d, device=device, generator=g) * 0.05 * (256 / d) ** 0.5
    scale = torch.rand(3, device=device, generator=g) + 0.5
    base = torch.randn(24, device=device, generator=g) * 0.3
    return x, fn, scale, base, torch.rand(T, 4, device=device, generator=g)


def test_bf16_parts_exact():
    """fn's three bf16 parts sum to fn exactly (fp64 sum) over fp32's range down to 2^-110 and up to
    bf16's max, and within half a bf16 subnormal step below that."""
    from deepinfer.kernels.triton_mhc import bf16_parts
    g = torch.Generator().manual_seed(0)
    mant = 1 + torch.rand(200_000, generator=g, dtype=torch.float64)
    expo = torch.randint(-110, 127, (200_000,), generator=g).double()
    sign = torch.where(torch.rand(200_000, generator=g) < 0.5, -1.0, 1.0).double()
    fn = (sign * mant * 2.0 ** expo).float()
    fn = fn[fn.abs() < 3.38e38]                      # past bf16's max the hi part rounds to inf
    fn = torch.cat([fn, torch.tensor([0.0, -0.0, 1.0, -1.5, 3.0e38, 2.0 ** -110, 1 + 2.0 ** -23, 0.1, -1 / 3])])
    parts = bf16_parts(fn)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, fn.numel())
    total = parts.double().sum(0)
    assert torch.equal(total, fn.double()), (total - fn.double()).abs().max()
    tiny = (torch.rand(10_000, generator=g, dtype=torch.float64) * 2.0 ** -110).float()
    err = (bf16_parts(tiny).double().sum(0) - tiny.double()).abs().max().item()
    assert err <= 2.0 ** -134


def test_mix_variant_defaults_and_prefill_merge(monkeypatch):
    """No keywords: bt 16 (64 from T 64 unless batch invariant; bk 128; one chunk; tf32x3), then
    SIZE_VARIANTS' tiles for T, then PREFILL_VARIANT from T 1,024 or DECODE_VARIANT below it, in the
    default mode only; keywords win over them; the chunk count falls to one that tiles d, set by d and
    the keywords alone."""
    from deepinfer.kernels import triton_mhc
    invariant = triton_mhc.mix_variant(8192, 5120, batch_invariant=True)
    assert invariant["bt"] == 16 and invariant["dot"] == "tf32x3"
    monkeypatch.setattr(triton_mhc, "SIZE_VARIANTS", [(1, 256, {"bk": 64}), (4096, None, {"num_warps": 8})])
    assert triton_mhc.mix_variant(8192, 5120) == {**invariant, "bt": 64, "num_warps": 8, **triton_mhc.PREFILL_VARIANT}
    assert triton_mhc.mix_variant(4096, 5120)["num_warps"] == 8 and triton_mhc.mix_variant(4095, 5120)["num_warps"] == 4
    assert triton_mhc.mix_variant(64, 5120) == {**invariant, "bt": 64, "bk": 64, **triton_mhc.DECODE_VARIANT}
    assert triton_mhc.mix_variant(256, 5120)["bk"] == 64 and triton_mhc.mix_variant(257, 5120)["bk"] == 128
    assert triton_mhc.mix_variant(64, 5120, batch_invariant=True) == invariant
    monkeypatch.setattr(triton_mhc, "DECODE_VARIANT", {"bk": 128})           # the tables win over the tiers
    assert triton_mhc.mix_variant(64, 5120)["bk"] == 128
    monkeypatch.setattr(triton_mhc, "SIZE_VARIANTS", [])
    monkeypatch.setattr(triton_mhc, "PREFILL_VARIANT", {})
    monkeypatch.setattr(triton_mhc, "DECODE_VARIANT", {})
    base = {"bk": 128, "num_warps": 4, "num_stages": 1, "chunks_per_program": 1, "dot": "tf32x3", "tail": "split"}
    assert triton_mhc.mix_variant(16, 5120) == {"bt": 16, **base}
    assert triton_mhc.mix_variant(64, 5120) == {"bt": 64, **base}
    assert triton_mhc.mix_variant(1024, 5120) == {"bt": 64, **base}
    assert triton_mhc.mix_variant(4096, 5120, batch_invariant=True) == {"bt": 16, **base}
    assert triton_mhc.mix_variant(64, 192)["bk"] == 64
    pick = {"bt": 32, "chunks_per_program": 4, "num_stages": 2, "dot": "bf16x3"}
    monkeypatch.setattr(triton_mhc, "PREFILL_VARIANT", pick)
    assert triton_mhc.mix_variant(1023, 5120) == {"bt": 64, **base}
    assert triton_mhc.mix_variant(8192, 5120) == {**base, **pick}
    assert triton_mhc.mix_variant(8192, 5120, batch_invariant=True) == {"bt": 16, **base}
    assert triton_mhc.mix_variant(8192, 5120, dot="tf32x3")["dot"] == "tf32x3"
    assert triton_mhc.mix_variant(8192, 1280)["chunks_per_program"] == 2          # 10 chunks of 128
    assert triton_mhc.mix_variant(8192, 1280, bk=96)["bk"] == 128                 # 96 does not divide 1280
    with pytest.raises(AssertionError):
        triton_mhc.mix_variant(64, 5120, dot="fp16")
    with pytest.raises(AssertionError):
        triton_mhc.mix_variant(64, 5120, tail="one")


def test_fn_parts_cached_per_weight():
    """The bf16 split runs once per weight tensor, again after an in-place write (into the same parts
    tensor: a captured graph reads it), and leaves the cache with the tensor."""
    import gc
    from deepinfer.kernels import triton_mhc
    fn = torch.randn(24, 1024)
    a = triton_mhc._fn_parts(fn)
    assert triton_mhc._fn_parts(fn) is a and torch.equal(a.double().sum(0), fn.double())
    fn.mul_(2)
    b = triton_mhc._fn_parts(fn)
    assert b is a and torch.equal(b.double().sum(0), fn.double())
    key = id(fn)
    del fn
    gc.collect()
    assert key not in triton_mhc._PARTS


def _interpret_variants():
    """Under TRITON_INTERPRET=1 (CPU; run by the test below): every variant against the reference at tiny
    shapes (d 1,280: ten chunks, so chunks_per_program 4 falls back to 2), the mean tap's extra output,
    and a token's bits alike in a 3-token call and a 1-token one."""
    from deepinfer.kernels import triton_mhc
    for d in (256, 1280):
        x, fn, scale, base, pre_prev = _mhc_case(3, d, "cpu")
        ref = triton_mhc.hc_mixes_pre_ref(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20)
        plain = triton_mhc.hc_mixes_pre(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20)
        for kw in VARIANTS:
            got = triton_mhc.hc_mixes_pre(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20, **kw)
            for a, b, c in zip(got[:3], ref[:3], plain[:3]):
                assert (a - b).abs().max() < 1e-5 and (a - c).abs().max() < 1e-6, (d, kw)
            assert rel_err(got[3], ref[3]) < 1e-2 and torch.equal(got[3], plain[3]), (d, kw)
            *same, mean = triton_mhc.hc_mixes_pre(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20, mean=True, **kw)
            assert all(torch.equal(a, b) for a, b in zip(same, got)) and rel_err(mean, x.mean(dim=1)) < 1e-2
            one = triton_mhc.hc_mixes_pre(x[:1], fn, scale, base, pre_prev[:1], 20, 1e-6, 1e-20, **kw)
            assert all(torch.equal(a[:1], b) for a, b in zip(got, one)), (d, kw)
    print("ok")


def test_hc_mixes_pre_variants_interpreted():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600,
                       cwd=os.path.dirname(__file__))
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
@pytest.mark.parametrize("T,d", [(1, 5120), (64, 5120), (300, 5120), (2048, 256), (1100, 1280)])
def test_hc_mixes_pre_variant(T, d, kw):
    """Each variant against the reference as tight as the default (bf16x3: exact products, so fp32-level
    mixes), the mean tap from the same call, and its rows batch invariant under fixed keywords."""
    from deepinfer.kernels.triton_mhc import hc_mixes_pre, hc_mixes_pre_ref
    x, fn, scale, base, pre_prev = _mhc_case(T, d, "cuda")
    out = hc_mixes_pre(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20, **kw)
    ref = hc_mixes_pre_ref(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20)
    for a, b in zip(out[:3], ref[:3]):
        assert (a - b).abs().max().item() < 1e-4
    assert rel_err(out[3], ref[3]) < 1e-3
    *same, mean = hc_mixes_pre(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20, mean=True, **kw)
    assert all(torch.equal(a, b) for a, b in zip(same, out)) and torch.equal(mean, x.mean(dim=1))
    part = hc_mixes_pre(x[:17], fn, scale, base, pre_prev[:17], 20, 1e-6, 1e-20, batch_invariant=True, **kw)
    whole = hc_mixes_pre(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20, batch_invariant=True, **kw)
    for a, b in zip(whole, part):
        assert torch.equal(a[:17], b)


@pytest.mark.gpu
def test_hc_mixes_pre_bf16x3_accuracy():
    """bf16x3 against the contract computed in fp64: at fp32 level, like tf32x3 (on the CPU: fp32 5e-7 off;
    fn rounded to bf16 alone, 3e-3)."""
    from deepinfer.kernels.triton_mhc import hc_mixes_pre
    x, fn, scale, base, pre_prev = _mhc_case(256, 5120, "cuda")
    xd = x.flatten(1).double()
    mixes = (xd @ fn.double().T) * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-20)
    exact = hc_split_sinkhorn_ref(mixes, scale.double(), base.double(), 4, 20, 1e-6)
    errs = {}
    for dot in ("tf32x3", "bf16x3", "bf16x3n"):
        out = hc_mixes_pre(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20, dot=dot)
        errs[dot] = max((a.double() - b).abs().max().item() for a, b in zip(out[:3], exact))
    for dot in ("bf16x3", "bf16x3n"):
        assert errs[dot] < 1e-5 and errs[dot] <= 2 * errs["tf32x3"] + 1e-6, errs


if __name__ == "__main__":
    _interpret_variants()
