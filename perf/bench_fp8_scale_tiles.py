"""The CUDA FP8 x FP8 prefill GEMM's scale-tile forms (kernels/cuda_fp8_gemm.py SCALE_TILES: each stage's
scales TMA-loaded into shared memory) against their plain twins (scales from global memory), cuBLAS bf16 on
the same shape (what the dense prefill linears run today) and the FP8 / bf16 peaks measured in the same run;
beside each, the issue ceiling perf/sass_issue_model.py reads off the SASS (measured / ceiling says how much
of the gap is issue). Every twin's output is compared with its plain form's first: the same arithmetic, so
the bits must be equal, and a fast wrong form cannot post a number unflagged.

    python3 perf/bench_fp8_scale_tiles.py [--m 8192 2048]        (~1 min on the H200)

Shapes: the release's six dense FP8 linears with 32x32-block scales, and the MoE's row-scaled expert
projections (w13 4608 x 5120, w2 5120 x 2304) as one weight with per-row scales (the grouped form's body).
Writes bench_fp8_scale_tiles.json and fp8_scale_tiles.png to $OUT.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_fp8_prefill import DENSE, weight  # noqa: E402
from benchutil import measure_ceilings, out_dir, panels_by_m, save_json, time_calls  # noqa: E402

ROW_SCALED = {"moe_w13": (4608, 5120), "moe_w2": (5120, 2304)}


def issue_ceilings() -> dict[str, float]:
    """entry -> the static issue ceiling of its K loop (fraction of the FP8 peak), where cuobjdump is found."""
    import sass_issue_model
    from deepinfer.kernels import cuda_driver
    from deepinfer.kernels.cuda_fp8_gemm import SRC, TS_TWIN
    if sass_issue_model.find_cuobjdump() is None:
        return {}
    cubin, _ = cuda_driver.compile_cubin(SRC)
    out = {}
    for plain, twin in TS_TWIN.items():
        for e in (plain, twin):
            r = sass_issue_model.loop_mix(cubin, e)
            if r["found"]:
                out[e] = r["ceiling"]
    return out


def rows_for(ms, peaks: dict, ceilings: dict) -> tuple[list[dict], list]:
    """(a row per shape and M: twin / plain / three consumers / bf16, the shapes where the wave rule takes the
    wide tile with their operands, for wide_rows)."""
    from deepinfer.kernels.cuda_fp8_gemm import TS_TWIN, form, fp8_gemm_cuda, num_sms
    from deepinfer.kernels.triton_fp8_prefill import as_f32_scale
    from deepinfer.kernels.triton_quant import act_quant_fp8
    sms = num_sms(torch.device("cuda"))
    rows, wide = [], []
    shapes = [(name, n, k, "block") for name, (n, k) in DENSE.items()] + \
             [(name, n, k, "row") for name, (n, k) in ROW_SCALED.items()]
    for name, n, k, kind in shapes:
        w, s = weight(n, k)
        s = as_f32_scale(s) if kind == "block" else torch.exp2(torch.randint(-9, -5, (n, 1), device="cuda").float())
        wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a, sa = act_quant_fp8(x)
            plain = form(m, kind, False, n, None, k, scale_tiles=False)     # BN 128 (the wide tile: last)
            twin = TS_TWIN[plain]
            same = torch.equal(fp8_gemm_cuda(a, sa, w, s, entry=plain), fp8_gemm_cuda(a, sa, w, s, entry=twin))
            flops = 2.0 * m * n * k
            r = {"name": name, "m": m, "n": n, "k": k, "kind": kind, "plain": plain, "twin": twin, "bits_equal": same}
            r["plain_us"] = time_calls([lambda: fp8_gemm_cuda(a, sa, w, s, entry=plain)]) * 1e6
            r["twin_us"] = time_calls([lambda: fp8_gemm_cuda(a, sa, w, s, entry=twin)]) * 1e6
            r["bf16_us"] = time_calls([lambda: x @ wb.T]) * 1e6
            for key in ("plain", "twin", "bf16"):
                r[f"{key}_tflops"] = flops / r[f"{key}_us"] / 1e6
                r[f"{key}_of_fp8_peak"] = r[f"{key}_tflops"] * 1e12 / peaks["fp8_flops"]
            r["twin_vs_plain"] = r["plain_us"] / r["twin_us"]
            r["twin_vs_bf16"] = r["bf16_us"] / r["twin_us"]
            three = "fp8_gemm_sm90_bm192_row_ts" if kind == "row" else "fp8_gemm_sm90_bm192_ts"
            if m >= 192:           # three consumer warpgroups, one temporary each: more warps to hide latency
                y3 = fp8_gemm_cuda(a, sa, w, s, entry=three)
                r["three_bits_equal"] = torch.equal(y3, fp8_gemm_cuda(a, sa, w, s, entry=twin))
                r["three_us"] = time_calls([lambda: fp8_gemm_cuda(a, sa, w, s, entry=three)]) * 1e6
                r["three_tflops"] = flops / r["three_us"] / 1e6
                r["three_of_fp8_peak"] = r["three_tflops"] * 1e12 / peaks["fp8_flops"]
            for key, e in (("plain", plain), ("twin", twin)):
                if e in ceilings:
                    r[f"{key}_ceiling"] = ceilings[e]
                    r[f"{key}_of_ceiling"] = r[f"{key}_of_fp8_peak"] / ceilings[e]
            if kind == "block" and form(m, kind, False, n, sms, k, scale_tiles=False) == "fp8_gemm_sm90_bn192":
                wide.append((r, a, sa, w, s, flops))     # timed after every other row: a fault there loses nothing
            print(f"{name:11s} m {m:5d} {kind:5s}: twin {r['twin_tflops']:6.0f} TF ({r['twin_of_fp8_peak']:.2f} of FP8 peak, "
                  f"ceiling {r.get('twin_ceiling', float('nan')):.2f}) | plain {r['plain_tflops']:6.0f} "
                  f"({r['plain_of_fp8_peak']:.2f}, ceiling {r.get('plain_ceiling', float('nan')):.2f}) | bf16 "
                  f"{r['bf16_tflops']:6.0f} | twin {r['twin_vs_plain']:.2f}x plain, {r['twin_vs_bf16']:.2f}x bf16 | "
                  f"3 consumers {r.get('three_tflops', float('nan')):6.0f}"
                  f"{'' if r.get('three_bits_equal', True) else ' (BITS DIFFER)'}"
                  f"{'' if same else '  BITS DIFFER: not a valid twin'}", flush=True)
            rows.append(r)
            del x
        del wb
    return rows, wide


def wide_rows(wide: list) -> None:
    """The 128 x 192 tile's two forms where the wave rule takes it (run after everything else is saved)."""
    from deepinfer.kernels.cuda_fp8_gemm import fp8_gemm_cuda
    for r, a, sa, w, s, flops in wide:
        y = fp8_gemm_cuda(a, sa, w, s, entry="fp8_gemm_sm90_bn192")
        r["wide_bits_equal"] = torch.equal(y, fp8_gemm_cuda(a, sa, w, s, entry="fp8_gemm_sm90_bn192_ts"))
        for key, e in (("wide_plain", "fp8_gemm_sm90_bn192"), ("wide_twin", "fp8_gemm_sm90_bn192_ts")):
            r[f"{key}_us"] = time_calls([lambda: fp8_gemm_cuda(a, sa, w, s, entry=e)]) * 1e6
            r[f"{key}_tflops"] = flops / r[f"{key}_us"] / 1e6
        print(f"{r['name']:11s} m {r['m']:5d} wide tile (BN 192): twin {r['wide_twin_tflops']:6.0f} TF, plain "
              f"{r['wide_plain_tflops']:6.0f}{'' if r['wide_bits_equal'] else '  BITS DIFFER'}", flush=True)


