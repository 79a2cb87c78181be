"""The indexer's scores at prefill shapes: the per-token kernel (every query reloads its key tile, a
32-row dot per query) against the runs kernel (kernels/triton_indexer.py `runs`: a sequence's queries
in runs sharing the key tile, head by head, causally masked key blocks skipped), over run heights and
warp counts. Keys in a shuffled pool read through a row table (the model's index_scores_pool), causal
lengths of a compressed layer (--ratio). Prints ms, the useful (unmasked) TFLOP/s against the bf16 peak
measured in the same run, and the speed-up.

    python perf/bench_indexer.py [--cases 1x8192 4x2048 16x512] [--configs 64x4 128x8 32x4] [--ratio 2]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import measure_ceilings, save_json, time_eager  # noqa: E402

IH, ID = 32, 128
FIGURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", nargs="+", default=["1x8192", "4x2048", "16x512"])
    p.add_argument("--configs", nargs="+", default=["64x4", "64x8", "128x8", "32x4"], help="run height x warps")
    p.add_argument("--ratio", type=int, default=2,
                   help="compression ratio of the scored layer (the release's index layers: 2 and 1; 4 in the first run)")
    a = p.parse_args()
    from deepinfer.kernels import triton_indexer as ti
    peak = measure_ceilings()["bf16_flops"]
    print(f"bf16 peak (same run) {peak / 1e12:.0f} TFLOP/s")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for case in a.cases:
        B, S = (int(v) for v in case.split("x"))
        T, E = B * S, S // a.ratio
        cu = np.arange(B + 1, dtype=np.int64) * S
        q = torch.randn(T, IH, ID, device="cuda", generator=g).bfloat16()
        w = (torch.randn(T, IH, device="cuda", generator=g) * 0.02).bfloat16()
        pool = torch.randn(B * E + 7, ID, device="cuda", generator=g).bfloat16()
        rows = torch.randperm(B * E + 7, device="cuda", generator=g)[:B * E]
        pos = torch.arange(T, device="cuda") % S
        lens = ((pos + 1) // a.ratio).to(torch.int32)
        ks = torch.arange(T, device="cuda") // S * E
        useful = 2 * IH * ID * float(lens.sum())
        args = (q, w, pool, lens)
        kw = dict(key_start=ks, num_keys=E, rows=rows)
        base = ti.index_scores(*args, **kw)
        t_tok = time_eager(lambda: ti.index_scores(*args, **kw), iters=10)
        print(f"{case:>7} per-token {t_tok * 1e3:8.3f} ms {useful / t_tok / 1e12:6.0f} TF/s "
              f"{useful / t_tok / peak:5.2f} of bf16", flush=True)
        rows_out.append(dict(case=case, form="per-token", ms=t_tok * 1e3, of_bf16=useful / t_tok / peak))
        for cfg in a.configs:
            bt, warps = (int(v) for v in cfg.split("x"))
            ti.RUN_BT, ti.RUN_WARPS = bt, warps
            runs = tuple(torch.from_numpy(x).cuda() for x in ti.query_runs(cu, bt=bt))
            try:
                out = ti.index_scores(*args, **kw, runs=runs)
                t = time_eager(lambda: ti.index_scores(*args, **kw, runs=runs), iters=10)
            except Exception as e:  # noqa: BLE001 (a config past the resources: say so, go on)
                print(f"{case:>7} runs {cfg:>6} FAILED {type(e).__name__}: {str(e)[:100]}")
                continue
            fin = torch.isfinite(base)
            same_mask = torch.equal(torch.isfinite(out), fin)
            err = ((out.float() - base.float())[fin].norm() / base.float()[fin].norm()).item()
            print(f"{case:>7} runs {cfg:>6} {t * 1e3:8.3f} ms {useful / t / 1e12:6.0f} TF/s {useful / t / peak:5.2f} of bf16"
                  f"  {t_tok / t:5.2f}x per-token  (rel. diff {err:.1e}{'' if same_mask else ', MASK DIFFERS'})", flush=True)
            rows_out.append(dict(case=case, form=f"runs {cfg}", ms=t * 1e3, of_bf16=useful / t / peak,
                                 speedup=t_tok / t))
    save_json("indexer.json", dict(rows=rows_out, peak_bf16=peak, ratio=a.ratio))
    plot(rows_out, os.path.join(FIGURES, f"indexer_runs_ratio{a.ratio}_h200.png"), a.ratio)


def plot(rows: list[dict], path: str, ratio: int) -> None:
    """ms per case and form, grouped bars (the per-token kernel first)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = list(dict.fromkeys(r["case"] for r in rows))
    forms = list(dict.fromkeys(r["form"] for r in rows))
    w = 0.8 / len(forms)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for i, form in enumerate(forms):
        ms = [next((r["ms"] for r in rows if r["case"] == c and r["form"] == form), 0.0) for c in cases]
        ax.bar([j + w * i for j in range(len(cases))], ms, w, label=form)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(cases))], cases)
    ax.set_ylabel("ms per call")
    ax.set_title(f"H200 indexer scores at prefill (32 heads x 128, ratio {ratio}): per-token vs runs (height x warps)",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
