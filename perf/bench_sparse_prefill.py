"""Sparse attention at prefill sizes: our Triton kernel (kernels/triton_sparse_attn.py) against FlashMLA's SM90
sparse prefill kernel (kernels/flashmla.sparse_prefill), V4 shapes (H 64, D 512, window 128 + 512 picks), with
the relative difference of the two outputs and of each to the torch reference on the first 256 queries.

    python perf/bench_sparse_prefill.py [--n 8192 2048 512] [--lists 640 1152]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import save_json, time_eager  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, nargs="+", default=[8192, 2048, 512])
    p.add_argument("--lists", type=int, nargs="+", default=[640, 1152])
    p.add_argument("--heads", type=int, default=64)
    a = p.parse_args()
    from deepinfer.kernels import flashmla
    from deepinfer.kernels.reference import act_quant_ref, sparse_attn_ref
    from deepinfer.kernels.triton_sparse_attn import sparse_attn
    D, H = 512, a.heads
    rows = []
    print(f"{'n':>6} {'L':>5} {'triton us':>10} {'flashmla us':>11} {'speed-up':>8} {'TF/s fmla':>9} "
          f"{'rel(fmla, triton)':>17} {'rel(fmla, ref)':>14} {'rel(triton, ref)':>16}")
    for n in a.n:
        for L in a.lists:
            M = n + n // 4 + 128
            q = torch.randn(n, H, D, device="cuda").bfloat16()
            kv = act_quant_ref(torch.randn(M, D, device="cuda").bfloat16())
            sink = torch.randn(H, device="cuda")
            idx = torch.randint(0, M, (n, L), device="cuda", dtype=torch.int32)
            idx[torch.rand(n, L, device="cuda") < 0.1] = -1
            scale = D ** -0.5
            t_tri = time_eager(lambda: sparse_attn(q, kv, sink, idx, scale, blocks_per_split=None))
            t_fm = time_eager(lambda: flashmla.sparse_prefill(q, kv, sink, idx, scale))
            o_tri = sparse_attn(q, kv, sink, idx, scale, blocks_per_split=None).float()
            o_fm = flashmla.sparse_prefill(q, kv, sink, idx, scale).float()
            ref = sparse_attn_ref(q[:256], kv, sink, idx[:256], scale).float()

            def rel(x, y):
                return ((x - y).norm() / y.norm()).item()
            flop = 4 * n * H * L * D
            r = dict(n=n, L=L, triton_us=t_tri * 1e6, flashmla_us=t_fm * 1e6, speedup=t_tri / t_fm,
                     flashmla_tflops=flop / t_fm / 1e12, rel_fm_tri=rel(o_fm, o_tri), rel_fm_ref=rel(o_fm[:256], ref),
                     rel_tri_ref=rel(o_tri[:256], ref))
            rows.append(r)
            print(f"{n:>6} {L:>5} {r['triton_us']:>10.0f} {r['flashmla_us']:>11.0f} {r['speedup']:>8.2f} "
                  f"{r['flashmla_tflops']:>9.0f} {r['rel_fm_tri']:>17.1e} {r['rel_fm_ref']:>14.1e} {r['rel_tri_ref']:>16.1e}",
                  flush=True)
    print("json:", save_json("bench_sparse_prefill.json", rows))


if __name__ == "__main__":
    main()
