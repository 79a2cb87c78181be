"""Prefill-sized FP8 linears on the GPU: the FP8 x FP8 per-32-promotion kernel (kernels/triton_fp8_prefill.py)
against the W8A16 kernel it replaces there, DeepGEMM (per-128 promotion on 128x128-tile weights: not the
release numbers, a speed reference), torch's bf16 matmul, and the FP8 / bf16 peaks measured in the same run
(benchutil.measure_ceilings); and the MoE's grouped contiguous form against the per-expert loop it replaces.

    python perf/bench_fp8_prefill.py [--m 8192] [--sweep]      (bench_fp8_prefill.json in $OUT)
    python perf/bench_fp8_prefill.py --variants [NAMES]        (every FP8 x FP8 variant of
        kernels/triton_fp8_variants.py at the six linears x M 32, 64, 128, 8192 against W8A16, DeepGEMM and
        the peaks, then the MoE at 8192 x 6 pairs; writes fp8_select_table.json to $OUT: copy it to
        kernels/fp8_select_table.json to make select take the winners. ~2-3 min on the H200)
    python perf/bench_fp8_prefill.py --variants --splits       (+ split-K counts per variant at M <= 128;
        a winning count goes into the table row as split_k)
    python perf/bench_fp8_prefill.py --cuda [--m 8192 2048 128 64 32] [--deepgemm-m 8192]  (the CUDA
        kernel's forms, kernels/cuda_fp8_gemm.py: the default, BN 192, 2-CTA multicast, split-K, BM 64,
        the no-overlap debugging form, per-row and per-(row, 32) weight scales; against W8A16, the Triton FP8 forms,
        DeepGEMM and the peaks at the six linears; each CUDA result is checked first. bench_fp8_cuda.json in
        $OUT. ~1.5 min on the H200 per two Ms: run --m 8192 2048 and --m 128 64 32 as two commands)

Shapes: the full-width layer's dense FP8 linears at M tokens (wq_a+wkv fused 1280+512 x 5120, wq_b
32768 x 1280, wo_b 5120 x 8192, the shared expert 4608 x 5120 and 5120 x 2304, the indexer's wq_b
4096 x 1280), and the routed experts (48 local of 384, top-6: at EP8 each GPU's experts receive as many
pairs as its own M tokens pick, M * 6, about 128 * M / 1024 rows per expert).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import measure_ceilings, save_json, time_calls  # noqa: E402

DENSE = {"wqkv_a": (1792, 5120), "wq_b": (32768, 1280), "wo_b": (5120, 8192), "shared_w13": (4608, 5120),
         "shared_w2": (5120, 2304), "index_wq_b": (4096, 1280)}
SWEEP = [dict(BM=128, BN=128, GROUP_M=8, NUM_STAGES=3, num_warps=8),
         dict(BM=128, BN=128, GROUP_M=8, NUM_STAGES=4, num_warps=8),
         dict(BM=128, BN=256, GROUP_M=8, NUM_STAGES=3, num_warps=8),
         dict(BM=64, BN=128, GROUP_M=8, NUM_STAGES=4, num_warps=4)]


def weight(n: int, k: int):
    w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.float8_e4m3fn)
    s = torch.randint(118, 124, (-(-n // 32), k // 32), dtype=torch.uint8, device="cuda")
    return w, s


def dense_rows(m: int, sweep: bool, peaks: dict) -> list[dict]:
    from deepinfer.kernels import deepgemm
    from deepinfer.kernels.triton_fp8_prefill import as_f32_scale, fp8_prefill_gemm
    from deepinfer.kernels.triton_gemm import fp8_gemm, w8a16_gemm
    from deepinfer.kernels.triton_quant import act_quant, act_quant_fp8
    rows = []
    dg = deepgemm.load()
    for name, (n, k) in DENSE.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w, s = weight(n, k)
        xq = act_quant(x)
        a, sa = act_quant_fp8(x)
        flops = 2.0 * m * n * k
        r = {"name": name, "m": m, "n": n, "k": k}
        r["w8a16_us"] = time_calls([lambda: w8a16_gemm(xq, w, s)]) * 1e6
        s32 = as_f32_scale(s)
        r["fp8_bk32_us"] = time_calls([lambda: fp8_gemm(a, sa, w, s32)]) * 1e6
        cfgs = SWEEP if sweep else [None]
        best = None
        for cfg in cfgs:
            try:
                t = time_calls([lambda: fp8_prefill_gemm(a, sa, w, s32, cfg)]) * 1e6
            except Exception as e:  # noqa: BLE001 (out of shared memory etc.: report, keep sweeping)
                print(f"  {name} cfg {cfg}: {type(e).__name__} {str(e)[:120]}")
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        r["fp8_us"], r["fp8_cfg"] = best
        r["act_quant_us"] = time_calls([lambda: act_quant_fp8(x)]) * 1e6
        if _cuda_ok(n, k, s):
            from deepinfer.kernels.cuda_fp8_gemm import fp8_gemm_cuda
            r["cuda_us"] = time_calls([lambda: fp8_gemm_cuda(a, sa, w, s32)]) * 1e6
        wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        r["bf16_us"] = time_calls([lambda: x @ wb.T]) * 1e6
        if dg is not None and n % 128 == 0 and k % 128 == 0:
            pair = deepgemm.cached_tile128(w, s)
            r["deepgemm_us"] = time_calls([lambda: deepgemm.linear(x, *pair)]) * 1e6
        for key in ("w8a16", "fp8", "fp8_bk32", "bf16", "deepgemm", "cuda"):
            if f"{key}_us" in r:
                r[f"{key}_tflops"] = flops / r[f"{key}_us"] / 1e6
        r["fp8_of_fp8_peak"] = r["fp8_tflops"] * 1e12 / peaks["fp8_flops"]
        r["fp8_vs_w8a16"] = r["w8a16_us"] / r["fp8_us"]
        rows.append(r)
        print(f"{name:10s} {m}x{n}x{k}: w8a16 {r['w8a16_tflops']:6.0f} TF  fp8 {r['fp8_tflops']:6.0f} TF "
              f"({r['fp8_of_fp8_peak']:.2f} of FP8 peak, {r['fp8_vs_w8a16']:.2f}x w8a16, cfg {r['fp8_cfg']})  "
              f"fp8 BK32 walk {r['fp8_bk32_tflops']:6.0f}  bf16 {r['bf16_tflops']:6.0f}  deepgemm {r.get('deepgemm_tflops', float('nan')):6.0f}  "
              f"cuda {r.get('cuda_tflops', float('nan')):6.0f}  "
              f"act_quant {r['act_quant_us']:.0f} us", flush=True)
        del x, w, s, s32, xq, a, sa, wb
    return rows


def moe_rows(m: int, peaks: dict, E: int = 48, topk: int = 6, d: int = 5120, inter: int = 2304,
             variants: tuple = ()) -> dict:
    """One layer's routed experts on this GPU at EP8: m tokens per GPU x top-6 -> m * 6 pairs over the 48
    local experts; the grouped contiguous GEMMs (both projections) vs the same GEMMs expert by expert.
    (H200, 2026-12-02: run with m * 6 / 8 pairs, 128 rows per expert, before this was corrected.)"""
    from deepinfer.kernels.triton_fp8_prefill import fp8_grouped_contiguous, fp8_prefill_gemm
    from deepinfer.kernels.triton_gemm import w8a16_gemm
    from deepinfer.kernels.triton_moe_contiguous import w8a16_grouped_contiguous
    P = m * topk
    counts = torch.distributions.Multinomial(P, torch.ones(E)).sample().to(torch.int64).cuda()
    P = int(counts.sum())
    a = (torch.randn(P, d, device="cuda")).to(torch.float8_e4m3fn)
    sa = torch.full((P, d // 32), 2.0 ** -6, device="cuda")
    h = (torch.randn(P, inter, device="cuda")).to(torch.float8_e4m3fn)
    sh = torch.full((P, inter // 32), 2.0 ** -6, device="cuda")
    w13 = (torch.randn(E, 2 * inter, d, device="cuda") * 0.02).to(torch.float8_e4m3fn)
    s13 = torch.exp2(torch.randint(-9, -4, (E, 2 * inter, d // 32), device="cuda").float())
    w2 = (torch.randn(E, d, inter, device="cuda") * 0.02).to(torch.float8_e4m3fn)
    s2 = torch.exp2(torch.randint(-9, -4, (E, d, inter // 32), device="cuda").float())

    def grouped():
        fp8_grouped_contiguous(a, sa, w13, s13, counts)
        fp8_grouped_contiguous(h, sh, w2, s2, counts)
    cl = counts.tolist()
    starts = [sum(cl[:e]) for e in range(E)]
    xb = a.to(torch.bfloat16)
    hb = h.to(torch.bfloat16)

    def grouped_w8a16():
        w8a16_grouped_contiguous(xb, w13, s13, counts)
        w8a16_grouped_contiguous(hb, w2, s2, counts)

    def loop_w8a16():
        for e in range(E):
            if cl[e]:
                w8a16_gemm(xb[starts[e]:starts[e] + cl[e]], w13[e], s13[e])
                w8a16_gemm(hb[starts[e]:starts[e] + cl[e]], w2[e], s2[e])

    def loop_fp8():
        for e in range(E):
            if cl[e]:
                fp8_prefill_gemm(a[starts[e]:starts[e] + cl[e]], sa[starts[e]:starts[e] + cl[e]], w13[e], s13[e])
                fp8_prefill_gemm(h[starts[e]:starts[e] + cl[e]], sh[starts[e]:starts[e] + cl[e]], w2[e], s2[e])
    flops = 2.0 * P * (2 * inter * d + d * inter)
    r = {"tokens": m, "pairs": P, "experts": E}
    cases = [("grouped_fp8", grouped), ("grouped_w8a16", grouped_w8a16), ("loop_w8a16", loop_w8a16),
             ("loop_fp8", loop_fp8)]
    if variants:
        # the model's experts: FP4-origin stacks re-expressed with one f32 pow2 scale per row (select.row_scaled_fp8_weight)
        from deepinfer.kernels.triton_fp8_variants import fp8_variant_grouped_contiguous
        r13 = torch.exp2(torch.randint(-9, -4, (E, 2 * inter, 1), device="cuda").float())
        r2 = torch.exp2(torch.randint(-9, -4, (E, d, 1), device="cuda").float())

        def grouped_w8a16_rows():
            w8a16_grouped_contiguous(xb, w13, r13, counts)
            w8a16_grouped_contiguous(hb, w2, r2, counts)
        cases.append(("grouped_w8a16_rowscale", grouped_w8a16_rows))
        for v in variants:
            def fn(v=v, s13=s13, s2=s2):
                fp8_variant_grouped_contiguous(a, sa, w13, s13, counts, v)
                fp8_variant_grouped_contiguous(h, sh, w2, s2, counts, v)
            cases += [(f"grouped_{v}", fn), (f"grouped_{v}_rowscale", lambda v=v, f=fn: f(v, r13, r2))]   # f bound now: the timing loop below rebinds fn
    for name, fn in cases:
        try:
            r[f"{name}_us"] = time_calls([fn], iters=3) * 1e6
        except Exception as e:  # noqa: BLE001 (a variant that does not compile or launch: say so, go on)
            print(f"  MoE {name}: {type(e).__name__} {str(e)[:160]}", flush=True)
            continue
        r[f"{name}_tflops"] = flops / r[f"{name}_us"] / 1e6
    if variants:
        print("MoE FP8 variants (TFLOP/s; per-(row, 32) scales / row scales): " + ", ".join(
            f"{v} {r.get(f'grouped_{v}_tflops', float('nan')):.0f} / {r.get(f'grouped_{v}_rowscale_tflops', float('nan')):.0f}"
            for v in variants) + f"; grouped W8A16 row scales {r.get('grouped_w8a16_rowscale_tflops', float('nan')):.0f}",
            flush=True)
    r["grouped_of_fp8_peak"] = r["grouped_fp8_tflops"] * 1e12 / peaks["fp8_flops"]
    print(f"MoE {m} tokens, {P} pairs over {E} experts: grouped FP8 {r['grouped_fp8_tflops']:.0f} TF "
          f"({r['grouped_of_fp8_peak']:.2f} of FP8 peak), per-expert W8A16 loop {r['loop_w8a16_tflops']:.0f} TF, "
          f"per-expert FP8 loop {r['loop_fp8_tflops']:.0f} TF, grouped W8A16 {r['grouped_w8a16_tflops']:.0f} TF: "
          f"grouped W8A16 {r['loop_w8a16_us'] / r['grouped_w8a16_us']:.2f}x the W8A16 loop", flush=True)
    return r


def _cuda_ok(n: int, k: int, s: torch.Tensor) -> bool:
    """The CUDA kernel can run here (SM90, nvcc, its shape rules); else say why once per shape."""
    from deepinfer.kernels.cuda_fp8_gemm import decline_reason
    why = decline_reason(1, n, k, s, torch.device("cuda"))
    if why is not None:
        print(f"  cuda kernel skipped at {n}x{k}: needs {why}", flush=True)
    return why is None


CUDA_MS = (8192, 2048, 128, 64, 32)      # prefill first: the numbers that matter most if the run is cut short


def _warm_deepgemm_job(n: int, k: int, ms: tuple) -> str:
    """DeepGEMM's JIT compile of one linear at each M (a worker process; its cache is on disk)."""
    from deepinfer.kernels import deepgemm
    w, s = weight(n, k)
    pair = deepgemm.cached_tile128(w, s)
    for m in ms:
        deepgemm.linear(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), *pair)
    torch.cuda.synchronize()
    return f"deepgemm {n}x{k}"


