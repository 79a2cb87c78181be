"""The MoE's prefill-sized GEMMs on packed MXFP4 experts (expert_format="fp4", the release's EP8 default): what a
contiguous step of P token-expert rows costs today (the whole stack dequantized to bf16, then one bf16 grouped
GEMM: select._fp4_grouped_contiguous) against W4A16 forms that read the packed bytes in the K loop (no dequant
pass: half a byte a weight instead of 2.5). On one GPU's EP8 share: 48 experts, w13 [4608, 5120] and w2
[5120, 2304], m rows routed to every expert (m = 256: a 2,048-token chunk at top-6; 1,024: 1 x 8k).

Columns (us per call, CUDA graph replays; TFLOP/s of the GEMM's 2 P N K):
    dequant+bf16   today's path (dequant_fp4_bf16 into a buffer + torch._grouped_mm)
    bf16 only      the grouped GEMM alone on an already dequantized stack (what W4A16 has to approach)
    w4a16          kernels/triton_fp4_contiguous.w4a16_grouped_contiguous (the packed bytes decoded in the K
                   loop) at its default config, then at each --cfgs config
Each form's output is checked against dequant+bf16 (the same exact products; fp32 order only).

    python perf/bench_fp4_prefill.py [--m 64 256 1024] [--cfgs BM=256,BN=128,BK=64,NUM_STAGES=3,num_warps=8 ...]
                                                                          (fp4_prefill.json / .png in $OUT)
H100, 2026-12-06: W4A16 4.0-4.1x today's path at 64 rows an expert, 1.70-1.75x at 256, 0.92-0.93x at 1,024
(so select.FP4_W4A16_MAX_ROWS_PER_EXPERT = 640).
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
DEFAULT_CFGS = ["BM=128,BN=128,BK=64,NUM_STAGES=4,num_warps=8", "BM=256,BN=128,BK=64,NUM_STAGES=3,num_warps=8",
                "BM=128,BN=64,BK=128,NUM_STAGES=3,num_warps=4", "BM=64,BN=128,BK=128,NUM_STAGES=3,num_warps=8",
                "BM=256,BN=64,BK=64,NUM_STAGES=3,num_warps=4"]


def fp4_stack(e: int, n: int, k: int, seed: int):
    """Random MXFP4 experts in the kernel layout (every nibble; block scales 2^-10..2^-4)."""
    from deepinfer.kernels.triton_gemm import fp4_kernel_weight
    g = torch.Generator(device="cuda").manual_seed(seed)
    packed = torch.randint(0, 256, (e, n, k // 2), generator=g, device="cuda", dtype=torch.uint8)
    scale = torch.randint(117, 124, (e, n, k // 32), generator=g, device="cuda", dtype=torch.uint8)
    return fp4_kernel_weight(packed, scale)


def parse_cfg(text: str) -> dict:
    return {kv.split("=")[0]: int(kv.split("=")[1]) for kv in text.split(",")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--experts", type=int, default=48)
    p.add_argument("--cfgs", nargs="*", default=DEFAULT_CFGS)
    a = p.parse_args()
    from deepinfer.kernels.grouped_bf16 import bf16_grouped_contiguous
    from deepinfer.kernels.reference import act_quant_ref
    from deepinfer.kernels.triton_dequant import dequant_fp4_bf16
    from deepinfer.kernels.triton_fp4_contiguous import w4a16_grouped_contiguous

    ceil = measure_ceilings()
    print(f"copy {ceil['copy_bw'] / 1e9:.0f} GB/s, bf16 peak {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    for name, (n, k) in PROJ.items():
        e = a.experts
        w, s = fp4_stack(e, n, k, seed=n + k)
        wd = dequant_fp4_bf16(w.view(e * n, k // 2), s.view(e * n, k // 32)).view(e, n, k)
        buf = torch.empty_like(wd)
        for m in a.m:
            x = act_quant_ref(torch.randn(e * m, k, device="cuda").bfloat16())
            counts = torch.full((e,), m, dtype=torch.int32, device="cuda")

            def today():
                d = dequant_fp4_bf16(w.view(e * n, k // 2), s.view(e * n, k // 32), out=buf.view(e * n, k))
                return bf16_grouped_contiguous(x, d.view(e, n, k), counts)
            forms = {"dequant+bf16": today, "bf16 only": lambda: bf16_grouped_contiguous(x, wd, counts),
                     "w4a16": lambda: w4a16_grouped_contiguous(x, w, s, counts)}
            for c in a.cfgs:
                forms[f"w4a16 {c}"] = lambda cfg=parse_cfg(c): w4a16_grouped_contiguous(x, w, s, counts, cfg)
            ref = today().float()
            flops = 2 * e * m * n * k
            for f, fn in forms.items():
                try:
                    diff = ((fn().float() - ref).norm() / ref.norm()).item()
                    t = time_calls([fn], iters=10)
                except Exception as ex:  # noqa: BLE001 (a config the compiler refuses: say so, go on)
                    print(f"{name:>4} m {m:>5} {f:58s} FAILED {str(ex)[:200]}", flush=True)
                    continue
                rows.append(dict(proj=name, m=m, form=f, us=t * 1e6, tflops=flops / t / 1e12, rel_diff=diff))
                base = next(r["us"] for r in rows if r["proj"] == name and r["m"] == m and r["form"] == "dequant+bf16")
                print(f"{name:>4} m {m:>5} {f:58s} {t * 1e6:9.1f} us {flops / t / 1e12:6.0f} TFLOP/s "
                      f"{base / (t * 1e6):5.2f}x today  diff {diff:.1e}", flush=True)
    save_json("fp4_prefill.json", dict(ceilings=ceil, experts=a.experts, rows=rows))
    plot(rows, os.path.join(out_dir(), "fp4_prefill.png"))


def plot(rows, path: str) -> None:
    """TFLOP/s against rows an expert, one panel per projection: today's path, the bf16 GEMM alone, W4A16 at
    its default tiles."""
    by = {}
    for r in rows:
        by.setdefault((r["proj"], r["m"]), dict(proj=r["proj"], m=r["m"], tf={}))["tf"][r["form"]] = r["tflops"]
    series = [("dequant + bf16 grouped (before)", "o-", "dequant+bf16"), ("bf16 grouped alone", "s--", "bf16 only"),
              ("W4A16 contiguous (packed bytes)", "^-", "w4a16")]
    plot_per_proj(list(by.values()), PROJ, "m", [(lab, st, lambda r, f=f: r["tf"].get(f)) for lab, st, f in series],
                  "rows an expert (48 experts)", "TFLOP/s", path, what="FP4 experts' prefill GEMM")


if __name__ == "__main__":
    main()
