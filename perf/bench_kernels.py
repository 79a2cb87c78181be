"""Per-op GPU benchmark: each fast op against its roofline (bytes over the measured copy bandwidth,
or FLOPs over the measured matmul rate, whichever is larger) and against the library kernel where
one exists (DeepGEMM FP8 GEMM / masked grouped GEMM, FlashMLA sparse decode), plus the torch path
the model uses today. All ratios come from this one run.

    python perf/bench_kernels.py [--quick]      (writes kernels.json, kernels.md, kernels_*.png to $OUT)
    python perf/bench_kernels.py --only variants [--variants v1,v2,v3]
                                                 W8A16 kernel variants side by side with DeepGEMM

The `variants` part times each W8A16 variant (triton_gemm.W8A16_VARIANTS: v1 = Triton's e4m3 -> bf16
conversion, v2/v3 = integer/bf16x2 dequant with every load pipelined; perf/ptx_check.py shows what each
compiles to) on the FP8 linears (E8M0 scales, as the checkpoint) and the masked MoE shapes, in one run,
against DeepGEMM, printing vN/v1 and DeepGEMM/vN ratios (without --no-sweep also the best of a few tile
configs per variant).

Shapes are DeepSeek-V4.1-Flash's (dim 5120, 64 heads x 512, q_lora 1280, o_lora 8 x 1024, MoE
inter 2304, 384 experts; EP8 -> 48 local experts), decode batches as tokens per GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import copies_for, measure_ceilings, out_dir, save_json, time_calls  # noqa: E402

from deepinfer.kernels import deepgemm, flashmla, triton_gemm, triton_indexer, triton_mhc, triton_quant  # noqa: E402
from deepinfer.kernels import triton_sparse_attn as tsa  # noqa: E402
from deepinfer.kernels import triton_router, triton_topk  # noqa: E402
from deepinfer.kernels.reference import E2M1_GRID, act_quant_ref, e8m0_to_float, fp4_quant_ref, sparse_attn_ref  # noqa: E402
from deepinfer.kernels.reference import index_topk_ref, router_topk_ref, topk_block_mask_ref  # noqa: E402
from deepinfer.kernels.select import row_scaled_fp8_weight  # noqa: E402

ROWS: list[dict] = []
C: dict = {}


def time_deepgemm_linear(q, sa, wdg, name: str, M: int):
    """DeepGEMM fp8_gemm_nt on our per-32 activation re-expressed per 128 (None where it fails)."""
    q128, sa128 = deepgemm.act_reblock_128(q, sa)
    sa128 = deepgemm.prepare_sfa(sa128)
    try:
        return time_calls([lambda w=w, s=s: deepgemm.fp8_gemm_nt(q128, sa128, w, s) for w, s in wdg])
    except Exception as e:  # noqa: BLE001
        print("deepgemm failed", name, M, repr(e)[:200])
        return None


def roof(nbytes: float, flops: float = 0.0, peak: str = "bf16_flops") -> float:
    return max(nbytes / C["copy_bw"], flops / C[peak] if flops else 0.0)


def row(op, shape, t, nbytes, flops=0.0, peak="bf16_flops", lib=None, t_lib=None, t_torch=None, note=""):
    r = dict(op=op, shape=shape, us=t * 1e6, roof_us=roof(nbytes, flops, peak) * 1e6, GBps=nbytes / t / 1e9,
             TFLOPs=flops / t / 1e12 if flops else 0.0, lib=lib, lib_us=t_lib * 1e6 if t_lib else None,
             torch_us=t_torch * 1e6 if t_torch else None, note=note)
    r["frac_roof"] = r["roof_us"] / r["us"]
    r["lib_over_ours"] = (r["lib_us"] / r["us"]) if t_lib else None
    ROWS.append(r)
    lib_s = f" | {lib} {r['lib_us']:.1f}us lib/ours {r['lib_over_ours']:.2f}" if t_lib else ""
    tor_s = f" | torch {r['torch_us']:.1f}us" if t_torch else ""
    print(f"{op:22s} {shape:28s} {r['us']:9.1f}us roof {r['roof_us']:8.1f}us ({r['frac_roof']:.2f})"
          f" {r['GBps']:7.0f}GB/s{lib_s}{tor_s} {note}", flush=True)


def rand_w(n, k, rows=32):
    """e4m3 [n, k] and pow2 scales [n/rows, k/32] (rows = 32: linear tiles; 1: per-row experts)."""
    w = (torch.randn(n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    s = torch.exp2(torch.randint(-12, -6, (n // rows, k // 32), device="cuda").float())
    return w, s


# ---------------------------------------------------------------------------------------------
def bench_quant(quick):
    for M, K in ([(64, 5120), (4096, 5120)] if not quick else [(64, 5120)]):
        n = copies_for(M * K * 4)
        xs = [torch.randn(M, K, device="cuda").bfloat16() for _ in range(n)]
        t = time_calls([lambda x=x: triton_quant.act_quant(x) for x in xs])
        tt = time_calls([lambda x=x: act_quant_ref(x) for x in xs[:2]], iters=3)
        row("act_quant fp8 fake", f"{M}x{K}", t, 4 * M * K, t_torch=tt)
        t = time_calls([lambda x=x: triton_quant.act_quant_fp8(x) for x in xs])
        row("act_quant -> fp8+s", f"{M}x{K}", t, 3 * M * K + M * K // 8)
    for blk in (16, 32):
        M, K = 4096, 512
        n = copies_for(M * K * 4)
        xs = [torch.randn(M, K, device="cuda").bfloat16() for _ in range(n)]
        t = time_calls([lambda x=x: triton_quant.fp4_quant(x, blk) for x in xs])
        tt = time_calls([lambda x=x: fp4_quant_ref(x, blk) for x in xs[:2]], iters=3)
        row(f"fp4_quant b{blk}", f"{M}x{K}", t, 4 * M * K, t_torch=tt)


SWEEP = [dict(BN=256, num_warps=8, NUM_STAGES=3), dict(BK=256, NUM_STAGES=3), dict(num_warps=8),
         dict(NUM_STAGES=6), dict(BN=64), dict(SPLIT_K=1)]
GEMM_SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_b": (5120, 8192),
               "shared_w13": (4608, 5120), "shared_w2": (5120, 2304)}


def bench_gemm(quick):
    dg = deepgemm.load()
    ms = (1, 64) if quick else (1, 64, 128)
    for name, (N, K) in GEMM_SHAPES.items():
        wbytes = N * K
        n = copies_for(wbytes)
        ws = [rand_w(N, K) for _ in range(n)]
        wdg = [deepgemm.reblock_weight_128(w, s)[:2] for w, s in ws] if dg else None
        wbf = [(w.float() * s.repeat_interleave(32, 0).repeat_interleave(32, 1)).bfloat16() for w, s in ws[:max(1, n // 2)]]
        for M in ms + ((4096,) if name in ("wo_b", "shared_w13") and not quick else ()):
            x = torch.randn(M, K, device="cuda").bfloat16()
            q, sa = triton_quant.act_quant_fp8(x)
            nbytes = wbytes + N * K // 256 + M * K * 2 + M * N * 2
            flops = 2.0 * M * N * K
            xq = triton_quant.act_quant(x)
            t8 = time_calls([lambda w=w, s=s: triton_gemm.fp8_gemm(q, sa, w, s) for w, s in ws])
            t = time_calls([lambda w=w, s=s: triton_gemm.w8a16_gemm(xq, w, s) for w, s in ws])
            t_full = time_calls([lambda w=w, s=s: triton_gemm.fp8_linear(x, w, s) for w, s in ws])
            t_lib = None
            if dg:
                t_lib = time_deepgemm_linear(q, sa, wdg, name, M)
            t_torch = time_calls([lambda w=w: torch.nn.functional.linear(x, w) for w in wbf])
            row(f"fp8_gemm {name}", f"M{M} N{N} K{K}", t, nbytes, flops, "fp8_flops", "DeepGEMM", t_lib, t_torch,
                note=f"w8a16 {triton_gemm.W8A16_VARIANT}; fp8xfp8 per-32 promotion {t8 * 1e6:.1f}us; "
                f"+act_quant {t_full * 1e6:.1f}us")
            if M == 64 and name in ("wo_b", "shared_w13", "wq_a") and not quick:
                for ov in SWEEP:
                    try:
                        tv = time_calls([lambda w=w, s=s: triton_gemm.w8a16_gemm(xq, w, s, cfg_override=ov)
                                         for w, s in ws])
                        print(f"   sweep {name} M64 {ov}: {tv * 1e6:.1f}us (default {t * 1e6:.1f})", flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"   sweep {name} {ov} failed {repr(e)[:120]}")
            if M == 64:
                t_bi = time_calls([lambda w=w, s=s: triton_gemm.w8a16_gemm(xq, w, s, batch_invariant=True)
                                   for w, s in ws])
                row(f"fp8_gemm {name} BI", f"M{M} N{N} K{K}", t_bi, nbytes, flops, "fp8_flops",
                    note=f"batch-invariant cost x{t_bi / t:.2f}")


# linear_fp32 at decode sizes: the MoE router (384 experts) and the compressor's wkv / wgate (head_dim 512)
LINEAR_FP32_SHAPES = {"router": (384, 5120), "compressor": (512, 5120)}
LINEAR_FP32_SWEEP = [dict(SPLIT_K=20, NUM_STAGES=3), dict(SPLIT_K=10, NUM_STAGES=3),
                     dict(BK=64, SPLIT_K=40, NUM_STAGES=3), dict(NUM_STAGES=1), dict(NUM_STAGES=3),
                     dict(num_warps=8), dict(BM=64)]


def bench_linear_fp32(quick):
    """bf16 x bf16 -> fp32 GEMM (linear_fp32) at decode M: the split-K Triton GEMM against the cuBLAS call
    it replaces (torch.mm out_dtype=float32), both in this run; the roofline is the weight read (plus x
    and the fp32 output) over the measured copy bandwidth. At M 64 also a few launch configs (not
    --no-sweep); any fixed choice keeps rows batch invariant, as long as it does not depend on M."""
    from deepinfer.kernels import triton_linear_fp32 as tlf
    for name, (N, K) in LINEAR_FP32_SHAPES.items():
        if quick and name != "router":
            continue
        wbytes = N * K * 2
        ws = [(torch.randn(N, K, device="cuda") * 0.02).bfloat16() for _ in range(copies_for(wbytes))]
        cfg = tlf.linear_fp32_config(N, K, ws[0].device)
        for M in (1, 64, 128):
            x = torch.randn(M, K, device="cuda").bfloat16()
            t = time_calls([lambda w=w: tlf.linear_fp32(x, w) for w in ws])
            t_lib = time_calls([lambda w=w: torch.mm(x, w.t(), out_dtype=torch.float32) for w in ws])
            diff = (tlf.linear_fp32(x, ws[0]) - torch.mm(x, ws[0].t(), out_dtype=torch.float32)).abs().max().item()
            row(f"linear_fp32 {name}", f"M{M} N{N} K{K}", t, wbytes + M * K * 2 + M * N * 4, 2.0 * M * N * K,
                "bf16_flops", "cuBLAS", t_lib, note=f"SPLIT_K {cfg['SPLIT_K']} BK {cfg['BK']} x "
                f"{-(-N // cfg['BN'])} N tiles; max |ours - cuBLAS| {diff:.1e}")
            if M == 64 and not quick:
                for ov in LINEAR_FP32_SWEEP:
                    try:
                        tv = time_calls([lambda w=w: tlf.linear_fp32(x, w, ov) for w in ws])
                        print(f"   sweep linear_fp32 {name} M64 {ov}: {tv * 1e6:.1f}us (default {t * 1e6:.1f})",
                              flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"   sweep linear_fp32 {name} {ov} failed {repr(e)[:120]}")
        del ws


def bench_moe(quick):
    dg = deepgemm.load()
    G, mmax = 48, 128
    for name, (N, K) in (("moe_w13", (4608, 5120)), ("moe_w2", (5120, 2304))):
        w = (torch.randn(G, N, K, device="cuda") * 0.5).to(torch.float8_e4m3fn)
        s_e8 = torch.randint(115, 121, (G, N, K // 32), device="cuda", dtype=torch.uint8)
        s = e8m0_to_float(s_e8)
        if dg:
            s128 = torch.exp2(torch.randint(-12, -6, (G, N // 128, K // 128), device="cuda").float())
        for em in ((8,) if quick else (8, 32)):
            mm = torch.full((G,), em, dtype=torch.int32, device="cuda")
            x = torch.randn(G * mmax, K, device="cuda").bfloat16()
            q, sa = triton_quant.act_quant_fp8(x)
            q, sa = q.view(G, mmax, K), sa.view(G, mmax, K // 32)
            out = torch.empty(G, mmax, N, device="cuda", dtype=torch.bfloat16)
            nbytes = G * (N * K + N * K // 32 + em * K * 2 + em * N * 2)
            flops = 2.0 * G * em * N * K
            t8 = time_calls([lambda: triton_gemm.fp8_grouped_gemm_masked(q, sa, w, s, mm, em, out=out)], iters=5)
            xq = triton_quant.act_quant(x).view(G, mmax, K)
            t = time_calls([lambda: triton_gemm.w8a16_grouped_gemm_masked(xq, w, s_e8, mm, em, out=out)], iters=5)
            t_lib = _deepgemm_masked_time(q, sa, w, s128, mm, em, out) if dg else None
            if not quick and em == 8:
                for ov in SWEEP[:2]:
                    try:
                        tv = time_calls([lambda: triton_gemm.w8a16_grouped_gemm_masked(xq, w, s_e8, mm, em, out=out,
                                                                                       cfg_override=ov)], iters=5)
                        print(f"   sweep {name} m{em} {ov}: {tv * 1e6:.1f}us (default {t * 1e6:.1f})", flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"   sweep {name} {ov} failed {repr(e)[:120]}")
            row(f"moe masked {name}", f"G{G} m{em} N{N} K{K}", t, nbytes, flops, "fp8_flops", "DeepGEMM masked",
                t_lib, note=f"w8a16 {triton_gemm.W8A16_VARIANT}; fp8xfp8 per-32 promotion {t8 * 1e6:.1f}us")
        del w, s, s_e8


MOE_GROUPS = (48, 128)                       # local experts (EP8 share), capacity rows per expert
MOE_SHAPES = {"moe_w13": (4608, 5120), "moe_w2": (5120, 2304)}
VARIANT_SWEEP = [dict(num_warps=8), dict(NUM_STAGES=4), dict(BN=256, num_warps=8, NUM_STAGES=3), dict(BN=64),
                 dict(BN=64, NUM_STAGES=4), dict(BN=128)]
ROWS_SWEEP = [dict(num_warps=8), dict(NUM_STAGES=4), dict(NUM_STAGES=6), dict(BN=64), dict(BN=256, num_warps=8),
              dict(BK=256, NUM_STAGES=3), dict(BN=64, NUM_STAGES=6)]


def _e8m0_bytes(s: torch.Tensor) -> torch.Tensor:
    """pow2 f32 scales -> the same values as raw E8M0 bytes."""
    return (torch.log2(s).round() + 127).to(torch.uint8)


def _deepgemm_masked_time(q, sa, w, s128, mm, em, out) -> float | None:
    """Time of DeepGEMM's masked grouped GEMM on our FP8 activations (q e4m3 with per-32 scales sa,
    G * C rows in any shape) re-blocked to its per-128 scales, into out [G, C, N]; None if it fails."""
    G, C, N = out.shape
    K = q.shape[-1]
    q128, sa128 = deepgemm.act_reblock_128(q.reshape(-1, K), sa.reshape(-1, K // 32))
    q128, sa128 = q128.view(G, C, K), sa128.view(G, C, K // 128)
    try:
        return time_calls([lambda: deepgemm.grouped_masked(q128, sa128, w, s128, mm, em, out=out)], iters=5)
    except Exception as e:  # noqa: BLE001
        print("deepgemm masked failed", repr(e)[:300])
        return None


def _time_variants(label, shape, calls, variants, nbytes, t_lib, sweep, sweep_list=VARIANT_SWEEP):
    """Times calls(cfg_override) (a list of callables, one GEMM each) per variant: the default config, then
    the best of sweep_list with sweep; prints the side-by-side line and adds one row per variant."""
    times = {}
    for var in variants:
        try:
            t = time_calls(calls(dict(VARIANT=var)), iters=5)
        except Exception as e:  # noqa: BLE001
            print(f"   {label} {shape} {var} failed {repr(e)[:200]}", flush=True)
            continue
        best, best_ov = t, {}
        for ov in (sweep_list if sweep else []):
            try:
                tv = time_calls(calls(dict(ov, VARIANT=var)), iters=5)
            except Exception as e:  # noqa: BLE001
                print(f"   {label} {var} {ov} failed {repr(e)[:120]}", flush=True)
                continue
            if tv < best:
                best, best_ov = tv, ov
        times[var] = (t, best, best_ov)
    if not times:
        return
    base = times.get("v1", (None,))[0]
    parts = []
    for var, (t, best, ov) in times.items():
        p = f"{var} {t * 1e6:7.1f}us ({nbytes / t / 1e12:.2f} TB/s)"
        if base and var != "v1":
            p += f" x{base / t:.2f} vs v1"
        if t_lib:
            p += f" DG/{var} {t_lib / t:.2f}"
        if ov:
            p += f" [best {best * 1e6:.1f}us {ov}]"
        parts.append(p)
    lib = f" | DeepGEMM {t_lib * 1e6:.1f}us ({nbytes / t_lib / 1e12:.2f} TB/s)" if t_lib else ""
    print(f"W8A16 {label:18s} {shape:26s} " + " | ".join(parts) + lib, flush=True)
    for var, (t, best, ov) in times.items():
        note = f"vs v1 x{base / t:.2f}" if base and var != "v1" else ""
        if ov:
            note += f"; best {best * 1e6:.1f}us with {ov}"
        row(f"w8a16 {var} {label}", shape, t, nbytes, 0.0, "fp8_flops", "DeepGEMM" if t_lib else None, t_lib,
            note=note)


def bench_variants(quick, variants=None, sweep=True, moe=True):
    """W8A16 variants side by side: FP8 linears (E8M0 scales) at decode sizes and (moe) the masked MoE
    GEMMs."""
    variants = variants or list(triton_gemm.W8A16_VARIANTS)
    dg = deepgemm.load()
    ms = (1, 64) if quick else (1, 64, 128)
    for name, (N, K) in GEMM_SHAPES.items():
        n = copies_for(N * K)
        ws = [rand_w(N, K) for _ in range(n)]
        ws8 = [(w, _e8m0_bytes(s)) for w, s in ws]
        wdg = [deepgemm.reblock_weight_128(w, s)[:2] for w, s in ws] if dg else None
        for M in ms:
            x = torch.randn(M, K, device="cuda").bfloat16()
            xq = triton_quant.act_quant(x)
            nbytes = N * K + N * K // 1024 + M * K * 2 + M * N * 2
            t_lib = None
            if dg:
                q, sa = triton_quant.act_quant_fp8(x)
                t_lib = time_deepgemm_linear(q, sa, wdg, name, M)

            def calls(ov, xq=xq):
                return [lambda w=w, s=s: triton_gemm.w8a16_gemm(xq, w, s, cfg_override=ov) for w, s in ws8]
            _time_variants(f"linear {name}", f"M{M} N{N} K{K}", calls, variants, nbytes, t_lib, sweep)
        del ws, ws8, wdg
    if not moe:
        return
    G, mmax = MOE_GROUPS
    grid = torch.tensor(E2M1_GRID, device="cuda")
    grid = torch.cat([grid, -grid])
    for name, (N, K) in MOE_SHAPES.items():
        # MXFP4 experts as the loader holds them: e2m1 values in e4m3, E8M0 per (row, 32), and the same
        # weights with one scale per row (select.row_scaled_fp8_weight) for the rows kernel
        w = grid[torch.randint(0, 16, (G, N, K), device="cuda")].to(torch.float8_e4m3fn)
        s_e8 = torch.randint(115, 121, (G, N, K // 32), device="cuda", dtype=torch.uint8)
        wr, sr = torch.empty_like(w), torch.empty(G, N, 1, device="cuda")
        for g in range(G):
            wr[g], sr[g] = row_scaled_fp8_weight(w[g], s_e8[g])
        if dg:
            s128 = torch.exp2(torch.randint(-12, -6, (G, N // 128, K // 128), device="cuda").float())
        for em in ((1, 8) if quick else (1, 8, 32)):      # m=1: a batch-64 step's share at EP8 (0.75 pairs/token)
            mm = torch.full((G,), em, dtype=torch.int32, device="cuda")
            x = torch.randn(G * mmax, K, device="cuda").bfloat16()
            xq = triton_quant.act_quant(x).view(G, mmax, K)
            out = torch.empty(G, mmax, N, device="cuda", dtype=torch.bfloat16)
            nbytes = G * (N * K + N * K // 32 + em * K * 2 + em * N * 2)
            t_lib = _deepgemm_masked_time(*triton_quant.act_quant_fp8(x), w, s128, mm, em, out) if dg else None

            def calls(ov, xq=xq, mm=mm, em=em):
                return [lambda: triton_gemm.w8a16_grouped_gemm_masked(xq, w, s_e8, mm, em, out=out, cfg_override=ov)]
            _time_variants(f"moe masked {name}", f"G{G} m{em} N{N} K{K}", calls, variants, nbytes, t_lib, sweep)

            def calls_rows(ov, xq=xq, mm=mm, em=em):
                ov = {k: v for k, v in ov.items() if k != "VARIANT"}
                return [lambda: triton_gemm.w8a16_grouped_gemm_masked(xq, wr, sr, mm, em, out=out, cfg_override=ov)]
            ref = triton_gemm.w8a16_grouped_gemm_masked(xq, w, s_e8, mm, em, cfg_override=dict(VARIANT="v3"))
            got = triton_gemm.w8a16_grouped_gemm_masked(xq, wr, sr, mm, em)
            same = torch.equal(got[:, :em], ref[:, :em])
            print(f"   rows kernel vs v3 on the same weights: {'bitwise equal' if same else 'DIFFERENT'} "
                  f"(max abs diff {(got[:, :em].float() - ref[:, :em].float()).abs().max().item():.3g})", flush=True)
            _time_variants(f"moe masked {name}", f"G{G} m{em} N{N} K{K}", calls_rows, ["rows"],
                           G * (N * K + N * 4 + em * K * 2 + em * N * 2), t_lib, sweep, ROWS_SWEEP)
        del w, s_e8, wr, sr


def bench_attn(quick):
    fm = flashmla.load()
    H, D, L, ctx = 64, 512, 640, 8192
    for b in ((64,) if quick else (1, 16, 64, 128)):
        rows = b * ctx
        kv = act_quant_ref(torch.randn(rows, D, device="cuda").bfloat16())
        q = torch.randn(b, H, D, device="cuda").bfloat16()
        sink = torch.randn(H, device="cuda")
        base = (torch.arange(b, device="cuda") * ctx)[:, None]
        idx = (base + torch.randint(0, ctx, (b, L), device="cuda")).int()
        flops = tsa.attn_flops(b, H, L, D)
        nbytes = tsa.attn_bytes(b, H, L, D)
        best = None
        # None: the default mode's occupancy split (blocks_per_split_for); 4: the batch-invariant rule
        variants = [(64, None, 8), (64, 4, 8), (64, 8, 8)] if not quick else [(64, None, 8), (64, 4, 8)]
        for bh, bps, nw in variants:
            try:
                t = time_calls([lambda: tsa.sparse_attn(q, kv, sink, idx, D ** -0.5, block_h=bh, blocks_per_split=bps,
                                                        num_warps=nw)])
            except Exception as e:  # noqa: BLE001
                print("attn variant failed", bh, bps, nw, repr(e)[:200])
                continue
            if len(variants) > 1:
                auto = f" (auto: {tsa.blocks_per_split_for(b, H, bh, L, q.device)})" if bps is None else ""
                print(f"   attn variant BH{bh} bps{bps}{auto} w{nw}: {t * 1e6:.1f}us")
            if best is None or t < best[0]:
                best = (t, bh, bps, nw)
        t_lib = None
        if fm:
            cache = flashmla.pack_v4(kv)
            _, sched = flashmla.sparse_decode(q, cache, idx, sink, D ** -0.5)
            try:
                t_lib = time_calls([lambda: flashmla.sparse_decode(q, cache, idx, sink, D ** -0.5, sched)])
            except Exception as e:  # noqa: BLE001
                print("flashmla failed", repr(e)[:300])
        t_torch = time_calls([lambda: sparse_attn_ref(q, kv, sink, idx, D ** -0.5)], iters=2) if b <= 16 else None
        row("sparse_attn bf16 KV", f"b{b} H{H} L{L}", best[0], nbytes, flops, "bf16_flops", "FlashMLA V4 fp8", t_lib,
            t_torch, note=f"BH{best[1]} bps{best[2]} w{best[3]}; FlashMLA reads {L * 584 / 1024:.0f}KB/q vs ours "
            f"{L * 1024 / 1024:.0f}KB/q")
        del kv


def bench_mhc(quick):
    hc, d = 4, 5120
    fn = torch.randn(24, hc * d, device="cuda") * 0.01
    scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda")
    for T in ((64,) if quick else (64, 4096)):
        n = copies_for(T * hc * d * 2)
        xs = [torch.randn(T, hc, d, device="cuda").bfloat16() for _ in range(n)]
        pre = torch.rand(T, hc, device="cuda")
        t = time_calls([lambda x=x: triton_mhc.hc_mixes_pre(x, fn, scale, base, pre, 20, 1e-6, 1e-20) for x in xs])
        tt = time_calls([lambda x=x: triton_mhc.hc_mixes_pre_ref(x, fn, scale, base, pre, 20, 1e-6, 1e-20)
                         for x in xs[:2]], iters=3)
        row("hc_mixes+sinkhorn+pre", f"T{T}", t, T * hc * d * 2 + 24 * hc * d * 4 + T * d * 2,
            2.0 * T * 24 * hc * d, "bf16_flops", t_torch=tt)
        mixes = torch.randn(T, 24, device="cuda")
        t = time_calls([lambda: triton_mhc.hc_split_sinkhorn(mixes, scale, base, hc, 20, 1e-6)])
        row("hc sinkhorn alone", f"T{T}", t, T * 24 * 4 + T * 24 * 4)
        y = torch.randn(T, d, device="cuda").bfloat16()
        post, comb = torch.rand(T, hc, device="cuda"), torch.rand(T, hc, hc, device="cuda")
        t = time_calls([lambda x=x: triton_mhc.hc_post(y, x, post, comb) for x in xs])
        tt = time_calls([lambda x=x: triton_mhc.hc_post_ref(y, x, post, comb) for x in xs[:2]], iters=3)
        row("hc_post", f"T{T}", t, T * d * 2 + 2 * T * hc * d * 2, t_torch=tt)


def bench_indexer(quick):
    n, E = 64, 8192
    q = fp4_quant_ref(torch.randn(n, 32, 128, device="cuda").bfloat16(), 32)
    w = (torch.randn(n, 32, device="cuda") * 0.02).bfloat16()
    ks = [fp4_quant_ref(torch.randn(E, 128, device="cuda").bfloat16(), 32) for _ in range(copies_for(E * 256))]
    t = time_calls([lambda k=k: triton_indexer.index_scores(q, w, k) for k in ks])
    tt = time_calls([lambda k=k: triton_indexer.index_scores_ref(q, w, k) for k in ks[:2]], iters=3)
    row("index_scores", f"n{n} IH32 E{E}", t, E * 256 + n * E * 2, 2.0 * n * 32 * E * 128, "bf16_flops", t_torch=tt)
    s = triton_indexer.index_scores(q, w, ks[0])
    t = time_calls([lambda: s.topk(512, dim=-1)])
    row("topk 512 (torch)", f"n{n} E{E}", t, n * E * 2)


def bench_topk(quick):
    """The indexer's top-k at the decode step: 64 rows of 8192 bf16 scores (-inf past each row's lens),
    k 512, one Triton program per row against the torch index_topk chain the model ran before (~30
    launches); with a re-indexer's candidate mask; fp32 rows; rows of 32768 (the kernel's widest); the
    candidate blocks' level one (block scores of 8 entries, 256 kept) against its torch chain; and
    candidate_blocks (block maxima of 64 entries in the kernel; and the model's level one, 2,048 blocks of 8
    kept, which at 8k entries keeps every block: no search). The note says whether the picks are the same bits."""
    from deepinfer.kernels.reference import candidate_blocks_ref
    n, E, k = 64, 8192, 512
    lens = torch.randint(E // 2, E + 1, (n,), device="cuda")
    scores = [(torch.randn(n, E, device="cuda").abs() * 0.3).bfloat16().masked_fill(
        torch.arange(E, device="cuda") >= lens[:, None], -torch.inf) for _ in range(copies_for(n * E * 2))]
    scores32 = [s.float() for s in scores]
    cand = torch.rand(n, E, device="cuda") < 0.25
    E2 = 32768                                                  # long context: 128k tokens at ratio 4
    wide = [(torch.randn(n, E2, device="cuda").abs() * 0.3).bfloat16() for _ in range(copies_for(n * E2 * 2))]
    lens2 = torch.full((n,), E2, device="cuda")
    bs, kb = 8, 256
    blocks = [s.unflatten(-1, (-1, bs)).amax(-1) for s in scores]                     # [n, E / 8]
    cases = [(f"index_topk {k}", f"n{n} E{E}", scores, lambda s: triton_topk.index_topk(s, lens, k),
              lambda s: index_topk_ref(s, lens, k), n * E * 2 + n * k * 8),
             (f"index_topk {k} +cand", f"n{n} E{E}", scores, lambda s: triton_topk.index_topk(s, lens, k, cand),
              lambda s: index_topk_ref(s, lens, k, cand), n * E * 3 + n * k * 8),
             (f"index_topk {k} fp32", f"n{n} E{E}", scores32, lambda s: triton_topk.index_topk(s, lens, k),
              lambda s: index_topk_ref(s, lens, k), n * E * 4 + n * k * 8),
             (f"index_topk {k}", f"n{n} E{E2}", wide, lambda s: triton_topk.index_topk(s, lens2, k),
              lambda s: index_topk_ref(s, lens2, k), n * E2 * 2 + n * k * 8),
             (f"topk_block_mask {kb}", f"n{n} NB{E // bs} x{bs}", blocks,
              lambda b: triton_topk.topk_block_mask(b, kb, bs, E), lambda b: topk_block_mask_ref(b, kb, bs, E),
              n * E // bs * 2 + n * E),
             ("candidate_blocks 16", f"n{n} E{E} x64", scores,
              lambda s: triton_topk.candidate_blocks(s, lens, 16, 64), lambda s: candidate_blocks_ref(s, lens, 16, 64),
              n * E * 3),
             ("candidate_blocks 2048", f"n{n} E{E} x8", scores,
              lambda s: triton_topk.candidate_blocks(s, lens, 2048, 8),
              lambda s: candidate_blocks_ref(s, lens, 2048, 8), n * E * 3)]
    for name, shape, inputs, fast, ref, nbytes in cases:
        tt = time_calls([lambda x=x: ref(x) for x in inputs[:2]], iters=3)
        t = time_calls([lambda x=x: fast(x) for x in inputs])
        same = torch.equal(fast(inputs[0]), ref(inputs[0]))
        row(name, shape, t, nbytes, t_torch=tt,
            note=f"torch/ours {tt / t:.1f}x; {'bits equal' if same else 'MISMATCH vs the reference'}")
    del wide


def _router_chain(logits, bias, topk, temp, route_scale, norm):
    """moe.py Gate.forward's torch ops after the GEMM, as they ran before router_topk (~10 launches)."""
    scores = torch.nn.functional.softplus(logits / temp).sqrt()
    indices = (scores + bias).topk(topk, dim=-1)[1]
    weights = scores.gather(1, indices)
    if norm and topk > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * route_scale, indices


