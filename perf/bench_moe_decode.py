"""The masked MoE GEMMs of a decode step: the exact FP8 x FP8 CUDA form (cuda_fp8_decode.fp8_masked_moe_gemm:
weight rows on the wgmma's M side, an expert's tokens on N, one scale a row in the epilogue) against today's
W8A16 form (triton_gemm.w8a16_grouped_gemm_masked on the same row-scaled stacks), on one GPU's EP8 share: 48
experts, w13 [4608, 5120] and w2 [5120, 2304], T tokens each routed to 6 distinct random experts (so the
experts' counts vary as in a step). Prints us per call, the weight bytes read per second against the copy
bandwidth measured in the same run, FP8 x W8A16 speed, and that the forms agree.

    python perf/bench_moe_decode.py [--tokens 16 64 128 256] [--forms all [--write-table]]   (moe_decode.json / .png in $OUT)

--write-table (with --forms all): kernels/moe_masked_table.json, which cuda_fp8_decode.masked_form reads on the GPU
model it names: per stack shape and expected tokens an expert, the fastest masked form of the run (the file, with
other GPU models' tables kept, is also copied to $OUT).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_fp4_experts import PROJ, expert_stacks  # noqa: E402
from benchutil import measure_ceilings, out_dir, plot_per_proj, save_json, time_calls  # noqa: E402

TOPK = 6


def routed_counts(T: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """Tokens an expert gets when T tokens each pick TOPK distinct experts uniformly at random."""
    picks = torch.stack([torch.randperm(E, generator=gen)[:TOPK] for _ in range(T)])
    return torch.bincount(picks.flatten(), minlength=E).to(torch.int32)


def step_inputs(T: int, e: int, k: int, gen: torch.Generator):
    """One decode step's slabs over e experts: (counts [e] int32 on the GPU, the expected tokens an expert, the
    FP8 slab q [e, T, k] with its transposed per-32 scales s, the same values in bf16 xf [e, T, k])."""
    from deepinfer.kernels.triton_quant import act_quant_fp8
    counts = routed_counts(T, e, gen).cuda()
    expected = -(-T * TOPK // e)
    x = torch.randn(e, T, k, device="cuda").bfloat16()
    q, s = act_quant_fp8(x.view(e * T, k), scales_ld=-(-e * T // 4) * 4)
    q = q.view(e, T, k)
    xf = (q.float().view(e * T, k) * s[:, :e * T].T.repeat_interleave(32, 1)).bfloat16().view(e, T, k)
    return counts, expected, q, s, xf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 128, 256])
    p.add_argument("--experts", type=int, default=48)
    p.add_argument("--forms", default="plan", choices=["plan", "all"], help="all: every masked CUDA form too")
    p.add_argument("--write-table", action="store_true", help="(with --forms all) write kernels/moe_masked_table.json")
    a = p.parse_args()
    if a.write_table and a.forms != "all":
        p.error("--write-table needs --forms all")
    from deepinfer.kernels import cuda_fp8_decode as cfd
    from deepinfer.kernels import triton_gemm as tg

    ceil = measure_ceilings()
    bw = ceil["copy_bw"]
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'proj':>4} {'T':>4} {'max m':>5} {'w8a16 us':>9} {'fp8 us':>8} {'fp8 x':>6} {'w8a16 of copy':>13} "
          f"{'fp8 of copy':>11} {'rel diff':>9}  form", flush=True)
    for name, (n, k) in PROJ.items():
        _, _, wr = expert_stacks(a.experts, n, k, seed=n + k)
        w8, r = wr
        r = r.float().contiguous()
        e = a.experts
        for T in a.tokens:
            counts, expected, q, s, xf = step_inputs(T, e, k, gen)
            forms = {"w8a16": lambda: tg.w8a16_grouped_gemm_masked(xf, w8, r, counts, expected),
                     "fp8": lambda: cfd.fp8_masked_moe_gemm(q, s, w8, r, counts, expected)}
            if a.forms == "all":
                for f in cfd.MOE_FORMS:
                    forms[f] = lambda f=f: cfd.fp8_masked_moe_gemm(q, s, w8, r, counts, expected, entry=f)
            outs = {f: fn() for f, fn in forms.items()}
            valid = torch.arange(T, device="cuda")[None, :] < counts[:, None]
            ref = outs["w8a16"].float()[valid]
            diff = max(((o.float()[valid] - ref).norm() / ref.norm()).item() for o in outs.values())
            t = {f: time_calls([fn], iters=20) for f, fn in forms.items()}
            nb = e * n * k * 1.0                                        # the e4m3 stack (row scales: 4 B a row)
            row = dict(proj=name, n=n, k=k, T=T, expected_m=expected, max_m=int(counts.max()),
                       us={f: v * 1e6 for f, v in t.items()},
                       fp8_speedup=t["w8a16"] / t["fp8"], w8a16_of_copy=nb / t["w8a16"] / bw,
                       fp8_of_copy=nb / t["fp8"] / bw, rel_diff=diff, plan=cfd.masked_plan(expected),
                       default=cfd.masked_form(expected, n, k, torch.cuda.get_device_name(0)))
            rows.append(row)
            print(f"{name:>4} {T:>4} {row['max_m']:>5} {t['w8a16'] * 1e6:>9.1f} {t['fp8'] * 1e6:>8.1f} "
                  f"{row['fp8_speedup']:>6.2f} {row['w8a16_of_copy']:>13.2f} {row['fp8_of_copy']:>11.2f} "
                  f"{diff:>9.1e}  {row['default']}", flush=True)
            if a.forms == "all":
                print("      " + ", ".join(f"{f.replace('fp8_moe_sm90_', '')} {t[f] * 1e6:.1f}" for f in cfd.MOE_FORMS),
                      flush=True)
            assert diff < 1e-2, "the forms disagree"
    save_json("moe_decode.json", dict(ceilings=ceil, experts=a.experts, rows=rows))
    plot(rows, os.path.join(out_dir(), "moe_decode.png"))
    if a.write_table:
        write_table(rows, torch.cuda.get_device_name(0))


def table_rows(rows: list[dict], forms) -> list[dict]:
    """The masked table's rows from --forms all rows: per (N, K, expected tokens an expert) the fastest of `forms`
    (the masked entries), with its time beside masked_plan's rule's form and W8A16 of the same run (one row a point: a
    later T of the same expected m replaces an earlier one)."""
    out = {}
    for r in rows:
        best_us, entry = min((r["us"][f], f) for f in forms)
        out[(r["n"], r["k"], r["expected_m"])] = dict(
            n=r["n"], k=r["k"], m=r["expected_m"], tokens=r["T"], entry=entry, us=round(best_us, 2),
            plan=r["plan"], plan_us=round(r["us"][r["plan"]], 2), w8a16_us=round(r["us"]["w8a16"], 2))
    return list(out.values())


def write_table(rows: list[dict], device: str) -> None:
    """This GPU model's table in cuda_fp8_decode.MOE_TABLE_PATH (other models' tables kept; also copied to $OUT)."""
    import datetime
    import shutil

    from deepinfer.kernels import cuda_fp8_decode as cfd
    from deepinfer.kernels.measured_table import merge_table
    out = table_rows(rows, cfd.MOE_FORMS)
    merge_table(cfd.MOE_TABLE_PATH, {"measured": "perf/bench_moe_decode.py --forms all --write-table",
                                     "device": device, "date": datetime.date.today().isoformat(), "rows": out})
    shutil.copy(cfd.MOE_TABLE_PATH, os.path.join(out_dir(), os.path.basename(cfd.MOE_TABLE_PATH)))
    moved = [r for r in out if r["entry"] != r["plan"]]
    print(f"wrote {device}'s masked table in {cfd.MOE_TABLE_PATH}: the best form differs from masked_plan's rule at "
          f"{len(moved)} of {len(out)} points" + "".join(
              f"\n    {r['n']}x{r['k']} m {r['m']}: {r['entry']} {r['us']} us, plan {r['plan']} {r['plan_us']} us"
              for r in moved), flush=True)


def plot(rows, path: str) -> None:
    plot_per_proj(rows, PROJ, "T", [("W8A16 (today)", "s--", lambda r: r["w8a16_of_copy"]),
                                    ("FP8 x FP8, CUDA masked", "o-", lambda r: r["fp8_of_copy"])],
                  "tokens in the step (6 experts each of 48)", "weight bytes / time / copy bandwidth", path)


if __name__ == "__main__":
    main()
