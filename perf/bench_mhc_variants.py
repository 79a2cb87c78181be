"""hc_mixes_pre launch variants (triton_mhc.mix_variant's keywords) at decode and prefill sizes: each
against hc_mixes_pre_ref and timed as CUDA-graph replays (benchutil.time_calls: median of 20), the
whole wrapper (mixes kernel, chunk-sum kernel, Sinkhorn) per call. Picks PREFILL_VARIANT.

    python perf/bench_mhc_variants.py [--tokens 64 512 2048 8192] [--budget 70] [--out FILE]
        [--dots bf16x3] [--bts 64 128 256] [--wide] [--tails split fused]
    python perf/bench_mhc_variants.py --smoke       (CPU, Triton's interpreter, tiny shapes: the plumbing)

The grid: bt 16/32/64/128 x bk 128/64 x num_warps 4/8 x (num_stages, chunks_per_program) in (1,1) (1,2)
(1,4) (2,2) (2,4) (3,4) x dot tf32x3/bf16x3, less what cannot fit (shared-memory estimate) or would
spill (a [bt, bk] fp32 tile over 64 registers a thread). Every variant is compiled first in parallel
worker processes (Triton's disk cache then serves this process), a failed compile or launch (out of
resources) is reported and skipped, and variants are dropped once --budget seconds have passed.

Prints per T the current wrapper's time, then per variant ms, GB/s and the largest differences from
the reference; per T the best variant, its speedup and GB/s, and a line "best: T=... {kwargs}"; all
of it as JSON to --out ($OUT/mhc_variants.json, else perf/results/).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

HC, MIX = 4, 24
SMEM = 227 * 1024                      # the H200's shared memory per block
ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-20
STAGES_CHUNKS = ((1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (3, 4))   # stages > 1 need a loop to pipeline
WIDE_STAGES_CHUNKS = STAGES_CHUNKS + ((1, 8), (2, 8), (3, 8), (4, 8), (3, 10))   # --wide: long column walks


def smem_estimate(v: dict) -> int:
    """Bytes of shared memory a variant asks: the x tiles of the HC streams and fn's chunk (f32, or three
    bf16 parts) per buffer, max(1, stages - 1) buffers (the kernel's 3 stages at bt 64 asked 288 KB)."""
    fn_bytes = {"bf16x3": 32 * 6, "bf16x3n": 128 * 2}.get(v["dot"], 32 * 4)     # a column's worth of fn
    per = HC * v["bt"] * v["bk"] * 2 + HC * v["bk"] * fn_bytes
    return max(1, v["num_stages"] - 1) * per


def grid(dots=("tf32x3", "bf16x3"), bts=(16, 32, 64, 128), wide: bool = False, tails=("split",)) -> list[dict]:
    """wide: also column walks of 8-10 chunks (fewer partial mixes to write and sum at large T); tails:
    the chunk sums + Sinkhorn as two kernels ("split") and / or one ("fused")."""
    out = []
    for dot, bt, bk, warps, (stages, cpp), tail in itertools.product(dots, bts, (128, 64), (4, 8),
                                                                     WIDE_STAGES_CHUNKS if wide else STAGES_CHUNKS,
                                                                     tails):
        v = {"bt": bt, "bk": bk, "num_warps": warps, "num_stages": stages, "chunks_per_program": cpp, "dot": dot,
             "tail": tail}
        if warps == 8 and bt == 16:
            continue
        if bt * bk > 64 * 32 * warps or smem_estimate(v) > SMEM:
            continue
        out.append(v)
    return out


def smoke_grid() -> list[dict]:
    return [{"bt": 16, "bk": 128, "num_warps": 4, "num_stages": 1, "chunks_per_program": 1, "dot": "bf16x3"},
            {"bt": 32, "bk": 64, "num_warps": 4, "num_stages": 2, "chunks_per_program": 2, "dot": "bf16x3"},
            {"bt": 16, "bk": 64, "num_warps": 4, "num_stages": 1, "chunks_per_program": 4, "dot": "tf32x3"},
            {"bt": 16, "bk": 64, "num_warps": 4, "num_stages": 1, "chunks_per_program": 1, "dot": "bf16x3n",
             "tail": "fused"}]


def key(v: dict) -> str:
    return " ".join(f"{k}={v.get(k, 'split')}" for k in ("bt", "bk", "num_warps", "num_stages", "chunks_per_program",
                                                          "dot", "tail"))


def inputs(T: int, d: int, n: int, dev: str, seed: int = 0):
    import torch
    g = torch.Generator(device=dev).manual_seed(seed + T)
    xs = [torch.randn(T, HC, d, device=dev, generator=g).bfloat16() for _ in range(n)]
    pre = torch.rand(T, HC, device=dev, generator=g)
    return xs, pre


def weights(d: int, dev: str):
    import torch
    g = torch.Generator(device=dev).manual_seed(1)
    fn = torch.randn(MIX, HC * d, device=dev, generator=g) * 0.01 * (5120 / d) ** 0.5
    scale = torch.rand(3, device=dev, generator=g) + 0.5
    base = torch.randn(MIX, device=dev, generator=g) * 0.3
    return fn, scale, base


def _compile_one(args):
    """Worker: compile (and launch once, on 16 tokens: the same specialization as every timed T) one
    variant; returns None or the error's first line."""
    v, d = args
    import torch
    from deepinfer.kernels import triton_mhc
    fn, scale, base = weights(d, "cuda")
    (x,), pre = inputs(16, d, 1, "cuda")
    try:
        triton_mhc.hc_mixes_pre(x, fn, scale, base, pre, ITERS, HC_EPS, NORM_EPS, **v)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001  (out of resources and compile errors: reported per variant)
        return short_error(e)


def precompile(variants, d, jobs):
    """Compile every variant in `jobs` spawned processes (Triton's disk cache is shared): {key: error}."""
    import concurrent.futures as cf
    import multiprocessing as mp
    t0 = time.time()
    with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
        errs = list(ex.map(_compile_one, [(v, d) for v in variants], chunksize=1))
    bad = {key(v): e for v, e in zip(variants, errs) if e}
    print(f"compiled {len(variants)} variants in {time.time() - t0:.1f} s with {jobs} processes, {len(bad)} failed",
          flush=True)
    return bad


def diffs(out, ref) -> dict:
    names = ("pre", "post", "comb", "y")
    return {n: float((a.float() - b.float()).abs().max()) for n, a, b in zip(names, out, ref)}


def acceptable(e: dict, y_tol: float) -> bool:
    return max(e["pre"], e["post"], e["comb"]) < 1e-4 and e["y"] <= y_tol


def timer(smoke: bool):
    if smoke:
        def cpu_time(calls):
            for c in calls:
                c()
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                calls[0]()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)
        return cpu_time
    from benchutil import time_calls
    return lambda calls: time_calls(calls, iters=2, reps=20)


