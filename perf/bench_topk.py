"""The indexer's top-k (kernels/triton_topk.py) with its threshold search one bit a pass against two bits a
pass (triton_topk.DIGIT2), side by side in one run, timed as CUDA-graph replays; the picks compared.

    python perf/bench_topk.py [--rows 16 64 128] [--widths 1024 2048 4096 8192] [--k 512]

Prints us per call for each (rows, width, dtype) and the ratio; writes topk.json under $OUT (else perf/results/).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--widths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--k", type=int, default=512)
    args = ap.parse_args()
    import torch
    from benchutil import save_json, time_calls
    from deepinfer.kernels import triton_topk
    rows_out = []
    print(f"{'rows':>5} {'width':>6} {'dtype':>9} {'1 bit us':>9} {'2 bits us':>10} {'x':>6} same", flush=True)
    for dtype in (torch.bfloat16, torch.float32):
        for n in args.rows:
            for width in args.widths:
                g = torch.Generator(device="cuda").manual_seed(n * width)
                score = (torch.randn(n, width, device="cuda", generator=g).abs() * 0.3).to(dtype)
                lens = torch.randint(width // 2, width + 1, (n,), device="cuda", generator=g)
                t, picks = {}, {}
                for digit2 in (False, True):
                    triton_topk.DIGIT2 = digit2
                    picks[digit2] = triton_topk.index_topk(score, lens, args.k)
                    t[digit2] = time_calls([lambda: triton_topk.index_topk(score, lens, args.k)], iters=20, reps=10) * 1e6
                same = torch.equal(picks[False], picks[True])
                rows_out.append({"rows": n, "width": width, "dtype": str(dtype), "one_bit_us": t[False],
                                 "two_bits_us": t[True], "same": same})
                print(f"{n:>5} {width:>6} {str(dtype)[6:]:>9} {t[False]:>9.1f} {t[True]:>10.1f} "
                      f"{t[False] / t[True]:>6.2f} {same}", flush=True)
    triton_topk.DIGIT2 = True
    print("wrote", save_json("topk.json", {"k": args.k, "rows": rows_out}))


if __name__ == "__main__":
    main()
