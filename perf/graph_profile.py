"""Where a CUDA graph's replay time goes: the kernels of a few replays recorded by torch.profiler (CUPTI records
a graph's kernel nodes one by one), the replay's span against the union of its kernels' busy intervals (the
rest is the GPU idle between dependent kernels: launch latency, PDL waits, a side stream's join), and each
kernel name's time, calls and exposed time (the part of its intervals no other kernel overlaps: what
removing it could save at most).

    from graph_profile import profile_graph; profile_graph(step_fn, label="batch 64")

An eager profile (bench_model_decode.profile) counts kernel time only; this one sees what the replayed step
pays between kernels, which is what separates a step of many small kernels from its bytes.
"""

from __future__ import annotations

import torch


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def alone_times(kernels: list[tuple]) -> dict[int, float]:
    """kernel index -> time during which that kernel was the only one running (a sweep over start / end events;
    a kernel is (start, end, ...))."""
    events = sorted([(k[0], 1, i) for i, k in enumerate(kernels)] + [(k[1], -1, i) for i, k in enumerate(kernels)])
    running: set[int] = set()
    out: dict[int, float] = {}
    last = None
    for t, kind, i in events:
        if last is not None and len(running) == 1:
            (only,) = running
            out[only] = out.get(only, 0.0) + t - last
        (running.add if kind == 1 else running.discard)(i)
        last = t
    return out


def exposed_times(kernels: list[tuple[float, float, str]]) -> dict[str, float]:
    """name -> time during which a kernel of that name was the only one running."""
    out: dict[str, float] = {}
    for i, t in alone_times(kernels).items():
        out[kernels[i][2]] = out.get(kernels[i][2], 0.0) + t
    return out


def replay_stats(kernels: list[tuple[float, float, str]]) -> dict:
    """Span, busy time, idle time and per-name totals of one replay's kernels ((start_us, end_us, name))."""
    span = max(e for _, e, _ in kernels) - min(s for s, _, _ in kernels)
    busy = _union([(s, e) for s, e, _ in kernels])
    by_name: dict[str, list[float]] = {}
    for s, e, n in kernels:
        by_name.setdefault(n, []).append(e - s)
    return dict(span_us=span, busy_us=busy, idle_us=span - busy, kernels=len(kernels),
                kernel_sum_us=sum(e - s for s, e, _ in kernels), by_name=by_name, exposed=exposed_times(kernels))


def split_replays(kernels: list[tuple[float, float, str]], n: int) -> list[list[tuple[float, float, str]]]:
    """The kernels of n back-to-back replays (synchronized between them), split at the n - 1 largest gaps."""
    kernels = sorted(kernels)
    if n <= 1 or len(kernels) < n:
        return [kernels]
    gaps = sorted(range(1, len(kernels)), key=lambda i: kernels[i][0] - max(e for _, e, _ in kernels[:i][-64:]))
    cuts = sorted(gaps[-(n - 1):])
    out, prev = [], 0
    for c in cuts + [len(kernels)]:
        out.append(kernels[prev:c])
        prev = c
    return out