def nbytes(T: int, d: int, dot: str = "tf32x3") -> int:
    """x read + y written + fn read once (what a roofline counts; the partial mixes are extra)."""
    return T * HC * d * 2 + T * d * 2 + MIX * HC * d * (6 if dot.startswith("bf16x3") else 4)


def short_error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


def measure(call, xs, ref, y_tol, time_of, nb) -> dict:
    """One variant at one T: differences from the reference, median time, GB/s, within tolerance."""
    row = {"err": diffs(call(xs[0]), ref)}
    t = time_of([lambda x=x: call(x) for x in xs])
    row.update(ms=t * 1e3, gbps=nb / t / 1e9, ok=acceptable(row["err"], y_tol))
    return row


def describe(T, row) -> str:
    if "error" in row:
        return f"T{T} FAILED"
    e = row["err"]
    return (f"T{T} {row['ms']:.4f} ms {row['gbps']:.0f} GB/s err mix {max(e['pre'], e['post'], e['comb']):.1e} "
            f"y {e['y']:.1e}{'' if row['ok'] else ' BAD'}")


def summarize(res: dict, tokens) -> None:
    print("\nsummary (ms per call of the whole wrapper; GB/s of x read + y written + fn):")
    for T in tokens:
        r = res[T]
        dm = r["default"]["ms"]
        good = [row for row in r["variants"] if row.get("ok")]
        if not good:
            print(f"T {T}: default {dm:.4f} ms; no variant ran correctly")
            continue
        best = r["best"] = min(good, key=lambda row: row["ms"])
        print(f"T {T}: default {dm:.4f} ms ({r['default']['gbps']:.0f} GB/s); best {best['ms']:.4f} ms "
              f"({best['gbps']:.0f} GB/s) {dm / best['ms']:.2f}x: {key(best['kwargs'])}")
    for T in tokens:
        if "best" in res[T]:
            print(f"best: T={T} {res[T]['best']['kwargs']}")


