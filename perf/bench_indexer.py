"""The indexer's scores at prefill shapes: the per-token kernel (every query reloads its key tile, a
32-row dot per query) against the runs kernel (kernels/triton_indexer.py `runs`: a sequence's queries
in runs sharing the key tile, head by head, causally masked key blocks skipped), over run heights and
warp counts. Keys in a shuffled pool read through a row table (the model's index_scores_pool), causal
lengths of a compressed layer (--ratio). Prints ms, the useful (unmasked) TFLOP/s against the bf16 peak
measured in the same run, and the speed-up.

    python perf/bench_indexer.py [--cases 1x8192 4x2048 16x512] [--configs 64x4 128x8 32x4] [--ratio 2]

Decode mode (--decode-batches): one query per request over its own keys, read in place through a row
table (the model's index_scores_pool), the old one-block-per-program kernel (index_scores_kernel)
against the decode form (index_scores_decode_kernel) at the host's NB and any --nb / --stages /
--warps given, timed as CUDA-graph replays side by side in one run. E is the graph's width
(--graph-entries, at least the live keys ctx // ratio); lens = the live keys, less a jitter below one
block. Prints us per call, new / old, the fraction of the copy bandwidth measured in the same run
(bytes: live keys + their row-table entries + q + w + out) and whether the two outputs are the same
bits; writes indexer_decode.json. Without CUDA and with TRITON_INTERPRET=1: the bit check only, on
the CPU (small sizes).

    python perf/bench_indexer.py --decode-batches 1 16 64 128 --ctx 8192 --graph-entries 4096 --ratio 2 \
        [--heads 64] [--head-dim 128] [--nb auto 4 8 16] [--stages 3] [--warps 4] [--packed]

--packed: also the host's form on the keys as packed FP4 rows (the cache's form under
ModelArgs.index_k_packed; bytes counted as the packed rows), same bits as the bf16 rows required.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import copies_for, measure_ceilings, save_json, time_calls, time_eager  # noqa: E402
from deepinfer.kernels.reference import fp4_pack_rows_ref, fp4_quant_ref, fp4_rows_width  # noqa: E402

IH, ID = 32, 128
FIGURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", nargs="+", default=["1x8192", "4x2048", "16x512"])
    p.add_argument("--configs", nargs="+", default=["64x4", "64x8", "128x8", "32x4"], help="run height x warps")
    p.add_argument("--ratio", type=int, default=2,
                   help="compression ratio of the scored layer (the release's index layers: 2 and 1; 4 in the first run)")
    p.add_argument("--packed", action="store_true",
                   help="decode mode: also the keys as the cache's packed FP4 rows (ModelArgs.index_k_packed)")
    p.add_argument("--decode-batches", nargs="+", type=int, default=None,
                   help="decode mode: these batch sizes (one query per request) instead of the prefill cases")
    p.add_argument("--ctx", type=int, default=8192, help="decode: tokens of context per request")
    p.add_argument("--graph-entries", type=int, default=None,
                   help="decode: E, the key entries the CUDA graph is sized for (default and minimum: ctx // ratio)")
    p.add_argument("--heads", type=int, default=64, help="decode: index heads (full-width checkpoint 64)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--nb", nargs="+", default=["auto"], help="decode: key blocks per program of the new form (auto: host's)")
    p.add_argument("--stages", nargs="+", type=int, default=None, help="decode: pipeline depths (default DECODE_STAGES)")
    p.add_argument("--warps", nargs="+", type=int, default=None, help="decode: warps (default DECODE_WARPS)")
    return p.parse_args(argv)


def main() -> None:
    a = parse_args()
    if a.decode_batches:
        decode(a)
    else:
        prefill(a)


def prefill(a: argparse.Namespace) -> None:
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


def decode_case(B: int, ctx: int, ratio: int, graph_entries: int | None, ih: int, idim: int, device, seed: int = 0):
    """A batch-B decode step's indexer inputs: one query per request, E = max(graph_entries, ctx // ratio)
    entries per request in a shuffled pool read through a row table, lens = the live ctx // ratio keys less
    a jitter below one block (not block-aligned), capped at E. -> (args, kwargs) of ti.index_scores, bytes."""
    live = ctx // ratio
    E = max(graph_entries or live, live)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, ih, idim, generator=g).bfloat16()
    w = (torch.randn(B, ih, generator=g) * 0.02).bfloat16()
    pool = fp4_quant_ref(torch.randn(B * E + 7, idim, generator=g).bfloat16(), 32)     # the keys' values: FP4
    rows = torch.randperm(B * E + 7, generator=g)[:B * E]
    lens = (live - torch.randint(0, min(128, live), (B,), generator=g)).clamp(0, E).to(torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    ks = torch.arange(B, device=device) * E
    nbytes = int(lens.sum()) * (idim * 2 + 8) + B * ih * (idim + 1) * 2 + B * E * 2
    return (to(q), to(w), to(pool), to(lens)), dict(key_start=ks, num_keys=E, rows=to(rows)), nbytes


def decode_forms(a: argparse.Namespace, ti) -> list[tuple[str, int | None, int, int]]:
    """(name, blocks_per_program, stages, warps) of the new forms to time against the old kernel."""
    forms = []
    for nb in a.nb:
        for st in a.stages or [ti.DECODE_STAGES]:
            for wp in a.warps or [ti.DECODE_WARPS]:
                forms.append((f"nb {nb} st {st} w {wp}", None if nb == "auto" else int(nb), st, wp))
    return forms


def run_form(ti, args, kw, nb, stages, warps):
    """index_scores at one decode form (the module knobs set for the call); nb 0: the old kernel."""
    saved = ti.DECODE_STAGES, ti.DECODE_WARPS
    ti.DECODE_STAGES, ti.DECODE_WARPS = stages, warps
    try:
        return ti.index_scores(*args, **kw, blocks_per_program=nb)
    finally:
        ti.DECODE_STAGES, ti.DECODE_WARPS = saved


def packed_sets(sets, args, nbytes) -> tuple[list, int]:
    """The decode sets with their pools as the cache's packed FP4 rows, and the bytes a call reads then (the
    live keys' rows at fp4_rows_width instead of bf16)."""
    d = args[2].shape[1]
    return ([((x[0], x[1], fp4_pack_rows_ref(x[2]), x[3]), kw_) for x, kw_ in sets],
            nbytes - int(args[3].sum()) * (d * 2 - fp4_rows_width(d)))


