"""The dense bf16 prefill path (kernels/triton_dequant.py: FP8 weights dequantized exactly to bf16, act_quant,
cuBLAS) against the paths select took before it (the CUDA FP8 x FP8 kernel where auto picks it, else W8A16),
at the full-width layer's six dense FP8 linears and a range of M, with the FP8 / bf16 peaks of the same run.

    python perf/bench_bf16_prefill.py [--m 8192 4096 2048 1024 512 256]     (bench_bf16_prefill.json in $OUT)

Columns: TFLOP/s of the path select took before (and which), of the bf16 path (dequant + act_quant + GEMM),
of cuBLAS's GEMM alone on the dequantized weight (the path's ceiling), the dequant's share of the path's
time, and bf16 path / before. The first M where the ratio stays above 1 is what BF16_AUTO_MIN_M should say.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import measure_ceilings, save_json, time_eager  # noqa: E402
from bench_fp8_prefill import DENSE, weight  # noqa: E402


def before(x, w, s):
    """select.fp8_linear as it was: the bf16 path off."""
    from deepinfer.kernels import select
    saved = select.BF16_AUTO_MIN_M
    select.BF16_AUTO_MIN_M = 0
    try:
        return select.fp8_linear(x, w, s)
    finally:
        select.BF16_AUTO_MIN_M = saved


def which_before(x, w, s) -> str:
    from deepinfer.kernels import select
    return "cuda" if select._cuda_fp8_ok(x, w, s) else "w8a16/variant"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, nargs="+", default=[8192, 4096, 2048, 1024, 512, 256])
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    from deepinfer.kernels import select
    from deepinfer.kernels.triton_dequant import dequant_fp8_bf16
    from deepinfer.kernels.triton_quant import act_quant
    peaks = measure_ceilings()
    print(f"peaks in this run: FP8 {peaks['fp8_flops'] / 1e12:.0f} TFLOP/s, bf16 {peaks['bf16_flops'] / 1e12:.0f}, "
          f"copy {peaks['copy_bw'] / 1e12:.2f} TB/s")
    print(f"{'linear':>11} {'M':>5} {'before':>14} {'TF/s':>6} {'bf16 path':>9} {'GEMM only':>9} {'dequant':>7} "
          f"{'x before':>8} {'of FP8 pk':>9}")
    rows = []
    for m in a.m:
        for name, (n, k) in DENSE.items():
            w, s = weight(n, k)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            flop = 2 * m * n * k
            y0, y1 = before(x, w, s), select._bf16_gemm_linear(x, w, s)
            # the two paths: the same products summed in a different order (bf16 outputs)
            diff = ((y0.float() - y1.float()).norm() / y1.float().norm()).item()
            wd = dequant_fp8_bf16(w, s)
            xq = act_quant(x)
            t_before = time_eager(lambda: before(x, w, s), a.iters)
            t_path = time_eager(lambda: select._bf16_gemm_linear(x, w, s), a.iters)
            t_gemm = time_eager(lambda: torch.nn.functional.linear(xq, wd), a.iters)
            t_deq = time_eager(lambda: dequant_fp8_bf16(w, s, out=wd), a.iters)
            r = dict(linear=name, m=m, n=n, k=k, before=which_before(x, w, s), before_tflops=flop / t_before / 1e12,
                     bf16_tflops=flop / t_path / 1e12, gemm_tflops=flop / t_gemm / 1e12, dequant_share=t_deq / t_path,
                     ratio=t_before / t_path, of_fp8_peak=flop / t_path / peaks["fp8_flops"], rel_diff=diff)
            rows.append(r)
            print(f"{name:>11} {m:>5} {r['before']:>14} {r['before_tflops']:>6.0f} {r['bf16_tflops']:>9.0f} "
                  f"{r['gemm_tflops']:>9.0f} {r['dequant_share']:>7.2f} {r['ratio']:>8.2f} {r['of_fp8_peak']:>9.2f}"
                  f"   (rel. diff {diff:.1e})", flush=True)
    print("json:", save_json("bench_bf16_prefill.json", {"peaks": peaks, "rows": rows}))


if __name__ == "__main__":
    main()