def out_path(arg, smoke) -> str:
    if arg:
        return arg
    if os.environ.get("OUT"):
        return os.path.join(os.environ["OUT"], "mhc_variants.json")
    if smoke:
        return "/tmp/mhc_variants_smoke.json"
    from benchutil import out_dir
    return os.path.join(out_dir(), "mhc_variants.json")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--budget", type=float, default=70.0, help="seconds for compiling and timing variants")
    ap.add_argument("--max-variants", type=int, default=0)
    ap.add_argument("--dots", nargs="+", default=["tf32x3", "bf16x3"], choices=["tf32x3", "bf16x3", "bf16x3n"])
    ap.add_argument("--bts", type=int, nargs="+", default=[16, 32, 64, 128], help="token tiles (256: 8 warps)")
    ap.add_argument("--wide", action="store_true", help="also walks of 8-10 column chunks a program")
    ap.add_argument("--tails", nargs="+", default=["split"], choices=["split", "fused"],
                    help="the chunk sums + Sinkhorn as two kernels and / or one")
    ap.add_argument("--jobs", type=int, default=min(14, os.cpu_count() or 1), help="compile processes (0: none)")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny shapes, 3 variants")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    smoke = args.smoke
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"           # before triton is first imported
    start = time.time()
    import torch
    from benchutil import copies_for
    from deepinfer.kernels import triton_mhc
    from deepinfer.kernels.reference import hc_mixes_pre_ref
    if not smoke and not torch.cuda.is_available():
        sys.exit("needs CUDA (or --smoke)")
    dev = "cpu" if smoke else "cuda"
    d = args.dim or (256 if smoke else 5120)
    tokens = args.tokens or ((3, 20) if smoke else (64, 512, 2048, 8192))
    variants = smoke_grid() if smoke else grid(tuple(args.dots), tuple(args.bts), args.wide, tuple(args.tails))
    variants = variants[:1] + random.Random(0).sample(variants[1:], len(variants) - 1)   # a budget cut: a spread
    variants = variants[:args.max_variants or None]
    print(f"hc_mixes_pre variants: d {d}, hc {HC}, T {list(tokens)}, {len(variants)} variants, PREFILL_VARIANT "
          f"{triton_mhc.PREFILL_VARIANT}, device {'cpu' if smoke else torch.cuda.get_device_name()}", flush=True)
    failed = precompile(variants, d, args.jobs) if not smoke and args.jobs > 0 else {}

    fn, scale, base = weights(d, dev)
    time_of = timer(smoke)

    def caller(pre, kw):
        return lambda x: triton_mhc.hc_mixes_pre(x, fn, scale, base, pre, ITERS, HC_EPS, NORM_EPS, **kw)

    data, res = {}, {}
    for T in tokens:
        xs, pre = data[T] = inputs(T, d, 1 if smoke else copies_for(T * HC * d * 2), dev)
        ref = hc_mixes_pre_ref(xs[0], fn, scale, base, pre, ITERS, HC_EPS, NORM_EPS)
        y_tol = 2.0 ** -7 * float(ref[3].float().abs().max()) * (8 if smoke else 1)   # ~1 bf16 ulp (interp: trunc.)
        dv = triton_mhc.mix_variant(T, d)
        row = measure(caller(pre, {}), xs, ref, y_tol, time_of, nbytes(T, d, dv["dot"]))
        res[T] = {"default": {"kwargs": dv, **row}, "ref": ref, "y_tol": y_tol, "variants": []}
        print(f"T {T}: default {key(dv)}: " + describe(T, row), flush=True)

    skipped = 0
    for i, v in enumerate(variants):
        if time.time() - start > args.budget:
            skipped = len(variants) - i
            print(f"budget of {args.budget:.0f} s spent: {skipped} variants not timed", flush=True)
            break
        for T in tokens:
            xs, pre = data[T]
            try:
                if key(v) in failed:
                    raise RuntimeError(failed[key(v)])
                row = measure(caller(pre, v), xs, res[T]["ref"], res[T]["y_tol"], time_of, nbytes(T, d, v["dot"]))
            except Exception as e:  # noqa: BLE001  (out of resources, compile errors: reported, not fatal)
                row = {"error": short_error(e)}
            res[T]["variants"].append({"kwargs": v, **row})
        rows = [res[T]["variants"][-1] for T in tokens]
        tail = f" ({rows[0]['error']})" if "error" in rows[0] else ""
        print(f"[{i + 1}/{len(variants)} {time.time() - start:.0f}s] {key(v)}: "
              + "; ".join(describe(T, r) for T, r in zip(tokens, rows)) + tail, flush=True)

    summarize(res, tokens)
    for T in tokens:
        del res[T]["ref"]
    out = out_path(args.out, smoke)
    with open(out, "w") as f:
        json.dump({"d": d, "hc": HC, "tokens": list(tokens), "smoke": smoke, "not_timed": skipped,
                   "prefill_variant": triton_mhc.PREFILL_VARIANT, "results": {str(T): res[T] for T in tokens}},
                  f, indent=1)
    print(f"wrote {out}; {time.time() - start:.0f} s in all")


if __name__ == "__main__":
    main()
