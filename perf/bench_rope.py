"""RoPE (kernels/triton_rope.py) on the model's prefill shapes at 8,192 tokens over program tiles
(tokens x heads): attention q and output [T, 64, 512] in place (64 rotated dims; the output inverse),
kv [T, 512] in place, the indexer's q [T, 32, 128] in place, the compressor's latent [T/4, 512] and
index key [T/4, 128] copied. Prints ms and the bytes moved against the copy bandwidth measured in the
same run, the best tile per shape, and that every tile gives the default's bits. "packed": the bf16
in-place form that loads each (re, im) pair as one 32-bit word (triton_rope.rope_pairs_kernel, the
default where it applies); the other entries are the split form's tiles ("default": its default tile),
against which the speed-ups are printed.

    python perf/bench_rope.py [--tokens 8192] [--tiles packed default 2x16 ...]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import save_json, time_eager  # noqa: E402

TILES = ["packed", "default", "2x16", "1x32", "1x64", "16x1", "32x1"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--tiles", nargs="+", default=TILES)
    a = p.parse_args()
    from deepinfer.kernels import triton_rope as tr
    T = a.tokens
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() / time_eager(lambda: dst.copy_(src), iters=10)
    del src, dst
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")
    # name, shape, rotated dims, inverse, in place
    shapes = [("q", (T, 64, 512), 64, False, True), ("o inverse", (T, 64, 512), 64, True, True),
              ("kv", (T, 512), 64, False, True), ("index q", (T, 32, 128), 64, False, True),
              ("latent copy", (T // 4, 512), 64, False, False), ("index k copy", (T // 4, 128), 64, False, False)]
    rows = []
    for name, shape, rd, inverse, inplace in shapes:
        x = torch.randn(shape, device="cuda").bfloat16()
        ang = torch.rand(T if shape[0] == T else shape[0], rd // 2, device="cuda") * 6.28
        cis = torch.polar(torch.ones_like(ang), ang)
        heads = shape[1] if len(shape) == 3 else 1
        moved = 2 * 2 * shape[0] * heads * (rd if inplace else shape[-1])     # bf16 read + written
        tr.TILE, tr.PACKED = None, False
        want = tr.rope(x.clone(), cis, inverse, inplace)
        best = None
        for t in a.tiles:
            tr.PACKED = t == "packed"
            tr.TILE = None if t in ("default", "packed") else tuple(int(v) for v in t.split("x"))
            label = "x".join(map(str, tr._tile(heads))) if t == "default" else t
            xs = x.clone()
            ms = time_eager(lambda: tr.rope(xs, cis, inverse, inplace), iters=20) * 1e3   # in place: rotates on
            same = torch.equal(tr.rope(x.clone(), cis, inverse, inplace), want)
            bw = moved / (ms / 1e3)
            rows.append(dict(shape=name, tile=t, label=label, ms=ms, of_copy=bw / copy_bw, same=same))
            print(f"{name:>13} {t:>8} ({label:>5}) {ms * 1e3:8.1f} us {bw / copy_bw:5.2f} of copy"
                  f"{'' if same else '  DIFFERENT BITS'}", flush=True)
            if same and (best is None or ms < best[1]):
                best = (t, ms)
        ref = "default" if "default" in a.tiles else a.tiles[0]
        base = next(r["ms"] for r in rows if r["shape"] == name and r["tile"] == ref)
        print(f"{name:>13} best {best[0]}: {base / best[1]:.2f}x the split form's {ref}", flush=True)
    tr.TILE, tr.PACKED = None, True
    save_json("rope.json", dict(copy_bw=copy_bw, rows=rows))


if __name__ == "__main__":
    main()
