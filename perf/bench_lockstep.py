"""What the rank workers' CUDA-graph agreement costs a step (deepinfer/parallel/lockstep.py): N processes on one
host call GraphLockstep.agree back to back (each rank's rows drawn at random, a rank in ten not a graph step)
through the shared-memory HostAgreement the engine uses, then (a phase of its own, same run) the same two
integers through a gloo all-reduce, the obvious alternative.

    python perf/bench_lockstep.py [--ranks 2 4 8] [--steps 2000]

Prints per rank count: microseconds a step (median, p90; the slowest rank's) of each and the gloo / shared
memory ratio. A decode step on the H200 takes ~4-5 ms (perf/H200_NOTES.md), the scale to read these against.
Writes bench_lockstep.json ($OUT or perf/results/).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def _rank(rank: int, world: int, port: int, name: str, steps: int, out) -> None:
    import random

    import torch
    import torch.distributed as dist

    from deepinfer.parallel.lockstep import NOT_A_GRAPH_STEP, GraphLockstep, HostAgreement
    from deepinfer.parallel.state import ParallelState
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    lock = GraphLockstep(ParallelState(rank=rank, world_size=world),
                         HostAgreement(name, rank, world, GraphLockstep.FIELDS))
    lock.max_rows = lock.max_rank_tokens = 64
    rnd = random.Random(rank)
    times = {"shm": [], "gloo": []}

    def gloo(local: int) -> None:
        dist.all_reduce(torch.tensor([int(local < 0), max(local, 0)]), op=dist.ReduceOp.MAX)
    for kind, agree in (("shm", lock.agree), ("gloo", gloo)):       # each in its own phase: no skew carried over
        dist.barrier()
        for i in range(steps + 100):                  # the first 100: warm-up
            local = NOT_A_GRAPH_STEP if rnd.random() < 0.1 else rnd.randint(0, 64)
            t = time.perf_counter()
            agree(local)
            if i >= 100:
                times[kind].append(time.perf_counter() - t)
    out.put((rank, times))
    dist.destroy_process_group()


def measure(world: int, steps: int) -> dict:
    import statistics

    from deepinfer.parallel.lockstep import HostAgreement
    from deepinfer.parallel.executor import free_port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port, name = free_port(), HostAgreement.create(world)
    procs = [ctx.Process(target=_rank, args=(r, world, port, name, steps, q)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        got = dict(q.get() for _ in procs)
        for p in procs:
            p.join()
    finally:
        HostAgreement.unlink(name)

    def stat(kind: str, f) -> float:        # the slowest rank's figure
        return max(f(sorted(got[r][kind])) for r in got) * 1e6
    row = {"ranks": world, "steps": steps}
    for kind in ("shm", "gloo"):
        row[f"{kind}_median_us"] = stat(kind, statistics.median)
        row[f"{kind}_p90_us"] = stat(kind, lambda v: v[int(0.9 * (len(v) - 1))])
    row["gloo_over_shm"] = row["gloo_median_us"] / row["shm_median_us"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--steps", type=int, default=2000)
    a = p.parse_args()
    from benchutil import save_json
    print(f"{os.cpu_count()} CPUs; a step's agreement on two integers, microseconds (the slowest rank's)")
    print("ranks  shared memory median  p90     gloo all-reduce median  p90     gloo / shared memory")
    rows = []
    for world in a.ranks:
        r = measure(world, a.steps)
        rows.append(r)
        print(f"{world:5d}  {r['shm_median_us']:20.1f}  {r['shm_p90_us']:6.1f}  {r['gloo_median_us']:22.1f}  "
              f"{r['gloo_p90_us']:6.1f}  {r['gloo_over_shm']:20.1f}", flush=True)
    save_json("bench_lockstep", {"cpus": os.cpu_count(), "rows": rows})


if __name__ == "__main__":
    main()
