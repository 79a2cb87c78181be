"""hc_post + hc_mixes_pre (two calls, x [T, 4, d] written then read back) against the fused
hc_post_mixes_pre (kernels/triton_mhc.py: x written once) at decode and prefill sizes, d 5,120. Each
path is timed as CUDA-graph replays (benchutil.time_calls: CUDA events, median of the reps) over input
copies that overflow L2; prints ms per call, the speedup, and GB/s against the copy bandwidth measured
in the same run (benchutil.measure_ceilings). The bytes are the activations each path must move in
DRAM: a and res read, x written, y (and the mean) written, plus x read again by the two calls; fn's
parts and the [d/ch, T, 32] fp32 partials are left out. Checks the two paths give the same bits.

    python perf/bench_mhc_fused.py [--tokens 64 512 2048 8192] [--dim 5120] [--mean] [--batch-invariant]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from benchutil import copies_for, measure_ceilings, save_json, time_calls  # noqa: E402

HC, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-20


def make_inputs(T: int, d: int, n: int, seed: int = 0) -> list[tuple]:
    """n copies of (a, res, post, comb); fn / scale / base / pre_prev are shared (weights, one pre)."""
    from deepinfer.kernels.reference import hc_split_sinkhorn_ref
    g = torch.Generator(device="cuda").manual_seed(seed)
    sc, base = torch.rand(3, device="cuda", generator=g) + 0.5, torch.randn(24, device="cuda", generator=g) * 0.3
    out = []
    for _ in range(n):
        a = torch.randn(T, d, device="cuda", generator=g).bfloat16()
        res = torch.randn(T, HC, d, device="cuda", generator=g).bfloat16()
        _, post, comb = hc_split_sinkhorn_ref(torch.randn(T, 24, device="cuda", generator=g), sc, base, HC, ITERS,
                                              HC_EPS)
        out.append((a, res, post, comb))
    return out


def bytes_moved(T: int, d: int, mean: bool, fused: bool) -> int:
    """DRAM bytes of the activations: a + res read, x written (+ read back by the two calls), y (+ mean)."""
    x = T * HC * d * 2
    return T * d * 2 + x + x + (0 if fused else x) + T * d * 2 * (2 if mean else 1)


def bench(T: int, d: int, mean: bool, bi: bool, copy_bw: float) -> dict:
    from deepinfer.kernels import triton_mhc as tm
    g = torch.Generator(device="cuda").manual_seed(1)
    fn = torch.randn(24, HC * d, device="cuda", generator=g) * 0.05 * (256 / d) ** 0.5
    scale, base = torch.rand(3, device="cuda", generator=g) + 0.5, torch.randn(24, device="cuda", generator=g) * 0.3
    pre = torch.rand(T, HC, device="cuda", generator=g)
    sets = make_inputs(T, d, copies_for(bytes_moved(T, d, mean, fused=True)))

    def two(a, res, post, comb):
        x = tm.hc_post(a, res, post, comb)
        return (x,) + tm.hc_mixes_pre(x, fn, scale, base, pre, ITERS, HC_EPS, NORM_EPS, mean, bi)

    def fused(a, res, post, comb):
        return tm.hc_post_mixes_pre(a, res, post, comb, fn, scale, base, pre, ITERS, HC_EPS, NORM_EPS, mean, bi)

    same = all(torch.equal(u, v) for u, v in zip(two(*sets[0]), fused(*sets[0])))
    t_two = time_calls([lambda s=s: two(*s) for s in sets])
    t_fused = time_calls([lambda s=s: fused(*s) for s in sets])
    row = dict(T=T, d=d, mean=mean, batch_invariant=bi, same=same, copies=len(sets),
               two_ms=t_two * 1e3, fused_ms=t_fused * 1e3, speedup=t_two / t_fused,
               two_of_copy=bytes_moved(T, d, mean, False) / t_two / copy_bw,
               fused_of_copy=bytes_moved(T, d, mean, True) / t_fused / copy_bw)
    print(f"T {T:>5}: two calls {row['two_ms']:7.3f} ms ({row['two_of_copy']:.2f} of copy)  fused "
          f"{row['fused_ms']:7.3f} ms ({row['fused_of_copy']:.2f} of copy)  {row['speedup']:.2f}x"
          f"{'' if same else '  DIFFERENT BITS'}", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 2048, 8192])
    p.add_argument("--dim", type=int, default=5120)
    p.add_argument("--mean", action="store_true", help="also the mean tap (the attention mixes' DSpark form)")
    p.add_argument("--batch-invariant", action="store_true")
    a = p.parse_args()
    copy_bw = measure_ceilings()["copy_bw"]
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write); d {a.dim}, mean {a.mean}, "
          f"batch_invariant {a.batch_invariant}", flush=True)
    rows = [bench(T, a.dim, a.mean, a.batch_invariant, copy_bw) for T in a.tokens]
    save_json("mhc_fused.json", dict(copy_bw=copy_bw, rows=rows))


if __name__ == "__main__":
    main()
