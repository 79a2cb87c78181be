"""Routing across replicas: prefix-aware vs round robin (ensemble/router.py), side by side.

2 engine replicas (EngineProcess, one CPU process each, tiny preset), 64 conversations of 2 turns
sharing 4 system prompts, arriving in random order at a fixed concurrency. Per policy it reports

  locality   per system prompt, the fraction of its requests on the replica that served it most,
             averaged over the prompts (1.0 = every prefix stays on one replica; round robin ~0.5)
  TTFT       client-side time to the first token (mean, p50, p90), and the ratio to round robin
  hit rate   the replicas' prefix-cache hit rate (counters prefix_cache_hits_total /
             prefix_cache_queries_total) when the engine has a prefix cache; "n/a" otherwise

Each policy gets its own system prompts (another seed), so what one policy cached does not help
another; the policies run in alternating rounds (--rounds) so that a drift in the machine's load
hits them alike.
The router reads each replica's load (running, waiting, cache usage, hit rate) every 0.2 s, as it
would from the deepinfer model's metrics.

    python perf/routing.py                       # tiny preset, built into a temp folder
    python perf/routing.py --checkpoint DIR --prefix-len 1024 --concurrency 16
"""

from __future__ import annotations

import argparse
import ast
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
from deepinfer.ensemble.router import ReplicaLoad, Router
from deepinfer.sampling_params import SamplingParams


def make_conversations(args, seed: int) -> list[tuple[int, list[int], list[int]]]:
    """(system prompt index, first turn ids, second turn's extra ids), in random arrival order."""
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 30000) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
    convs = [(i % args.prefixes,) for i in range(args.conversations)]
    rng.shuffle(convs)
    return [(p, systems[p] + [rng.randrange(100, 30000) for _ in range(args.user_len)],
             [rng.randrange(100, 30000) for _ in range(args.user_len)]) for (p,) in convs]


def poll_loads(router: Router, replicas: dict, stop: threading.Event) -> None:
    while not stop.wait(0.2):
        for name, rep in replicas.items():
            try:
                g = rep.state(timeout=5)["stats"]["gauges"]
                router.update_load(name, ReplicaLoad(g["num_requests_running"], g["num_requests_waiting"],
                                                     g["cache_usage"], g.get("prefix_cache_hit_rate")))
            except Exception:  # noqa: BLE001 - an unreachable replica counts as a failed check
                router.update_load(name, ReplicaLoad(healthy=False))


def hit_counts(replicas: dict) -> tuple[int, int] | None:
    hits = queries = 0
    for rep in replicas.values():
        c = rep.state()["stats"]["counters"]
        if "prefix_cache_queries_total" not in c:
            return None
        hits, queries = hits + c["prefix_cache_hits_total"], queries + c["prefix_cache_queries_total"]
    return hits, queries


