"""Multi-rank engine throughput: attention DP + MoE EP (deepinfer/parallel/) over N ranks, through
the public LLM API, with the all-to-all share of each rank's step.

    python perf/bench_parallel.py [--checkpoint DIR | --preset tiny|small] [--ranks 1,2,4] [--repeat 2]
                                  [--ep-timing]      (the all-to-all share: DEEPINFER_EP_TIMING=1)
    python perf/bench_parallel.py --device cuda [--config DIR] [--num-layers 7] [--engram-vocab-size V]
                                  [--ranks 2,4,8] [--batches 16,64,128] [--prompt-len 8192]
                                  [--decode-len 64] [--ep-timing] [--dry-run]
    python perf/bench_parallel.py --cp [--device cuda ...] [--ranks 1,2,4] [--prompt-len L]

CP mode (--cp): the prefill time of ONE long prompt (generate with max_tokens=1: prefill + the first
token) at each N, with balanced context parallelism (deepinfer/parallel/cp.py: every rank prefills
two mirrored chunks) against one rank and against N ranks without CP (the prompt on one rank, the
others stepping idle through the MoE collectives). Best of --repeat after a warm-up prompt of a
quarter of the length. Default L: 4096 on CPU, 65536 on CUDA (dummy weights as in the CUDA mode).

CPU (default): one load (32 requests of 64 prompt tokens, 32 greedy output tokens, ignore_eos, all
added at once) through LLM(ckpt, device="cpu", data_parallel_size=N) for each N; N=1 is the
single-process engine, N>1 are gloo rank processes of max(1, cores // N) torch threads each. Start-up
is excluded (the LLM is built and warmed up first); tokens/s are the best of --repeat rounds.
NOTE: on a host with fewer cores than ranks x threads the ranks share the same cores, so the ratio
to 1 rank prices the multi-rank overheads (driver <-> rank IPC, a collective pair in every MoE
layer, idle steps, smaller per-rank batches), not a speed-up.

CUDA (--device cuda): the release config (or --config) with load_format="dummy" (random weights
made on each rank's GPU), EP = DP = N over N GPUs. Per N: 8k-token prompts for max(--batches)
requests per rank are prefilled in --prefill-chunk token steps (prefill tok/s per GPU, the early
requests' decodes riding along), then decode is timed over --decode-len steps at each batch per
rank, largest first (requests aborted evenly between windows; the contexts stay ~8k). Reported:
decode tok/s per GPU and per user, the all-to-all share (--ep-timing), and the ratio to single-GPU
figures (--single-gpu-decode-tok-s, default the README's EP8 estimate). The release config needs 8
H200s (deepinfer-plan); --num-layers K writes a K-layer copy (the release's role pattern, K=7 is
the full-width-layers preset) and the per-GPU figures are then scaled by K / 40 (the source's
layers) to a 40-layer equivalent (the head is scaled along: slightly pessimistic). --engram-vocab-size shrinks the Engram
tables (rows, not lookup work) for 2 GPUs. EP ranks decode eagerly (the engine captures CUDA
graphs for one rank only), so the ratio to graph-replayed single-GPU figures includes that.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIGURES = Path(__file__).resolve().parent / "figures"
TIMING_ENV = "DEEPINFER_EP_TIMING"          # deepinfer/parallel/comm_timer.py
# README / perf/H200_NOTES.md: estimated EP8 decode tok/s per GPU (full-width-ep8 step, 8k context)
SINGLE_GPU_DECODE = "1:63,16:839,64:2321,128:3016"
BLOCK_TOKENS = 64


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def batch_figures(text: str) -> dict[int, float]:
    """'16:839,64:2321' -> {16: 839.0, 64: 2321.0}"""
    return {int(b): float(t) for b, t in (kv.split(":") for kv in text.split(",") if kv.strip())}


def timing_on() -> bool:
    return os.environ.get(TIMING_ENV, "") not in ("", "0")


def comm_share(before: list[dict] | None, after: list[dict] | None) -> float | None:
    """Mean over ranks of (comm seconds / step seconds) between two pings; None without timing."""
    if not before or before[0].get("comm_seconds") is None:
        return None
    shares = [(b["comm_seconds"] - a["comm_seconds"]) / max(1e-12, b["step_seconds"] - a["step_seconds"])
              for a, b in zip(before, after)]
    return sum(shares) / len(shares)


def ping(llm) -> list[dict] | None:
    """Per-rank gauges of a multi-rank engine (None for the single-process engine)."""
    fn = getattr(llm.engine.runner, "ping", None)
    return fn() if fn is not None else None


def fmt(x, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def progress(total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr, dynamic_ncols=True)


# ---- CPU mode ------------------------------------------------------------------------------------
def default_checkpoint(tmp: Path, preset: str) -> str:
    out = tmp / preset
    subprocess.run([sys.executable, "-m", "deepinfer.cli.make_checkpoint", "--preset", preset, "--seed", "0",
                    "--out", str(out)], check=True, capture_output=True)
    return str(out)


def cpu_llm(ckpt: str, n: int, threads: int, a):
    from deepinfer import LLM
    total = a.num_requests
    per_seq = -(-(a.prompt_len + a.output_len) // BLOCK_TOKENS)
    return LLM(ckpt, device="cpu", data_parallel_size=n, worker_threads=threads, max_num_seqs=total,
               max_num_batched_tokens=max(2048, total * a.prompt_len), num_cache_blocks=total * per_seq + 8)


def cpu_round(llm, prompts, params) -> dict:
    """One generate() of the whole load: tokens/s, seconds, engine steps, all-to-all share."""
    steps0, p0 = llm.stats()["counters"]["steps_total"], ping(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    steps, p1 = llm.stats()["counters"]["steps_total"] - steps0, ping(llm)
    n = sum(len(o.token_ids) for o in outs)
    assert n == len(prompts) * params.max_tokens, n
    return {"tok_s": n / dt, "seconds": dt, "steps": steps, "share": comm_share(p0, p1)}


def run_cpu(a) -> None:
    import torch

    from deepinfer import SamplingParams
    cores = a.threads or os.cpu_count() or 1
    torch.set_num_threads(cores)                 # the single-process engine's threads (N = 1)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    best: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = a.checkpoint or default_checkpoint(Path(tmp), a.preset)
        bar = progress(len(a.ranks) * (a.repeat + 1), "bench_parallel cpu")
        for n in a.ranks:
            threads = max(1, cores // n)
            bar.set_postfix_str(f"{n} rank(s): start")
            llm = cpu_llm(ckpt, n, threads, a)
            try:
                vocab = llm.engine.vocab_size
                prompts = [[rng.randrange(1000, vocab) for _ in range(a.prompt_len)] for _ in range(a.num_requests)]
                llm.generate(prompts[:2 * n], warm)            # one short round on every rank
                bar.update()
                for r in range(a.repeat):
                    bar.set_postfix_str(f"{n} rank(s): round {r}")
                    res = cpu_round(llm, prompts, params)
                    if n not in best or res["tok_s"] > best[n]["tok_s"]:
                        best[n] = dict(res, threads=threads)
                    bar.update()
            finally:
                llm.engine.shutdown()
        bar.close()
        print_cpu(a, ckpt, cores, best)
    plot_cpu(a.plot or str(FIGURES / "bench_parallel_cpu.png"), best, a, cores)
    if a.json:
        Path(a.json).write_text(json.dumps({"mode": "cpu", "args": vars(a), "results": best}, indent=1))


def print_cpu(a, ckpt: str, cores: int, best: dict[int, dict]) -> None:
    print(f"checkpoint={Path(ckpt).name} device=cpu cores={cores} requests={a.num_requests} "
          f"prompt_len={a.prompt_len} output_len={a.output_len} greedy ignore_eos repeat={a.repeat} "
          f"ep_timing={'on' if timing_on() else 'off'}")
    base = best[a.ranks[0]]["tok_s"]
    print(f"{'ranks':>5} {'thr/rank':>8} {'tok/s':>9} {'x ' + str(a.ranks[0]) + ' rank':>9} {'tok/s/rank':>11} {'steps':>6} "
          f"{'ms/step':>8} {'a2a share':>10}")
    for n in a.ranks:
        r = best[n]
        print(f"{n:>5} {r['threads']:>8} {r['tok_s']:>9.1f} {r['tok_s'] / base:>9.2f} {r['tok_s'] / n:>11.1f} "
              f"{r['steps']:>6} {1e3 * r['seconds'] / max(1, r['steps']):>8.1f} "
              f"{pct(r['share']):>10}")
    over = [n for n in a.ranks if n * best[n]["threads"] > cores]
    print(f"NOTE: {cores} core(s) here; N ranks run max(1, {cores} // N) torch threads each and share those cores"
          + (f" ({', '.join(map(str, over))} rank(s): more threads than cores)" if over else "")
          + ", so the total compute is the same for every N: 'x 1 rank' prices the multi-rank overheads (driver <-> "
          "rank IPC per step, a gloo collective pair in every MoE layer, idle steps, per-rank batches of "
          "requests / N), not a speed-up; that needs a core (or GPU) per rank.")
    print("NOTE: 1 rank is the single-process engine (no IPC, MoE local, no a2a). 'a2a share' = MoE dispatch + "
          "combine seconds / the rank's step seconds (launch + resolve), mean over ranks"
          + ("; a collective's time includes waiting for the slowest peer, which on shared cores includes "
             "the peers' compute" if timing_on() else "; run with --ep-timing (DEEPINFER_EP_TIMING=1) to measure it")
          + ".")


def plot_cpu(path: str, best: dict[int, dict], a, cores: int) -> None:
    """Tokens/s against ranks, the 1-rank level (same cores) dashed, with the ratio and a2a share."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ranks = sorted(best)
    tps = [best[n]["tok_s"] for n in ranks]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.plot(ranks, tps, "o-", label="measured")
    ax.axhline(tps[0], ls="--", color="gray", label=f"{ranks[0]} rank (same {cores} cores)")
    for n, t in zip(ranks, tps):
        share = best[n]["share"]
        note = f"{t / tps[0]:.2f}x" + (f", a2a {100 * share:.0f}%" if share is not None else "")
        ax.annotate(note, (n, t), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xticks(ranks)
    ax.set_ylim(0, 1.15 * max(tps))
    ax.set_xlabel("ranks (attention DP + MoE EP, gloo processes)")
    ax.set_ylabel("generated tokens/s (all ranks)")
    ax.set_title(f"Multi-rank engine, CPU ({cores} cores shared), {a.num_requests} requests x "
                 f"{a.prompt_len}+{a.output_len} tokens", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# ---- CP mode: one long prompt's prefill -------------------------------------------------------------
def cp_llm(ckpt: str, n: int, cp: bool, a, cuda: bool):
    from deepinfer import LLM
    max_len = -(-(a.prompt_len + 64) // BLOCK_TOKENS) * BLOCK_TOKENS
    kw = dict(data_parallel_size=n, context_parallel_size=n if cp else 1, cp_min_prompt_tokens=1,
              max_num_seqs=4, max_num_batched_tokens=a.prompt_len + 8, max_model_len=max_len,
              block_tokens=BLOCK_TOKENS, num_cache_blocks=4 * max_len // BLOCK_TOKENS + 8)   # the rest: activations
    if cuda:
        return LLM(ckpt, device="cuda", load_format="dummy", enforce_eager=True, **kw)
    return LLM(ckpt, device="cpu", worker_threads=max(1, (a.threads or os.cpu_count() or 1) // n), **kw)


def cp_fits(cfg_dir: str, n: int, a) -> bool:
    """deepinfer-plan's verdict for n GPUs holding the config with the CP run's cache (printed)."""
    from deepinfer.model.args import ModelArgs
    from deepinfer.parallel.planner import plan_memory
    plan = plan_memory(ModelArgs.from_checkpoint(cfg_dir), num_gpus=n, gpu_memory_bytes=gpu_memory_bytes(a),
                       engram_placement="sharded" if n > 1 else "device", max_model_len=a.prompt_len + 64,
                       max_num_seqs=4, block_tokens=BLOCK_TOKENS)
    print(f"  {n} GPU(s): deepinfer-plan: {plan.message()}")
    return plan.fits


def cp_round(llm, prompt) -> float:
    from deepinfer import SamplingParams
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 1
    return time.perf_counter() - t0


def run_cp(a) -> None:
    """Prefill seconds of one a.prompt_len-token prompt: 1 rank, then per N > 1 without and with CP."""
    import torch

    from deepinfer.parallel.cp import MirrorSplit, causal_work
    cuda = a.device == "cuda"
    cores = a.threads or os.cpu_count() or 1
    if not cuda:
        torch.set_num_threads(cores)
    runs = [(n, cp) for n in a.ranks for cp in ((False,) if n == 1 else (False, True))]
    rng = random.Random(0)
    res: dict[tuple[int, bool], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if cuda:
            from deepinfer.parallel.planner import release_config_dir
            src = Path(a.config) if a.config else release_config_dir()
            ckpt = str(bench_config(src, Path(tmp) / "config", a.num_layers, a.engram_vocab_size)[0])
            num_gpus = torch.cuda.device_count()
            fits = {n: cp_fits(ckpt, n, a) for n in a.ranks}
            runs = [(n, cp) for n, cp in runs if n <= num_gpus and fits[n]]
        else:
            ckpt = a.checkpoint or default_checkpoint(Path(tmp), a.preset)
        print(f"checkpoint={Path(ckpt).name} device={a.device} prompt_len={a.prompt_len} repeat={a.repeat} "
              f"runs={['%d%s' % (n, '+cp' if cp else '') for n, cp in runs]}"
              + ("" if cuda else f" cores={cores} (shared by the ranks)"))
        if a.dry_run:
            return
        bar = progress(len(runs) * (a.repeat + 1), "bench_parallel cp")
        for n, cp in runs:
            bar.set_postfix_str(f"{n} rank(s){' CP' if cp else ''}: start")
            llm = cp_llm(ckpt, n, cp, a, cuda)
            try:
                vocab = llm.engine.vocab_size
                prompt = [rng.randrange(1000, vocab) for _ in range(a.prompt_len)]
                cp_round(llm, prompt[: max(16, a.prompt_len // 4)])                  # warm-up
                bar.update()
                best = None
                for _ in range(a.repeat):
                    dt = cp_round(llm, prompt)
                    best = dt if best is None else min(best, dt)
                    bar.update()
                cps = getattr(llm.engine.scheduler, "cp_prefills", [])
                assert not cp or len(cps) == a.repeat + 1, cps        # every round went through CP
                split = MirrorSplit(a.prompt_len - 1, n)
                work = [causal_work(split.positions(r)) for r in range(n)] if cp else [1]
                res[(n, cp)] = {"seconds": best, "tok_s": a.prompt_len / best, "work_ratio": max(work) / min(work)}
            finally:
                llm.engine.shutdown()
        bar.close()
    print_cp(a, res, cores, cuda)
    plot_cp(a.plot or str(FIGURES / f"bench_parallel_cp_{'gpu' if cuda else 'cpu'}.png"), res, a, cores, cuda)
    if a.json:
        Path(a.json).write_text(json.dumps({"mode": "cp", "args": vars(a),
                                            "results": {f"{n}{'+cp' if cp else ''}": r for (n, cp), r in res.items()}},
                                           indent=1, default=str))


def print_cp(a, res: dict, cores: int, cuda: bool) -> None:
    base = res[(1, False)]["seconds"] if (1, False) in res else None
    print(f"{'ranks':>5} {'CP':>3} {'prefill s':>10} {'tok/s':>9} {'x 1 rank':>9} {'x no CP':>8} {'work max/min':>13}")
    for (n, cp), r in sorted(res.items()):
        no_cp = res.get((n, False))
        print(f"{n:>5} {'yes' if cp else 'no':>3} {r['seconds']:>10.3f} {r['tok_s']:>9.1f} "
              f"{fmt(base and base / r['seconds'], '.2f'):>9} "
              f"{fmt(no_cp['seconds'] / r['seconds'] if cp and no_cp else None, '.2f'):>8} {r['work_ratio']:>13.4f}")
    print("NOTE: 'x 1 rank' = 1-rank prefill seconds / these; 'work max/min' = the mirror split's causal work "
          "(sum of p + 1 over a rank's query positions), largest over smallest rank.")
    if not cuda:
        print(f"NOTE: {cores} core(s) here, split over the ranks (max(1, {cores} // N) torch threads each): a rank "
              "count above the cores cannot speed up, and the per-layer gathers and MoE collectives are priced in.")


def plot_cp(path: str, res: dict, a, cores: int, cuda: bool) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for cp, style, label in ((False, "s--", "no CP (prompt on one rank)"), (True, "o-", "balanced CP")):
        pts = sorted((n, r["seconds"]) for (n, c), r in res.items() if c == cp or (n == 1 and cp))
        if pts:
            ax.plot([n for n, _ in pts], [t for _, t in pts], style, label=label)
            for n, t in pts:
                if cp and n > 1:     # CP against 1 rank, and against the same ranks without CP
                    note = " / ".join(f"{res[k]['seconds'] / t:.2f}x {what}" for k, what in
                                      (((1, False), "1 rank"), ((n, False), "no CP")) if k in res)
                    ax.annotate(note, (n, t), textcoords="offset points", xytext=(-40, 8), fontsize=7)
    ax.set_xticks(sorted({n for n, _ in res}))
    ax.set_ylim(0, 1.25 * max(r["seconds"] for r in res.values()))
    ax.set_xlabel("ranks")
    ax.set_ylabel(f"prefill seconds, one {a.prompt_len}-token prompt")
    where = "H200" if cuda else f"CPU: {os.cpu_count()}-core host, max(1, {cores} // N) threads per rank"
    ax.set_title(f"Balanced context parallelism ({where})", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# ---- CUDA mode: the config -----------------------------------------------------------------------
def layer_layout(num_layers: int, num_nextn: int) -> dict:
    """The release's role pattern over K backbone layers: 2 window-only, then ratio-2 (sources every 6
    from layer 2), then ratio-1 (KV + candidate source first, re-indexers every 4 after it, or the
    next layer when none fits), Engram at 1 and min(14, first ratio-1), DSpark on the last three.
    K=40 gives the release config's lists, K=7 the full-width-layers preset's (one layer per role)."""
    if num_layers < 7:
        raise ValueError(f"--num-layers must be >= 7 (one layer per role), got {num_layers}")
    n2 = max(2, round((num_layers - 2) * 18 / 38))
    s1 = 2 + n2                                          # the first ratio-1 layer
    ratio2_sources = list(range(2, s1, 6))
    reindex = list(range(s1 + 4, num_layers, 4)) or [s1 + 1]
    return dict(compress_ratios=[0, 0] + [2] * n2 + [1] * (num_layers - s1) + [0] * num_nextn,
                kv_source_layer_ids=ratio2_sources + [s1], index_source_layer_ids=ratio2_sources + [s1] + reindex,
                candidate_source_layer_id=s1, engram_layer_ids=[1, min(14, s1)],
                dspark_target_layer_ids=list(range(num_layers - 3, num_layers)))


def bench_config(src: Path, out: Path, num_layers: int | None, engram_vocab_size: int | None) -> tuple[Path, int]:
    """config.json of src, with K backbone layers and/or smaller Engram tables, written to out
    (src itself when neither is asked); returns (folder, source backbone layers)."""
    cfg = json.loads((src / "config.json").read_text())
    tc = cfg["text_config"]
    src_layers = tc["num_hidden_layers"]
    if not num_layers and not engram_vocab_size:
        return src, src_layers
    if num_layers:
        tc.update(layer_layout(num_layers, tc["num_nextn_predict_layers"]), num_hidden_layers=num_layers)
    if engram_vocab_size:
        from deepinfer.model.engram import engram_primes
        primes = engram_primes(tc["engram_layer_ids"], tc["engram_max_ngram_size"], tc["engram_n_heads"],
                               engram_vocab_size)
        tc.update(engram_vocab_size=engram_vocab_size, engram_num_embeddings=[sum(map(sum, p)) for p in primes])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    from deepinfer.model.args import ModelArgs
    ModelArgs.from_checkpoint(out)                       # validates the copy (sources, ranges)
    return out, src_layers


# ---- CUDA mode: the plan -------------------------------------------------------------------------
def gpu_lengths(a) -> dict:
    """Per-request token budget: prefill steps (early requests decode meanwhile) + every window."""
    b = max(a.batches)
    prefill_steps = -(-b * a.prompt_len // max(1, a.prefill_chunk - b)) + b
    max_tokens = prefill_steps + len(a.batches) * (a.warm_steps + a.repeat * a.decode_len) + 16
    max_len = -(-(a.prompt_len + max_tokens) // BLOCK_TOKENS) * BLOCK_TOKENS
    return {"max_batch": b, "prefill_steps": prefill_steps, "max_tokens": max_tokens, "max_model_len": max_len}


def gpu_memory_bytes(a) -> int:
    if a.gpu_memory:
        from deepinfer.cli.plan import parse_size
        return parse_size(a.gpu_memory)
    import torch
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 141 * 10**9


def plan_verdict(cfg_dir: Path, n: int, a) -> str | None:
    """None when deepinfer-plan says N GPUs hold this config at these sizes, else its message."""
    from deepinfer.model.args import ModelArgs
    from deepinfer.parallel.planner import plan_memory
    ln = gpu_lengths(a)
    try:
        plan = plan_memory(ModelArgs.from_checkpoint(cfg_dir), num_gpus=n, gpu_memory_bytes=gpu_memory_bytes(a),
                           engram_placement="sharded" if n > 1 else "device", max_model_len=ln["max_model_len"],
                           max_num_seqs=ln["max_batch"], block_tokens=BLOCK_TOKENS)
    except ValueError as e:
        return str(e)
    return None if plan.fits else plan.message()


def print_gpu_plan(a, cfg_dir: Path, src_layers: int, num_gpus: int) -> list[int]:
    """The runs this invocation makes (or would, --dry-run): sizes, token counts, the planner's verdict.
    Returns the EP sizes that run."""
    from deepinfer.model.args import ModelArgs
    m, ln = ModelArgs.from_checkpoint(cfg_dir), gpu_lengths(a)
    print(f"config={cfg_dir} layers={m.n_layers} (source {src_layers}) experts={m.n_routed_experts} "
          f"engram_rows={list(m.engram_num_embeddings)} load_format=dummy ep_backend={a.ep_backend} "
          f"ep_timing={'on' if timing_on() else 'off'} GPUs here={num_gpus}")
    print(f"per EP size: build + warm-up (1 x {a.prompt_len}-token prompt per rank); prefill {ln['max_batch']} "
          f"requests x {a.prompt_len} tokens per rank in {a.prefill_chunk}-token steps (~{ln['prefill_steps']} "
          f"steps); decode windows at batch {sorted(a.batches, reverse=True)} per rank: {a.warm_steps} warm + "
          f"{a.repeat} x {a.decode_len} timed steps each (max_tokens={ln['max_tokens']}, "
          f"max_model_len={ln['max_model_len']})")
    runs = []
    for n in a.ranks:
        verdict = plan_verdict(cfg_dir, n, a)
        ok = n <= num_gpus and verdict is None
        why = f"needs {n} GPU(s), {num_gpus} here" if n > num_gpus else "does not fit"
        print(f"  EP{n}: {n * ln['max_batch']} requests, {n * ln['max_batch'] * a.prompt_len:,} prompt tokens; "
              f"deepinfer-plan: {verdict or 'fits'}; {'run' if ok else 'skip (' + why + ')'}")
        if ok:
            runs.append(n)
    return runs


# ---- CUDA mode: one EP size ----------------------------------------------------------------------
class StepDriver:
    """Drives llm.engine step by step over a fixed request set, counting tokens of the live ones."""

    def __init__(self, llm, bar) -> None:
        self.engine, self.bar = llm.engine, bar
        self.live: set[str] = set()
        self.num_out: dict[str, int] = {}

    def add(self, req_ids, prompts, params) -> None:
        for rid, p in zip(req_ids, prompts):
            self.engine.add_request(rid, p, params)
            self.live.add(rid)
            self.num_out[rid] = 0

    def step(self) -> int:
        """One engine step; new tokens of live requests. A failed request fails the benchmark."""
        n = 0
        for out in self.engine.step():
            if out.request_id not in self.live:
                continue
            if out.finish_reason is not None:
                raise RuntimeError(f"{out.request_id} finished ({out.finish_reason}) inside the benchmark: "
                                   "raise max_tokens or check the engine log")
            n += len(out.new_token_ids)
            self.num_out[out.request_id] += len(out.new_token_ids)
        self.bar.update()
        return n

    def keep_per_rank(self, b: int) -> None:
        """Abort requests until each rank holds b (DataParallelScheduler.rank_of; one rank: all)."""
        rank_of = getattr(self.engine.scheduler, "rank_of", None)
        by_rank: dict[int, list[str]] = {}
        for rid in sorted(self.live):
            by_rank.setdefault(rank_of[rid] if rank_of is not None else 0, []).append(rid)
        for rids in by_rank.values():
            for rid in rids[b:]:
                self.engine.abort(rid)
                self.live.discard(rid)

    def drain(self) -> None:
        for rid in list(self.live):
            self.engine.abort(rid)
        self.live.clear()
        while self.engine.has_unfinished_requests():
            self.engine.step()


def gpu_llm(cfg_dir: Path, n: int, a):
    from deepinfer import LLM
    ln = gpu_lengths(a)
    return LLM(str(cfg_dir), device="cuda", load_format="dummy", data_parallel_size=n,
               max_num_seqs=ln["max_batch"], max_num_batched_tokens=a.prefill_chunk,
               max_model_len=ln["max_model_len"], max_seq_len_to_capture=ln["max_model_len"],
               ep_backend=a.ep_backend, block_tokens=BLOCK_TOKENS,
               enforce_eager=a.enforce_eager)   # one rank has no dispatcher: --ep-timing leaves its graphs be


def run_gpu_size(cfg_dir: Path, n: int, a) -> dict:
    """Prefill, then the decode windows, on one engine of n ranks."""
    from deepinfer import SamplingParams
    ln = gpu_lengths(a)
    rng = random.Random(n)
    llm = gpu_llm(cfg_dir, n, a)
    try:
        vocab = llm.engine.vocab_size

        def prompts(k):
            return [[rng.randrange(1000, vocab) for _ in range(a.prompt_len)] for _ in range(k)]
        llm.generate(prompts(n), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))   # warm-up
        total_steps = ln["prefill_steps"] + len(a.batches) * (a.warm_steps + a.repeat * a.decode_len)
        bar = progress(total_steps, f"EP{n}")
        drv = StepDriver(llm, bar)
        num_reqs = n * ln["max_batch"]
        drv.add([f"bench-{i}" for i in range(num_reqs)], prompts(num_reqs),
                SamplingParams(max_tokens=ln["max_tokens"], temperature=0, ignore_eos=True))
        t0 = time.perf_counter()
        while min(drv.num_out.values()) == 0:
            drv.step()
        res = {"ranks": n, "prefill_tok_s_gpu": num_reqs * a.prompt_len / (time.perf_counter() - t0) / n,
               "decode": {}}
        for b in sorted(a.batches, reverse=True):
            res["decode"][b] = decode_window(llm, drv, b, n, a)
        bar.close()
        drv.drain()
        return res
    finally:
        llm.engine.shutdown()


def decode_window(llm, drv: StepDriver, b: int, n: int, a) -> dict:
    """Best of a.repeat windows of a.decode_len steps at b requests per rank."""
    drv.keep_per_rank(b)
    for _ in range(a.warm_steps):          # the pipelined step of the larger batch drains here
        drv.step()
    best = None
    for _ in range(a.repeat):
        p0 = ping(llm)
        t0 = time.perf_counter()
        num_tokens = sum(drv.step() for _ in range(a.decode_len))
        dt = time.perf_counter() - t0
        if num_tokens != b * n * a.decode_len:
            print(f"WARNING: EP{n} batch {b}: {num_tokens} tokens in {a.decode_len} steps, expected "
                  f"{b * n * a.decode_len} (unbalanced ranks or a step without every request)", file=sys.stderr)
        r = {"tok_s_gpu": num_tokens / dt / n, "step_ms": 1e3 * dt / a.decode_len, "share": comm_share(p0, ping(llm))}
        r["tok_s_user"] = r["tok_s_gpu"] / b
        if best is None or r["tok_s_gpu"] > best["tok_s_gpu"]:
            best = r
    return best


def run_gpu(a) -> None:
    import torch

    from deepinfer.parallel.planner import release_config_dir
    num_gpus = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(a.config) if a.config else release_config_dir()
        cfg_dir, src_layers = bench_config(src, Path(tmp) / "config", a.num_layers, a.engram_vocab_size)
        runs = print_gpu_plan(a, cfg_dir, src_layers, num_gpus)
        if a.dry_run:
            return
        results = [run_gpu_size(cfg_dir, n, a) for n in runs]
    layers = a.num_layers or src_layers
    print_gpu(a, results, layers, src_layers)
    if results:
        plot_gpu(a.plot or str(FIGURES / "bench_parallel_gpu.png"), results, a, layers, src_layers)
    out = a.json or (os.path.join(os.environ["OUT"], "bench_parallel_gpu.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps({"mode": "cuda", "args": vars(a), "layers": layers, "results": results},
                                        indent=1, default=str))


def print_gpu(a, results: list[dict], layers: int, full_layers: int) -> None:
    """Per EP size and batch; 'NL eq.' scales the measured K-layer figures to the source config's N
    layers (step time ~ layers)."""
    single = batch_figures(a.single_gpu_decode_tok_s)
    scale, eq_name = layers / full_layers, f"{full_layers}L eq."
    print(f"prompt_len={a.prompt_len} decode_len={a.decode_len} layers={layers} "
          f"('{eq_name}' = tok/s x {layers}/{full_layers}; 'vs 1 GPU' against {a.single_gpu_decode_tok_s})")
    print(f"{'EP':>3} {'batch/rank':>10} {'tok/s/GPU':>10} {eq_name:>9} {'vs 1 GPU':>9} {'tok/s/user':>11} "
          f"{'step ms':>8} {'a2a share':>10}")
    for r in results:
        for b in sorted(r["decode"]):
            d = r["decode"][b]
            eq = d["tok_s_gpu"] * scale
            ratio = eq / single[b] if b in single else None
            print(f"{r['ranks']:>3} {b:>10} {d['tok_s_gpu']:>10.1f} {eq:>9.1f} {fmt(ratio, '.2f'):>9} "
                  f"{d['tok_s_user']:>11.2f} {d['step_ms']:>8.2f} {pct(d['share']):>10}")
        print(f"{r['ranks']:>3} {'prefill':>10} {r['prefill_tok_s_gpu']:>10.0f} "
              f"{r['prefill_tok_s_gpu'] * scale:>9.0f}   ({a.prompt_len}-token prompts, {a.prefill_chunk}-token steps)")
    print("NOTE: EP ranks decode eagerly (CUDA graphs are captured for one rank only) while the single-GPU "
          "figures are graph replays; a2a share = MoE dispatch + combine / the rank's step wall time, with a "
          "device sync around each call (--ep-timing slows the step a little).")


def plot_gpu(path: str, results: list[dict], a, layers: int, full_layers: int) -> None:
    """Full-depth-equivalent decode tok/s per GPU against batch per rank, one line per EP size, and the
    single-GPU figures."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    single = batch_figures(a.single_gpu_decode_tok_s)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for r in results:
        bs = sorted(r["decode"])
        ax.plot(bs, [r["decode"][b]["tok_s_gpu"] * layers / full_layers for b in bs], "o-", label=f"EP{r['ranks']}")
    bs = sorted(b for b in single if b in set(a.batches))
    ax.plot(bs, [single[b] for b in bs], "--", color="gray", label="single-GPU estimate")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch per rank")
    ax.set_ylabel(f"decode tok/s per GPU ({full_layers}-layer equivalent)")
    ax.set_title(f"EP decode, {a.prompt_len}-token context, {layers} layers, dummy weights", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# ---- main ----------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--cp", action="store_true", help="CP mode: one long prompt's prefill time, with and without "
                   "balanced context parallelism")
    p.add_argument("--ranks", type=ints, help="data_parallel_size values (default 1,2,4 on CPU, 2,4,8 on CUDA)")
    p.add_argument("--repeat", type=int, default=2, help="rounds (CPU) / timed windows per batch (CUDA); best kept")
    p.add_argument("--ep-timing", action="store_true",
                   help=f"measure the all-to-all share: sets {TIMING_ENV}=1 for the engine and its rank workers "
                        "(an already set variable counts too)")
    p.add_argument("--plot", help="PNG path (default perf/figures/bench_parallel_{cpu,gpu}.png)")
    p.add_argument("--json", help="also write the results here")
    cpu = p.add_argument_group("CPU mode")
    cpu.add_argument("--checkpoint", help="release-format checkpoint (default: --preset built into a temp dir)")
    cpu.add_argument("--preset", choices=["tiny", "small"], default="tiny")
    cpu.add_argument("--num-requests", type=int, default=32)
    cpu.add_argument("--prompt-len", type=int, help="default 64 (CPU) / 8192 (CUDA)")
    cpu.add_argument("--output-len", type=int, default=32)
    cpu.add_argument("--threads", type=int, default=0, help="cores to split over the ranks (0 = os.cpu_count())")
    gpu = p.add_argument_group("CUDA mode")
    gpu.add_argument("--config", help="folder with config.json (default: the shipped release config)")
    gpu.add_argument("--num-layers", type=int, help="backbone layers of a temp copy of the config (>= 7)")
    gpu.add_argument("--engram-vocab-size", type=int,
                     help="Engram vocab size of the copy (release 16000000; 1600000 = 1/10 of the rows)")
    gpu.add_argument("--batches", type=ints, default=[16, 64, 128], help="decode batches per rank")
    gpu.add_argument("--decode-len", type=int, default=64, help="timed decode steps per window")
    gpu.add_argument("--warm-steps", type=int, default=2, help="untimed steps after each batch change")
    gpu.add_argument("--prefill-chunk", type=int, default=8192, help="max_num_batched_tokens (tokens per step)")
    gpu.add_argument("--ep-backend", choices=["allgather", "alltoall"], default="allgather")
    gpu.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs on a 1-rank run either")
    gpu.add_argument("--gpu-memory", help="per-GPU memory for the plan check, e.g. 141GB (default: GPU 0's)")
    gpu.add_argument("--single-gpu-decode-tok-s", default=SINGLE_GPU_DECODE,
                     help="batch:tok/s per GPU to compare with (default %(default)s: the README's EP8 estimate)")
    gpu.add_argument("--dry-run", action="store_true", help="print the plan of runs and exit")
    a = p.parse_args(argv)
    if a.cp:
        a.ranks = a.ranks or ([1, 2, 4] if a.device == "cpu" else [1, 2, 4, 8])
        a.prompt_len = a.prompt_len or (4096 if a.device == "cpu" else 65536)
    a.ranks = a.ranks or ([1, 2, 4] if a.device == "cpu" else [2, 4, 8])
    a.prompt_len = a.prompt_len or (64 if a.device == "cpu" else 8192)
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.ep_timing:
        os.environ[TIMING_ENV] = "1"          # read when each engine builds its dispatcher; workers inherit it
    if a.cp:
        run_cp(a)
    elif a.device == "cpu":
        if a.dry_run:
            print(f"CPU runs: ranks {a.ranks}, {a.num_requests} requests x {a.prompt_len}+{a.output_len} tokens, "
                  f"{a.repeat} round(s) each")
            return
        run_cpu(a)
    else:
        run_gpu(a)


if __name__ == "__main__":
    main()
