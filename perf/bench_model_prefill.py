"""Whole prefill on the GPU: Transformer.forward on the `full-width-ep8` config (real widths, one layer per
role, 48 local experts = one GPU's EP8 share; random weights made on the device, load_format="dummy")
for 1 x 8192, 4 x 2048 and 16 x 512 prompt tokens in one step, and 1 x 8192 as chunked prefill with a
2,048-token budget, side by side in one run on three GEMM paths (GEMM_MODES): the W8A16 kernels (the
default), W8A16 with the MoE in the grouped contiguous form (DEEPINFER_MOE_CONTIGUOUS=1), and the FP8 x
FP8 per-32-promotion kernels (DEEPINFER_PREFILL_GEMM=fp8, kernels/triton_fp8_prefill.py).

    python perf/bench_model_prefill.py [--cases 1x8192 4x2048 16x512 chunked] [--profile] [--gemms w8a16 lag_blocks ...]
                                       (model_prefill.json / .png in $OUT, the plot also as perf/figures/model_prefill_<gpu>.png)

Printed per case and GEMM path: milliseconds, tokens/s, the linear work's TFLOP/s and its share of the
FP8 and bf16 peaks measured in the same run (benchutil.measure_ceilings: torch._scaled_mm per-tensor FP8
and the bf16 matmul at 8192^3), and the 40-layer per-GPU estimate: the step time scaled by 40 / 7 layers
(the head and embedding are in the 7-layer time, so this slightly overstates the 40-layer time; with
--preset release-ep8, the release's 40 layers at one GPU's EP8 share of experts, it is measured). Linear
work = every FP8 linear (fused or not), wo_a, the routed experts (T x top-6 pairs on the 48 local experts:
at EP8 each GPU's experts see as many pairs as its own tokens pick) and the shared expert; attention,
indexers, compressors, norms, mHC and the head are not counted. --profile: the top kernels of one
1 x 8192 prefill (or --profile-case) on the default path (torch.profiler), and the host's time in it.
--mhc-variants '{}' '{"bt": 128, ...}': hc_mixes_pre's prefill launch constants compared in the same run
(each row's gemm column gets /m0, /m1, ...); the profile runs the last one. --routing balanced (the default
since 2026-12-06) gives every expert an equal share of the picks; before, the random gates' skewed picks
(--routing model) decided the experts' loads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import (dummy_model, gpu_model, measure_ceilings, mhc_variants, out_dir,  # noqa: E402
                       save_json, time_eager, use_mhc_variant)
from deepinfer.model.balanced_routing import install as balance_routing  # noqa: E402

FULL_LAYERS = 40
# the prefill GEMM paths compared: W8A16 everywhere (the default: per-expert loop for large MoE steps),
# W8A16 with the MoE's grouped contiguous form (DEEPINFER_MOE_CONTIGUOUS=1), FP8 x FP8 (DEEPINFER_PREFILL_GEMM=fp8)
GEMM_MODES = ("w8a16", "w8a16+moe", "fp8")


def gemm_mode(mode: str) -> tuple[str, bool]:
    """--gemms entry -> (select.PREFILL_GEMM, select.MOE_CONTIGUOUS): w8a16, w8a16+moe, fp8 (the first FP8
    kernel, MoE contiguous on it), auto / auto+moe (the measured table kernels/fp8_select_table.json or
    DEEPINFER_FP8_TABLE picks per shape), or an FP8 variant name (triton_fp8_variants: every FP8 linear of
    >= 32 rows and the MoE's contiguous form on it), cuda (the warp-specialized CUDA FP8 GEMM,
    kernels/cuda_fp8_gemm.py, for the dense FP8 linears; cuda+moe: the MoE's contiguous form too), bf16
    (every dense FP8 linear dequantized to bf16 and on cuBLAS, kernels/triton_dequant.py), auto_fp8
    (auto without that bf16 path: the default before 2026-12-03). Sets select.BF16_AUTO_MIN_M too.
    Suffixes after ':' change one setting for that entry, so that paths compare in one process:
    ':ts' / ':plain' the CUDA FP8 kernel's scale-tile twins on / off (cuda_fp8_gemm.TS_ON), ':fp8moe' the
    MoE's long steps on it too (select.BF16_MOE_MIN_ROWS = 0: no bf16 grouped GEMM), e.g. auto+moe:ts:fp8moe;
    FP4 stacks' contiguous steps ':fp4deq' always dequantized to bf16 first
    (select.FP4_W4A16_MAX_ROWS_PER_EXPERT = 0), ':fp4w4a16' always on the W4A16 K loop (no row limit)."""
    from deepinfer.kernels import cuda_fp8_gemm, select
    name, *flags = mode.split(":")
    base, _, moe = name.partition("+")
    if base not in ("w8a16", "fp8", "cuda", "auto", "auto_fp8", "bf16") + select.FP8_VARIANTS or moe not in ("", "moe") \
            or set(flags) - {"ts", "plain", "fp8moe", "fp4deq", "fp4w4a16"}:
        raise SystemExit(f"--gemms: unknown mode {mode!r}")
    select.BF16_AUTO_MIN_M = 0 if base == "auto_fp8" else _BF16_DEFAULT
    cuda_fp8_gemm.TS_ON = True if "ts" in flags else False if "plain" in flags else _TS_DEFAULT
    select.BF16_MOE_MIN_ROWS = 0 if "fp8moe" in flags else _BF16_MOE_DEFAULT
    select.FP4_W4A16_MAX_ROWS_PER_EXPERT = (0 if "fp4deq" in flags else 1 << 62 if "fp4w4a16" in flags
                                            else _FP4_W4A16_DEFAULT)
    return ("auto" if base == "auto_fp8" else base), moe == "moe"

_BF16_DEFAULT = 1024            # select.BF16_AUTO_MIN_M as the process started (main sets it)
_TS_DEFAULT = False             # cuda_fp8_gemm.TS_ON as the process started (main sets it)
_BF16_MOE_DEFAULT = 16384       # select.BF16_MOE_MIN_ROWS as the process started (main sets it)
_FP4_W4A16_DEFAULT = 640        # select.FP4_W4A16_MAX_ROWS_PER_EXPERT as the process started (main sets it)
FIGURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")


def linear_flops(args, T: int) -> float:
    """FLOPs of the linear work of one step of T tokens (module docstring)."""
    d, H, hd, qr = args.dim, args.n_heads, args.head_dim, args.q_lora_rank
    inter, G, r = args.moe_inter_dim, args.o_groups, args.o_lora_rank
    per_layer = qr * d + hd * d + H * hd * qr + H * hd * r + d * G * r + 3 * d * inter
    per_layer += args.n_activated_experts * 3 * d * inter
    total = per_layer * args.n_layers
    total += sum(args.index_n_heads * args.index_head_dim * qr for L in args.index_source_layers)
    return 2.0 * T * total


def case_batch(model, caches, seqs: int, tokens: int, start: int = 0, block_tokens: int = 64, nb: int = 0):
    from deepinfer.model.simple import make_batch
    g = torch.Generator().manual_seed(seqs * 7919 + tokens)
    chunks = []
    for _ in range(seqs):
        ids = torch.randint(1000, 120000, (start + tokens,), generator=g).tolist()
        chunks.append((ids[start:], start, ids[:start]))
    table = torch.arange(seqs * nb, dtype=torch.int64).view(seqs, nb)
    return make_batch(chunks, list(range(seqs)), table, model.args.engram_max_ngram_size, "cuda")


def run_case(model, caches, name: str, nb: int):
    """A callable running the case's step(s), and its prompt tokens."""
    if name == "chunked":
        batches = [case_batch(model, caches, 1, 2048, s, nb=nb) for s in range(0, 8192, 2048)]

        def fn():
            for b in batches:
                model(b, caches)
        return fn, 8192
    seqs, tokens = (int(v) for v in name.split("x"))
    b = case_batch(model, caches, seqs, tokens, nb=nb)
    return (lambda: model(b, caches)), seqs * tokens


# kernel names of the linear work (cuBLAS / CUTLASS / our GEMMs) and of the exact bf16 path's weight dequant
_LINEAR_KERNELS = ("gemm", "nvjet", "cutlass", "xmma", "w8a16", "w4a16")


def linear_mfu_bound(kernels: list[dict], flops: float, fp8_peak: float) -> dict:
    """How far whole-prefill linear MFU can go with these kernels (rows {name, us}): the linear GEMMs
    replaced by ones at the FP8 peak (flops / fp8_peak each prefill), the rest (attention, indexers, norms,
    mHC, the MoE's glue) as measured. Without the dequant: an FP8 GEMM would not need the exact path's
    bf16 weights. other_ms_for_half: what the non-linear kernels may take for 0.5 of the FP8 peak."""
    lin = sum(r["us"] for r in kernels if any(k in r["name"].lower() for k in _LINEAR_KERNELS)
              and "dequant" not in r["name"].lower()) / 1e3
    deq = sum(r["us"] for r in kernels if "dequant" in r["name"].lower()) / 1e3
    other = sum(r["us"] for r in kernels) / 1e3 - lin - deq
    at_peak = flops / fp8_peak * 1e3
    return dict(linear_ms=lin, dequant_ms=deq, other_ms=other, linear_at_fp8_peak_ms=at_peak,
                bound=at_peak / (other + at_peak), bound_with_dequant=at_peak / (other + deq + at_peak),
                other_ms_for_half=at_peak)


def print_mfu_bound(b: dict) -> None:
    print(f"linear MFU bound: GEMM kernels {b['linear_ms']:.1f} ms, weight dequant {b['dequant_ms']:.1f}, the rest "
          f"{b['other_ms']:.1f}; every linear at the FP8 peak would take {b['linear_at_fp8_peak_ms']:.1f} ms, so the "
          f"whole prefill's linear MFU is at most {b['bound']:.2f} of the FP8 peak ({b['bound_with_dequant']:.2f} "
          f"with the dequant); 0.5 needs the rest within {b['other_ms_for_half']:.1f} ms", flush=True)


def profile(fn, top: int = 20, case: str = "1x8192", flops: float = 0.0, fp8_peak: float = 0.0):
    """Top kernels of one call, then where the host waited on the device inside it (device-to-host reads:
    each one drains the queue, so the GPU idles while the host launches what follows), by Python stack."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [dict(name=e.key[:90], us=e.device_time_total, calls=e.count) for e in prof.key_averages()
            if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    print(f"profile {case} (default path): {total / 1e3:.1f} ms of kernel time; top {top}:")
    for r in rows[:top]:
        print(f"  {r['us'] / 1e3:8.2f} ms {100 * r['us'] / total:5.1f}%  {r['calls']:5d}x  {r['name']}")
    bound = linear_mfu_bound(rows, flops, fp8_peak) if flops and fp8_peak else None
    if bound:
        print_mfu_bound(bound)
    # where the device time comes from, by aten op and the model's Python line (kernels launched by
    # torch ops carry no stack; their CPU op does): finds the glue kernels the top list names by template
    ops_ = [e for e in prof.key_averages(group_by_stack_n=8)
            if e.key.startswith("aten::") and e.self_device_time_total > 0]
    ops_.sort(key=lambda e: -e.self_device_time_total)
    print("torch ops by device time and the model line that issued them (top 15):")
    for e in ops_[:15]:
        stack = " < ".join(f.split("/")[-1] for f in (e.stack or []) if "deepinfer" in f or "kernels" in f)[:150]
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms {e.count:5d}x  {e.key}  {stack}")
    waits = [e for e in prof.key_averages(group_by_stack_n=6)
             if e.key in ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize")]
    waits.sort(key=lambda e: -e.cpu_time_total)
    print(f"host waits inside the call: {sum(e.count for e in waits)} "
          f"({sum(e.cpu_time_total for e in waits) / 1e3:.1f} ms of host time in them); by stack:")
    for e in waits[:12]:
        stack = " < ".join(f.split("/")[-1] for f in (e.stack or [])[:6] if "deepinfer" in f or "kernels" in f)
        print(f"  {e.count:4d}x {e.cpu_time_total / 1e3:7.2f} ms  {e.key}  {stack}")
    return rows[:top], bound


def idle_gaps(fn, top: int = 12) -> None:
    """Where the GPU idles inside one call (no stacks recorded, so the host runs near its real speed): the
    gaps between consecutive kernels, their sum against the call's span, and the largest with the kernels
    on either side. A gap after a host read of a device value is the queue drained and refilled."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ks = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0),
                key=lambda e: e.time_range.start)
    if len(ks) < 2:
        return
    gaps, end = [], ks[0].time_range.end
    for prev, k in zip(ks, ks[1:]):
        if k.time_range.start > end:
            gaps.append((k.time_range.start - end, prev.name[:40], k.name[:40]))
        end = max(end, k.time_range.end)
    span = ks[-1].time_range.end - ks[0].time_range.start
    idle = sum(g for g, *_ in gaps)
    big = [g for g in gaps if g[0] >= 50]
    print(f"GPU idle inside the call: {idle / 1e3:.1f} ms of a {span / 1e3:.1f} ms span ({len(ks)} kernels); "
          f"{len(big)} gaps >= 50 us hold {sum(g for g, *_ in big) / 1e3:.1f} ms; largest:")
    for g, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {g / 1e3:7.2f} ms  after {before}  before {after}")


