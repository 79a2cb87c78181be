"""The prefill MoE's two copy-bound glue kernels over their launch tiles: moe_dispatch (x [T, d] -> its
act_quant rows at the T*K pairs' sorted rows) and moe_combine (the K rows of each token summed, + the shared
expert's row), at a 1 x 8,192 prefill's sizes (d 4096, top-6, 48 local experts, balanced picks). Prints ms,
GB/s (bytes each must move) against the copy bandwidth measured in the same run, and that every tile gives
the default's bits.

    python perf/bench_moe_glue.py [--tokens 8192] [--tiles 1024x4 2048x8 ...]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import save_json, time_eager  # noqa: E402

TILES = ["1024x4", "1024x8", "2048x4", "2048x8", "4096x8", "4096x16", "512x4", "512x2"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--experts", type=int, default=48)
    p.add_argument("--tiles", nargs="+", default=TILES)
    a = p.parse_args()
    from deepinfer.kernels import triton_moe as tm
    T, d, K, E = a.tokens, a.dim, a.topk, a.experts
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() / time_eager(lambda: dst.copy_(src), iters=10)
    del src, dst
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write); T {T}, d {d}, top-{K}, {E} experts")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, d, device="cuda", generator=g).bfloat16()
    # balanced distinct picks: token t takes experts (t*K + j) % E
    idx = ((torch.arange(T, device="cuda")[:, None] * K + torch.arange(K, device="cuda")) % E).int()
    counts, slot = tm.moe_route(idx, E, contiguous=True)
    shared = torch.randn(T, d, device="cuda", generator=g).bfloat16()
    pairs_out = torch.randn(K, T, d, device="cuda", generator=g).bfloat16()
    kernels = {
        "dispatch": (lambda tile: tm.moe_dispatch(x, slot, K, K, tile=tile), 2 * d * (T + T * K)),
        "combine": (lambda tile: tm.moe_combine(pairs_out, slot, idx, shared, tile=tile), 2 * d * (T * K + 2 * T)),
    }
    rows = []
    for name, (run, nbytes) in kernels.items():
        want = run(None)
        for t in ["default"] + a.tiles:
            tile = None if t == "default" else tuple(int(v) for v in t.split("x"))
            if tile and tile[0] > d:
                continue
            try:
                got = run(tile)
                ms = time_eager(lambda: run(tile), iters=20) * 1e3
            except Exception as e:  # noqa: BLE001  (a tile past the resources: report it, go on)
                print(f"{name:8} {t:>8}  FAILED {type(e).__name__}: {str(e)[:80]}")
                continue
            same = torch.equal(got.view(-1)[:want.numel()], want.view(-1)) if name == "combine" else \
                torch.equal(got.view(-1, d)[slot], want.view(-1, d)[slot])
            bw = nbytes / (ms / 1e3)
            rows.append(dict(kernel=name, tile=t, ms=ms, gb_s=bw / 1e9, of_copy=bw / copy_bw, same=same))
            print(f"{name:8} {t:>8} {ms:8.3f} ms {bw / 1e9:7.0f} GB/s {bw / copy_bw:5.2f} of copy"
                  f"{'' if same else '  DIFFERENT BITS'}", flush=True)
        best = min((r for r in rows if r["kernel"] == name and r["same"]), key=lambda r: r["ms"])
        base = next(r for r in rows if r["kernel"] == name and r["tile"] == "default")
        print(f"best {name}: {best['tile']} {best['ms']:.3f} ms ({base['ms'] / best['ms']:.2f}x the default)")
    save_json("moe_glue.json", dict(copy_bw=copy_bw, rows=rows))


if __name__ == "__main__":
    main()
