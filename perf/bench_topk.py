"""The indexer's top-k (kernels/triton_topk.py): the k-th key found bit by bit (DIGIT_BITS = 1: one block-wide
count a bit, 16 rounds for bf16 keys) against a nibble at a time (DIGIT_BITS = 4: 15 counts in one reduction a
round, 4 rounds), side by side in one run as CUDA-graph replays, at decode sizes (one row a sequence) and prefill
sizes. Both searches' picks are checked against reference.index_topk_ref first.

Why: in the H100's replayed batch-64 decode step (2026-12-07) the top-k of a ratio-2 layer took 27 us on the
window's critical path (64 programs, one a row, each spending its time in 16 barrier-bound reductions).

    python perf/bench_topk.py [--rows 64 128 4096] [--widths 2048 4096 8192 32768]     (topk.json, topk.png)

Prints per (op, rows, width, dtype): both searches' microseconds and the nibble search's speed-up.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from benchutil import gpu_model, save_json, time_calls  # noqa: E402

from deepinfer.kernels import triton_topk  # noqa: E402
from deepinfer.kernels.reference import candidate_blocks_ref, index_topk_ref  # noqa: E402

K = 512                 # index_topk of the release
BLOCK = 64              # select_candidate_blocks' block size at prefill


def calls(op: str, rows: int, width: int, dtype: torch.dtype):
    """(the kernel call, its reference call) on indexer-like scores with -inf past each row's length."""
    x = (torch.randn(rows, width, device="cuda").abs() * 0.3).to(dtype)
    lens = torch.randint(width // 2, width + 1, (rows,), device="cuda")
    x = x.masked_fill(torch.arange(width, device="cuda") >= lens[:, None], -torch.inf)
    if op == "index_topk":
        return (lambda: triton_topk.index_topk(x, lens, K)), (lambda: index_topk_ref(x, lens, K))
    return ((lambda: triton_topk.candidate_blocks(x, lens, K // BLOCK, BLOCK)),
            (lambda: candidate_blocks_ref(x, lens, K // BLOCK, BLOCK)))


def timed(op: str, rows: int, width: int, dtype: torch.dtype) -> dict:
    fast, ref = calls(op, rows, width, dtype)
    want = ref()
    out = {"op": op, "rows": rows, "width": width, "dtype": str(dtype).split(".")[-1]}
    for bits in (1, 4):
        triton_topk.DIGIT_BITS = bits
        assert torch.equal(fast(), want), (op, rows, width, dtype, bits)
        out[f"us_{bits}"] = time_calls([fast]) * 1e6
    out["speedup"] = out["us_1"] / out["us_4"]
    print(f"{op:16s} rows {rows:5d} width {width:6d} {out['dtype']:9s} bitwise {out['us_1']:8.1f} us  "
          f"nibbles {out['us_4']:8.1f} us  {out['speedup']:.2f}x", flush=True)
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["op"], r["rows"], r["dtype"]) for r in rows}):
        rs = [r for r in rows if (r["op"], r["rows"], r["dtype"]) == key]
        ax.plot([r["width"] for r in rs], [r["speedup"] for r in rs], marker="o", label=" ".join(map(str, key)))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("row width")
    ax.set_ylabel("bitwise / nibble time")
    ax.set_title(f"top-k: the k-th key a nibble at a time ({gpu_model()})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128, 4096])
    p.add_argument("--widths", type=int, nargs="+", default=[2048, 4096, 8192, 32768])
    a = p.parse_args()
    saved = triton_topk.DIGIT_BITS
    rows = []
    try:
        for op in ("index_topk", "candidate_blocks"):
            for n in a.rows:
                for width in a.widths:
                    for dtype in (torch.bfloat16, torch.float32):
                        if op == "candidate_blocks" and (dtype != torch.float32 or n < 4096):
                            continue        # the prefill path's block pick (fp32 scores, many rows)
                        rows.append(timed(op, n, width, dtype))
    finally:
        triton_topk.DIGIT_BITS = saved
    path = save_json("topk", {"device": gpu_model(), "rows": rows})
    plot(rows, os.path.join(os.path.dirname(path), "topk.png"))


if __name__ == "__main__":
    main()