def sync_points(fn, top: int = 12) -> None:
    """The host reads of device values inside one call (torch.cuda.set_sync_debug_mode), by the model
    line that made them: each drains the launch queue."""
    import collections
    import traceback
    import warnings
    fn()
    torch.cuda.synchronize()
    seen = collections.Counter()

    def hook(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "deepinfer" in f.filename or "kernels" in f.filename]
        seen[" < ".join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in frames[::-1][:4])] += 1
    old = warnings.showwarning
    warnings.showwarning = hook
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = hook
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = old
    print(f"synchronizing calls inside the call: {sum(seen.values())}; by stack:")
    for stack, n in seen.most_common(top):
        print(f"  {n:4d}x  {stack or '(outside the model)'}")


def host_profile(fn, top: int = 25) -> None:
    """Where the host spends one call (cProfile, self time): the ~29 ms by which a 1 x 8192 prefill's wall
    time exceeded its kernel time (H200, 2026-12-03) is the host issuing launches behind the GPU."""
    import cProfile
    import pstats
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    issued = time.perf_counter() - t0
    torch.cuda.synchronize()
    print(f"host: one call issued in {issued * 1e3:.1f} ms (under cProfile), done {(time.perf_counter() - t0) * 1e3:.1f} ms "
          f"after it started; top {top} by self time:")
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (path, line, name), (_cc, calls, self_t, cum_t, _callers) in rows:
        print(f"  {self_t * 1e3:8.2f} ms self {cum_t * 1e3:8.2f} ms cum {calls:6d}x  {path.split('/')[-1]}:{line} {name}")


