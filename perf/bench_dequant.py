"""The exact FP8 -> bf16 dequant (kernels/triton_dequant.py) over its tile choices, on the MoE's whole
expert stacks (the bf16 grouped path dequantizes a layer's 48 local experts per long prefill step):
w13 [48 x 4608, 5120] and w2 [48 x 5120, 2304], per-row f32 scales (the row-scaled experts) and 32x32
E8M0 blocks. Prints ms, GB/s (1 byte read + 2 written per element) against the copy bandwidth measured
in the same run, and that every tile gives the default's bits.

    python perf/bench_dequant.py [--tiles 32x128x4 64x256x8 ...] [--fp4-tiles 32x512x4 ...]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import save_json, time_eager  # noqa: E402

TILES = ["32x128x4", "32x256x4", "64x128x4", "64x256x8", "128x128x8", "16x512x4", "32x512x8", "64x512x8"]
STACKS = {"w13": (48 * 4608, 5120), "w2": (48 * 5120, 2304)}


def sweep(run, tiles: list[str], name: str, layout: str, nbytes: float, copy_bw: float) -> list[dict]:
    """run(out, tile) timed at every tile (a tile past the resources is reported and skipped), each checked
    for the first tile's bits (32x128x4: the reference tiling)."""
    want = run(None, (32, 128, 4))
    out = torch.empty_like(want)
    rows = []
    for t in tiles:
        tile = tuple(int(v) for v in t.split("x"))
        try:
            ms = time_eager(lambda: run(out, tile), iters=10) * 1e3
        except Exception as e:  # noqa: BLE001  (a tile past the resources: report it, go on)
            print(f"{name:4} {layout:5} {t:>10}  FAILED {type(e).__name__}: {str(e)[:80]}")
            continue
        same = torch.equal(out, want)
        bw = nbytes / (ms / 1e3)
        rows.append(dict(stack=name, layout=layout, tile=t, ms=ms, gb_s=bw / 1e9, of_copy=bw / copy_bw, same=same))
        print(f"{name:4} {layout:5} {t:>10} {ms:8.3f} ms {bw / 1e9:7.0f} GB/s {bw / copy_bw:5.2f} of copy"
              f"{'' if same else '  DIFFERENT BITS'}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiles", nargs="+", default=TILES)
    p.add_argument("--fp4-tiles", nargs="+", default=["32x512x4", "32x256x4", "64x256x4", "64x512x8", "128x256x8",
                                                      "16x512x4"])
    a = p.parse_args()
    from deepinfer.kernels import triton_dequant as td
    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() / time_eager(lambda: dst.copy_(src), iters=10)
    del src, dst
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")
    rows = []
    for name, (n, k) in STACKS.items():
        w = torch.randint(0, 126, (n, k), device="cuda", generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
        for layout, s in (("row", torch.exp2(torch.randint(-12, -4, (n, 1), device="cuda", generator=g).float())),
                          ("block", torch.randint(118, 124, (n // 32, k // 32), device="cuda", generator=g,
                                                  dtype=torch.uint8))):
            rows += sweep(lambda out, tile: td.dequant_fp8_bf16(w, s, out=out, tile=tile), a.tiles, name, layout,
                          3 * n * k, copy_bw)
            best = min((r for r in rows if r["stack"] == name and r["layout"] == layout and r["same"]),
                       key=lambda r: r["ms"])
            print(f"best {name} {layout}: {best['tile']} {best['ms']:.3f} ms")
    # the FP4 stacks' dequant (expert_format="fp4"): 0.5 + 1/32 bytes read and 2 written per element
    from deepinfer.kernels.fp4_layout import fp4_kernel_weight
    for name, (n, k) in STACKS.items():
        pk, sk = fp4_kernel_weight(torch.randint(0, 256, (n, k // 2), device="cuda", generator=g, dtype=torch.uint8),
                                   torch.randint(118, 124, (n, k // 32), device="cuda", generator=g, dtype=torch.uint8))
        rows += sweep(lambda out, tile: td.dequant_fp4_bf16(pk, sk, out=out, tile=tile), a.fp4_tiles, name, "fp4",
                      (2.5 + 1 / 32) * n * k, copy_bw)
    save_json("dequant_tiles.json", dict(copy_bw=copy_bw, rows=rows))


if __name__ == "__main__":
    main()
