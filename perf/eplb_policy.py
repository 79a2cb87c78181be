"""EPLB policy figures on a skewed synthetic load (a benchmark; no asserts): max/mean rank load of
the initial placement, DeepSeek's rebalance_experts (global, on the window's summed load) and
DeepInfer's rebalance_experts_per_step, and each policy's CPU run time.

Each policy sees the first `--steps` steps; "next" scores its placement on the following `--steps`
steps of the same load (what serving sees until the next rebalance). synthetic_loads draws each
step's noise independently, so whatever the per-step policy fits beyond the mean load is noise
there: a real router's step-to-step correlation decides whether that part carries over.

    .venv/bin/python perf/eplb_policy.py [--layers 4] [--experts 384] [--steps 100] [--ep 8]
                                         [--redundant 8 16 32] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import torch

from deepinfer.parallel.eplb import (
    balance_ratio,
    initial_placement,
    rebalance_experts,
    rebalance_experts_per_step,
    synthetic_loads,
)


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def placements(fit: torch.Tensor, num_replicas: int, num_gpus: int):
    """(name, phy2log, seconds) for each policy, fitted on fit [L, S, E]."""
    num_layers, _, num_experts = fit.shape
    initial, t_initial = timed(initial_placement, num_layers, num_experts, num_replicas)
    deepseek, t_deepseek = timed(rebalance_experts, fit.sum(1), num_replicas, 1, 1, num_gpus)
    per_step, t_per_step = timed(rebalance_experts_per_step, fit, num_replicas, num_gpus)
    return [("initial", initial[0], t_initial), ("deepseek", deepseek[0], t_deepseek),
            ("per_step", per_step[0], t_per_step)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=384)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--redundant", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    loads = synthetic_loads(args.layers, 2 * args.steps, args.experts, seed=args.seed)  # [L, 2S, E]
    fit, held_out = loads[:, :args.steps], loads[:, args.steps:]
    print(f"{args.layers} layers x {args.experts} experts x {args.steps} steps, EP {args.ep}, "
          f"{torch.get_num_threads()} CPU threads; max/mean rank load (1.000 = perfect) of the window's "
          "summed load, per step (peak), per step on the next window (next)")
    print(f"{'redundant':>9} {'policy':>9} {'summed':>7} {'peak':>7} {'next':>7} {'ms':>8}")
    for num_redundant in args.redundant:
        num_replicas = args.experts + num_redundant
        if num_replicas % args.ep:
            print(f"{num_redundant:>9} skipped: {num_replicas} slots do not split over EP {args.ep}")
            continue
        for name, phy2log, seconds in placements(fit, num_replicas, args.ep):
            summed = balance_ratio(phy2log, fit.sum(1), args.ep)
            peak = balance_ratio(phy2log, fit, args.ep)
            nxt = balance_ratio(phy2log, held_out, args.ep)
            print(f"{num_redundant:>9} {name:>9} {summed:7.3f} {peak:7.3f} {nxt:7.3f} {seconds * 1e3:8.1f}")


if __name__ == "__main__":
    main()
