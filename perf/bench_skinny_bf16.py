"""Decode-sized dense linears on bf16-held weights: cuBLAS (torch.nn.functional.linear, today's path) against
the Triton skinny kernel (triton_gemm.bf16_skinny_linear: the W8A16 kernels' swapped tiles and split-K on
bf16 weights) and its tile variants, side by side in one run, timed as CUDA-graph replays on rotating
weight copies (each set at least 4x the L2). Prints per (linear, M) microseconds, GB/s of the weight bytes
and the share of the copy bandwidth measured in the same run, Triton / cuBLAS speed, the best variant, and
writes skinny_bf16.json ($OUT or perf/results/) with a plot (skinny_bf16.png).

    python perf/bench_skinny_bf16.py [--m 16 64 128] [--variants] [--write-table]
    python perf/bench_skinny_bf16.py --table-from results/skinny_bf16.json   (the table from a saved run)

--write-table: this GPU model's table in kernels/skinny_bf16_table.json (one table a model; select.py reads the
one of the GPU it runs on): per
(N, K, measured M) the fastest tiles where they beat cuBLAS by WIN_MARGIN, else null (cuBLAS); a call takes the
row of the smallest measured M at or above its own, none above the largest.

Checks every variant against the float64 product before timing (bf16 products are exact in fp32: the
difference is the fp32 summation order and the output rounding).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from benchutil import copies_for, measure_ceilings, out_dir, panels_by_m, save_json, time_calls  # noqa: E402

# (name, N, K): the full-width decode step's dense linears (perf/bench_model_decode.py's profile)
SHAPES = (("wqkv_a", 1792, 5120), ("wq_b", 32768, 1280), ("wo_b", 5120, 8192), ("shared_w13", 4608, 5120),
          ("shared_w2", 5120, 2304), ("indexer_wq_b", 4096, 1280), ("engram_wkv", 25600, 6144),
          ("head", 129280, 5120), ("router", 384, 5120), ("router_48", 48, 5120), ("compressor", 512, 5120))
# fp32 out (select.linear_fp32: the MoE router's gate (the release's 384 experts; 48 in full-width-ep8's
# benchmark checkpoint) and the ratio > 1 compressor's projections; the head's logits at decode sizes too): against
# cuBLAS's bf16 GEMM with fp32 output (torch.mm(out_dtype=float32))
FP32_OUT = {"head", "router", "router_48", "compressor"}


WIN_MARGIN = 1.03
TABLE = os.path.join(os.path.dirname(HERE), "kernels", "skinny_bf16_table.json")


def write_table(rows: list[dict], source: str, device: str, path: str = TABLE) -> None:
    """select.py's table for GPU model `device` from measured rows: the best tiles where best_x >= WIN_MARGIN,
    else None; merged by (N, K, M) into that model's rows at path (a run of some M's keeps the others'; the
    other models' tables stay as they are); a copy goes to out_dir()."""
    from deepinfer.kernels.measured_table import merge_table, rows_by_shape
    new = [dict(n=r["n"], k=r["k"], m=r["m"], cfg=json.loads(r["best"].replace("'", '"'))
                if r["best_x"] >= WIN_MARGIN else None) for r in rows]
    merge_table(path, {"measured": source, "device": device, "win_margin": WIN_MARGIN, "rows": new})
    shutil.copyfile(path, os.path.join(out_dir(), os.path.basename(path)))
    out = [r for rs in rows_by_shape(path, device=device)[1].values() for r in rs]
    print(f"wrote {path} ({device}): {sum(r['cfg'] is not None for r in out)} of {len(out)} (N, K, M) on the "
          f"Triton kernel ({len(new)} measured now)")


