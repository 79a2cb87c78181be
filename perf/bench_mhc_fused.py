"""hc_post + the next sublayer's hc_mixes_pre (two passes, today's constants) against the fused pass
(kernels/triton_mhc_fused.py) at decode and prefill sizes, side by side in one run, timed as CUDA-graph
replays (benchutil.time_calls) of the whole wrappers; then a sweep of the fused kernel's launch constants.

    python perf/bench_mhc_fused.py [--tokens 64 128 2048 8192] [--budget 150] [--out FILE]

Prints per T: the two calls' ms, the fused default's ms and ratio, each variant's, the best variant
(a line "best: T=... {kwargs}" for triton_mhc_fused.FUSED_SIZE_VARIANTS) and the bytes both move as a
share of the copy bandwidth measured in the same run. Every variant is checked against the two kernels
first (residual streams bit for bit, mixes within 1e-5). JSON to $OUT/mhc_fused.json (else perf/results/).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

HC, MIX, ITERS, HC_EPS, NORM_EPS = 4, 24, 20, 1e-6, 1e-20


def grid() -> list[dict]:
    out = []
    for bt, bk, warps, (stages, cpp) in itertools.product((16, 32, 64), (64, 128), (4, 8),
                                                         ((1, 1), (1, 4), (2, 4), (2, 8))):
        if (warps == 8 and bt == 16) or bt * bk > 32 * 32 * warps:     # five fp32 tiles a program
            continue
        out.append({"bt": bt, "bk": bk, "num_warps": warps, "num_stages": stages, "chunks_per_program": cpp})
    return out


def key(v: dict) -> str:
    return " ".join(f"{k}={v[k]}" for k in ("bt", "bk", "num_warps", "num_stages", "chunks_per_program") if k in v)


def inputs(T: int, d: int, n: int):
    import torch
    g = torch.Generator(device="cuda").manual_seed(T)
    sets = []
    for _ in range(n):
        sets.append((torch.randn(T, d, device="cuda", generator=g).bfloat16(),
                     torch.randn(T, HC, d, device="cuda", generator=g).bfloat16(),
                     torch.rand(T, HC, device="cuda", generator=g) * 2,
                     torch.rand(T, HC, HC, device="cuda", generator=g)))
    return sets, torch.rand(T, HC, device="cuda", generator=g)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 2048, 8192])
    ap.add_argument("--dim", type=int, default=5120)
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for the variant sweep")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    from benchutil import copies_for, measure_ceilings, out_dir, time_calls
    from deepinfer.kernels import triton_mhc, triton_mhc_fused
    start, d = time.time(), args.dim
    g = torch.Generator(device="cuda").manual_seed(1)
    fn = torch.randn(MIX, HC * d, device="cuda", generator=g) * 0.01
    scale, base = torch.rand(3, device="cuda", generator=g) + 0.5, torch.randn(MIX, device="cuda", generator=g) * 0.3
    copy = measure_ceilings()["copy_bw"] / 1e12
    print(f"mHC post + mixes: d {d}, copy {copy:.2f} TB/s, device {torch.cuda.get_device_name()}", flush=True)

    def two(s, pre):
        out = triton_mhc.hc_post(*s)
        return (out,) + triton_mhc.hc_mixes_pre(out, fn, scale, base, pre, ITERS, HC_EPS, NORM_EPS)

    def fused(s, pre, kw):
        return triton_mhc_fused.hc_post_mixes_pre(*s, fn, scale, base, pre, ITERS, HC_EPS, NORM_EPS, **kw)

    def timed(f, sets, pre):
        return time_calls([lambda s=s: f(s, pre) for s in sets], iters=2, reps=20) * 1e3

    res = {}
    for T in args.tokens:
        sets, pre = inputs(T, d, copies_for(T * HC * d * 4))
        # y + res read, out written (both); the two calls also read out back and write x each; fn's parts
        moved = T * d * 2 + 2 * T * HC * d * 2 + T * d * 2 + MIX * HC * d * 6
        base_ms = timed(two, sets, pre)
        dflt_ms = timed(lambda s, p: fused(s, p, {}), sets, pre)
        res[T] = {"two_ms": base_ms, "fused_default": {"kwargs": triton_mhc_fused.fused_variant(T, d), "ms": dflt_ms},
                  "variants": [], "copy_tbps": copy}
        print(f"T {T}: two calls {base_ms:.4f} ms; fused default {dflt_ms:.4f} ms ({base_ms / dflt_ms:.2f}x; "
              f"{moved / dflt_ms / 1e9 / copy:.2f} of copy)  [{key(res[T]['fused_default']['kwargs'])}]", flush=True)
    for i, v in enumerate(grid()):
        if time.time() - start > args.budget:
            print(f"budget spent: {len(grid()) - i} variants not timed", flush=True)
            break
        cells = []
        for T in args.tokens:
            sets, pre = inputs(T, d, 1)
            try:
                got, ref = fused(sets[0], pre, v), two(sets[0], pre)
                ok = torch.equal(got[0], ref[0]) and max((a - b).abs().max().item() for a, b in zip(got[1:4], ref[1:4])) < 1e-5
                ms = timed(lambda s, p: fused(s, p, v), *inputs(T, d, copies_for(T * HC * d * 4)))
                res[T]["variants"].append({"kwargs": v, "ms": ms, "ok": ok})
                cells.append(f"T{T} {ms:.4f}{'' if ok else ' BAD'}")
            except Exception as e:  # noqa: BLE001  (out of resources: reported, not fatal)
                cells.append(f"T{T} failed ({type(e).__name__})")
        print(f"[{i + 1} {time.time() - start:.0f}s] {key(v)}: " + "; ".join(cells), flush=True)
    print("\nsummary (ms a call, whole wrappers):")
    for T in args.tokens:
        r = res[T]
        good = [row for row in r["variants"] if row["ok"]] + [dict(r["fused_default"], ok=True)]
        best = r["best"] = min(good, key=lambda row: row["ms"])
        print(f"T {T}: two calls {r['two_ms']:.4f}; fused default {r['fused_default']['ms']:.4f} "
              f"({r['two_ms'] / r['fused_default']['ms']:.2f}x); best {best['ms']:.4f} ({r['two_ms'] / best['ms']:.2f}x) "
              f"{key(best['kwargs'])}")
    for T in args.tokens:
        print(f"best: T={T} {json.dumps(res[T]['best']['kwargs'])}")
    out = args.out or os.path.join(out_dir(), "mhc_fused.json")
    with open(out, "w") as f:
        json.dump({"d": d, "results": {str(T): res[T] for T in args.tokens}}, f, indent=1)
    print(f"wrote {out}; {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
