"""The masked MoE GEMMs of a decode step on packed MXFP4 experts (W4A16, triton_gemm.w4a16_grouped_gemm_masked on
fp4_layout's kernel layout: EngineArgs.expert_format="fp4") against the FP8 stacks (the same experts converted once
at load: row-scaled e4m3,
w8a16_pairs_kernel ROW_SCALE; and per-(row, 32) E8M0 blocks), on one GPU's EP8 share: 48 experts, w13
[4608, 5120] and w2 [5120, 2304], m tokens routed to every expert. Prints us per call, weight bytes read
per second against the copy bandwidth measured in the same run, FP4 x FP8-rows, and that the three forms
agree (the same exact products; only fp32 summation order differs).

    python perf/bench_fp4_experts.py [--m 1 2 4 8 16 32] [--experts 48] [--fp4-cfgs BK=256 BN=128,BK=64]
                                                                            (fp4_experts.json / .png in $OUT)
H200, 2026-12-04: FP4 1.05-1.10x the row-scaled FP8 form at m 1-32 (0.73-0.80x in the release layout).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import measure_ceilings, out_dir, plot_per_proj, save_json, time_calls  # noqa: E402

PROJ = {"w13": (4608, 5120), "w2": (5120, 2304)}


def expert_stacks(e: int, n: int, k: int, seed: int):
    """Random MXFP4 experts (every nibble; block scales 2^-10..2^-4, a checkpoint's range) in the three
    held forms: packed + E8M0, e4m3 + E8M0 per (row, 32), e4m3 + one f32 scale per row (None if a row
    does not convert exactly)."""
    from deepinfer.kernels.select import fp4_to_fp8_weight, row_scaled_fp8_weight
    from deepinfer.kernels.triton_gemm import fp4_kernel_weight
    g = torch.Generator(device="cuda").manual_seed(seed)
    packed = torch.randint(0, 256, (e, n, k // 2), generator=g, device="cuda", dtype=torch.uint8)
    scale = torch.randint(117, 124, (e, n, k // 32), generator=g, device="cuda", dtype=torch.uint8)
    w8, s8 = zip(*(fp4_to_fp8_weight(packed[i], scale[i]) for i in range(e)))
    w8, s8 = torch.stack(w8), torch.stack(s8)
    rows = [row_scaled_fp8_weight(w8[i], s8[i]) for i in range(e)]
    wr = None if any(r is None for r in rows) else (torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]))
    return fp4_kernel_weight(packed, scale), (w8, s8), wr


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--experts", type=int, default=48)
    p.add_argument("--fp4-cfgs", nargs="*", default=[],
                   help="extra W4A16 launch configs timed beside the default, e.g. BN=128,BK=64 NUM_STAGES=4")
    a = p.parse_args()
    from deepinfer.kernels import triton_gemm as tg
    from deepinfer.kernels.reference import act_quant_ref

    ceil = measure_ceilings()
    bw = ceil["copy_bw"]
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    rows = []
    print(f"{'proj':>4} {'m':>3} {'fp8 rows us':>11} {'fp8 e8m0 us':>11} {'fp4 us':>8} {'fp4 x rows':>10} "
          f"{'rows of copy':>12} {'fp4 of copy':>11} {'max rel diff':>12}", flush=True)
    for name, (n, k) in PROJ.items():
        fp4, fp8, fp8r = expert_stacks(a.experts, n, k, seed=n + k)
        for m in a.m:
            e = a.experts
            x = act_quant_ref(torch.randn(e, m, k, device="cuda").bfloat16())
            mm = torch.full((e,), m, dtype=torch.int32, device="cuda")
            forms = {"fp4": lambda: tg.w4a16_grouped_gemm_masked(x, *fp4, mm, m),
                     "e8m0": lambda: tg.w8a16_grouped_gemm_masked(x, *fp8, mm, m)}
            if fp8r is not None:
                forms["rows"] = lambda: tg.w8a16_grouped_gemm_masked(x, *fp8r, mm, m)
            for c in a.fp4_cfgs:
                cfg = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in c.split(",")}
                forms[f"fp4 {c}"] = lambda cfg=cfg: tg.w4a16_grouped_gemm_masked(x, *fp4, mm, m, cfg_override=cfg)
            outs = {f: fn().float() for f, fn in forms.items()}
            diff = max(((o - outs["e8m0"]).norm() / outs["e8m0"].norm()).item() for o in outs.values())
            t = {f: time_calls([fn], iters=20) for f, fn in forms.items()}
            nb8, nb4 = e * n * k * (1 + 1 / 32), e * n * k * (0.5 + 1 / 32)
            base = t.get("rows", t["e8m0"])
            row = dict(proj=name, m=m, us={f: v * 1e6 for f, v in t.items()}, fp4_speedup=base / t["fp4"],
                       rows_of_copy=nb8 / base / bw, fp4_of_copy=nb4 / t["fp4"] / bw, max_rel_diff=diff)
            rows.append(row)
            print(f"{name:>4} {m:>3} {t.get('rows', float('nan')) * 1e6:>11.1f} {t['e8m0'] * 1e6:>11.1f} "
                  f"{t['fp4'] * 1e6:>8.1f} {row['fp4_speedup']:>10.2f} {row['rows_of_copy']:>12.2f} "
                  f"{row['fp4_of_copy']:>11.2f} {diff:>12.1e}", flush=True)
            for c in a.fp4_cfgs:
                print(f"{'':>4} {'':>3} fp4 {c}: {t[f'fp4 {c}'] * 1e6:.1f} us ({base / t[f'fp4 {c}']:.2f}x rows)",
                      flush=True)
            assert diff < 1e-2, "the forms disagree"
    save_json("fp4_experts.json", dict(ceilings=ceil, experts=a.experts, rows=rows))
    plot(rows, os.path.join(out_dir(), "fp4_experts.png"))


def plot(rows, path: str) -> None:
    labels = {"rows": ("FP8, row scales", "o-"), "e8m0": ("FP8, E8M0 per (row, 32)", "s--"),
              "fp4": ("MXFP4 packed (W4A16)", "^-")}
    plot_per_proj(rows, PROJ, "m", [(lab, st, lambda r, f=f: r["us"].get(f)) for f, (lab, st) in labels.items()],
                  "tokens per expert", "us per call (48 experts)", path)


if __name__ == "__main__":
    main()