def variants(m: int) -> list[dict]:
    """The default, then BN x BK x stages; above 64 rows also the token tile (BM 64: two of them) and 4 / 8 warps."""
    out = [{}]
    for bn, bk, st in itertools.product((64, 128), (64, 128, 256), (3, 4)):
        if bn * bk * 2 * st <= 160 * 1024:
            out.append({"BN": bn, "BK": bk, "NUM_STAGES": st})
    if m > 64:
        for bm, warps, bn, bk, st in itertools.product((64, 128), (4, 8), (64, 128), (64, 128), (3, 4)):
            if (bn + bm) * bk * 2 * st <= 200 * 1024:
                out.append({"BM": bm, "num_warps": warps, "BN": bn, "BK": bk, "NUM_STAGES": st})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--variants", action="store_true", help="also every tile variant (else the default only)")
    p.add_argument("--shapes", nargs="+", default=None, help="names from SHAPES")
    p.add_argument("--write-table", action="store_true", help=f"write {os.path.relpath(TABLE, os.path.dirname(HERE))}")
    p.add_argument("--table-from", help="only write the table from a saved skinny_bf16.json")
    p.add_argument("--device", default="NVIDIA H200", help="with --table-from: the GPU model it was measured on")
    a = p.parse_args()
    if a.table_from:
        with open(a.table_from) as f:
            write_table(json.load(f)["rows"], f"perf/bench_skinny_bf16.py --variants, {a.table_from}", a.device)
        return
    from deepinfer.kernels.triton_gemm import bf16_skinny_linear
    copy_bw = measure_ceilings()["copy_bw"]
    print(f"copy bandwidth (same run): {copy_bw / 1e9:.0f} GB/s", flush=True)
    shapes = [s for s in SHAPES if a.shapes is None or s[0] in a.shapes]
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in shapes:
        nb = n * k * 2
        ws = [torch.randn(n, k, device="cuda", generator=g).bfloat16() for _ in range(copies_for(nb, cap=8))]
        for m in a.m:
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            exact = x.double() @ ws[0].double().T
            tol = 2.0 ** -7 * exact.abs().max().item()
            out = torch.float32 if name in FP32_OUT else torch.bfloat16
            if name in FP32_OUT:
                t_cublas = time_calls([lambda w=w: torch.mm(x, w.t(), out_dtype=torch.float32) for w in ws])
            else:
                t_cublas = time_calls([lambda w=w: torch.nn.functional.linear(x, w) for w in ws])
            res = {}
            for v in (variants(m) if a.variants else [{}]):
                try:
                    err = (bf16_skinny_linear(x, ws[0], v, out).double() - exact).abs().max().item()
                    if err > tol:
                        print(f"{name} m {m} {v}: WRONG (max error {err:.3g} > {tol:.3g})", flush=True)
                        continue
                    res[str(v)] = time_calls([lambda w=w: bf16_skinny_linear(x, w, v, out) for w in ws])
                except Exception as e:  # noqa: BLE001  (out of resources: reported, not fatal)
                    print(f"{name} m {m} {v}: FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)
            if not res:
                continue
            best = min(res, key=res.get)
            t_def = res.get("{}", float("nan"))
            row = dict(name=name, n=n, k=k, m=m, cublas_us=t_cublas * 1e6, triton_us=t_def * 1e6,
                       best=best, best_us=res[best] * 1e6, cublas_of_copy=nb / t_cublas / copy_bw,
                       triton_of_copy=nb / t_def / copy_bw, best_of_copy=nb / res[best] / copy_bw,
                       triton_x=t_cublas / t_def, best_x=t_cublas / res[best])
            rows.append(row)
            print(f"{name:>13} {n:>6}x{k:<5} m {m:>3}: cuBLAS {row['cublas_us']:7.1f} us ({row['cublas_of_copy']:.2f} of copy)"
                  f"  Triton {row['triton_us']:7.1f} ({row['triton_of_copy']:.2f}) {row['triton_x']:.2f}x"
                  f"  best {row['best_us']:7.1f} ({row['best_of_copy']:.2f}) {row['best_x']:.2f}x {best}", flush=True)
    save_json("skinny_bf16.json", dict(copy_bw=copy_bw, rows=rows))
    if a.write_table:
        write_table(rows, f"perf/bench_skinny_bf16.py --variants --m {' '.join(map(str, a.m))}, {time.strftime('%Y-%m-%d')}",
                    torch.cuda.get_device_name())
    try:
        plot(rows, os.path.join(out_dir(), "skinny_bf16.png"))
    except Exception as e:  # noqa: BLE001
        print(f"plot skipped: {e}")


def plot(rows, path: str) -> None:
    _, fig, panels = panels_by_m(rows)
    for ax, m, rs in panels:
        xs = range(len(rs))
        ax.bar([i - 0.2 for i in xs], [r["cublas_of_copy"] for r in rs], 0.4, label="cuBLAS")
        ax.bar([i + 0.2 for i in xs], [r["best_of_copy"] for r in rs], 0.4, label="Triton skinny (best)")
        ax.set_xticks(list(xs), [r["name"] for r in rs], rotation=45, ha="right", fontsize=7)
        ax.set(title=f"M = {m}", ylabel="weight bytes / time / copy")
        ax.legend(fontsize=7)
    fig.suptitle(f"bf16 decode linears on the {torch.cuda.get_device_name()}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
