"""The indexer's top-k threshold search, side by side in one run: the radix select (triton_topk.RADIX, the default:
one 256-bin histogram a key byte) against the bitwise search (a block-wide count a key bit), on decode-sized rows
(batch 64 / 128, 2k-16k entries, k 512; indexer-like bf16 scores, with and without a candidate mask; fp32 too),
timed as CUDA-graph replays; both checked against index_topk_ref first (bit for bit).

Why: in the H100's replayed batch-64 decode step (2026-12-07) a top-k call took 27 us, on the attention's critical
path of every indexer layer; its 16 block-wide sums (a barrier and a cross-warp merge each) were most of it.

    python perf/bench_topk.py [--rows 64 128] [--widths 2048 4096 8192 16384]        (topk.json in $OUT)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from benchutil import save_json, time_calls  # noqa: E402


def scores(n: int, E: int, dtype: torch.dtype) -> torch.Tensor:
    """Indexer-like scores: positive, a few exponents wide (most keys share their high byte), -inf past a
    per-row length."""
    x = (torch.rand(n, E, device="cuda") * 4 + torch.rand(n, 1, device="cuda")).to(dtype)
    lens = torch.randint(E // 2, E + 1, (n,), device="cuda")
    return x.masked_fill(torch.arange(E, device="cuda") >= lens[:, None], -torch.inf), lens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128])
    p.add_argument("--widths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--k", type=int, default=512)
    a = p.parse_args()
    from deepinfer.kernels import triton_topk
    from deepinfer.kernels.reference import index_topk_ref
    out = []
    print(f"{'rows':>5} {'width':>6} {'case':>10} {'bitwise us':>10} {'radix us':>9} {'speed-up':>8}")
    for n in a.rows:
        for E in a.widths:
            for case, dtype, cand in (("bf16", torch.bfloat16, False), ("bf16+cand", torch.bfloat16, True),
                                      ("fp32", torch.float32, False)):
                x, lens = scores(n, E, dtype)
                c = torch.rand(n, E, device="cuda") < 0.25 if cand else None
                want = index_topk_ref(x, lens, a.k, c)
                t = {}
                for radix in (False, True):
                    triton_topk.RADIX = radix
                    assert torch.equal(triton_topk.index_topk(x, lens, a.k, c), want), (n, E, case, radix)
                    t[radix] = time_calls([lambda: triton_topk.index_topk(x, lens, a.k, c)])
                triton_topk.RADIX = True
                out.append(dict(rows=n, width=E, case=case, bitwise_us=t[False] * 1e6, radix_us=t[True] * 1e6))
                print(f"{n:>5} {E:>6} {case:>10} {t[False] * 1e6:>10.1f} {t[True] * 1e6:>9.1f} "
                      f"{t[False] / t[True]:>7.2f}x", flush=True)
    save_json("topk.json", dict(device=torch.cuda.get_device_name(), k=a.k, rows=out))


if __name__ == "__main__":
    main()