def warm_deepgemm(ms: tuple, jobs: int = 6) -> None:
    """Compile DeepGEMM's kernels for the six linears in parallel before timing (a fresh machine's JIT
    takes seconds per shape, in series minutes)."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor
    from deepinfer.kernels import deepgemm
    if deepgemm.load() is None or not ms or jobs <= 0:
        return
    t0 = time.time()
    todo = [(n, k) for n, k in DENSE.values() if n % 128 == 0 and k % 128 == 0]
    with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=multiprocessing.get_context("spawn")) as ex:
        for f in [ex.submit(_warm_deepgemm_job, n, k, tuple(ms)) for n, k in todo]:
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 (the timed run meets it again and reports it)
                print(f"  deepgemm warm-up failed: {type(e).__name__} {str(e)[:200]}", flush=True)
    print(f"DeepGEMM compiled in parallel: {time.time() - t0:.0f} s", flush=True)


def _cuda_forms(m: int) -> dict[str, str]:
    """The CUDA forms timed at m rows (column key -> entry; "auto" = what fp8_gemm_cuda picks, split-K at
    decode sizes): the default two-consumer form, the BN 192 one-temporary form, split-K and BM 64 at
    M <= 128; the 2-CTA multicast forms (BN 128 and 192) and the no-overlap debugging form at M >= 2048."""
    forms = {"cuda": "fp8_gemm_sm90_bn128", "cuda_bn192": "fp8_gemm_sm90_bn192", "cuda_auto": None}
    if m <= 128:
        forms["cuda_bm64"] = "fp8_gemm_sm90_bm64"
        forms["cuda_splitk"] = "fp8_gemm_sm90_bm64_splitk" if m <= 64 else "fp8_gemm_sm90_bn128_splitk"
    if m >= 2048:
        forms["cuda_mc2"] = "fp8_gemm_sm90_bn128_mc2"
        forms["cuda_bn192_mc2"] = "fp8_gemm_sm90_bn192_mc2"
        forms["cuda_debug"] = "fp8_gemm_sm90_debug"
    return forms


def _row_scale_forms(m: int) -> dict[str, tuple[str, str]]:
    """Column key -> (scale layout, entry) of the per-row weight-scale forms at m rows."""
    small = "bm64" if m <= 64 else "bn128"
    return {"cuda_row": ("row", f"fp8_gemm_sm90_{small}_row"), "cuda_rowk": ("rowk", f"fp8_gemm_sm90_{small}_rowk")}


def cuda_rows(ms, peaks: dict, deepgemm_ms=(8192,)) -> list[dict]:
    """The CUDA kernel's forms (_cuda_forms: the default two-consumer form, BN 192, split-K and BM 64 at
    M <= 128, the no-overlap debugging form; _row_scale_forms: per-row [N, 1] and per-(row, 32) [N, K/32]
    weight scales on the same weight bytes) against W8A16, the Triton FP8 x FP8 forms (the BK 32 walk of
    triton_gemm.fp8_gemm; the per-32 prefill kernel at M >= 512), DeepGEMM (at deepgemm_ms only: its JIT
    compiles each shape, minutes on a fresh machine) and bf16 at each dense linear and M, with ratios to
    W8A16, DeepGEMM and the FP8 peak. Each row first checks every CUDA form's values against
    triton_gemm.fp8_gemm's (block scales) or an fp32 torch product of the dequantized operands (row
    scales): the same exact products, so they may differ by the FP8 MMA's in-slice rounding only, and a
    fast wrong form cannot post a number unflagged."""
    from deepinfer.kernels import deepgemm
    from deepinfer.kernels.cuda_fp8_gemm import fp8_gemm_cuda
    from deepinfer.kernels.select import dequant_fp8
    from deepinfer.kernels.triton_fp8_prefill import as_f32_scale, fp8_prefill_gemm
    from deepinfer.kernels.triton_gemm import fp8_gemm, w8a16_gemm
    from deepinfer.kernels.triton_quant import act_quant, act_quant_fp8
    dg = deepgemm.load()
    rows = []
    nan = float("nan")

    def check(r, key, got, want):
        err = ((got.float() - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()   # normwise
        r[f"{key}_max_rel_diff"] = err
        if not err <= 2 ** -6:
            print(f"  {r['name']} m {r['m']} {key}: WRONG (max difference to the reference {err:.3g} of max |y|)", flush=True)

    for name, (n, k) in DENSE.items():
        w, s = weight(n, k)
        s32 = as_f32_scale(s)
        if not _cuda_ok(n, k, s):
            continue
        row_scales = {"row": torch.exp2(torch.randint(-9, -5, (n, 1), device="cuda").float()),
                      "rowk": torch.randint(118, 124, (n, k // 32), dtype=torch.uint8, device="cuda")}
        pair = deepgemm.cached_tile128(w, s) if dg is not None and n % 128 == 0 and k % 128 == 0 else None
        wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq = act_quant(x)
            a, sa = act_quant_fp8(x)
            flops = 2.0 * m * n * k
            r = {"name": name, "m": m, "n": n, "k": k}
            want = fp8_gemm(a, sa, w, s32).float()
            forms = _cuda_forms(m)
            for key, entry in forms.items():
                check(r, key, fp8_gemm_cuda(a, sa, w, s32, entry=entry), want)
            ad = a.float() * sa.repeat_interleave(32, 1)
            for key, (kind, entry) in _row_scale_forms(m).items():
                check(r, key, fp8_gemm_cuda(a, sa, w, row_scales[kind], entry=entry), ad @ dequant_fp8(w, row_scales[kind]).T)
            del ad
            r["w8a16_us"] = time_calls([lambda: w8a16_gemm(xq, w, s)]) * 1e6
            r["fp8_bk32_us"] = time_calls([lambda: fp8_gemm(a, sa, w, s32)]) * 1e6
            if m >= 512:
                r["fp8_us"] = time_calls([lambda: fp8_prefill_gemm(a, sa, w, s32)]) * 1e6
            for key, entry in forms.items():
                r[f"{key}_us"] = time_calls([lambda: fp8_gemm_cuda(a, sa, w, s32, entry=entry)]) * 1e6
            for key, (kind, entry) in _row_scale_forms(m).items():
                r[f"{key}_us"] = time_calls([lambda: fp8_gemm_cuda(a, sa, w, row_scales[kind], entry=entry)]) * 1e6
            r["bf16_us"] = time_calls([lambda: x @ wb.T]) * 1e6
            if pair is not None and m in deepgemm_ms:
                try:
                    r["deepgemm_us"] = time_calls([lambda: deepgemm.linear(x, *pair)]) * 1e6
                except Exception as e:  # noqa: BLE001 (DeepGEMM refusing an M: the row goes on without it)
                    print(f"  {name} m {m} deepgemm: {type(e).__name__} {str(e)[:160]}", flush=True)
            for key in ("w8a16", "fp8_bk32", "fp8", "bf16", "deepgemm", *forms, *_row_scale_forms(m)):
                if f"{key}_us" in r:
                    r[f"{key}_tflops"] = flops / r[f"{key}_us"] / 1e6
            r["cuda_of_fp8_peak"] = r["cuda_tflops"] * 1e12 / peaks["fp8_flops"]
            r["cuda_vs_w8a16"] = r["w8a16_us"] / r["cuda_us"]
            for key in forms:                     # each form against W8A16 and the default form
                r[f"{key}_vs_w8a16"] = r["w8a16_us"] / r[f"{key}_us"]
                r[f"{key}_vs_default"] = r["cuda_us"] / r[f"{key}_us"]
            if "cuda_debug_us" in r:
                r["cuda_vs_overlap_off"] = r["cuda_debug_us"] / r["cuda_us"]
            if "deepgemm_us" in r:
                r["cuda_vs_deepgemm"] = r["deepgemm_us"] / r["cuda_us"]
                r["cuda_bn192_vs_deepgemm"] = r["deepgemm_us"] / r["cuda_bn192_us"]
            best = max(forms, key=lambda f: r[f"{f}_tflops"])
            print(f"{name:10s} m {m:5d}: cuda {r['cuda_tflops']:6.0f} TF ({r['cuda_of_fp8_peak']:.2f} of FP8 peak, "
                  f"{r['cuda_vs_w8a16']:.2f}x w8a16, {r.get('cuda_vs_deepgemm', nan):.2f}x deepgemm) "
                  f"bn192 {r['cuda_bn192_tflops']:6.0f}  auto {r['cuda_auto_tflops']:6.0f}  "
                  f"splitk {r.get('cuda_splitk_tflops', nan):6.0f}  bm64 {r.get('cuda_bm64_tflops', nan):6.0f}  "
                  f"mc2 {r.get('cuda_mc2_tflops', nan):6.0f}  bn192 mc2 {r.get('cuda_bn192_mc2_tflops', nan):6.0f}  "
                  f"no-overlap {r.get('cuda_debug_tflops', nan):6.0f}  row {r['cuda_row_tflops']:6.0f}  "
                  f"rowk {r['cuda_rowk_tflops']:6.0f} | best {best} {r[f'{best}_vs_w8a16']:.2f}x w8a16 | "
                  f"w8a16 {r['w8a16_tflops']:6.0f}  triton fp8 bk32 {r['fp8_bk32_tflops']:6.0f}  "
                  f"per-32 {r.get('fp8_tflops', nan):6.0f}  deepgemm {r.get('deepgemm_tflops', nan):6.0f}  "
                  f"bf16 {r['bf16_tflops']:6.0f}  (worst rel diff "
                  f"{max(v for kk, v in r.items() if kk.endswith('_max_rel_diff')):.1e})", flush=True)
            rows.append(r)
            del x, xq, a, sa, want
        del w, s, s32, pair, wb, row_scales
    return rows


VARIANT_MS = (32, 64, 128, 8192)
MOE_VARIANTS = ("blocks", "blocks_bm64", "lag_blocks", "lag_blocks_bm64", "lag2_blocks_bn64", "tma_lag_blocks")   # (the MoE's grouped form)
WIN_MARGIN = 1.03          # a variant enters the table only where it beats W8A16 by 3% or more


def _warm(job: str) -> str:
    """Compile what the timed run will launch, in a worker process (Triton's and DeepGEMM's on-disk caches
    are shared, so the timed run only loads binaries). job: a variant name or "baselines". The compile
    keys depend on the constexprs and on which ints are multiples of 16 (all of the bench's M, N, K), so
    small K stands in for the real one."""
    import time
    t0 = time.time()
    if job == "baselines":
        from deepinfer.kernels import deepgemm
        from deepinfer.kernels.triton_gemm import w8a16_gemm
        from deepinfer.kernels.triton_quant import act_quant, act_quant_fp8
        dg = deepgemm.load()
        for n, k in DENSE.values():
            w, s = weight(n, k)
            pair = deepgemm.cached_tile128(w, s) if dg is not None and n % 128 == 0 and k % 128 == 0 else None
            for m in VARIANT_MS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w8a16_gemm(act_quant(x), w, s)
                act_quant_fp8(x)
                if pair is not None:
                    try:
                        deepgemm.linear(x, *pair)
                    except Exception:  # noqa: BLE001 (the timed run reports it)
                        pass
    else:
        from deepinfer.kernels.triton_fp8_prefill import as_f32_scale
        from deepinfer.kernels.triton_fp8_variants import fp8_variant_gemm, fp8_variant_grouped_contiguous
        k = 512
        for m, n in ((64, 4608), (128, 4608), (64, 32768), (1024, 4608)):   # split / unsplit at both tiles
            w, s = weight(n, k)
            a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
            fp8_variant_gemm(a, torch.ones(m, k // 32, device="cuda"), w, as_f32_scale(s), job)
        if job in MOE_VARIANTS:
            E, n, P = 4, 256, 320                  # P a multiple of 16, as 8192 x 6
            a = torch.randn(P, k, device="cuda").to(torch.float8_e4m3fn)
            w = torch.randn(E, n, k, device="cuda").to(torch.float8_e4m3fn)
            counts = torch.tensor([100, 0, 160, 60], device="cuda")
            for sc in (torch.ones(E, n, k // 32, device="cuda"), torch.ones(E, n, 1, device="cuda")):
                fp8_variant_grouped_contiguous(a, torch.ones(P, k // 32, device="cuda"), w, sc, counts, job)
    torch.cuda.synchronize()
    return f"{job} {time.time() - t0:.0f} s"


def warm_all(names, jobs: int) -> None:
    """Compile every variant (and the baselines) in parallel worker processes before timing anything."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor
    t0 = time.time()
    todo = ["baselines"] + list(names)
    with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=multiprocessing.get_context("spawn")) as ex:
        for f in [ex.submit(_warm, j) for j in todo]:
            try:
                print("  compiled", f.result(), flush=True)
            except Exception as e:  # noqa: BLE001 (the timed run meets it again and reports it)
                print(f"  compile job failed: {type(e).__name__} {str(e)[:200]}", flush=True)
    print(f"compiled in parallel: {time.time() - t0:.0f} s", flush=True)


