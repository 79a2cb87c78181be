"""MoE expert-parallel dispatch + combine (deepinfer/parallel/ep_comm.py): allgather vs alltoall,
N processes, T tokens per rank, random top-K routing over N * num_local slots. The experts are a
stand-in (y = lt.x[lt.pair_token]): only the transport and its index work are timed.

    python perf/bench_ep_comm.py [--world-sizes 2 4] [--tokens 16 64 256] [--dim 512] [--topk 6]
                                 [--num-local 16] [--backend gloo|nccl]     (ep_comm.json in $OUT)

A time is the per-iteration maximum over ranks (the slowest rank sets the step), median over
iterations. allgather gets max_tokens = T from the "driver" (no count all-reduce). On CPU (gloo)
the N processes share the machine's cores: at N > cores the numbers measure oversubscription too.
--backend nccl needs N GPUs (one per rank); there the alltoall column includes its host read of the
splits, the allgather one does not graph-capture (eager, like alltoall).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import save_json  # noqa: E402
from deepinfer.parallel.ep_comm import make_dispatcher  # noqa: E402
from deepinfer.parallel.executor import free_port  # noqa: E402

BACKENDS = ["allgather", "alltoall"]


def _routing(T: int, num_slots: int, topk: int, dim: int, rank: int, device):
    """(x [T, d] bf16, topk_ids [T, K] distinct slots, topk_weights [T, K] fp32), seeded per rank."""
    g = torch.Generator().manual_seed(rank * 7919 + T)
    x = torch.randn(T, dim, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, num_slots, generator=g).argsort(1)[:, :topk]
    w = torch.rand(T, topk, generator=g)
    return x.to(device), ids.to(device), w.to(device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_step(disp, inputs, iters: int, warmup: int, device) -> list[float]:
    """Seconds of dispatch -> stand-in experts -> combine, per iteration (this rank)."""
    times = []
    for i in range(warmup + iters):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        lt, h = disp.dispatch(*inputs)
        disp.combine(lt.x[lt.pair_token], h)                                  # [T, K, d]
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _slowest_rank_median(times: list[float], device) -> float:
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def _worker(rank: int, n: int, port: int, a, queue) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    device = torch.device("cuda", rank) if a.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(a.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=120))
    rows = []
    for T in a.tokens:
        inputs = _routing(T, n * a.num_local, a.topk, a.dim, rank, device)
        row = {"world_size": n, "tokens": T, "dim": a.dim}
        for backend in BACKENDS:
            disp = make_dispatcher(backend, a.num_local, rank, n)
            disp.max_tokens = T
            row[backend] = _slowest_rank_median(_time_step(disp, inputs, a.iters, a.warmup, device), device)
        rows.append(row)
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def run_world(n: int, a) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(n, free_port(), a, queue), nprocs=n, join=True, start_method="spawn")
    return queue.get()


def print_table(rows: list[dict]) -> None:
    print(f"{'N':>3} {'T/rank':>7} {'d':>5} {'allgather ms':>13} {'alltoall ms':>12} {'ag / a2a':>9}")
    for r in rows:
        ag, a2a = r["allgather"] * 1e3, r["alltoall"] * 1e3
        print(f"{r['world_size']:>3} {r['tokens']:>7} {r['dim']:>5} {ag:>13.3f} {a2a:>12.3f} {ag / a2a:>9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--num-local", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    if a.backend == "nccl" and max(a.world_sizes) > torch.cuda.device_count():
        ap.error(f"nccl needs one GPU per rank: {torch.cuda.device_count()} visible")
    rows = [r for n in a.world_sizes for r in run_world(n, a)]
    print_table(rows)
    save_json(f"ep_comm{a.tag}.json", {"args": vars(a), "results": rows})


if __name__ == "__main__":
    main()
