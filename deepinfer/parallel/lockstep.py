"""CUDA-graph decode on the rank workers: every rank replays the same captured batch size in a step,
or every rank runs eagerly.

A captured decode step holds its MoE layers' collectives at fixed sizes (the all-gather dispatcher's
fixed-shape form, ep_comm.AllGatherDispatcher.dispatch_dense, over `bs` rows a rank; the sharded
Engram lookup likewise), so a step's collectives only line up if every rank replays a graph of the
same size: a rank with fewer requests pads to it, a rank with none replays an all-padding step (the
graph's idle step), and one rank that cannot take a graph (a prefill chunk, a sequence past
max_seq_len_to_capture, a replay rule in reach) sends every rank to the eager forward.

    sizes = rank_graph_sizes(args, model_args, device, world_size)    # () = eager only, with the reason logged
    lock = GraphLockstep(parallel, host_group, max(sizes))
    lock.max_rank_tokens = n          # each step, from the driver's plan (every rank gets the same n)
    rows = lock.agree(local)          # local: this rank's decode rows (> 0), 0 = idle, -1 = not a graph step
                                      # -> the largest rank's rows, or None: every rank runs eagerly
    lock.before_forward(bs)           # DecodeGraphs' captured function: the collectives' per-rank size

The agreement is one all-reduce of two integers on a host (gloo) group, so it reads nothing from the
GPU and waits for no step in flight; it runs only when the step could take a graph at all (the
driver's largest rank size within the captured sizes), which every rank knows alike from the plan.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

IDLE = 0             # agree(): this rank has no request this step
NOT_A_GRAPH_STEP = -1


def rank_graph_sizes(args, model_args, device: str, world_size: int) -> tuple[int, ...]:
    """The decode batch sizes every rank captures (the same on every rank: the arguments are), or () where
    a captured step could not hold its collectives: DSpark (its verify and drafting steps stay eager
    across ranks), the all-to-all dispatcher (host-read split sizes), and on CUDA sizes whose gathered
    picks (world_size x size x top-k) pass the MoE's masked form (the fixed-shape form a graph holds)."""
    from deepinfer.model.moe import MASKED_MAX_PAIRS
    from deepinfer.worker.graph_step import graph_sizes
    sizes = graph_sizes(args, model_args, device)
    if not sizes:
        return ()
    if args.speculative is not None:
        logger.info("CUDA graphs off on the rank workers: speculative decoding across ranks runs eagerly")
        return ()
    if args.expert_parallel and args.ep_backend != "allgather":
        logger.info("CUDA graphs off on the rank workers: ep_backend=%r reads split sizes on the host", args.ep_backend)
        return ()
    if device.startswith("cuda") and args.expert_parallel:
        top_k = max(model_args.n_activated_experts, 1)
        fits = tuple(s for s in sizes if world_size * s * top_k <= MASKED_MAX_PAIRS)
        if fits != sizes:
            logger.info("rank workers capture decode sizes %s (of %s): %d ranks x size x top-%d picks must fit "
                        "the masked MoE form's %d", fits, sizes, world_size, top_k, MASKED_MAX_PAIRS)
        sizes = fits
    return sizes


def host_group():
    """A gloo group over every rank for the agreement (None: the default group, already on the host).
    Collective: every rank calls it once, in the same order."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


class GraphLockstep:
    def __init__(self, parallel, group, max_size: int) -> None:
        self.parallel, self.group, self.max_size = parallel, group, max_size
        self.max_rank_tokens = 0        # the step's largest rank size (the driver's plan), set every step
        self.num_graph_steps = 0        # steps every rank took through a graph
        self.num_eager_steps = 0        # steps that could have and did not (some rank could not)

    def agree(self, local: int) -> int | None:
        """local: this rank's rows of a graph-ready decode step (> 0), IDLE, or NOT_A_GRAPH_STEP. -> the
        largest rank's rows where every rank can take a graph (the caller pads to the captured size
        holding it), else None. Called by every rank in every forward step, in the same order."""
        if not 0 < self.max_rank_tokens <= self.max_size:
            return None                                   # decided alike everywhere from the plan
        t = torch.tensor([int(local < 0), max(local, 0)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        if t[0] or not t[1]:
            self.num_eager_steps += 1
            return None
        self.num_graph_steps += 1
        return int(t[1])

    def before_forward(self, bufs) -> None:
        """Before the padded step's forward (DecodeStepBuffers `bufs`: captured, warmed up, or run eagerly on
        a CPU): its rows are the size the collectives gather from every rank; the EPLB recorder counts the
        real rows' picks only (a decode row sits at a position > 0, a padding row at 0)."""
        self.parallel.set_step_tokens(bufs.num_tokens)
        if self.parallel.recorder is not None:
            self.parallel.recorder.real_rows = bufs.v["positions"] > 0