def bench_router(quick):
    """The MoE router after its gate GEMM at a decode step: 64 tokens, top-6 of 48 local experts (EP8)
    and of all 384; one Triton program per token against the torch chain Gate.forward ran. A num_warps
    sweep for the wider row; the note says whether the bits equal router_topk_ref."""
    T, k, temp, scale = 64, 6, 1.0, 1.5
    for E in (48, 384):
        logits = [torch.randn(T, E, device="cuda") * 2 for _ in range(copies_for(T * E * 4))]
        bias = torch.randn(E, device="cuda") * 0.1
        nbytes = T * E * 4 + E * 4 + T * k * 12
        t = time_calls([lambda x=x: triton_router.router_topk(x, bias, k, temp, scale, True) for x in logits])
        tt = time_calls([lambda x=x: _router_chain(x, bias, k, temp, scale, True) for x in logits])
        same = all(torch.equal(a, b) for a, b in zip(triton_router.router_topk(logits[0], bias, k, temp, scale, True),
                                                    router_topk_ref(logits[0], bias, k, temp, scale, True)))
        sweep = ""
        if E > 128 and not quick:
            tw = {nw: time_calls([lambda x=x, nw=nw: triton_router.router_topk(x, bias, k, temp, scale, True,
                                                                                num_warps=nw) for x in logits])
                  for nw in (1, 2, 4, 8)}
            sweep = "; num_warps " + " ".join(f"{nw}:{v * 1e6:.1f}us" for nw, v in tw.items())
        row("router_topk", f"T{T} E{E} k{k}", t, nbytes, t_torch=tt,
            note=f"torch/ours {tt / t:.1f}x; {'bits equal' if same else 'MISMATCH vs router_topk_ref'}{sweep}")