def decode(a: argparse.Namespace) -> None:
    """Old vs new decode form per batch size (module docstring)."""
    from deepinfer.kernels import triton_indexer as ti
    cuda = torch.cuda.is_available()
    if not cuda and not ti.INTERPRET:
        sys.exit("bench_indexer --decode-batches: needs CUDA to time (or TRITON_INTERPRET=1 for the CPU bit check)")
    device = "cuda" if cuda else "cpu"
    copy_bw = measure_ceilings()["copy_bw"] if cuda else None
    if cuda:
        print(f"copy bandwidth (same run) {copy_bw / 1e12:.2f} TB/s")
    else:
        print("no CUDA: the bit check of old vs new on the CPU (interpreter), no timing")
    rows_out, all_same = [], True
    for B in a.decode_batches:
        args, kw, nbytes = decode_case(B, a.ctx, a.ratio, a.graph_entries, a.heads, a.head_dim, device)
        E = kw["num_keys"]
        sets = [decode_case(B, a.ctx, a.ratio, a.graph_entries, a.heads, a.head_dim, device, seed=i)[:2]
                for i in range(copies_for(nbytes) if cuda else 1)]           # rotated: not timed from L2
        old = ti.index_scores(*args, **kw, blocks_per_program=0)
        t_old = time_calls([lambda s=s: ti.index_scores(*s[0], **s[1], blocks_per_program=0) for s in sets]) if cuda else None
        head = f"B {B:>4} E {E:>6}"
        if cuda:
            print(f"{head} {'old':<18} (NB  1) {t_old * 1e6:8.1f} us  {nbytes / t_old / copy_bw:5.2f} of copy", flush=True)
        rows_out.append(dict(batch=B, E=E, form="old", us=t_old and t_old * 1e6, bytes=nbytes,
                             of_copy=t_old and nbytes / t_old / copy_bw))
        for name, nb, st, wp in decode_forms(a, ti):
            nb_used = nb or ti.decode_blocks_per_program(B, -(-E // 128), ti._sm_count(torch.device(device)))
            new = run_form(ti, args, kw, nb, st, wp)
            same = torch.equal(new, old)
            all_same &= same
            t = time_calls([lambda s=s: run_form(ti, s[0], s[1], nb, st, wp) for s in sets]) if cuda else None
            timing = (f"{t * 1e6:8.1f} us  {nbytes / t / copy_bw:5.2f} of copy  {t / t_old:5.2f}x old" if cuda else "")
            print(f"{head} {name:<18} (NB {nb_used:>2}) {timing}  {'same bits' if same else 'BITS DIFFER'}", flush=True)
            rows_out.append(dict(batch=B, E=E, form=name, nb=nb_used, stages=st, warps=wp, us=t and t * 1e6,
                                 bytes=nbytes, of_copy=t and nbytes / t / copy_bw, new_over_old=t and t / t_old,
                                 same_bits=same))
        pk, pbytes = packed_sets(sets, args, nbytes) if a.packed else (None, None)
        if a.packed:        # the cache's packed FP4 rows (ModelArgs.index_k_packed): the host's form on them
            new = ti.index_scores(*pk[0][0], **pk[0][1])
            same = torch.equal(new, old)
            all_same &= same
            t = time_calls([lambda s=s: ti.index_scores(*s[0], **s[1]) for s in pk]) if cuda else None
            timing = (f"{t * 1e6:8.1f} us  {pbytes / t / copy_bw:5.2f} of copy  {t / t_old:5.2f}x old" if cuda else "")
            print(f"{head} {'packed keys':<18}         {timing}  {'same bits' if same else 'BITS DIFFER'}", flush=True)
            rows_out.append(dict(batch=B, E=E, form="packed", us=t and t * 1e6, bytes=pbytes,
                                 of_copy=t and pbytes / t / copy_bw, new_over_old=t and t / t_old, same_bits=same))
    path = save_json("indexer_decode.json", dict(rows=rows_out, copy_bw=copy_bw, ctx=a.ctx, ratio=a.ratio,
                                                 graph_entries=a.graph_entries, heads=a.heads, head_dim=a.head_dim,
                                                 device=torch.cuda.get_device_name() if cuda else "cpu (interpreter)"))
    print(f"wrote {path}; {'all forms the old bits' if all_same else 'SOME FORMS DIFFER FROM THE OLD BITS'}")
    if not all_same:
        sys.exit(1)


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
