"""Decode-sized FP8 linears on the GPU: the CUDA FP8 x FP8 decode GEMM (kernels/cuda_fp8_decode.py: weight rows
on the wgmma's M side, tokens on N, split-K) against DeepGEMM (per-128 promotion on 128x128-tile weights: a speed
reference, not the release's numbers), today's paths (the bf16-held weight on cuBLAS / the skinny kernel,
select.dense_linear; the FP8 weight on select.fp8_linear's W8A16 / Triton FP8 kernels) and the copy bandwidth
measured in the same run. Each path includes its activation quantization; every timing is a CUDA-graph replay
over rotating weight copies (each set at least 4x the L2).

    python perf/bench_fp8_decode.py [--m 1 16 32 64 128] [--forms [--all-splits] [--write-table]] [--breakdown]
                                    [--only w13 w2]

Prints per (linear, M): microseconds, the share of the copy bandwidth on the FP8 weight bytes, and the decode
kernel's speed as a ratio to DeepGEMM and to the bf16-held path (and the decode path without programmatic
dependent launch beside it); --forms also times every row-block form
and a few split counts (--all-splits: every split count the call may take). Writes bench_fp8_decode.json and fp8_decode_<gpu>.png ($OUT or perf/results/).
--write-table (with --forms): kernels/fp8_decode_table.json, which select reads on the GPU model it names: per
(N, K, measured M) the best form and split count and the times of the paths it would replace (a call takes the
row of the smallest measured M at or above its own; the kernel only where it won by cuda_fp8_decode.WIN_MARGIN).
Checks the decode kernel against the release GEMM's reference (the FP8 MMA bound) before timing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "kernels"))

from bench_fp8_prefill import DENSE  # noqa: E402
from benchutil import copies_for, gpu_model, measure_ceilings, out_dir, save_json, time_calls  # noqa: E402

# the prefill bench's six dense linears and the two FP8 linears that only decode-sized steps run at these M:
# Engram's wkv (two layers of the release, 315 MB of bf16 a call) and DSpark's main_proj (the drafts' input)
DECODE_SHAPES = {**DENSE, "engram_wkv": (25600, 6144), "dspark_main_proj": (5120, 15360)}


def weights(n: int, k: int, copies: int):
    out = []
    for _ in range(copies):
        w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.float8_e4m3fn)
        s = torch.randint(118, 124, (-(-n // 32), k // 32), dtype=torch.uint8, device="cuda")
        out.append((w, s))
    return out


def check(x, w, s) -> None:
    from fp8_prefill_checks import outside_fp8_mma_bound

    from deepinfer.kernels.cuda_fp8_decode import fp8_decode_linear
    from deepinfer.kernels.triton_fp8_prefill import fp8_prefill_linear_ref
    y = fp8_decode_linear(x, w, s).float()
    r = fp8_prefill_linear_ref(x, w, s).float()
    bad = outside_fp8_mma_bound(y, r, x, w, s)
    assert not bad.any(), (tuple(x.shape), tuple(w.shape), (y - r).abs().max().item())


@contextlib.contextmanager
def pdl_off():
    """The decode path in plain stream order (no programmatic dependent launch) meanwhile."""
    from deepinfer.kernels import cuda_fp8_decode
    saved, cuda_fp8_decode.PDL = cuda_fp8_decode.PDL, False
    try:
        yield
    finally:
        cuda_fp8_decode.PDL = saved


@contextlib.contextmanager
def table_off():
    """cuda_fp8_decode without its measured table (select never routes to the kernel by it) meanwhile."""
    from deepinfer.kernels import cuda_fp8_decode
    saved = cuda_fp8_decode.TABLE_PATH
    cuda_fp8_decode.TABLE_PATH = ""
    cuda_fp8_decode.reload_table()
    try:
        yield
    finally:
        cuda_fp8_decode.TABLE_PATH = saved
        cuda_fp8_decode.reload_table()


def rows_for(name: str, n: int, k: int, ms, copy_bw: float, forms: bool, parts: bool = False,
             all_splits: bool = False, narrow: bool = False) -> list[dict]:
    from deepinfer.kernels import deepgemm, select
    from deepinfer.kernels.cuda_fp8_decode import (FORMS, form_for, fp8_decode_linear, kernel_scales, split_counts,
                                                   token_tile)
    from deepinfer.kernels.triton_dequant import dequant_fp8_bf16
    from deepinfer.kernels.triton_quant import act_quant
    nbytes = n * k * (1 + 1 / 1024)
    ws = weights(n, k, copies_for(nbytes))
    for _, s in ws:          # the kernel's scale layout, made eagerly (as the model's warm-up does)
        kernel_scales(s)
    held = [dequant_fp8_bf16(w, s) for w, s in ws]
    dg = deepgemm.load() is not None and n % 128 == 0 and k % 128 == 0
    tiles = [deepgemm.cached_tile128(w, s) for w, s in ws] if dg else []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        check(x, *ws[0])
        entry, splits = form_for(m, n, k, torch.cuda.get_device_name(0), sms)   # what a call runs
        r = {"name": name, "n": n, "k": k, "m": m, "entry": entry, "splits": splits}
        r["decode_us"] = time_calls([lambda w=w, s=s: fp8_decode_linear(x, w, s) for w, s in ws]) * 1e6
        with pdl_off():
            r["decode_no_pdl_us"] = time_calls([lambda w=w, s=s: fp8_decode_linear(x, w, s) for w, s in ws]) * 1e6
        r["bf16_held_us"] = time_calls([lambda h=h: select.dense_linear(act_quant(x), h) for h in held]) * 1e6
        with table_off():        # select.fp8_linear's other FP8 paths (the table would send it here)
            r["fp8_select_us"] = time_calls([lambda w=w, s=s: select.fp8_linear(x, w, s) for w, s in ws]) * 1e6
        if dg:
            r["deepgemm_us"] = time_calls([lambda p=p: deepgemm.linear(x, *p) for p in tiles]) * 1e6
        if forms:
            # m's token tile; narrow: also tiles of a half and a quarter of it, m's tokens in several tiles
            # (blockIdx.z), each tile's CTAs reading their weight rows again (from L2 where they run together)
            bt = token_tile(m)
            for name_f in FORMS:
                if FORMS[name_f][0] != bt and not (narrow and bt // 4 <= FORMS[name_f][0] < bt):
                    continue
                for sp in split_counts(k) if all_splits else sorted({1, max(1, splits // 2), splits, 2 * splits}):
                    key = f"{name_f[len('fp8_decode_sm90_'):]}/s{sp}"
                    r[f"form {key}_us"] = time_calls([lambda w=w, s=s: fp8_decode_linear(x, w, s, name_f, sp)
                                                      for w, s in ws]) * 1e6
        r["decode_of_copy"] = nbytes / (r["decode_us"] * 1e-6) / copy_bw
        r["x_bf16_held"] = r["bf16_held_us"] / r["decode_us"]
        r["x_fp8_select"] = r["fp8_select_us"] / r["decode_us"]
        if dg:
            r["x_deepgemm"] = r["deepgemm_us"] / r["decode_us"]
        best = min((v, key) for key, v in r.items() if key.startswith("form ")) if forms else None
        print(f"{name:11s} M {m:4d}: decode {r['decode_us']:7.1f} us ({r['decode_of_copy']:.2f} of copy, {entry} x{splits};"
              f" no PDL {r['decode_no_pdl_us']:.1f})"
              f"  DeepGEMM {r.get('deepgemm_us', float('nan')):7.1f} (x {r.get('x_deepgemm', float('nan')):.2f})"
              f"  bf16 held {r['bf16_held_us']:7.1f} (x {r['x_bf16_held']:.2f})  fp8 select {r['fp8_select_us']:7.1f}"
              + (f"  best form {best[1][5:-3]} {best[0]:.1f}" if best else ""), flush=True)
        if forms:   # each form at its best split count
            per = {}
            for key, v in r.items():
                if key.startswith("form "):
                    f = key[5:-3].rsplit("/", 1)[0]
                    per[f] = min(per.get(f, v), v)
            print("    forms: " + ", ".join(f"{f} {v:.1f}" for f, v in sorted(per.items(), key=lambda kv: kv[1])))
        if parts:
            r["parts"] = breakdown(name, n, k, m, ws, tiles)
        out.append(r)
    del ws, held, tiles
    torch.cuda.empty_cache()
    return out


def breakdown(name: str, n: int, k: int, m: int, ws, tiles) -> dict:
    """Where a call's time goes (graph replays, each part alone): our act_quant, the GEMM with its split-K
    reduce, the reduce alone, at the form and split count a call takes (the table's, else plan's); DeepGEMM's
    two quantization passes and its GEMM alone."""
    from deepinfer.kernels import cuda_fp8_decode as dec
    from deepinfer.kernels.cuda_fp8_gemm import splitk_reduce
    from deepinfer.kernels.triton_quant import act_quant_fp8
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ld = -(-m // 4) * 4
    entry, splits = dec.form_for(m, n, k, torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).multi_processor_count)
    a, sa_t = act_quant_fp8(x, scales_ld=ld, pdl=dec.PDL)
    r = {"name": name, "m": m, "entry": entry, "splits": splits,
         "quant_us": time_calls([lambda: act_quant_fp8(x, scales_ld=ld, pdl=dec.PDL)]) * 1e6,
         "gemm_us": time_calls([lambda w=w, s=s: dec.fp8_decode_gemm(a, sa_t, w, s, entry, splits) for w, s in ws]) * 1e6,
         "gemm_1split_us": time_calls([lambda w=w, s=s: dec.fp8_decode_gemm(a, sa_t, w, s, entry, 1) for w, s in ws]) * 1e6}
    if splits > 1:
        part = torch.randn(splits, m, n, device="cuda")
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        r["reduce_us"] = time_calls([lambda: splitk_reduce(dec.SRC, part, out, pdl=dec.PDL)]) * 1e6
    if tiles:
        from deepinfer.kernels.deepgemm import act_quant_128, fp8_gemm_nt
        q, sq = act_quant_128(x)
        r["dg_quant_us"] = time_calls([lambda: act_quant_128(x)]) * 1e6
        r["dg_gemm_us"] = time_calls([lambda p=p: fp8_gemm_nt(q, sq, *p) for p in tiles]) * 1e6
    print(f"    parts ({entry} x{splits}): act_quant {r['quant_us']:.1f} us, GEMM + reduce {r['gemm_us']:.1f}"
          f" (one split {r['gemm_1split_us']:.1f}), reduce alone {r.get('reduce_us', 0.0):.1f};"
          f" DeepGEMM quant {r.get('dg_quant_us', float('nan')):.1f}, GEMM {r.get('dg_gemm_us', float('nan')):.1f}",
          flush=True)
    return r


def write_table(rows: list[dict], device: str) -> None:
    """This GPU model's table in cuda_fp8_decode.TABLE_PATH (other models' tables kept; the file also copied to
    out_dir()) from --forms rows: each (N, K, M)'s fastest form and split count with its time beside the
    bf16-held, select.fp8_linear and DeepGEMM times of the same run."""
    import shutil

    from deepinfer.kernels.cuda_fp8_decode import PDL, TABLE_PATH
    from deepinfer.kernels.measured_table import merge_table
    out = []
    for r in rows:
        best_us, key = min((v, key) for key, v in r.items() if key.startswith("form "))
        form, split = key[5:-3].rsplit("/s", 1)
        out.append(dict(n=r["n"], k=r["k"], m=r["m"], entry=f"fp8_decode_sm90_{form}", splits=int(split),
                        decode_us=round(best_us, 2), bf16_held_us=round(r["bf16_held_us"], 2),
                        fp8_select_us=round(r["fp8_select_us"], 2), deepgemm_us=round(r.get("deepgemm_us", 0.0), 2)))
    merge_table(TABLE_PATH, {"measured": "perf/bench_fp8_decode.py --forms --write-table", "device": device,
                             "pdl": PDL, "date": datetime.date.today().isoformat(), "rows": out})
    shutil.copy(TABLE_PATH, os.path.join(out_dir(), os.path.basename(TABLE_PATH)))
    wins = sum(r["bf16_held_us"] >= 1.03 * r["decode_us"] for r in out)
    print(f"wrote {device}'s table in {TABLE_PATH}: the kernel beat the bf16-held path at {wins} of {len(out)} (N, K, M)")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ms = sorted({r["m"] for r in rows})
    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, m in enumerate(ms):
        sel = {r["name"]: r for r in rows if r["m"] == m}
        line = axes[0].plot(names, [sel[n].get("x_deepgemm", float("nan")) for n in names], "o-", label=f"M {m}")
        best = [min((v for k, v in sel[n].items() if k.startswith("form ")), default=float("nan")) for n in names]
        if any(b == b for b in best):      # --forms: the best form's speed (what a measured table picks), dashed
            axes[0].plot(names, [sel[n].get("deepgemm_us", float("nan")) / b for n, b in zip(names, best)], "s--",
                         color=line[0].get_color(), label=f"M {m}, best form")
        axes[1].plot(names, [sel[n]["decode_of_copy"] for n in names], "o-", label=f"M {m}")
    axes[0].axhline(0.9, color="gray", ls="--", lw=1)
    axes[0].set(title="CUDA FP8 decode GEMM / DeepGEMM (speed)", ylabel="x DeepGEMM")
    axes[1].set(title="share of copy bandwidth (FP8 weight bytes)", ylim=(0, 1))
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 32, 64, 128])
    p.add_argument("--forms", action="store_true", help="also every row-block form and split counts")
    p.add_argument("--all-splits", action="store_true", help="(with --forms) every split count, not four")
    p.add_argument("--narrow-tiles", action="store_true",
                   help="(with --forms) also the forms of token tiles a half and a quarter of M's, M's tokens in several tiles")
    p.add_argument("--breakdown", action="store_true", help="also time each part of a call alone (quant, GEMM, reduce)")
    p.add_argument("--only", nargs="+", default=None, help="only these linears (names of DECODE_SHAPES)")
    p.add_argument("--write-table", action="store_true", help="(with --forms) write kernels/fp8_decode_table.json")
    p.add_argument("--replot", metavar="JSON", help="only redraw the plot of a saved run (its bench_fp8_decode JSON)")
    p.add_argument("--plot-out", default=None, help="(with --replot) the PNG's path")
    a = p.parse_args()
    if a.replot:
        with open(a.replot) as f:
            plot(json.load(f)["rows"], a.plot_out or os.path.join(out_dir(), "fp8_decode_h200.png"))
        return
    if a.write_table and not a.forms:
        p.error("--write-table needs --forms")
    peaks = measure_ceilings()
    print(f"copy {peaks['copy_bw'] / 1e12:.2f} TB/s, FP8 peak {peaks['fp8_flops'] / 1e12:.0f} TFLOP/s")
    rows = []
    for name, (n, k) in DECODE_SHAPES.items():
        if a.only is None or name in a.only:
            rows += rows_for(name, n, k, a.m, peaks["copy_bw"], a.forms, a.breakdown, a.all_splits, a.narrow_tiles)
    save_json("bench_fp8_decode", {"peaks": peaks, "rows": rows})
    if a.write_table:
        write_table(rows, torch.cuda.get_device_name(0))
    plot(rows, os.path.join(out_dir(), f"fp8_decode_{gpu_model().lower()}.png"))


if __name__ == "__main__":
    main()