def split_candidates(variant: str, m: int, n: int, k: int) -> list[int]:
    """Split-K counts to try besides decode_config's rule at decode-sized M: up to 32 splits of at
    least 4 slices each (the rule stops at one wave of output tiles; two or more CTAs per SM may hide
    the promotion's latency better)."""
    from deepinfer.kernels.triton_fp8_variants import decode_config
    if m > 128:
        return []
    rule = decode_config(variant, m, n, k, "cuda")["SPLIT_K"]
    return [s for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if s != rule and s <= k // 32 // 4]


def variant_rows(ms, names, peaks: dict, splits: bool = False) -> tuple[list[dict], list[dict]]:
    """Each dense linear at each M: W8A16 (the default path's GEMM on act_quant's bf16 values), every FP8
    x FP8 variant (GEMM on act_quant_fp8's e4m3 + scales), DeepGEMM (per-128 promotion: a speed reference,
    not exact), with ratios; and the choice table (the fastest variant where it beats W8A16 by
    WIN_MARGIN, else null). splits: at M <= 128 also each variant's split-K counts (split_candidates);
    a count that wins by WIN_MARGIN replaces the rule's and goes into the table row as split_k."""
    from deepinfer.kernels import deepgemm
    from deepinfer.kernels.triton_fp8_prefill import as_f32_scale
    from deepinfer.kernels.triton_fp8_variants import fp8_variant_gemm
    from deepinfer.kernels.triton_gemm import w8a16_gemm
    from deepinfer.kernels.triton_quant import act_quant, act_quant_fp8
    dg = deepgemm.load()
    rows, table = [], []
    for name, (n, k) in DENSE.items():
        w, s = weight(n, k)
        s32 = as_f32_scale(s)
        pair = deepgemm.cached_tile128(w, s) if dg is not None and n % 128 == 0 and k % 128 == 0 else None
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq = act_quant(x)
            a, sa = act_quant_fp8(x)
            flops = 2.0 * m * n * k
            r = {"name": name, "m": m, "n": n, "k": k, "w8a16_us": time_calls([lambda: w8a16_gemm(xq, w, s)]) * 1e6}
            if pair is not None:
                try:
                    r["deepgemm_us"] = time_calls([lambda: deepgemm.linear(x, *pair)]) * 1e6
                except Exception as e:  # noqa: BLE001 (DeepGEMM refusing an M: the row goes on without it)
                    print(f"  {name} m {m} deepgemm: {type(e).__name__} {str(e)[:160]}", flush=True)
            for v in names:
                try:
                    r[f"{v}_us"] = time_calls([lambda: fp8_variant_gemm(a, sa, w, s32, v)]) * 1e6
                    for split in (split_candidates(v, m, n, k) if splits else ()):
                        us = time_calls([lambda: fp8_variant_gemm(a, sa, w, s32, v, split_k=split)]) * 1e6
                        if us * WIN_MARGIN < r[f"{v}_us"]:        # a split count beats the rule's clearly
                            r[f"{v}_us"], r[f"{v}_split"] = us, split
                except Exception as e:  # noqa: BLE001 (a variant that does not compile or launch: say so, go on)
                    print(f"  {name} m {m} {v}: {type(e).__name__} {str(e)[:160]}", flush=True)
            timed = [v for v in names if f"{v}_us" in r]
            best = min(timed, key=lambda v: r[f"{v}_us"]) if timed else None
            r["best"] = best
            for key in ["w8a16", "deepgemm"] + timed:
                if f"{key}_us" in r:
                    r[f"{key}_tflops"] = flops / r[f"{key}_us"] / 1e6
            line = f"{name:10s} m {m:5d}: w8a16 {r['w8a16_tflops']:6.0f} TF"
            if "deepgemm_us" in r:
                line += f"  deepgemm {r['deepgemm_tflops']:6.0f}"
            if best:
                r["best_vs_w8a16"] = r["w8a16_us"] / r[f"{best}_us"]
                r["best_of_fp8_peak"] = r[f"{best}_tflops"] * 1e12 / peaks["fp8_flops"]
                if "deepgemm_us" in r:
                    r["best_vs_deepgemm"] = r["deepgemm_us"] / r[f"{best}_us"]
                line += (f"  best {best} {r[f'{best}_tflops']:6.0f} TF = {r['best_vs_w8a16']:.2f}x w8a16, "
                         f"{r.get('best_vs_deepgemm', float('nan')):.2f}x deepgemm, {r['best_of_fp8_peak']:.2f} of FP8 peak |")
            line += " ".join(f" {v} {r[f'{v}_tflops']:.0f}" + (f"/s{r[f'{v}_split']}" if f"{v}_split" in r else "")
                             for v in timed)
            print(line, flush=True)
            rows.append(r)
            win = best is not None and r["w8a16_us"] >= WIN_MARGIN * r[f"{best}_us"]
            row = {"n": n, "k": k, "m": m, "variant": best if win else None}
            if win and f"{best}_split" in r:
                row["split_k"] = r[f"{best}_split"]
            table.append(row)
            del x, xq, a, sa
        del w, s, s32, pair
    return rows, table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=None, help="M rows (default 8192; --cuda: 8192 2048 128 64 32)")
    p.add_argument("--sweep", action="store_true", help="try every SWEEP tile config, keep the fastest")
    p.add_argument("--variants", nargs="?", const="all", default=None,
                   help="the FP8 x FP8 variants (comma-separated names, default all) at M 32/64/128/8192 + the MoE")
    p.add_argument("--splits", action="store_true", help="--variants: also sweep split-K counts at M <= 128")
    p.add_argument("--cuda", action="store_true", help="the CUDA kernel's forms against the others at --m (default 8192/2048/128/64/32)")
    p.add_argument("--deepgemm-m", type=int, nargs="*", default=[8192], help="--cuda: the Ms that also time DeepGEMM")
    p.add_argument("--jobs", type=int, default=8, help="--variants / --cuda: compile in this many worker processes first (0: no)")
    a = p.parse_args()
    peaks = measure_ceilings()
    print(f"peaks (same run): FP8 {peaks['fp8_flops'] / 1e12:.0f} TFLOP/s, bf16 {peaks['bf16_flops'] / 1e12:.0f}, "
          f"copy {peaks['copy_bw'] / 1e12:.2f} TB/s", flush=True)
    if a.cuda:
        ms = a.m or CUDA_MS
        warm_deepgemm(tuple(m for m in ms if m in a.deepgemm_m), a.jobs)
        rows = cuda_rows(ms, peaks, tuple(a.deepgemm_m))
        print("saved", save_json("bench_fp8_cuda.json", {"peaks": peaks, "dense": rows}))
        return
    if a.variants:
        import time
        from deepinfer.kernels.triton_fp8_variants import VARIANTS
        names = list(VARIANTS) if a.variants == "all" else a.variants.split(",")
        t0 = time.time()
        if a.jobs > 0:
            warm_all(names, a.jobs)
        rows, table = variant_rows(VARIANT_MS, names, peaks, a.splits)
        moe = moe_rows(8192, peaks, variants=tuple(v for v in names if v in MOE_VARIANTS))
        print(f"MoE grouped contiguous W8A16 / per-expert W8A16 loop: {moe['loop_w8a16_us'] / moe['grouped_w8a16_us']:.2f}x "
              f"(> 1: flip select.MOE_CONTIGUOUS_DEFAULT to \"1\")", flush=True)
        doc = {"measured": "H200 (perf/bench_fp8_prefill.py --variants)", "win_margin": WIN_MARGIN, "rows": table}
        print("saved", save_json("bench_fp8_variants.json", {"peaks": peaks, "dense": rows, "moe": moe}),
              save_json("fp8_select_table.json", doc), f"({time.time() - t0:.0f} s)")
        return
    out = {"peaks": peaks, "dense": [], "moe": []}
    for m in a.m or [8192]:
        out["dense"] += dense_rows(m, a.sweep, peaks)
        out["moe"].append(moe_rows(m, peaks))
    print("saved", save_json("bench_fp8_prefill.json", out))


if __name__ == "__main__":
    main()