def plot(rows: list[dict], peaks: dict, path: str) -> None:
    _, fig, panels = panels_by_m(rows, 7, 4.5)
    for ax, m, sub in panels:
        xs = range(len(sub))
        for i, (key, label) in enumerate((("plain", "plain (scales from global)"), ("twin", "scale tiles (TMA)"),
                                          ("bf16", "cuBLAS bf16"))):
            ax.bar([x + 0.27 * (i - 1) for x in xs], [r[f"{key}_of_fp8_peak"] for r in sub], 0.27, label=label)
        ax.scatter(list(xs), [r.get("twin_ceiling", float("nan")) for r in sub], marker="_", s=300, color="k",
                   label="scale tiles: issue ceiling (SASS)")
        ax.axhline(peaks["bf16_flops"] / peaks["fp8_flops"], color="gray", ls="--", lw=1, label="bf16 peak")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["name"] for r in sub], rotation=30, ha="right")
        ax.set_ylabel("fraction of the FP8 peak measured in the run")
        ax.set_title(f"exact FP8 x FP8 GEMM, M = {m}")
        ax.set_ylim(0, 1)
    panels[0][0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[8192, 2048])
    args = ap.parse_args()
    peaks = measure_ceilings()
    print(f"peaks: FP8 {peaks['fp8_flops'] / 1e12:.0f} TFLOP/s, bf16 {peaks['bf16_flops'] / 1e12:.0f}", flush=True)
    ceilings = issue_ceilings()
    rows, wide = rows_for(args.m, peaks, ceilings)

    def save():
        save_json("bench_fp8_scale_tiles.json", {"peaks": peaks, "ceilings": ceilings, "rows": rows,
                                                 "device": torch.cuda.get_device_name()})
    save()
    plot(rows, peaks, os.path.join(out_dir(), "fp8_scale_tiles.png"))
    bad = [r for r in rows if not r["bits_equal"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} twins bit-equal to their plain forms; twin / plain speed: "
          + ", ".join(f"{r['name']}@{r['m']} {r['twin_vs_plain']:.2f}" for r in rows), flush=True)
    wide_rows(wide)
    save()


if __name__ == "__main__":
    main()
