"""Does pulling a decode GEMM's weight into L2 during a latency-bound stretch pay? (kernels/l2_prefetch.py)

For the decode step's dense FP8 linears at M = 64 (the CUDA FP8 x FP8 decode GEMM, act_quant included), in one run:
    cold        the GEMM over rotating weight copies (each graph replay streams >= 4x the L2): today's case
    warm        the same weight every call (L2 holds what fits): the most a prefetch could give
    idle+gemm   a latency-bound stand-in (torch.cuda._sleep: one thread spinning IDLE_US) then the cold GEMM
    +prefetch   the same, with prefetch_l2 of that weight on a side stream forked before the stand-in
and the prefetch alone: its rate over the weight's bytes by program count and form. Ratios are printed
against the cold GEMM and against the idle+gemm chain measured in the same run.

    python perf/bench_l2_prefetch.py [--m 64] [--idle-us 10 25] [--programs 4 8 16 32] [--only wq_b wo_b]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_fp8_decode import DECODE_SHAPES, weights  # noqa: E402
from benchutil import copies_for, gpu_model, save_json, time_calls  # noqa: E402


def sleep_cycles(us: float, _per_us: list = []) -> int:
    """Spin cycles for about `us` microseconds, from one timed spin (the clock as it runs)."""
    if not _per_us:
        _per_us.append(100_000 / (time_calls([lambda: torch.cuda._sleep(100_000)]) * 1e6))
    return int(us * _per_us[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--idle-us", type=float, nargs="+", default=[10.0, 25.0])
    ap.add_argument("--programs", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--modes", nargs="+", default=["bulk", "line"])
    ap.add_argument("--only", nargs="*", default=["wq_b", "wo_b", "shared_w13", "wqkv_a"])
    args = ap.parse_args()

    from deepinfer.kernels.cuda_fp8_decode import fp8_decode_linear
    from deepinfer.kernels.l2_prefetch import prefetch_l2

    print(f"{gpu_model()}, L2 {torch.cuda.get_device_properties(0).L2_cache_size / 2**20:.0f} MiB, M = {args.m}")
    side = torch.cuda.Stream()
    rows = []
    for name in args.only:
        n, k = DECODE_SHAPES[name]
        ws = weights(n, k, copies_for(n * k))
        x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
        nbytes = n * k
        gemm = [lambda w=w, s=s: fp8_decode_linear(x, w, s) for w, s in ws]
        cold = time_calls(gemm)
        warm = time_calls(gemm[:1])
        row = dict(linear=name, n=n, k=k, mb=nbytes / 1e6, cold_us=cold * 1e6, warm_us=warm * 1e6)
        print(f"\n{name} [{n}, {k}] {nbytes / 1e6:.1f} MB: cold {cold * 1e6:.1f} us ({nbytes / cold / 1e12:.2f} TB/s), "
              f"warm {warm * 1e6:.1f} us ({nbytes / warm / 1e12:.2f} TB/s): warm is {cold / warm:.2f}x")
        for mode in args.modes:
            for p in args.programs:
                t = time_calls([lambda w=w: prefetch_l2(w, programs=p, mode=mode) for w, _ in ws])
                row[f"prefetch_{mode}_{p}_us"] = t * 1e6
                print(f"  prefetch alone {mode:4s} x{p:2d}: {t * 1e6:6.1f} us, {nbytes / t / 1e12:.2f} TB/s")
        for idle in args.idle_us:
            cyc = sleep_cycles(idle)
            alone = time_calls([lambda: torch.cuda._sleep(cyc)])

            def chain(w, s, mode=None, p=0):
                if mode is not None:
                    cur = torch.cuda.current_stream()
                    side.wait_stream(cur)
                    with torch.cuda.stream(side):
                        prefetch_l2(w, programs=p, mode=mode)
                torch.cuda._sleep(cyc)
                fp8_decode_linear(x, w, s)
                if mode is not None:
                    torch.cuda.current_stream().wait_stream(side)

            base = time_calls([lambda w=w, s=s: chain(w, s) for w, s in ws])
            print(f"  idle {idle:.0f} us (measured {alone * 1e6:.1f}): idle+gemm {base * 1e6:.1f} us "
                  f"(the GEMM's share {(base - alone) * 1e6:.1f})")
            row[f"idle{idle:.0f}_alone_us"] = alone * 1e6
            row[f"idle{idle:.0f}_chain_us"] = base * 1e6
            for mode in args.modes:
                for p in args.programs:
                    t = time_calls([lambda w=w, s=s: chain(w, s, mode, p) for w, s in ws])
                    row[f"idle{idle:.0f}_{mode}_{p}_us"] = t * 1e6
                    print(f"    +prefetch {mode:4s} x{p:2d}: {t * 1e6:6.1f} us = {base / t:.3f}x the chain, "
                          f"the GEMM's share {(t - alone) * 1e6:5.1f} us ({cold / max(t - alone, 1e-9):.2f}x cold)")
        rows.append(row)
        del ws
        torch.cuda.empty_cache()
    print("\nwrote", save_json("bench_l2_prefetch", dict(gpu=gpu_model(), m=args.m, rows=rows)))


if __name__ == "__main__":
    main()