def plot(path_prefix):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return
    labels = [f"{r['op']} {r['shape']}" for r in ROWS]
    fig, ax = plt.subplots(figsize=(11, 0.28 * len(ROWS) + 1.5))
    ax.barh(range(len(ROWS)), [r["frac_roof"] for r in ROWS], color="tab:blue")
    ax.set_yticks(range(len(ROWS)), labels, fontsize=7)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("roofline time / measured time (1.0 = at the roofline)")
    ax.set_title(f"H200 ops vs roofline (copy {C['copy_bw'] / 1e12:.2f} TB/s, bf16 {C['bf16_flops'] / 1e12:.0f} / "
                 f"fp8 {C['fp8_flops'] / 1e12:.0f} TFLOP/s measured)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path_prefix + "_roofline.png", dpi=110)
    lib = [r for r in ROWS if r["lib_over_ours"]]
    if lib:
        fig, ax = plt.subplots(figsize=(11, 0.3 * len(lib) + 1.5))
        ax.barh(range(len(lib)), [r["lib_over_ours"] for r in lib], color="tab:green")
        ax.set_yticks(range(len(lib)), [f"{r['op']} {r['shape']} vs {r['lib']}" for r in lib], fontsize=7)
        ax.axvline(0.9, color="r", lw=0.8, ls="--")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlabel("library time / our time (>= 0.9 is the goal)")
        ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(path_prefix + "_vs_library.png", dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parse-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--only", default="quant,gemm,linear_fp32,moe,variants,attn,mhc,indexer,topk,router")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile sweeps")
    ap.add_argument("--linears-only", action="store_true", help="`variants`: skip the masked MoE shapes")
    ap.add_argument("--variants", default=",".join(triton_gemm.W8A16_VARIANTS),
                    help="W8A16 variants the `variants` part compares (default: all)")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(triton_gemm.W8A16_VARIANTS)
    if unknown:
        ap.error(f"unknown W8A16 variants {sorted(unknown)}; known {list(triton_gemm.W8A16_VARIANTS)}")
    parts = [p for p in args.only.split(",") if p]
    missing = [p for p in parts if f"bench_{p}" not in globals()]
    if missing:
        ap.error(f"unknown parts {missing}")
    if args.parse_only:
        print(f"parts {parts}, variants {variants}, sweep {not args.no_sweep}")
        return
    torch.manual_seed(0)
    C.update(measure_ceilings())
    print(f"ceilings: copy {C['copy_bw'] / 1e12:.3f} TB/s, bf16 {C['bf16_flops'] / 1e12:.0f} TFLOP/s, "
          f"fp8 {C['fp8_flops'] / 1e12:.0f} TFLOP/s; {torch.cuda.get_device_name()}", flush=True)
    if args.no_sweep:
        SWEEP.clear()
        LINEAR_FP32_SWEEP.clear()
    for part in parts:
        try:
            if part == "variants":
                bench_variants(args.quick, variants, sweep=not args.no_sweep, moe=not args.linears_only)
            else:
                globals()[f"bench_{part}"](args.quick)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            print(f"bench {part} failed: {e!r}"[:400])
        torch.cuda.empty_cache()
    save_json("kernels.json", {"ceilings": C, "rows": ROWS})
    def fmt(v, spec=".1f"):
        return "" if v is None else format(v, spec)

    with open(os.path.join(out_dir(), "kernels.md"), "w") as f:
        f.write("| op | shape | us | roofline us | frac | GB/s | lib | lib us | lib/ours | torch us | note |\n")
        f.write("|---|---|---|---|---|---|---|---|---|---|---|\n")
        for r in ROWS:
            f.write(f"| {r['op']} | {r['shape']} | {r['us']:.1f} | {r['roof_us']:.1f} | {r['frac_roof']:.2f} | "
                    f"{r['GBps']:.0f} | {r['lib'] or ''} | {fmt(r['lib_us'])} | {fmt(r['lib_over_ours'], '.2f')} | "
                    f"{fmt(r['torch_us'])} | {r['note']} |\n")
    plot(os.path.join(out_dir(), "kernels"))


if __name__ == "__main__":
    main()
