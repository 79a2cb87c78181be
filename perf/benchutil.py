"""Timing helpers for the GPU benchmarks (METHOD.md): ceilings measured in the same run, CUDA-graph
replay (no launch gaps), inputs rotated over several copies so a working set smaller than L2 is
not timed from cache, medians."""

from __future__ import annotations

import json
import os
import statistics

import torch

L2_BYTES = 60 * 2**20


def out_dir() -> str:
    d = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(d, exist_ok=True)
    return d


def gpu_model() -> str:
    """The GPU's short model name for plot titles and file names ("H200", "H100"; "GPU" where unknown):
    the pool lends either, and a figure must say which one measured it."""
    import re
    import torch
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    found = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    return found.group(1) if found else "GPU"


def copies_for(nbytes: float, cap: int = 16) -> int:
    """How many distinct input sets make one graph replay stream at least ~4x the L2 size."""
    return int(max(1, min(cap, -(-4 * L2_BYTES // max(1, int(nbytes))))))


def time_calls(calls, iters: int = 10, reps: int = 5) -> float:
    """Median seconds of one call, for a list of calls (each on its own inputs), timed as CUDA graph
    replays of all of them in sequence."""
    for c in calls:                                   # compile / JIT / autotune outside the graph
        c()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            for c in calls:
                c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / (iters * len(calls)))
    del g
    return statistics.median(times)


def time_eager(fn, iters: int = 20) -> float:
    """Median seconds of an eager call (for paths that cannot be captured)."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def measure_ceilings() -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and dense matmul rates on random data."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):                              # ~1 s of work: clocks up from idle first
        a @ b
    torch.cuda.synchronize()
    n = 2**30 // 2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    # Eager: a device-to-device memcpy captured in a CUDA graph becomes a copy-engine node (~2.7 TB/s
    # here), while eager copy_ / elementwise kernels run on the SMs, as every kernel we time does.
    # The best of five rounds of each form: one round alone swung 3.95-4.21 TB/s between processes
    # (H200, 2026-12-04, evening: the same 4.90 ms decode step read as 0.82 and 0.77 of copy), and a
    # ceiling is the rate the device reaches, not one sample of it.
    copy_bw = max(2 * x.numel() * 2 / time_eager(f, iters=10)
                  for _ in range(5) for f in (lambda: y.copy_(x), lambda: torch.mul(x, 1.0, out=y)))
    del x, y
    t = time_calls([lambda: a @ b], iters=5)
    bf16 = 2 * 8192**3 / t
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    try:
        t = time_calls([lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)], iters=5)
        fp8 = 2 * 8192**3 / t
    except Exception:  # noqa: BLE001
        fp8 = 2 * bf16
    return {"copy_bw": copy_bw, "bf16_flops": bf16, "fp8_flops": fp8}


def plot_per_proj(rows, projs: dict, x_key: str, series, xlabel: str, ylabel: str, path: str,
                  what: str = "masked MoE") -> None:
    """One panel per projection (projs: name -> (N, K)) of the MoE benches: series = [(label, style,
    row -> y or None)] plotted against row[x_key] (log x); a series missing on any row is left out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(projs), figsize=(5 * len(projs), 4), sharey=True)
    for ax, name in zip(axes, projs):
        rs = [r for r in rows if r["proj"] == name]
        for label, style, y in series:
            ys = [y(r) for r in rs]
            if rs and all(v is not None for v in ys):
                ax.plot([r[x_key] for r in rs], ys, style, label=label)
        ax.set(xscale="log", xlabel=xlabel, title=f"{what} {name}, {projs[name][0]} x {projs[name][1]}")
        ax.legend(fontsize=8)
    axes[0].set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def panels_by_m(rows, panel_width: float = 5, height: float = 4):
    """(pyplot, figure, [(axes, m, that m's rows)]): one panel per distinct row["m"], ascending (the
    per-shape bar charts of the GEMM benches)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ms = sorted({r["m"] for r in rows})
    fig, axes = plt.subplots(1, len(ms), figsize=(panel_width * len(ms), height), squeeze=False)
    return plt, fig, [(ax, m, [r for r in rows if r["m"] == m]) for ax, m in zip(axes[0], ms)]


def save_json(name: str, obj) -> str:
    p = os.path.join(out_dir(), name)
    with open(p, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    return p


def dummy_model(preset: str, device: str = "cuda", dense_weights: str = "fp8", expert_format: str = "fp8",
                **load_options):
    """The preset's model with random weights made on the device (load_format="dummy"): no checkpoint
    to build (the full-width-ep8 one takes ~3 min of CPU and 12 GB of disk). dense_weights "bf16": the
    dense FP8 linears dequantized at load, "bf16+fp8" / "auto" with FP8 decode copies as the engine resolves
    them (EngineArgs.dense_weights); expert_format "fp4": the routed
    experts held as the release's MXFP4 (EngineArgs.expert_format); load_options: more of load_model's
    (a CPU load with the CUDA defaults: weight_format="fp8", moe_masked=True, ...)."""
    import tempfile
    from deepinfer.checkpoint.generator import hf_config, text_config
    from deepinfer.model.loader import load_model
    d = tempfile.mkdtemp(prefix=f"deepinfer-{preset}-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(hf_config(text_config(preset)), f)
    from deepinfer.model.args import ModelArgs
    from deepinfer.worker.loading import dense_fp8_copies, hold_dense_bf16
    args = ModelArgs.from_checkpoint(d)
    bf16 = dense_weights.startswith("bf16") or (dense_weights == "auto" and hold_dense_bf16("auto", device, args))
    return load_model(d, device, load_format="dummy", progress=False, dense_bf16=bf16,
                      dense_fp8_copy=dense_fp8_copies(dense_weights, device, args), expert_format=expert_format,
                      **load_options)


def routed_experts(model, step) -> dict[int, int]:
    """Layer id -> how many distinct experts one run of step routes its tokens to (the gates' picks, hooked):
    the experts a replay of the same step reads. Random weights do not route uniformly (the hash layers follow
    the token ids, the score layers a random router), so the uniform expectation can count experts a step
    never reads."""
    used, hooks = {}, []
    for layer in model.layers:
        gate = getattr(layer.ffn, "gate", None)
        if gate is not None:
            hooks.append(gate.register_forward_hook(
                lambda mod, inp, out, lid=layer.layer_id: used.__setitem__(lid, int(out[1].unique().numel()))))
    try:
        step()                              # (each hook's unique() waits for its gate)
    finally:
        for h in hooks:
            h.remove()
    return used


def release_engine_memory() -> float:
    """After an engine's shutdown and the caller's `del` of its last references: collect the cycles and
    return the freed blocks to the device, so the next engine builds in the memory; the GiB still
    allocated (what a leaked reference keeps alive)."""
    import gc
    gc.collect()
    if not torch.cuda.is_available():
        return 0.0
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / 2**30


def mhc_variants(args_json: list[str]) -> list[dict]:
    """--mhc-variants' JSON strings -> hc_mixes_pre launch-constant overrides (printed as m1, m2, ...)."""
    out = [json.loads(v) for v in args_json]
    for i, v in enumerate(out[1:], 1):
        print(f"mhc variant m{i}: {v}", flush=True)
    return out


class use_mhc_variant:
    """with use_mhc_variant(table, overrides): triton_mhc's PREFILL_VARIANT or DECODE_VARIANT (`table`)
    merged with overrides inside the block, restored after (benchmarks comparing tiles in one run)."""

    def __init__(self, table: dict, overrides: dict):
        self.table, self.overrides = table, overrides

    def __enter__(self):
        self.saved = dict(self.table)
        self.table.update(self.overrides)
        return self.table

    def __exit__(self, *exc):
        self.table.clear()
        self.table.update(self.saved)
        return False


class use_skinny_table:
    """with use_skinny_table(path): select.py's skinny-GEMM table (kernels/skinny_bf16_table.json) swapped
    for path ("" = cuBLAS for every dense bf16 linear) inside the block."""

    def __init__(self, path: str | None):
        self.path = path

    def __enter__(self):
        from deepinfer.kernels import select
        self.saved = select.SKINNY_TABLE_PATH
        if self.path is not None:
            select.SKINNY_TABLE_PATH = self.path
            select.reload_skinny_table()
        return self

    def __exit__(self, *exc):
        from deepinfer.kernels import select
        select.SKINNY_TABLE_PATH = self.saved
        select.reload_skinny_table()
        return False