class PolicyRun:
    """One policy's router and results; its conversations run in rounds interleaved with the other
    policies' (so a change in the machine's load hits every policy alike)."""

    def __init__(self, policy: str, replicas: dict, args, seed: int) -> None:
        self.policy, self.replicas, self.args = policy, replicas, args
        self.router = Router(list(replicas), policy=policy, chunk=args.chunk)
        self.convs = make_conversations(args, seed)
        self.ttft, self.assign, self.hits, self.queries = [], [], 0, 0
        self.lock = threading.Lock()

    def run_round(self, k: int, rounds: int, bar) -> None:
        stop = threading.Event()
        poller = threading.Thread(target=poll_loads, args=(self.router, self.replicas, stop), daemon=True)
        poller.start()
        before = hit_counts(self.replicas)
        n = len(self.convs)
        chunk = list(enumerate(self.convs))[k * n // rounds:(k + 1) * n // rounds]
        with ThreadPoolExecutor(self.args.concurrency) as pool:
            list(pool.map(lambda ic: self._conversation(*ic, bar), chunk))
        stop.set()
        poller.join()
        after = hit_counts(self.replicas)
        if before is not None and after is not None:
            self.hits, self.queries = self.hits + after[0] - before[0], self.queries + after[1] - before[1]

    def _turn(self, p: int, prompt: list[int], rid: str, bar) -> list[int]:
        params = SamplingParams(max_tokens=self.args.max_tokens, temperature=0, ignore_eos=True)
        name = self.router.pick(prompt)
        t0, first, out_ids = time.perf_counter(), None, []
        try:
            for out in self.replicas[name].stream(rid, prompt, params):
                if first is None and out.new_token_ids:
                    first = time.perf_counter() - t0
                out_ids += out.new_token_ids
        finally:
            self.router.done(name)
        with self.lock:
            self.ttft.append(first if first is not None else float("nan"))
            self.assign.append((p, name))
            bar.update()
        return out_ids

    def _conversation(self, i: int, conv, bar) -> None:
        p, first_turn, extra = conv
        answer = self._turn(p, first_turn, f"{self.policy}-{i}-0", bar)
        self._turn(p, first_turn + answer + extra, f"{self.policy}-{i}-1", bar)

    def result(self) -> dict:
        return {"policy": self.policy, "locality": locality(self.assign, self.args.prefixes), "ttft": self.ttft,
                "hit_rate": self.hits / self.queries if self.queries else None,
                "per_replica": {n: sum(1 for _, m in self.assign if m == n) for n in self.replicas}}


def locality(assign, prefixes: int) -> float:
    fr = []
    for p in range(prefixes):
        names = [n for q, n in assign if q == p]
        fr.append(max(names.count(n) for n in set(names)) / len(names))
    return sum(fr) / len(fr)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def report(results: list[dict], args) -> None:
    base = next(r for r in results if r["policy"] == "round_robin")
    print(f"\n{args.replicas} replicas, {args.conversations} conversations x 2 turns, {args.prefixes} system prompts "
          f"of {args.prefix_len} tokens, concurrency {args.concurrency}, max_tokens {args.max_tokens}")
    print(f"{'policy':<14}{'locality':>10}{'TTFT mean s':>13}{'p50':>8}{'p90':>8}{'vs rr':>8}{'hit rate':>10}  per replica")
    for r in results:
        m = statistics.fmean(r["ttft"])
        hr = "n/a" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}"
        print(f"{r['policy']:<14}{r['locality']:>10.2f}{m:>13.3f}{pct(r['ttft'], .5):>8.3f}{pct(r['ttft'], .9):>8.3f}"
              f"{m / statistics.fmean(base['ttft']):>8.2f}{hr:>10}  {r['per_replica']}")
    if args.plot:
        plot(results, args.plot)


def plot(results, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["policy"] for r in results]
    a.bar(names, [r["locality"] for r in results])
    a.set_ylim(0, 1.05)
    a.set_title("prefix locality")
    b.boxplot([r["ttft"] for r in results], tick_labels=names)
    b.set_title("TTFT (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"figure: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="default: the tiny preset, built into a temp folder")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--user-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=64, help="router chunk (tokens)")
    ap.add_argument("--policies", nargs="+", default=["prefix", "round_robin", "least_loaded"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--rounds", type=int, default=4, help="policies alternate in this many rounds")
    ap.add_argument("--engine-args", default="", help="extra EngineArgs as k=v,k=v (e.g. enable_prefix_caching=True)")
    ap.add_argument("--plot", default="perf/figures/routing_cpu_tiny.png")
    args = ap.parse_args()
    ckpt = args.checkpoint
    if ckpt is None:
        ckpt = str(Path(tempfile.mkdtemp()) / "tiny")
        subprocess.run([sys.executable, "-m", "deepinfer.cli.make_checkpoint", "--preset", "tiny", "--out", ckpt],
                       check=True, capture_output=True)
    extra = {k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in args.engine_args.split(",") if kv)}
    eargs = dict(checkpoint=ckpt, device="cpu", max_num_seqs=16, max_num_batched_tokens=1024, block_tokens=64,
                 **extra)
    replicas = {f"replica{i}": EngineProcess(eargs, num_threads=args.threads, name=f"replica{i}")
                for i in range(args.replicas)}
    try:
        runs = [PolicyRun(p, replicas, args, seed=1000 + k) for k, p in enumerate(args.policies)]
        with tqdm(total=2 * args.conversations * len(runs), desc="requests") as bar:
            for k in range(args.rounds):
                for run in runs:
                    run.run_round(k, args.rounds, bar)
        results = [run.result() for run in runs]
    finally:
        for rep in replicas.values():
            rep.close()
    report(results, args)


if __name__ == "__main__":
    main()
