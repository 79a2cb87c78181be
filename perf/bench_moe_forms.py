"""The routed experts at verify-step sizes: the masked form (DeepGEMM's masked layout, the W8A16
pairs kernel; what decode and verify graphs run up to MASKED_MAX_PAIRS) against the grouped
contiguous form (tokens sorted by expert, the CUDA FP8 x FP8 grouped GEMM; what prefill runs), on one
MoE layer of the full-width-ep8 config (48 local experts, random weights), both timed as CUDA-graph
replays in one run. A batch-64 DSpark verify step is 384 tokens (2,304 pairs): H200, 2026-12-03, the
masked form was 35% of that step's kernel time.

    python perf/bench_moe_forms.py [--tokens 64 128 256 384 512 682]

Prints per token count: ms of each form, contiguous / masked speed, and the largest difference of
the two outputs relative to their scale (both compute the release's products; they sum in other
orders).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import dummy_model, save_json, time_calls  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="full-width-ep8")
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 256, 384, 512, 682])
    a = p.parse_args()
    from deepinfer.kernels import select
    model = dummy_model(a.preset)
    moe = next(b.ffn for b in model.layers if getattr(b.ffn, "stacks", None) is not None)
    select.MOE_CONTIGUOUS = True
    rows = []
    print(f"{'tokens':>6} {'pairs':>6} {'masked ms':>10} {'contig ms':>10} {'speed':>6} {'max diff':>9}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for t in a.tokens:
        x = torch.randn(t, model.args.dim, device="cuda", generator=g).bfloat16()
        outs, ms = {}, {}
        for form, masked in (("masked", True), ("contiguous", False)):
            moe.masked = masked
            with torch.inference_mode():
                outs[form] = moe(x).float()
                ms[form] = time_calls([lambda: moe(x)]) * 1e3
        moe.masked = None
        diff = float((outs["masked"] - outs["contiguous"]).abs().max() / outs["masked"].abs().max())
        rows.append(dict(tokens=t, pairs=t * model.args.n_activated_experts, masked_ms=ms["masked"],
                         contiguous_ms=ms["contiguous"], max_rel_diff=diff))
        print(f"{t:6d} {rows[-1]['pairs']:6d} {ms['masked']:10.3f} {ms['contiguous']:10.3f} "
              f"{ms['masked'] / ms['contiguous']:5.2f}x {diff:9.2e}", flush=True)
    print("declined fast paths:", sorted(select.declined()))
    save_json("moe_forms.json", dict(preset=a.preset, rows=rows))


if __name__ == "__main__":
    main()
