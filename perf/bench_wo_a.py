"""wo_a at decode sizes: the block-diagonal output projection (full width: 8 groups of [1024, 4096], no activation
rounding) as the default runs it on bf16-held weights (select.grouped_mm_token_major: cuBLAS bmm, 67 MB a call)
against the grouped W8A16 kernel on its FP8 blocks (triton_gemm.w8a16_grouped_gemm, token-major: the same exact
products, 33.5 MB a call) and that kernel's tile variants, side by side in one run as CUDA-graph replays on
rotating weight copies, with the copy bandwidth measured beside them.

Why: the H100's replayed batch-64 step (2026-12-07, `perf/graph_profile.py`) has wo_a's bmm as its largest
kernel run alone between the experts (215 us in 7 calls, 31 us each: 0.72 of copy on the bf16 bytes), on the
attention's critical path of every layer. Half the bytes at the same share of copy would save ~15 us a layer.

    python perf/bench_wo_a.py [--m 1 16 64 128] [--cfgs BN=64,SPLIT_K=2 ...]      (wo_a.json in $OUT)

Prints per M: microseconds, the share of copy on the bytes each form reads, and W8A16 / bmm speed. Each form is
checked against the float64 product of the dequantized weight first (fp32 order and the bf16 output only).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from benchutil import copies_for, measure_ceilings, save_json, time_calls  # noqa: E402

GROUPS, N, K = 8, 1024, 4096          # full width: o_groups, o_lora_rank, n_heads * head_dim / o_groups


def fp8_blocks(copies: int):
    """`copies` FP8 wo_a weights [G, N, K] with E8M0 scales per 32 x 32 tile, and their bf16 dequantized twins."""
    from deepinfer.kernels.select import dequant_fp8
    out = []
    for _ in range(copies):
        w = (torch.randn(GROUPS, N, K, device="cuda") * K ** -0.5).to(torch.float8_e4m3fn)
        s = torch.randint(118, 124, (GROUPS, N // 32, K // 32), dtype=torch.uint8, device="cuda")
        out.append((w, s, dequant_fp8(w, s).to(torch.bfloat16)))
    return out


def form_bytes(name: str) -> float:
    """The weight bytes a form reads a call: bf16 for the bmm, FP8 + one E8M0 byte a 32 x 32 tile otherwise."""
    return GROUPS * N * K * (2 if name.startswith("bmm") else 1 + 1 / 1024)


def parse_cfg(text: str) -> dict:
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--cfgs", nargs="*", default=["BN=64", "BN=128", "SPLIT_K=1", "SPLIT_K=2", "SPLIT_K=4",
                                                     "NUM_STAGES=4"],
                    help="W8A16 config overrides (w8a16_config's keys) also timed")
    a = ap.parse_args()
    from deepinfer.kernels.select import grouped_mm_token_major
    from deepinfer.kernels.triton_gemm import w8a16_config, w8a16_grouped_gemm
    ceil = measure_ceilings()
    copy_bw = ceil["copy_bw"]
    print(f"copy {copy_bw / 1e12:.2f} TB/s; wo_a {GROUPS} x [{N}, {K}]: bf16 {form_bytes('bmm') / 1e6:.1f} MB, "
          f"FP8 {form_bytes('w8a16') / 1e6:.1f} MB")
    ws = fp8_blocks(copies_for(GROUPS * N * K * 2))
    rows = []
    for m in a.m:
        x = torch.randn(m, GROUPS, K, device="cuda", dtype=torch.bfloat16)
        ref = torch.einsum("tgd,grd->tgr", x.double(), ws[0][2].double())
        forms = {"bmm bf16 (today)": lambda w, s, h: grouped_mm_token_major(x, h),
                 "w8a16": lambda w, s, h: w8a16_grouped_gemm(x, w, s, token_major=True)}
        for c in a.cfgs:
            forms[f"w8a16 {c}"] = lambda w, s, h, c=c: w8a16_grouped_gemm(x, w, s, cfg_override=parse_cfg(c),
                                                                          token_major=True)
        r = {"m": m, "w8a16_cfg": w8a16_config(m, N, K, GROUPS, x.device)}
        for name, f in forms.items():
            try:
                err = ((f(*ws[0]).double() - ref).abs().max() / ref.abs().max()).item()
            except Exception as e:  # noqa: BLE001 - a config the kernel cannot take: report it, time the rest
                print(f"  M {m:4d} {name}: {type(e).__name__}: {e}")
                continue
            if err > 2 ** -7:
                print(f"  M {m:4d} {name}: off the float64 product by {err:.2e} of its largest value: not timed")
                continue
            us = time_calls([lambda w=w, s=s, h=h, f=f: f(w, s, h) for w, s, h in ws]) * 1e6
            r[name] = us
            print(f"  M {m:4d} {name:28s} {us:8.1f} us  {form_bytes(name) / (us * 1e-6) / copy_bw:5.2f} of copy",
                  flush=True)
        w8 = [v for k, v in r.items() if k.startswith("w8a16") and isinstance(v, float)]
        if w8 and "bmm bf16 (today)" in r:
            print(f"M {m:4d}: best W8A16 {min(w8):.1f} us = {r['bmm bf16 (today)'] / min(w8):.2f}x the bmm "
                  f"(default config {r.get('w8a16', float('nan')):.1f} us)")
        rows.append(r)
    print("wrote", save_json("wo_a.json", dict(ceilings=ceil, rows=rows)))


if __name__ == "__main__":
    main()