def plot(rows, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    modes = list(dict.fromkeys(r["gemm"] for r in rows))
    w = 0.8 / len(modes)
    for i, gemm in enumerate(modes):
        sel = [next((r for r in rows if r["case"] == c and r["gemm"] == gemm), None) for c in cases]
        sel = [r or dict(est40_tok_s=0.0, of_fp8_peak=0.0) for r in sel]
        xs = [j + w * i for j in range(len(cases))]
        ax[0].bar(xs, [r["est40_tok_s"] / 1e3 for r in sel], w, label=gemm)
        ax[1].bar(xs, [r["of_fp8_peak"] for r in sel], w, label=gemm)
    for a_, t in zip(ax, ("40 layers, k prompt tokens/s per GPU", "linear TFLOP/s / FP8 peak (same run)")):
        a_.set_xticks([j + 0.4 - w / 2 for j in range(len(cases))], cases)
        a_.set_title(t, fontsize=10)
        a_.legend()
    ax[0].axhline(15, color="gray", ls="--", lw=0.8)
    ax[1].axhline(0.5, color="gray", ls="--", lw=0.8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="full-width-ep8")
    p.add_argument("--expert-format", default="fp8", choices=["fp8", "fp4"],
                   help="the routed experts' stacks: FP8 (2x the release's bytes) or the release's MXFP4 (W4A16)")
    p.add_argument("--dense-weights", default="auto", choices=["auto", "fp8", "bf16", "bf16+fp8"],
                    help="EngineArgs.dense_weights; auto (the engine's default): bf16 where it fits, with FP8 decode "
                         "copies of the linears this GPU's decode table says pay")
    p.add_argument("--cases", nargs="+", default=["1x8192", "4x2048", "16x512", "chunked"])
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-case", default="1x8192", help="the case --profile looks into (e.g. chunked)")
    p.add_argument("--profile-top", type=int, default=20, help="how many kernels the profile lists")
    p.add_argument("--gemms", nargs="+", default=list(GEMM_MODES),
                   help="GEMM paths to compare (gemm_mode): w8a16, w8a16+moe, fp8, auto[+moe], an FP8 variant name")
    p.add_argument("--routing", default="balanced", choices=["balanced", "model"],
                   help="balanced: each expert gets an equal share of the step's picks (model/balanced_routing.py, "
                        "what a load-balanced router approaches); model: the random gates' own picks (skewed)")
    p.add_argument("--mhc-variants", nargs="+", default=["{}"],
                   help="hc_mixes_pre launch constants for T >= 1,024 (JSON, merged over triton_mhc.PREFILL_VARIANT) "
                        "to compare in one run, e.g. '{}' '{\"bt\": 128}' (perf/bench_mhc_variants.py's best)")
    a = p.parse_args()

    from deepinfer.cache.model_caches import ModelCaches
    from deepinfer.kernels import triton_mhc
    from deepinfer.kernels import select
    t0 = time.time()
    model = dummy_model(a.preset, dense_weights=a.dense_weights, expert_format=a.expert_format)
    print(f"built {a.preset} (dummy weights) in {time.time() - t0:.0f} s; kernels: {select.capability_report()}",
          flush=True)
    if a.routing == "balanced":
        balance_routing(model)
    peaks = measure_ceilings()
    print(f"peaks (same run): FP8 {peaks['fp8_flops'] / 1e12:.0f} TFLOP/s, bf16 {peaks['bf16_flops'] / 1e12:.0f}",
          flush=True)
    nb = -(-(8192 + 64) // 64)
    caches = ModelCaches.allocate(model.args, 16, 16 * nb, 64, "cuda")
    rows = []
    print(f"{'case':>8} {'gemm':>6} {'ms':>8} {'tok/s':>8} {'lin TF/s':>9} {'/FP8':>6} {'/bf16':>6} {'40L tok/s/GPU':>14}")
    global _BF16_DEFAULT, _TS_DEFAULT, _BF16_MOE_DEFAULT, _FP4_W4A16_DEFAULT
    from deepinfer.kernels import cuda_fp8_gemm
    _BF16_DEFAULT, _TS_DEFAULT, _BF16_MOE_DEFAULT = select.BF16_AUTO_MIN_M, cuda_fp8_gemm.TS_ON, select.BF16_MOE_MIN_ROWS
    _FP4_W4A16_DEFAULT = select.FP4_W4A16_MAX_ROWS_PER_EXPERT
    defaults = select.PREFILL_GEMM, select.MOE_CONTIGUOUS
    mhc = mhc_variants(a.mhc_variants)
    runs = [(g, i) for g in a.gemms for i in range(len(mhc))]
    for case in a.cases:
        for gemm, mi in runs:
            select.PREFILL_GEMM, select.MOE_CONTIGUOUS = gemm_mode(gemm)
            gemm = gemm if len(mhc) == 1 else f"{gemm}/m{mi}"
            try:
                with torch.inference_mode(), use_mhc_variant(triton_mhc.PREFILL_VARIANT, mhc[mi]):
                    fn, T = run_case(model, caches, case, nb)
                    t = time_eager(fn, iters=a.iters)
            except Exception as e:  # noqa: BLE001 (report and go on to the other cases)
                print(f"{case:>8} {gemm:>6} FAILED: {type(e).__name__}: {str(e)[:400]}", flush=True)
                continue
            tflops = linear_flops(model.args, T) / t
            row = dict(case=case, gemm=gemm, ms=t * 1e3, tok_s=T / t, linear_tflops=tflops / 1e12,
                       of_fp8_peak=tflops / peaks["fp8_flops"], of_bf16_peak=tflops / peaks["bf16_flops"],
                       est40_tok_s=T / (t * FULL_LAYERS / model.args.n_layers))
            rows.append(row)
            print(f"{case:>8} {gemm:>6} {row['ms']:8.1f} {row['tok_s']:8.0f} {row['linear_tflops']:9.0f} "
                  f"{row['of_fp8_peak']:6.2f} {row['of_bf16_peak']:6.2f} {row['est40_tok_s']:14.0f}", flush=True)
        mine = {r["gemm"]: r for r in rows if r["case"] == case}
        if len(mine) > 1:       # the first --gemms entry is the base of the ratios
            first, *others = mine
            print(f"{case:>8}  speed vs {first}: " + ", ".join(f"{g} {mine[first]['ms'] / mine[g]['ms']:.2f}x"
                                                            for g in others), flush=True)
    st = torch.cuda.memory_stats()
    # a retry frees the caching allocator's blocks to cudaMalloc again (a device sync: the GPU idles)
    print(f"allocator: {st.get('num_alloc_retries', 0)} retries, {st.get('num_device_alloc', 0)} cudaMallocs, peak "
          f"reserved {torch.cuda.max_memory_reserved() / 2**30:.1f} GiB of "
          f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f}", flush=True)
    select.PREFILL_GEMM, select.MOE_CONTIGUOUS = defaults
    select.BF16_AUTO_MIN_M, cuda_fp8_gemm.TS_ON, select.BF16_MOE_MIN_ROWS = _BF16_DEFAULT, _TS_DEFAULT, _BF16_MOE_DEFAULT
    select.FP4_W4A16_MAX_ROWS_PER_EXPERT = _FP4_W4A16_DEFAULT
    top, bound = [], None
    if a.profile:
        try:
            with torch.inference_mode(), use_mhc_variant(triton_mhc.PREFILL_VARIANT, mhc[-1]):   # the last one
                fn, T = run_case(model, caches, a.profile_case, nb)
                top, bound = profile(fn, top=a.profile_top, case=a.profile_case,
                                     flops=linear_flops(model.args, T), fp8_peak=peaks["fp8_flops"])
                idle_gaps(fn)
                sync_points(fn)
                host_profile(fn)
        except Exception as e:  # noqa: BLE001
            print(f"profile FAILED: {type(e).__name__}: {str(e)[:400]}")
    print("declined fast paths:", sorted(select.declined()))
    save_json("model_prefill.json", dict(preset=a.preset, routing=a.routing, peaks=peaks, rows=rows, profile_top=top,
                                         linear_mfu_bound=bound))
    os.makedirs(FIGURES, exist_ok=True)
    gpu = gpu_model()
    for path in (os.path.join(out_dir(), "model_prefill.png"), os.path.join(FIGURES, f"model_prefill_{gpu.lower()}.png")):
        try:
            plot(rows, path, f"{gpu} prefill, {a.preset} ({model.args.n_layers} layers, "
                             f"{model.args.n_routed_experts} local experts"
                             + (", 40-layer time scaled)" if model.args.n_layers != FULL_LAYERS else ")"))
        except OSError:
            pass


if __name__ == "__main__":
    main()
