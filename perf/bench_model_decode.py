"""The model's own decode step on the GPU: Transformer.forward on the `full-width-ep8` checkpoint
(real widths, one layer per role, 48 local experts = one GPU's EP8 share) at batch 1/16/64/128 with
every sequence at position --ctx, eager against the CUDA graph the engine replays (worker/graph_step.py
builds the same static step), as achieved HBM bandwidth over the copy bandwidth measured in the
same run, and the EP8 whole-model estimate built from it.

    python perf/bench_model_decode.py [--checkpoint DIR | --preset full-width-ep8 [--load-format dummy]] [--batches 1 16 64 128]
                                      [--ctx 8192]                    (model_decode.json/.png in $OUT)
                                      [--profile 64]   GPU kernel time of one step by kernel (torch.profiler)
                                      [--profile-graph 64 128]   the replayed graph: idle time, exposed kernels

Unlike perf/bench_layer_step.py (the same shapes composed from the kernels by hand), this runs the
code the engine runs: loader formats (FP8 linears, FP4 experts as FP8 stacks), the masked MoE, the
static decode metadata, whatever kernels/select.py binds (DEEPINFER_KERNELS=fast for the Triton
paths). Caches hold zeros: timing does not depend on their values; every sequence attends to its
full window and index_topk compressed picks, and the indexers score every entry below --ctx.

Bytes counted per step (the floor a perfect kernel set would move): every weight of every layer
(routed experts: those the step's picks name, counted from the gates in an eager run of the same step; the
"uniform" column counts E * (1 - (1 - k/E)^B) of them, uniform routing, which random weights do not give;
Engram tables: the rows looked up), the
head and the batch's embedding rows, and per sequence and layer the window rows, the compressed
picks and the index keys the indexers scan. The EP8 estimate scales the per-layer mean to the real
40 layers (2 window-only, 18 ratio-2, 20 ratio-1; our 7 have 2/2/3) and adds the head: all-to-all
dispatch/combine, DSpark drafting and Engram lookups are not in it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import (dummy_model, measure_ceilings, mhc_variants, out_dir,  # noqa: E402
                       routed_experts, save_json, time_eager, use_mhc_variant, use_skinny_table)
from deepinfer.model.balanced_routing import install as balance_routing  # noqa: E402
from graph_profile import capture  # noqa: E402

FULL_LAYERS = 40


def build_checkpoint(preset: str) -> str:
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"deepinfer-{preset}")
    if not os.path.isfile(os.path.join(out, "model.safetensors.index.json")):
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "deepinfer.cli.make_checkpoint", "--preset", preset, "--out", out],
                       check=True)
        print(f"built {preset} in {time.time() - t0:.0f} s", flush=True)
    return out


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o) for o in obj)
    return 0


def module_bytes(mod, skip=()) -> int:
    """Buffers plus the FP8 (weight, scale) pairs Linear keeps outside its buffers. A quantized Linear
    held dequantized (--dense-weights bf16) counts its release bytes (1 per element + its scales), so
    the ratio to copy bandwidth stays the same yardstick as the FP8 form's: time, not bytes, moves.
    wo_a's FP8 blocks count too (before 2026-12-03 they were left out: ~235 MB of a full-width-ep8 step,
    so earlier ratios understate the bytes a step reads)."""
    from deepinfer.model.layers import Linear
    total = 0
    for name, m in mod.named_modules():
        if any(name.startswith(s) for s in skip):
            continue
        # wo_a is FP8 in the release and may run dense
        release_fp8 = isinstance(m, Linear) and (m.quantized or name.endswith("wo_a"))
        if release_fp8 and m.fp8 is None and m.packed is None and m.weight.numel() \
                and m.weight.element_size() > 1:
            total += m.weight.numel() + m.weight.numel() // 1024
            total += sum(tensor_bytes(b) for n, b in m.named_buffers(recurse=False) if n != "weight")
            continue
        total += sum(tensor_bytes(b) for b in m.buffers(recurse=False))
        if isinstance(m, Linear):
            total += tensor_bytes(m.fp8) + tensor_bytes(m.packed) + tensor_bytes(m.fp8_blocks)
    return total


def step_bytes(model, B: int, ctx: int, used: dict[int, int] | None = None) -> dict:
    """What one decode step of B sequences at position ctx has to read, by part; the routed experts under
    uniform routing, or (used: routed_experts') the experts the step's picks name."""
    a = model.args
    parts = {"attention+shared": 0, "experts": 0, "kv": 0, "head": 0}
    kv_row = a.head_dim * 2                                      # bf16 latent rows
    for layer in model.layers:
        moe = layer.ffn
        stacks = getattr(moe, "stacks", None)
        routed = tensor_bytes([stacks.w13, stacks.s13, stacks.w2, stacks.s2]) if stacks is not None else \
            module_bytes(moe.experts)
        E, k = moe.n_experts, moe.gate.topk
        seen = used.get(layer.layer_id) if used is not None else None
        parts["experts"] += routed * (seen / E if seen is not None else 1 - (1 - k / E) ** B)
        parts["attention+shared"] += module_bytes(layer, skip=("ffn.experts", "engram.embed"))
        if layer.engram is not None:   # the table rows looked up, not the table
            t = layer.engram.embed
            row = t.weight.shape[1] + t.scale.shape[1]
            parts["attention+shared"] += B * a.n_hash_cols * row
        ratio = a.compress_ratios[layer.layer_id]
        per_seq = a.window_size * kv_row
        if ratio:
            per_seq += min(a.index_topk, ctx // ratio) * kv_row
            if layer.attn.indexer is not None:
                per_seq += (ctx // ratio) * a.index_head_dim * 2
        parts["kv"] += B * per_seq
    parts["head"] = tensor_bytes(model.head.fp8) + tensor_bytes(model.head.weight) + B * a.dim * 2
    parts["total"] = sum(parts.values())
    return parts


def decode_step(model, caches, B: int, ctx: int, max_len: int, block_tokens: int, device="cuda", full: bool = False):
    """Static padded decode buffers of B sequences at position ctx and the step function on them (its logits, or
    full: the whole ModelOutput)."""
    from deepinfer.model.step_metadata import DecodeStepBuffers
    a = model.args
    bps = -(-max_len // block_tokens)
    bufs = DecodeStepBuffers(B, window=a.window_size, ring_len=caches.ring_len, max_model_len=max_len,
                             block_tokens=block_tokens, max_blocks=bps,
                             ngram_width=max(a.engram_max_ngram_size - 1, 0),
                             ratios=[r for r in a.compress_ratios[:a.n_layers] if r > 0],
                             scratch_slot=caches.scratch_slot, scratch_block=caches.scratch_block, device=device)
    rng = np.random.default_rng(B)
    host = np.zeros(bufs.numel, dtype=np.int64)
    bufs.fill(host, positions=np.full(B, ctx), input_ids=rng.integers(1000, 100000, B),
              ngram_history=rng.integers(1000, 100000, (B, max(a.engram_max_ngram_size - 1, 0))),
              ring_slots=np.arange(B), block_tables=np.arange(B * bps).reshape(B, bps))
    bufs.flat.copy_(torch.from_numpy(host))
    max_pos = max_len + 63

    def step():
        out = model(bufs.forward_batch(), caches, meta=bufs.metadata(max_pos))
        return out if full else out.logits
    return step


def time_graph(fn, iters: int = 20, reps: int = 5) -> float:
    """Median seconds of one replay of fn captured as a CUDA graph (warmed up eagerly first)."""
    g = capture(fn)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            g.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / iters)
    del g
    return float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint")
    p.add_argument("--preset", default="full-width-ep8")
    p.add_argument("--expert-format", default="fp8", choices=["fp8", "fp4"],
                   help="the routed experts' stacks: FP8 (2x the release's bytes) or the release's MXFP4 (W4A16)")
    p.add_argument("--dense-weights", default="auto", choices=["auto", "fp8", "bf16", "bf16+fp8"],
                    help="EngineArgs.dense_weights; auto (the engine's default): bf16 where it fits, with FP8 decode "
                         "copies of the linears this GPU's decode table says pay")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--routing", default="balanced", choices=["balanced", "model"],
                   help="balanced (the step the decode goals mean): every expert in use once before any twice "
                        "(model/balanced_routing.py), the load a trained, load-balanced router approaches; model: the gates' "
                        "own picks (random weights send a step to a third of the experts)")
    p.add_argument("--profile", type=int, default=0, help="also profile one eager step at this batch size")
    p.add_argument("--profile-top", type=int, default=45, help="kernels and torch ops the profile lists")
    p.add_argument("--profile-graph", type=int, nargs="*", default=[],
                   help="also profile the CUDA graph's replays at these batch sizes: span, busy and idle time, kernels "
                        "with their exposed time (perf/graph_profile.py)")
    p.add_argument("--mhc-variants", nargs="+", default=["{}"],
                   help="hc_mixes_pre launch constants below 1,024 tokens (JSON, merged over triton_mhc.DECODE_VARIANT) "
                        "compared in one run, e.g. '{}' '{\"bt\": 16}' (perf/bench_mhc_variants.py's best)")
    p.add_argument("--skinny-tables", nargs="+", default=None,
                   help="select.py's skinny-GEMM tables to compare in one run ('' = cuBLAS for every dense bf16 "
                        "linear; 'default' = kernels/skinny_bf16_table.json)")
    p.add_argument("--moe-paths", nargs="+", default=["default"], choices=["default", "w8a16", "fp8", "fp8-padded"],
                   help="the masked MoE's GEMMs compared in one run: W8A16 or the CUDA FP8 x FP8 masked form "
                        "(select.MOE_FP8_DECODE; default: as configured); fp8-padded: batches not a multiple of 4 "
                        "padded onto the FP8 form too (moe.PAD_MASKED_SLABS)")
    p.add_argument("--index-k", nargs="+", default=["packed"], choices=["bf16", "packed"],
                   help="the cache's index keys compared in one run: bf16 rows or packed FP4 rows "
                        "(ModelArgs.index_k_packed; packed is the engine's default)")
    p.add_argument("--side-streams", nargs="+", default=["on"], choices=["on", "off"],
                   help="the step's independent branches on a second stream (model/side_stream.py) or inline, "
                        "compared in one run")
    p.add_argument("--triton-pdl", nargs="+", default=["on"], choices=["on", "off"],
                   help="the step's Triton kernels launched programmatically (kernels/pdl.py) or plainly, compared in "
                        "one run")
    p.add_argument("--knobs", nargs="+", default=["none"],
                   help="module attributes set for a variant, compared in one run: 'none' or "
                        "'module:ATTR=value[;module:ATTR=value]' (value a Python literal), e.g. "
                        "deepinfer.kernels.select:GROUPED_FP8_MAX_ROWS=0")
    p.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"],
                   help="dummy: random weights made on the device from the preset's config (no checkpoint)")
    a = p.parse_args()

    from deepinfer.cache.model_caches import ModelCaches
    from deepinfer.kernels.select import capability_report
    from deepinfer.kernels import pdl
    from deepinfer.model import side_stream
    from deepinfer.model.loader import load_model

    t0 = time.time()
    if a.load_format == "dummy":
        ckpt = f"{a.preset} (dummy weights)"
        model = dummy_model(a.preset, dense_weights=a.dense_weights, expert_format=a.expert_format)
    else:
        ckpt = a.checkpoint or build_checkpoint(a.preset)
        model = load_model(ckpt, "cuda")
    print(f"loaded {ckpt} in {time.time() - t0:.0f} s; kernels: {capability_report()}", flush=True)
    copied = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                     if getattr(m, "fp8_decode", None) is not None})
    print(f"dense weights {a.dense_weights}: FP8 decode copies of {', '.join(copied) or 'none'}", flush=True)
    stacks = [m.stacks for m in model.modules() if getattr(m, "stacks", None) is not None]
    print(f"expert stacks with one scale per row: w13 {sum(st.r13 is not None for st in stacks)}, "
          f"w2 {sum(st.r2 is not None for st in stacks)} of {len(stacks)}", flush=True)
    if a.routing == "balanced":
        balance_routing(model)
    ceil = measure_ceilings()
    copy_bw = ceil["copy_bw"]
    block_tokens, max_len = 64, a.ctx + 64
    bmax = max(a.batches)
    def allocate(index_k: str):
        args = dataclasses.replace(model.args, index_k_packed=index_k == "packed")
        return ModelCaches.allocate(args, bmax, bmax * -(-max_len // block_tokens), block_tokens, "cuda",
                                    scratch=True)

    caches_of = {k: allocate(k) for k in a.index_k}
    caches = caches_of[a.index_k[0]]
    # the head alone (bf16 or FP8 [V, dim]): subtracted to get the per-layer time
    rows = []
    print(f"{'batch':>5} {'eager ms':>9} {'graph ms':>9} {'graph x':>8} {'MB':>8} {'of copy':>8} {'uniform':>8} "
          f"{'experts':>8} {'head ms':>8} {'layer us':>9} {'EP8 tok/s/GPU':>14}", flush=True)
    from deepinfer.kernels import triton_mhc
    mhc = mhc_variants(a.mhc_variants)
    tables = [None if t == "default" else t for t in (a.skinny_tables or ["default"])]
    moes = a.moe_paths
    runs = [(B, mi, ti, oi, ki, ss, pd, kn) for B in a.batches for mi in range(len(mhc))
            for ti in range(len(tables)) for oi in range(len(moes)) for ki in a.index_k for ss in a.side_streams
            for pd in a.triton_pdl for kn in a.knobs]
    for B, mi, ti, oi, ki, ss, pd, kn in runs:
        caches = caches_of[ki]
        side_stream.ENABLED, pdl.ENABLED = ss == "on", pd == "on"
        set_knobs(kn)
        with torch.inference_mode(), use_mhc_variant(triton_mhc.DECODE_VARIANT, mhc[mi]), \
                use_skinny_table(tables[ti]), use_moe_path(moes[oi]):
            step = decode_step(model, caches, B, a.ctx, max_len, block_tokens)
            used = routed_experts(model, step)
            eager = time_eager(step, iters=5)
            graph = time_graph(step)
            x = torch.randn(B, model.args.dim, device="cuda").bfloat16()
            head = time_graph(lambda: model.head(x))
        nb = step_bytes(model, B, a.ctx, used)                  # what this step reads, as routed
        uniform = step_bytes(model, B, a.ctx)
        frac = nb["total"] / graph / copy_bw
        layer = (graph - head) / model.args.n_layers
        ep8_step = FULL_LAYERS * layer + head
        row = dict(batch=B, mhc_variant=mhc[mi], skinny_table=tables[ti], moe_path=moes[oi], index_k=ki, side_streams=ss,
                   triton_pdl=pd, knobs=kn,
                   eager_ms=eager * 1e3,
                   graph_ms=graph * 1e3,
                   graph_speedup=eager / graph,
                   bytes=nb, of_copy=frac, bytes_uniform=uniform, of_copy_uniform=uniform["total"] / graph / copy_bw,
                   experts_used=used, head_ms=head * 1e3, layer_us=layer * 1e6,
                   ep8_tok_s_per_gpu=B / ep8_step)
        rows.append(row)
        if frac > 1.02:     # no step reads faster than a copy moves: the byte count is wrong, not the kernels fast
            print(f"WARNING: batch {B} counts {frac:.2f} of copy: more bytes counted than the step reads", flush=True)
        tag = ('' if len(mhc) == 1 else f' m{mi}') + ('' if len(tables) == 1 else f' t{ti}') + \
            ('' if len(moes) == 1 else f' {moes[oi]}') + ('' if len(a.index_k) == 1 else f' {ki}') + \
            ('' if len(a.side_streams) == 1 else f' side {ss}') + ('' if len(a.triton_pdl) == 1 else f' pdl {pd}') + \
            ('' if len(a.knobs) == 1 else f' [{kn}]')
        print(f"{B:>5}{tag} {eager * 1e3:>9.2f} {graph * 1e3:>9.2f} {eager / graph:>8.2f} {nb['total'] / 1e6:>8.0f} "
              f"{frac:>8.3f} {row['of_copy_uniform']:>8.3f} {sum(used.values()) / max(len(used), 1):>8.1f} "
              f"{head * 1e3:>8.2f} {layer * 1e6:>9.0f} {B / ep8_step:>14.0f}", flush=True)
    save_json("model_decode.json", dict(checkpoint=ckpt, ctx=a.ctx, ceilings=ceil, rows=rows))
    if len(tables) > 1:
        print("skinny tables: " + ", ".join(f"t{i} {t if t is not None else 'default'!r}" for i, t in enumerate(tables)))
    plot([r for r in rows if r["mhc_variant"] == mhc[0] and r["skinny_table"] == tables[0] and r["moe_path"] == moes[0]
          and r["index_k"] == a.index_k[0] and r["side_streams"] == a.side_streams[0]
          and r["triton_pdl"] == a.triton_pdl[0] and r["knobs"] == a.knobs[0]],
         os.path.join(out_dir(), "model_decode.png"))
    set_knobs(a.knobs[0])                       # the profiles are of the first variant
    if a.profile:
        side_stream.ENABLED, pdl.ENABLED = a.side_streams[0] == "on", a.triton_pdl[0] == "on"
        with torch.inference_mode():
            profile(decode_step(model, caches, a.profile, a.ctx, max_len, block_tokens), a.profile, a.profile_top)
    if a.profile_graph:
        from graph_profile import profile_graph
        side_stream.ENABLED, pdl.ENABLED = a.side_streams[0] == "on", a.triton_pdl[0] == "on"
        for B in a.profile_graph:
            with torch.inference_mode():
                profile_graph(decode_step(model, caches, B, a.ctx, max_len, block_tokens), f"batch {B}",
                              top=a.profile_top, save=os.path.join(out_dir(), f"graph_profile_b{B}.json"))


class use_moe_path:
    """with use_moe_path("w8a16" | "fp8" | "fp8-padded" | "default"): select.MOE_FP8_DECODE (and, fp8-padded,
    moe.PAD_MASKED_SLABS: steps of a token count not a multiple of 4 padded onto the FP8 form) inside the
    block, restored after."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        from deepinfer.kernels import select
        from deepinfer.model import moe
        self.saved = select.MOE_FP8_DECODE, moe.PAD_MASKED_SLABS
        if self.path != "default":
            select.MOE_FP8_DECODE = "0" if self.path == "w8a16" else "1"
            moe.PAD_MASKED_SLABS = self.path == "fp8-padded"
        return self

    def __exit__(self, *exc):
        from deepinfer.kernels import select
        from deepinfer.model import moe
        select.MOE_FP8_DECODE, moe.PAD_MASKED_SLABS = self.saved
        return False


_KNOB_DEFAULTS: dict = {}


def set_knobs(spec: str) -> None:
    """'module:ATTR=value;...' set on their modules (value a Python literal), every knob set by an earlier variant
    first put back to what it was; 'none' only puts them back."""
    import ast
    import importlib
    for (mod, attr), v in _KNOB_DEFAULTS.items():
        setattr(importlib.import_module(mod), attr, v)
    for item in [] if spec == "none" else spec.split(";"):
        target, value = item.split("=", 1)
        mod, attr = target.split(":")
        m = importlib.import_module(mod)
        _KNOB_DEFAULTS.setdefault((mod, attr), getattr(m, attr))
        setattr(m, attr, ast.literal_eval(value))


def profile(step, B: int, top: int = 45) -> None:
    """Where the GPU time of one decode step goes: CUDA kernel time summed by kernel name (eager, so
    launch gaps are not counted; the kernels are the ones the graph replays)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            by_name.setdefault(ev.name[:90], []).append(ev.device_time_total if hasattr(ev, "device_time_total")
                                                        else ev.cuda_time_total)
    total = sum(sum(v) for v in by_name.values())
    n = sum(len(v) for v in by_name.values())
    print(f"profile batch {B}: {n} kernels, {total / 1e3:.2f} ms of kernel time")
    print(f"{'us':>9} {'share':>6} {'calls':>6}  kernel")
    for name, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{sum(v):>9.0f} {sum(v) / total:>6.1%} {len(v):>6}  {name}")
    # the torch glue by op and input shapes (the same step): which aten calls launch the small kernels
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.key.startswith("aten::") and getattr(e, "self_device_time_total", 0) > 0]
    print(f"torch ops by GPU time (self, us), top {top}:")
    for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"{e.self_device_time_total:>9.0f} {e.count:>6}  {e.key:28s} {str(e.input_shapes)[:150]}")


def plot(rows, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    b = [r["batch"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(b, [r["of_copy"] for r in rows], "o-", label="CUDA graph")
    ax[0].plot(b, [r["of_copy"] / r["graph_speedup"] for r in rows], "s--", label="eager (same bytes)")
    ax[0].axhline(0.7, color="gray", ls=":", label="goal 0.70 (batch 64)")
    ax[0].set(xscale="log", xlabel="batch", ylabel="bytes / time / copy bandwidth", title="model decode step, full width")
    ax[0].legend(fontsize=8)
    ax[1].plot(b, [r["ep8_tok_s_per_gpu"] for r in rows], "o-")
    ax[1].set(xscale="log", yscale="log", xlabel="batch per rank", ylabel="tokens/s per GPU (estimate)",
              title="EP8 whole-model decode estimate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
