"""The day's Triton kernels compile for sm_90a (the H200) without a GPU: each wrapper runs on CPU tensors with its
kernels swapped for recorders, and every recorded launch is specialized as Triton's JIT would and compiled with
triton.compile for GPUTarget("cuda", 90) (perf/ptx_check.compile_call). The interpreter checks a kernel's
arithmetic but not its compilation (layouts, reshapes, joins, masked loads of pointer tensors); this catches a
kernel that cannot build on the device before any device is lent. FMA forms as on CUDA."""

import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for the GPU: not under the interpreter", allow_module_level=True)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))

import ptx_check  # noqa: E402


def _compile(module, names, call, expect: dict | None = None):
    """Run call() with module's kernels `names` recorded, then compile each recorded launch for sm_90a; expect:
    launch arguments each recorded launch must carry (the form under test was the one launched)."""
    calls = ptx_check.record_launches(module, names, call)
    assert calls, names
    for fn, _grid, args, kw in calls:
        assert all(kw.get(k) == v for k, v in (expect or {}).items()), (fn.__name__, expect)
        kw = dict(kw)
        if "FMA" in fn.arg_names:
            kw["FMA"] = True
        compiled = ptx_check.compile_call(fn, args, kw)
        assert compiled.asm.get("cubin"), fn.__name__
    return {fn.__name__ for fn, *_ in calls}


def _cis(n, half=32):
    ang = torch.rand(n, half)
    return torch.polar(torch.ones_like(ang), ang)


def test_norm_kernels():
    from deepinfer.kernels import triton_hc_collapse, triton_hc_post_norm, triton_norm, triton_norm_rope_quant
    x = torch.randn(64, 5120).bfloat16()
    _compile(triton_norm, ["rms_norm_kernel"], lambda: triton_norm.rms_norm_quant(x, torch.rand(5120), 1e-6))
    kv = torch.randn(64, 512).bfloat16()
    ring = torch.zeros(1024, 512).bfloat16()
    _compile(triton_norm_rope_quant, ["norm_rope_quant_kernel"], lambda: triton_norm_rope_quant.norm_rope_quant(
        kv, torch.rand(512), 1e-6, _cis(64), (ring, torch.arange(64))))
    h = torch.randn(64, 4, 4096).bfloat16()
    _compile(triton_hc_collapse, ["hc_pre_norm_kernel"], lambda: triton_hc_collapse.hc_pre_norm(
        h, torch.rand(64, 4), torch.arange(64), torch.rand(4096), 1e-6))
    y, res = torch.randn(64, 5120).bfloat16(), torch.randn(64, 4, 5120).bfloat16()
    for quant in (False, True):
        _compile(triton_hc_post_norm, ["hc_post_norm_kernel"], lambda: triton_hc_post_norm.hc_post_norm(
            y, res, torch.rand(64, 4), torch.rand(64, 4, 4), torch.rand(64, 4), torch.rand(5120), 1e-6, quant, quant),
            expect={"QUANT": True, "MEAN": True} if quant else None)     # the tap's mean with the rounding


def test_sparse_attn_unrope():
    from deepinfer.kernels import triton_sparse_attn as sa
    q = torch.randn(64, 64, 512).bfloat16()
    kv = torch.randn(4096, 512).bfloat16()
    idx = torch.randint(0, 4096, (64, 640), dtype=torch.int32)
    names = ["sparse_attn_kernel", "sparse_attn_combine_kernel"]
    got = _compile(sa, names, lambda: sa.sparse_attn(q, kv, torch.randn(64), idx, 0.04, blocks_per_split=4,
                                                      unrope=_cis(64)))
    assert got == set(names)                                            # the split form and its combine
    _compile(sa, names, lambda: sa.sparse_attn(q, (kv, kv[:64]), torch.randn(64), idx[:, :64], 0.04,
                                               blocks_per_split=4, unrope=_cis(64)))


def test_rope_fp4_and_lists():
    from deepinfer.kernels import triton_lists, triton_quant, triton_rope_fp4
    q = torch.randn(64, 64, 128).bfloat16()
    _compile(triton_rope_fp4, ["rope_fp4_quant_kernel"], lambda: triton_rope_fp4.rope_fp4_quant(q, _cis(64), 32))
    lat = torch.randn(16, 512).bfloat16()
    pool = torch.zeros(256, 512).bfloat16()
    _compile(triton_rope_fp4, ["rope_fp4_quant_kernel"], lambda: triton_rope_fp4.rope_fp4_quant(
        lat, _cis(16), 16, torch.arange(16), pool))
    _compile(triton_quant, ["fp4_quant_kernel"], lambda: triton_quant.fp4_quant(lat, 16))
    win = torch.randint(-1, 200, (64, 128))
    _compile(triton_lists, ["window_pool_kernel"], lambda: triton_lists.window_pool(win, torch.arange(150), 4096, 64))


def test_candidate_blocks():
    from deepinfer.kernels import triton_topk
    s = torch.randn(64, 8192).bfloat16()
    _compile(triton_topk, ["topk_kernel"], lambda: triton_topk.candidate_blocks(s, torch.full((64,), 8000), 16, 64))
    # the index top-k on 16-bit and fp32 keys, with a candidate mask
    for dtype in (torch.bfloat16, torch.float32):
        _compile(triton_topk, ["topk_kernel"], lambda: triton_topk.index_topk(
            s.to(dtype), torch.full((64,), 8000), 512, torch.rand(64, 8192) < 0.5))