def capture(fn) -> "torch.cuda.CUDAGraph":
    """fn captured as a CUDA graph, warmed up eagerly first on a side stream (as the engine captures)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def profile_graph(fn, label: str = "", replays: int = 3, top: int = 40, save: str | None = None) -> dict:
    """Capture fn in a CUDA graph, profile `replays` replays (a synchronize between them) and print the middle
    replay's span, busy and idle time and its top kernels by time with their exposed time. save: a JSON path
    for the middle replay's kernels in launch order ((start, end) us from its first kernel, name, stream), for
    reading its critical path offline."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    g = capture(fn)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
            torch.cuda.synchronize()
    events = [ev for ev in prof.events() if ev.device_type.name == "CUDA" and ev.time_range.end > ev.time_range.start
              and not ev.name.startswith(("Memcpy", "Memset"))]
    kernels = [(ev.time_range.start, ev.time_range.end, ev.name[:90]) for ev in events]
    streams = {(ev.time_range.start, ev.time_range.end, ev.name[:90]): getattr(ev, "device_resource_id", 0)
               for ev in events}
    del g
    if not kernels:
        print(f"graph profile {label}: no kernel records (CUPTI saw no graph nodes)")
        return {}
    parts = split_replays(kernels, replays)
    st = replay_stats(parts[len(parts) // 2])
    print(f"graph profile {label}: {st['kernels']} kernels a replay, span {st['span_us']:.0f} us, busy "
          f"{st['busy_us']:.0f} us, idle {st['idle_us']:.0f} us ({st['idle_us'] / st['span_us']:.1%}), kernel sum "
          f"{st['kernel_sum_us']:.0f} us (overlap {st['kernel_sum_us'] - st['busy_us']:.0f})", flush=True)
    print(f"{'us':>8} {'exposed':>8} {'calls':>6} {'mean':>7}  kernel")
    for name, v in sorted(st["by_name"].items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{sum(v):>8.0f} {st['exposed'].get(name, 0.0):>8.0f} {len(v):>6} {sum(v) / len(v):>7.1f}  {name}")
    if save:
        import json
        mid = parts[len(parts) // 2]
        t0 = min(s for s, _, _ in mid)
        with open(save, "w") as f:
            json.dump({"label": label, "device": torch.cuda.get_device_name(0),
                       "summary": {k: v for k, v in st.items() if k not in ("by_name", "exposed")},
                       "kernels": [[round(s - t0, 2), round(e - t0, 2), n, streams.get((s, e, n), 0)]
                                   for s, e, n in mid]}, f)
        print(f"wrote {save}")
    return st


# kernel name patterns -> the step's parts (first match wins; names as CUPTI reports them)
PARTS = (("experts (masked MoE)", ("fp8_moe_", "w4a16", "w4a8", "moe_masked", "w8a16_masked")),
         ("dense FP8 decode GEMMs", ("fp8_decode_", "fp8_splitk_reduce", "act_quant")),
         # the W8A16 kernel on bf16-held weights (the head, Engram's wkv: skinny bf16 GEMMs; or W8A16 experts)
         ("W8A16 kernel (head, Engram)", ("w8a16_pairs", "skinny")),
         ("cuBLAS", ("cublas", "nvjet", "gemm", "cutlass", "xmma", "gemv", "sm90_")),
         ("attention", ("sparse_attn", "flash", "attn")),
         ("indexer", ("index", "topk", "top_k")),
         ("mHC", ("hc_", "mhc", "sinkhorn")),
         ("MoE glue", ("router", "dispatch", "combine", "moe", "swiglu", "gate")),
         ("norms / RoPE", ("norm", "rope")),
         ("compressor / caches", ("compress", "pool", "ring", "window", "kv")),
         ("Engram", ("engram", "hash")),
         ("torch ops", ("at::native",)))


def part_of(name: str) -> str:
    low = name.lower()
    return next((part for part, keys in PARTS if any(k in low for k in keys)), "other")


def layer_chain(kernels: list[tuple[float, float, str]]) -> list[tuple[float, float]]:
    """A decode step read as its layers' chain: (window, expert run) us per layer, where a layer's expert run spans
    its masked MoE's two GEMMs (w13, w2: consecutive calls of the experts' part) and its window is the time from
    the previous layer's expert run's end (the replay's start for the first) to this one's start. Empty where no
    expert kernels ran."""
    runs = sorted((s, e) for s, e, n in kernels if part_of(n) == PARTS[0][0])
    if len(runs) < 2:
        return []
    t0 = min(s for s, _, _ in kernels)
    out, prev = [], t0
    for (s, _), (_, e) in zip(runs[0::2], runs[1::2]):
        out.append((s - prev, e - s))
        prev = e
    return out


def window_kernels(kernels: list[tuple[float, float, str, int]], layer: int) -> list[tuple[float, float, float, int, str]]:
    """One layer's window (layer_chain's: from the previous expert run's end to this layer's first expert GEMM)
    as its kernels in start order: (start us from the window's start, duration us, us alone in the whole replay,
    stream, name). Reading the alone column down the list walks the window's critical path."""
    ks = [(s, e, n) for s, e, n, _ in kernels]
    runs = sorted((s, e) for s, e, n in ks if part_of(n) == PARTS[0][0])
    if 2 * layer + 1 >= len(runs):
        return []
    t0 = runs[2 * layer - 1][1] if layer else min(s for s, _, _ in ks)
    t1 = runs[2 * layer][0]
    alone = alone_times(ks)
    rows = [(s - t0, e - s, alone.get(i, 0.0), kernels[i][3], n) for i, (s, e, n) in enumerate(ks) if t0 <= s < t1]
    return sorted(rows)


def report(path: str, png: str | None = None, windows: tuple[int, ...] = ()) -> dict:
    """A saved replay (profile_graph(save=)) by part: kernel time, exposed time and calls; with png, its
    timeline by stream, coloured by part."""
    import json
    with open(path) as f:
        d = json.load(f)
    ks = [(s, e, n) for s, e, n, _ in d["kernels"]]
    exposed = exposed_times(ks)
    parts: dict[str, list[float]] = {}
    for s, e, n in ks:
        p = parts.setdefault(part_of(n), [0.0, 0.0, 0])
        p[0] += e - s
        p[2] += 1
    for n, t in exposed.items():
        parts[part_of(n)][1] += t
    span = d["summary"]["span_us"]
    print(f"{d['label']} on {d['device']}: span {span:.0f} us, idle {d['summary']['idle_us']:.0f} us")
    print(f"{'part':26s} {'kernel us':>9} {'exposed':>8} {'of span':>7} {'calls':>6}")
    for part, (t, x, c) in sorted(parts.items(), key=lambda kv: -kv[1][1]):
        print(f"{part:26s} {t:9.0f} {x:8.0f} {x / span:7.1%} {c:6d}")
    chain = layer_chain(ks)
    if chain:
        tail = span - sum(w + r for w, r in chain)
        print(f"as a chain of {len(chain)} layers: windows {sum(w for w, _ in chain):.0f} us "
              f"({' / '.join(f'{w:.0f}' for w, _ in chain)}), expert runs {sum(r for _, r in chain):.0f} us "
              f"({' / '.join(f'{r:.0f}' for _, r in chain)}), after the last {tail:.0f} us (the head)")
    for layer in windows:
        rows = window_kernels(d["kernels"], layer)
        print(f"layer {layer}'s window: {len(rows)} kernels, {sum(a for _, _, a, _, _ in rows):.0f} us alone")
        print(f"{'at us':>7} {'us':>6} {'alone':>6} {'stream':>6}  kernel")
        for at, dur, a, st, n in rows:
            print(f"{at:7.1f} {dur:6.1f} {a:6.1f} {st:6d}  {n[:100]}")
    if png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        names = [p for p, _ in PARTS] + ["other"]
        colors = {p: plt.cm.tab20(i) for i, p in enumerate(names)}
        streams = sorted({st for *_, st in d["kernels"]})
        fig, ax = plt.subplots(figsize=(16, 1.2 + 0.5 * len(streams)))
        for s, e, n, st in d["kernels"]:
            ax.barh(streams.index(st), e - s, left=s, color=colors[part_of(n)], height=0.8)
        ax.set_yticks(range(len(streams)), [f"stream {st}" for st in streams])
        ax.set_xlabel("us from the replay's first kernel")
        ax.set_title(f"{d['label']}, {d['device']}: one replayed decode step ({span:.0f} us)")
        ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in names if p in parts],
                  labels=[p for p in names if p in parts], fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        print(f"wrote {png}")
    return parts


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="report a replay saved by profile_graph(save=): by part, and a timeline")
    ap.add_argument("json")
    ap.add_argument("--png", default=None)
    ap.add_argument("--windows", type=int, nargs="*", default=[],
                    help="also list these layers' windows kernel by kernel (start, duration, time alone, stream)")
    a = ap.parse_args()
    report(a.json, a.png, tuple(a.windows))
