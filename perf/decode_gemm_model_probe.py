"""Every Linear of a preset that keeps an FP8 copy (dense_weights="bf16+fp8") through the CUDA FP8 decode GEMM
against the release GEMM's reference (fp8_prefill_linear_ref) at decode sizes, within the FP8 MMA bound; prints
each shape's worst excess (a bug shows as a shape far outside, noise as none).

    python perf/decode_gemm_model_probe.py [--preset tiny]
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "kernels"))

from benchutil import dummy_model  # noqa: E402
from fp8_prefill_checks import outside_fp8_mma_bound  # noqa: E402

from deepinfer.kernels.cuda_fp8_decode import fp8_decode_linear, plan  # noqa: E402
from deepinfer.kernels.triton_fp8_prefill import fp8_prefill_linear_ref  # noqa: E402
from deepinfer.model.layers import Linear  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    a = p.parse_args()
    model = dummy_model(a.preset, dense_weights="bf16+fp8")
    seen = set()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, mod in model.named_modules():
        if not isinstance(mod, Linear) or mod.fp8_decode is None:
            continue
        w, s = mod.fp8_decode
        key = (tuple(w.shape), tuple(s.shape), w.data_ptr() % 128, w.stride())
        if key in seen:
            continue
        seen.add(key)
        for m in (1, 2, 7, 33):
            x = (torch.randn(m, w.shape[1], device="cuda", generator=gen) * 3).bfloat16()
            y = fp8_decode_linear(x, w, s).float()
            r = fp8_prefill_linear_ref(x, w, s).float()
            bad = outside_fp8_mma_bound(y, r, x, w, s)
            print(f"{name:40s} w {tuple(w.shape)} s {tuple(s.shape)} ptr%128 {w.data_ptr() % 128} M {m} "
                  f"{plan(m, w.shape[0], w.shape[1], 132)}: max |y-r| {(y - r).abs().max().item():.3g} "
                  f"(|r| max {r.abs().max().item():.3g}), outside bound {int(bad.sum())}", flush=True)


if __name__ == "__main__":
    main()