def test_engram_compress_indexer_kernels():
    """The earlier glue kernels (written 2026-12-05 morning, also unmeasured): Engram's hash and rows, the
    compressor's member gather, the indexer's decode scores through the block tables."""
    from deepinfer.kernels import triton_compress, triton_engram, triton_indexer
    from test_triton_engram import _hash_case
    _compile(triton_engram, ["ngram_hash_kernel"], lambda: triton_engram.ngram_hash(*_hash_case("cpu", 1, 5, True)))
    w8 = torch.randint(0, 120, (300, 256), dtype=torch.uint8).view(torch.float8_e4m3fn)
    sc = torch.randint(110, 140, (300, 8), dtype=torch.uint8)
    _compile(triton_engram, ["engram_rows_kernel"], lambda: triton_engram.engram_rows(w8, sc, torch.randint(0, 300, (64,))))
    G, ratio, D, ring_len = 16, 4, 512, 256
    raw = [torch.randn(64, D) for _ in range(2)]
    carry = [torch.randn(65 * ring_len, D) for _ in range(2)]
    rows = torch.randint(-1, 64, (G, ratio))
    _compile(triton_compress, ["compress_members_kernel"], lambda: triton_compress.compress_members(
        *raw, *carry, rows, torch.where(rows < 0, 3, -1), torch.arange(64), torch.randint(0, 64, (G,)), ring_len))
    _compile(triton_compress, ["carry_write_kernel"], lambda: triton_compress.carry_write(
        *raw, *carry, torch.randperm(65 * ring_len)[:64]))
    _compile(triton_compress, ["compress_pool_kernel"], lambda: triton_compress.compress_pool(
        *raw, *carry, rows, torch.where(rows < 0, 3, -1), torch.arange(64), torch.randint(0, 64, (G,)), ring_len,
        torch.ones(D), 1e-20))
    q = torch.randn(64, 64, 128).bfloat16()
    pool = torch.randn(4096, 128).bfloat16()
    bt = torch.randint(0, 64, (64, 33), dtype=torch.int32)
    _compile(triton_indexer, ["index_scores_decode_kernel"], lambda: triton_indexer.index_scores(
        q, torch.randn(64, 64).bfloat16(), pool, torch.full((64,), 2000, dtype=torch.int32),
        key_start=torch.arange(64), num_keys=2048, block_table=bt, entries_per_block=64))


def test_mhc_fused_tail():
    """The mixes' fused tail (the chunk sums in chunk order, then Sinkhorn, in one kernel) at decode and
    prefill sizes."""
    from deepinfer.kernels import triton_mhc
    from test_mhc_indexer import _mhc_case
    for T in (64, 300):
        x, fn, scale, base, pre = _mhc_case(T, 5120, "cpu")
        _compile(triton_mhc, ["hc_mixes_pre_kernel", "hc_reduce_sinkhorn_kernel"], lambda: triton_mhc.hc_mixes_pre(
            x, fn, scale, base, pre, 20, 1e-6, 1e-20, tail="fused"))


def test_packed_index_keys():
    """The index keys as packed FP4 rows (the cache's form): the RoPE + FP4 kernel's packing pool write and the
    three score kernels' unpacking loads."""
    import numpy as np
    from deepinfer.kernels import triton_indexer, triton_rope_fp4
    from deepinfer.kernels.reference import fp4_rows_width
    k = torch.randn(64, 128).bfloat16()
    pool = torch.zeros(4096, fp4_rows_width(128), dtype=torch.uint8)
    _compile(triton_rope_fp4, ["rope_fp4_quant_kernel"], lambda: triton_rope_fp4.rope_fp4_quant(
        k, _cis(64), 32, torch.arange(64), pool))
    q = torch.randn(64, 64, 128).bfloat16()
    w = torch.randn(64, 64).bfloat16()
    bt = torch.randint(0, 64, (64, 33), dtype=torch.int32)
    lens = torch.full((64,), 2000, dtype=torch.int32)
    _compile(triton_indexer, ["index_scores_decode_kernel"], lambda: triton_indexer.index_scores(
        q, w, pool, lens, key_start=torch.arange(64), num_keys=2048, block_table=bt, entries_per_block=64))
    _compile(triton_indexer, ["index_scores_kernel"], lambda: triton_indexer.index_scores(
        q, w, pool, lens, key_start=torch.arange(64), num_keys=2048, block_table=bt, entries_per_block=64,
        blocks_per_program=0))
    cu = np.array([0, 64])
    runs = tuple(torch.from_numpy(a) for a in triton_indexer.query_runs(cu))
    _compile(triton_indexer, ["index_scores_runs_kernel"], lambda: triton_indexer.index_scores(
        q, w, pool, torch.arange(64, dtype=torch.int32) // 4 + 1, key_start=torch.zeros(64, dtype=torch.int64),
        num_keys=2048, block_table=bt[:1], entries_per_block=64, runs=runs))


def test_w4a16_contiguous():
    """The FP4 stacks' prefill GEMM at its default tiles for 256 and 62 rows an expert (BM 256 and 64), and at a
    small shape with N and K off the tiles."""
    from deepinfer.kernels import triton_fp4_contiguous as fc
    for e, n, k, rows in ((48, 4608, 5120, 12288), (48, 5120, 2304, 3000), (4, 96, 160, 70)):
        x = torch.zeros(rows, k).bfloat16()
        w = torch.zeros(e, n, k // 2, dtype=torch.uint8)
        s = torch.ones(e, n, k // 32, dtype=torch.uint8)
        counts = torch.full((e,), rows // e, dtype=torch.int32)
        _compile(fc, ["w4a16_contiguous_kernel"], lambda: fc.w4a16_grouped_contiguous(x, w, s, counts))
