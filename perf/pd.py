"""Prefill/decode disaggregation vs colocated replicas: TTFT and inter-token latency, side by side.

Same two CPU processes (tiny preset) in both runs:
  colocated   2 replicas with kv_role="both", requests alternating (round robin)
  disagg      1 kv_role="prefill" + 1 kv_role="decode" process; each request runs its prompt on the
              prefill, its caches move by NIXL (UCX), the decode continues (deepinfer/disagg/): the
              window ring rows and compressor carry move with the blocks (kv_transfer_window=True)
  replay      the same pair, the decode pulling only the full blocks and replaying the last 128
              positions to rebuild the window (kv_transfer_window=False)
at each concurrency (default 16 and 64), with 2 x concurrency requests of random prompts, after one
untimed wave per mode (on a GPU the first requests compile kernels and capture graphs: 12 s TTFT).

  TTFT  client time to the first token (disagg: the prefill's final output, which carries it; a
        gateway streams it at once)
  ITL   gaps between later tokens (disagg: the first gap includes the hand-over)
  bytes the decode's pulled bytes per hand-over (its kv_transfer_bytes_total), replayed positions
  ratio disagg / colocated, replay / disagg

    python perf/pd.py                              # tiny preset, built into a temp folder
    python perf/pd.py --concurrency 16 64 --prompt-len 512 --max-tokens 32
    python perf/pd.py --modes disagg replay        # the two transfer modes only
    python perf/pd.py --device cuda --preset small --prompt-len 1024 --max-tokens 32     # H200, one GPU
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from deepinfer.disagg.process import EngineProcess
from deepinfer.sampling_params import SamplingParams


def timed_stream(engine: EngineProcess, rid, prompt, params, t0, **kw) -> tuple[list[float], object]:
    """-> (arrival time of each token, last output)"""
    times, out = [], None
    for out in engine.stream(rid, prompt, params, **kw):
        times += [time.perf_counter() - t0] * len(out.new_token_ids)
    return times, out


def colocated(replicas, rid, i, prompt, params):
    t0 = time.perf_counter()
    times, out = timed_stream(replicas[i % len(replicas)], rid, prompt, params, t0)
    return times, out.finish_reason


def disaggregated(pair, rid, i, prompt, params):
    prefill, decode = pair
    t0 = time.perf_counter()
    first_t, first = timed_stream(prefill, rid, prompt, params, t0)
    if first.kv_transfer_params is None:
        return first_t, first.finish_reason
    times, out = timed_stream(decode, rid, prompt, params, t0, kv_transfer_params=first.kv_transfer_params)
    return first_t + times[1:], out.finish_reason     # the decode's first delta repeats the prefill's token


def run(mode, target, concurrency, args, warmup: bool = False) -> dict:
    rng = random.Random(concurrency + (1000 if warmup else 0))
    n = 2 * concurrency
    prompts = [[rng.randrange(100, 30000) for _ in range(rng.randint(args.prompt_len // 2, args.prompt_len))]
               for _ in range(n)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    fn = colocated if mode == "colocated" else disaggregated
    before = target[1].state()["stats"]["counters"] if mode != "colocated" else {}
    ttft, itl, errors = [], [], 0
    lock = threading.Lock()
    bar = tqdm(total=n, desc=f"{mode} c={concurrency}" + (" warm-up" if warmup else ""), leave=False)

    def one(i):
        nonlocal errors
        times, reason = fn(target, f"{mode}-{concurrency}-{i}", i, prompts[i], params)
        with lock:
            if reason != "length" or len(times) != args.max_tokens:
                errors += 1
            elif times:
                ttft.append(times[0])
                itl.extend(b - a for a, b in zip(times, times[1:]))
            bar.update()

    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(n)))
    wall = time.perf_counter() - t
    bar.close()
    moved = {}
    if mode != "colocated":
        after = target[1].state()["stats"]["counters"]
        moved = {k: after[k] - before[k] for k in
                 ("kv_transfers_total", "kv_transfer_bytes_total", "kv_transfer_replayed_tokens_total")}
    return {"mode": mode, "concurrency": concurrency, "ttft": ttft, "itl": itl, "errors": errors,
            "tok_s": n * args.max_tokens / wall, **moved}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="default: the tiny preset, built into a temp folder")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=["colocated", "disagg", "replay"],
                    choices=["colocated", "disagg", "replay"])
    ap.add_argument("--no-warmup", action="store_true",
                    help="time the first requests too (default: one untimed wave per mode first)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--preset", default="tiny", help="checkpoint preset when --checkpoint is not given")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (both processes share GPU 0)")
    ap.add_argument("--cache-memory-fraction", type=float,
                    help="cuda: size each process's cache from this fraction of the free memory it sees at start "
                         "(the second process sees what the first left) instead of to the workload")
    args = ap.parse_args()
    ckpt = args.checkpoint
    if ckpt is None:
        ckpt = str(Path(tempfile.mkdtemp()) / args.preset)
        subprocess.run([sys.executable, "-m", "deepinfer.cli.make_checkpoint", "--preset", args.preset, "--out", ckpt],
                       check=True, capture_output=True)
    # two processes share one GPU: each cache is sized to the workload (64 requests' blocks), not from
    # the free memory (the default 0.85 of it would leave the second process nothing)
    blocks = 64 * ((args.prompt_len + args.max_tokens + 63) // 64) + 64
    base = dict(checkpoint=ckpt, device=args.device, max_num_seqs=64, max_num_batched_tokens=2048, block_tokens=64,
                num_cache_blocks=blocks)
    if args.cache_memory_fraction is not None:
        base.update(num_cache_blocks=None, cache_memory_fraction=args.cache_memory_fraction)
    results = []
    for mode in args.modes:
        if mode == "colocated":
            procs = [EngineProcess(base, num_threads=args.threads, name=f"both{i}") for i in range(2)]
        else:
            procs = [EngineProcess({**base, "kv_role": role, "kv_transfer_window": mode == "disagg"},
                                   num_threads=args.threads, name=role) for role in ("prefill", "decode")]
        try:
            if not args.no_warmup:     # compiles, graph captures and allocator growth out of the timed runs
                run(mode, procs, min(args.concurrency), args, warmup=True)
            results += [run(mode, procs, c, args) for c in args.concurrency]
        finally:
            for p in procs:
                p.close()
    print(f"\n{args.preset} preset on {args.device}, 2 processes x {args.threads} thread(s), prompts {args.prompt_len // 2}.."
          f"{args.prompt_len} tokens, {args.max_tokens} output tokens, 2 x concurrency requests")
    print(f"{'mode':<11}{'conc':>5}{'TTFT p50':>10}{'p90':>8}{'ITL p50':>9}{'p90':>8}{'mean':>8}{'tok/s':>8}{'errors':>7}"
          f"{'KiB/req':>10}{'replayed/req':>13}")
    for r in results:
        k = r.get("kv_transfers_total") or 0
        per = (f"{r['kv_transfer_bytes_total'] / k / 1024:>10.1f}{r['kv_transfer_replayed_tokens_total'] / k:>13.1f}"
               if k else f"{'-':>10}{'-':>13}")
        print(f"{r['mode']:<11}{r['concurrency']:>5}{pct(r['ttft'], .5):>10.3f}{pct(r['ttft'], .9):>8.3f}"
              f"{pct(r['itl'], .5):>9.4f}{pct(r['itl'], .9):>8.4f}{statistics.fmean(r['itl'] or [0]):>8.4f}"
              f"{r['tok_s']:>8.1f}{r['errors']:>7}" + per)
    for c in args.concurrency:
        got = {r["mode"]: r for r in results if r["concurrency"] == c}
        for num, den in (("disagg", "colocated"), ("replay", "colocated"), ("replay", "disagg")):
            if num in got and den in got:
                a, b = got[den], got[num]
                bytes_ratio = (f"  bytes {b['kv_transfer_bytes_total'] / a['kv_transfer_bytes_total']:.3f}"
                               if a.get("kv_transfer_bytes_total") else "")
                print(f"concurrency {c}: {num}/{den}  TTFT p50 {pct(b['ttft'], .5) / pct(a['ttft'], .5):.2f}  "
                      f"ITL p50 {pct(b['itl'], .5) / pct(a['itl'], .5):.2f}  ITL p90 {pct(b['itl'], .9) / pct(a['itl'], .9):.2f}  "
                      f"throughput {b['tok_s'] / a['tok_s']:.2f}{bytes_ratio}")


if __name__ == "__main__":
    main()
