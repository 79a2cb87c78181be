"""The routed experts at verify-step sizes: the masked form (DeepGEMM's masked layout, the W8A16
pairs kernel; what decode and verify graphs run up to MASKED_MAX_PAIRS) against the grouped
contiguous form (tokens sorted by expert, the CUDA FP8 x FP8 grouped GEMM; what prefill runs), on one
MoE layer of the full-width-ep8 config (48 local experts, random weights), both timed as CUDA-graph
replays in one run. A batch-64 DSpark verify step is 384 tokens (2,304 pairs): H200, 2026-12-03, the
masked form was 35% of that step's kernel time.

    python perf/bench_moe_forms.py [--tokens 64 128 256 384 512 682]
    python perf/bench_moe_forms.py --prefill [--tokens 2048 4096 8192]

--prefill: the grouped contiguous form at prefill sizes on its GEMM paths, timed eagerly (the bf16
path declines inside a graph capture): the CUDA FP8 x FP8 kernel (plain forms and scale-tile twins,
whose bits must agree) against the whole stack dequantized to bf16 and one bf16 grouped GEMM
(select.BF16_MOE_MIN_ROWS picks between them by token-expert rows; the ts/fp8 and ts/bf16 columns: how many times
faster the twins are).

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

from benchutil import dummy_model, save_json, time_calls, time_eager  # noqa: E402


def prefill_paths(model, moe, tokens) -> list:
    """The grouped contiguous MoE layer per token count on its three GEMM paths, side by side: the CUDA
    FP8 x FP8 kernel's plain forms, its scale-tile twins (same bits), and the bf16 grouped GEMM."""
    from deepinfer.kernels import cuda_fp8_gemm, select
    rows = []
    print(f"{'tokens':>6} {'pairs':>6} {'fp8 ms':>8} {'fp8_ts ms':>9} {'bf16 ms':>8} {'ts/fp8':>6} {'ts/bf16':>7} "
          f"{'ts==fp8':>7} {'max diff':>9}")
    g = torch.Generator(device="cuda").manual_seed(1)
    saved = select.BF16_MOE_MIN_ROWS, cuda_fp8_gemm.TS_ON
    paths = (("fp8", 0, False), ("fp8_ts", 0, True), ("bf16", 1, False))
    for t in tokens:
        x = torch.randn(t, model.args.dim, device="cuda", generator=g).bfloat16()
        outs, ms = {}, {}
        for path, min_rows, ts in paths:
            select.BF16_MOE_MIN_ROWS, cuda_fp8_gemm.TS_ON = min_rows, ts
            with torch.inference_mode():
                outs[path] = moe(x).float()
                ms[path] = time_eager(lambda: moe(x), iters=10) * 1e3
        select.BF16_MOE_MIN_ROWS, cuda_fp8_gemm.TS_ON = saved
        diff = float((outs["fp8"] - outs["bf16"]).abs().max() / outs["fp8"].abs().max())
        same = bool(torch.equal(outs["fp8"], outs["fp8_ts"]))
        pairs = t * model.args.n_activated_experts
        rows.append(dict(tokens=t, pairs=pairs, fp8_ms=ms["fp8"], fp8_ts_ms=ms["fp8_ts"], bf16_ms=ms["bf16"],
                         ts_equal_plain=same, max_rel_diff=diff))
        print(f"{t:6d} {pairs:6d} {ms['fp8']:8.3f} {ms['fp8_ts']:9.3f} {ms['bf16']:8.3f} "
              f"{ms['fp8'] / ms['fp8_ts']:5.2f}x {ms['bf16'] / ms['fp8_ts']:6.2f}x {str(same):>7} {diff:9.2e}",
              flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="full-width-ep8")
    p.add_argument("--tokens", type=int, nargs="+")
    p.add_argument("--prefill", action="store_true", help="the two GEMM paths of the contiguous form")
    a = p.parse_args()
    from deepinfer.kernels import select
    model = dummy_model(a.preset)
    moe = next(b.ffn for b in model.layers if getattr(b.ffn, "stacks", None) is not None)
    select.MOE_CONTIGUOUS = True
    if a.prefill:
        moe.masked = False
        rows = prefill_paths(model, moe, a.tokens or [2048, 4096, 8192, 16384])
        print("declined fast paths:", sorted(select.declined()))
        save_json("moe_prefill_paths.json", dict(preset=a.preset, rows=rows))
        return
    a.tokens = a.tokens or [64, 128, 256, 384, 512, 682]
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
