"""The masked MoE GEMMs of a decode step on FP4 stacks: W4A8 (triton_w4a8.w4a8_masked_moe_gemm: the FP8 activation
slab x the packed MXFP4 bytes decoded to e4m3 in the K loop) against W4A16 (triton_gemm.w4a16_grouped_gemm_masked,
today's FP4 form) and the exact FP8 x FP8 CUDA form on an FP8 stack of the same values (cuda_fp8_decode.
fp8_masked_moe_gemm, row-scaled e4m3), on one GPU's EP8 share: 48 experts, w13 [4608, 5120] and w2 [5120, 2304], T
tokens each routed to 6 distinct random experts (bench_moe_decode.routed_counts). Prints us per call, the weight
bytes each form reads per second against the copy bandwidth measured in the same run, W4A8 x W4A16, and the
relative difference of each form from the FP8 form on the live rows (the same exact products; summation order).

    python perf/bench_w4a8.py [--tokens 16 64 128 256] [--w4a8-cfgs BN=64 NUM_STAGES=2,BN=256]
                                                                            (w4a8.json / .png in $OUT)

Offline sm_90a (tests/kernels/test_w4a8.py): W4A8's K loop 3.6 SASS instructions a weight at BN 128 (W4A16 4.9-5.3).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_fp4_experts import PROJ, expert_stacks  # noqa: E402
from bench_moe_decode import step_inputs  # noqa: E402
from benchutil import gpu_model, measure_ceilings, out_dir, plot_per_proj, save_json, time_calls  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 128, 256])
    p.add_argument("--experts", type=int, default=48)
    p.add_argument("--w4a8-cfgs", nargs="*", default=["BN=64", "NUM_STAGES=2", "NUM_STAGES=4", "BN=256,NUM_STAGES=2"],
                   help="extra W4A8 launch configs timed beside the default")
    a = p.parse_args()
    from deepinfer.kernels import cuda_fp8_decode as cfd
    from deepinfer.kernels import triton_gemm as tg
    from deepinfer.kernels import triton_w4a8 as tw

    ceil = measure_ceilings()
    bw = ceil["copy_bw"]
    print(f"{gpu_model()}: copy bandwidth {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'proj':>4} {'T':>4} {'max m':>5} {'w4a16 us':>9} {'w4a8 us':>8} {'fp8 us':>7} {'w4a8 x':>6} "
          f"{'w4a16/copy':>10} {'w4a8/copy':>9} {'fp8/copy':>8} {'diff w4a8':>9} {'diff w4a16':>10}", flush=True)
    for name, (n, k) in PROJ.items():
        fp4, _, wr = expert_stacks(a.experts, n, k, seed=n + k)
        pk, sk = fp4
        reason = tw.w4a8_decline_reason(pk, sk, pk.device)
        assert reason is None, reason
        w8, r = wr
        r = r.float().contiguous()
        e = a.experts
        for T in a.tokens:
            counts, expected, q, s, xf = step_inputs(T, e, k, gen)
            forms = {"w4a16": lambda: tg.w4a16_grouped_gemm_masked(xf, pk, sk, counts, expected),
                     "w4a8": lambda: tw.w4a8_masked_moe_gemm(q, s, pk, sk, counts, expected),
                     "fp8": lambda: cfd.fp8_masked_moe_gemm(q, s, w8, r, counts, expected)}
            for c in a.w4a8_cfgs:
                cfg = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in c.split(",")}
                forms[f"w4a8 {c}"] = lambda cfg=cfg: tw.w4a8_masked_moe_gemm(q, s, pk, sk, counts, expected,
                                                                            cfg_override=cfg)
            outs = {f: fn() for f, fn in forms.items()}
            valid = torch.arange(T, device="cuda")[None, :] < counts[:, None]
            ref = outs["fp8"].float()[valid]
            diffs = {f: ((o.float()[valid] - ref).norm() / ref.norm()).item() for f, o in outs.items()}
            t = {f: time_calls([fn], iters=20) for f, fn in forms.items()}
            nb4, nb8 = e * n * k * (0.5 + 1 / 32), e * n * k * 1.0     # packed + E8M0 bytes / the e4m3 stack
            row = dict(proj=name, n=n, k=k, T=T, expected_m=expected, max_m=int(counts.max()),
                       us={f: v * 1e6 for f, v in t.items()}, w4a8_speedup=t["w4a16"] / t["w4a8"],
                       w4a16_of_copy=nb4 / t["w4a16"] / bw, w4a8_of_copy=nb4 / t["w4a8"] / bw,
                       fp8_of_copy=nb8 / t["fp8"] / bw, rel_diff=diffs, cfg=tw.w4a8_config(expected, n, k, e, q.device))
            rows.append(row)
            print(f"{name:>4} {T:>4} {row['max_m']:>5} {t['w4a16'] * 1e6:>9.1f} {t['w4a8'] * 1e6:>8.1f} "
                  f"{t['fp8'] * 1e6:>7.1f} {row['w4a8_speedup']:>6.2f} {row['w4a16_of_copy']:>10.2f} "
                  f"{row['w4a8_of_copy']:>9.2f} {row['fp8_of_copy']:>8.2f} {diffs['w4a8']:>9.1e} "
                  f"{diffs['w4a16']:>10.1e}",
                  flush=True)
            if a.w4a8_cfgs:
                print("      " + ", ".join(f"{c}: {t[f'w4a8 {c}'] * 1e6:.1f}" for c in a.w4a8_cfgs), flush=True)
            assert max(diffs.values()) < 1e-2, ("the forms disagree", diffs)
    save_json("w4a8.json", dict(ceilings=ceil, gpu=torch.cuda.get_device_name(0), experts=a.experts, rows=rows))
    plot(rows, os.path.join(out_dir(), "w4a8.png"))


def plot(rows, path: str) -> None:
    labels = {"w4a16": ("W4A16 (FP4 stack, bf16 activations)", "^-"),
              "w4a8": ("W4A8 (FP4 stack, FP8 activations)", "o-"),
              "fp8": ("FP8 x FP8 CUDA (FP8 stack)", "s--")}
    plot_per_proj(rows, PROJ, "T", [(lab, st, lambda r, f=f: r["us"].get(f)) for f, (lab, st) in labels.items()],
                  f"tokens a step (6 experts each), {gpu_model()}", "us per call (48 experts)", path)


if __name__ == "__main__":
    main()
