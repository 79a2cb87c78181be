"""How far a bf16 vision tower is from fp32, and why (CPU; the analysis behind test_vision_gpu.py's
BF16_TOWER_SPREAD).

Runs the release-width tower (random weights as perf/vision_encode.build_tower makes them) on one
random patch grid five ways and prints their relative distances:
    truth      weights and activations in fp64
    cpu-side   fp32 weights, activations rounded to bf16 between ops (the GPU test's CPU side)
    gpu-like   bf16-rounded weights, bf16 activations (the CUDA tower's numerics)
    w-bf16     bf16-rounded weights, fp32 activations (the weights' share alone)
    fp32       fp32 weights and activations

    python perf/vision_bf16_spread.py --layers 2 8 32 --grid 20     (~6 min on 2 cores)

The activation dtype is the vision package's ACT constant, switched here per run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def run(tower, act: torch.dtype, patches: torch.Tensor, grid) -> torch.Tensor:
    import deepinfer.model.vision.tower as tower_mod
    import deepinfer.model.vision.vit as vit_mod
    vit_mod.ACT = tower_mod.ACT = act
    try:
        with torch.inference_mode():
            return tower.aligner(tower.vit(patches, grid), grid).double()
    finally:
        vit_mod.ACT = tower_mod.ACT = torch.bfloat16


def cast(tower, fn):
    for m in tower.modules():
        for name, b in list(m.named_buffers(recurse=False)):
            if b is not None:
                setattr(m, name, fn(b))
    return tower


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    p.add_argument("--grid", type=int, default=20, help="patches per side of the random grid")
    a = p.parse_args()
    from vision_encode import build_tower

    from deepinfer.model.vision import VisionArgs
    g = torch.Generator().manual_seed(1)
    patches = torch.randn(a.grid * a.grid, 3, 14, 14, generator=g).clamp(-1, 1).to(torch.bfloat16)
    grid = [(a.grid, a.grid)]
    rel = lambda x, y: ((x - y).norm() / y.norm()).item()          # noqa: E731
    for n in a.layers:
        t0 = time.perf_counter()
        v = VisionArgs(n_layers=n)
        fp32 = build_tower(v, 5120, "cpu")
        truth = run(cast(build_tower(v, 5120, "cpu"), lambda b: b.double()), torch.float64, patches, grid)
        cpu_side = run(fp32, torch.bfloat16, patches, grid)
        w16 = cast(build_tower(v, 5120, "cpu"), lambda b: b.to(torch.bfloat16).float() if b.dim() == 2 else b)
        gpu_like = run(w16, torch.bfloat16, patches, grid)
        w_only = run(w16, torch.float32, patches, grid)
        print(f"{n} layers, {a.grid}x{a.grid} patches: gpu-like vs cpu-side {rel(gpu_like, cpu_side):.4f}; vs truth: "
              f"cpu-side {rel(cpu_side, truth):.4f}, gpu-like {rel(gpu_like, truth):.4f}, "
              f"w-bf16 {rel(w_only, truth):.4f}, fp32 {rel(run(fp32, torch.float32, patches, grid), truth):.1e} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
