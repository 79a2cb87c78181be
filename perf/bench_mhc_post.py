"""A sublayer boundary of the mHC residual stream, two ways side by side: hc_post (the sublayer's output
expanded into the 4-stream residual) then the next sublayer's hc_mixes_pre (its mixes, Sinkhorn and collapsed
input), against triton_mhc.hc_post_mixes_pre (one pass over the residual: the stream written once, never
read back). Prints ms per boundary (CUDA graph replays, each call on its own inputs so the stream does not sit
in L2), the ratio, the bytes each form must move as a fraction of the copy bandwidth measured in the same
run, and that the two give the same bits.

    python perf/bench_mhc_post.py [--tokens 1 16 64 128 512 2048 8192] [--dim 4096]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import copies_for, save_json, time_calls, time_eager  # noqa: E402


def boundary_inputs(T: int, d: int, seed: int):
    from deepinfer.kernels.reference import hc_split_sinkhorn_ref
    g = torch.Generator(device="cuda").manual_seed(seed)
    y = torch.randn(T, d, device="cuda", generator=g).bfloat16()
    res = torch.randn(T, 4, d, device="cuda", generator=g).bfloat16()
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    _, post, comb = hc_split_sinkhorn_ref(torch.randn(T, 24, device="cuda", generator=g), scale,
                                          torch.randn(24, device="cuda", generator=g), 4, 20, 1e-6)
    fn = torch.randn(24, 4 * d, device="cuda", generator=g) * 0.05 * (256 / d) ** 0.5
    base = torch.randn(24, device="cuda", generator=g) * 0.3
    return y, res, post, comb, fn, scale, base, torch.rand(T, 4, device="cuda", generator=g)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 512, 2048, 8192])
    p.add_argument("--dim", type=int, default=4096)
    a = p.parse_args()
    from deepinfer.kernels import triton_mhc as tm
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() / time_eager(lambda: dst.copy_(src), iters=10)
    del src, dst
    d = a.dim
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write); d {d}, hc 4")
    print(f"{'T':>6} {'post + mixes ms':>16} {'fused ms':>9} {'x':>6} {'two of copy':>12} {'fused of copy':>14} bits")
    rows = []
    for T in a.tokens:
        stream = T * 4 * d * 2                        # the residual stream [T, 4, d] bf16
        small = T * d * 2                             # y in, the collapsed input out
        two_bytes = (stream + small + stream) + (stream + small)   # post: res, y -> x; mixes: x -> input
        fused_bytes = stream + small + stream + small
        sets = [boundary_inputs(T, d, s) for s in range(copies_for(stream))]

        def two(i):
            y, res, post, comb, fn, scale, base, pre = sets[i]
            return lambda: tm.hc_mixes_pre(tm.hc_post(y, res, post, comb), fn, scale, base, pre, 20, 1e-6, 1e-20)

        def fused(i):
            return lambda: tm.hc_post_mixes_pre(*sets[i], 20, 1e-6, 1e-20)
        t_two = time_calls([two(i) for i in range(len(sets))])
        t_fused = time_calls([fused(i) for i in range(len(sets))])
        y, res, post, comb, fn, scale, base, pre = sets[0]
        x = tm.hc_post(y, res, post, comb)
        same = all(torch.equal(u, v) for u, v in zip((x,) + tm.hc_mixes_pre(x, fn, scale, base, pre, 20, 1e-6, 1e-20),
                                                     tm.hc_post_mixes_pre(*sets[0], 20, 1e-6, 1e-20)))
        r = {"T": T, "two_ms": t_two * 1e3, "fused_ms": t_fused * 1e3, "x": t_two / t_fused,
             "two_of_copy": two_bytes / t_two / copy_bw, "fused_of_copy": fused_bytes / t_fused / copy_bw, "same": same}
        rows.append(r)
        print(f"{T:>6} {r['two_ms']:>16.4f} {r['fused_ms']:>9.4f} {r['x']:>5.2f}x {r['two_of_copy']:>12.2f} "
              f"{r['fused_of_copy']:>14.2f} {'same' if same else 'DIFFER'}", flush=True)
        del sets
    print("saved", save_json("mhc_post", {"copy_gbs": copy_bw / 1e9, "dim": d, "rows": rows}))


if __name__ == "__main__":
    main()
