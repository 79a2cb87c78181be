"""CUDA-graph decode on the rank workers: every rank replays the same captured batch size in a step,
or every rank runs eagerly.

A captured decode step holds its MoE layers' collectives at fixed sizes (the all-gather dispatcher's
fixed-shape form, ep_comm.AllGatherDispatcher.dispatch_dense, over `bs` rows a rank; the sharded
Engram lookup likewise), so a step's collectives only line up if every rank replays a graph of the
same size: a rank with fewer requests pads to it, a rank with none replays an all-padding step (the
graph's idle step), and one rank that cannot take a graph (a prefill chunk, a sequence past
max_seq_len_to_capture, a replay rule in reach) sends every rank to the eager forward.

    sizes = rank_graph_sizes(args, model_args, device, world_size)    # () = eager only, with the reason logged
    name = HostAgreement.create(world_size)       # the driver, before the ranks start (unlink() at the end)
    lock = GraphLockstep(parallel, HostAgreement(name, rank, world_size), max(sizes))
    lock.max_rank_tokens = n          # each step, from the driver's plan (every rank gets the same n)
    rows = lock.agree(local)          # local: this rank's decode rows (> 0), 0 = idle, -1 = not a graph step
                                      # -> the largest rank's rows, or None: every rank runs eagerly
    lock.before_forward(bufs)         # DecodeGraphs' captured function: the collectives' per-rank size

The agreement reads nothing from the GPU and waits for no step in flight: the ranks (one host, as the
executor starts them) post two integers each to a shared-memory segment and read everyone's, a few
microseconds where a gloo all-reduce takes hundreds (perf/bench_lockstep.py measures both). It runs
only when the step could take a graph at all (the driver's largest rank size within the captured
sizes), which every rank knows alike from the plan.
"""

from __future__ import annotations

import logging
import os
import mmap
import secrets

import numpy as np

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


SHM_DIR = "/dev/shm"      # a file there is shared memory on Linux (the engine's ranks share one host)


def _map(name: str, size: int = 0) -> mmap.mmap:
    """Map the segment `name` (size > 0: create it, zeroed). A plain file under SHM_DIR rather than
    multiprocessing.shared_memory, whose resource tracker (before Python 3.13) unlinks a segment when any
    process that attached it exits: the driver unlinks this one when the engine stops."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if size else 0), 0o600)
    try:
        if size:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size or os.fstat(fd).st_size)
    finally:
        os.close(fd)


class HostAgreement:
    """The ranks' (flag, rows) pairs combined by max, through a shared-memory segment: each rank posts its
    pair packed with the step's sequence number in one aligned 64-bit store (atomic), then reads until every
    rank has posted that number. Two banks by the number's parity: a rank that finished step g may post
    g + 1 while a slower one still reads g's bank, never g + 2 (that needs everyone's g + 1 first)."""

    SPINS_BEFORE_YIELD = 200        # then sched_yield between reads (more ranks than cores: let them run)
    _ROWS_BITS = 23                  # rows < 2^23, the flag one bit above, the sequence number above that

    def __init__(self, name: str, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.map = _map(name)
        self.banks = np.ndarray((2, world_size), dtype=np.int64, buffer=self.map)
        self.seq = 0

    @classmethod
    def create(cls, world_size: int) -> str:
        """A zeroed segment for world_size ranks (the driver, before they start); its name."""
        name = f"deepinfer-lockstep-{os.getpid()}-{secrets.token_hex(4)}"
        _map(name, size=2 * world_size * 8).close()
        return name

    @staticmethod
    def unlink(name: str) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass

    def max2(self, flag: int, rows: int) -> tuple[int, int]:
        """(max flag, max rows) over every rank; each rank calls it once a step, in the same order."""
        assert flag in (0, 1) and 0 <= rows < 1 << self._ROWS_BITS, (flag, rows)
        self.seq += 1
        bank = self.banks[self.seq & 1]
        bank[self.rank] = (self.seq << (self._ROWS_BITS + 1)) | (flag << self._ROWS_BITS) | rows
        spins = 0
        while True:
            posted = bank.copy()
            if ((posted >> (self._ROWS_BITS + 1)) == self.seq).all():
                break
            spins += 1
            if spins > self.SPINS_BEFORE_YIELD:
                os.sched_yield()
        return int((posted >> self._ROWS_BITS).max() & 1), int((posted & ((1 << self._ROWS_BITS) - 1)).max())

    def close(self) -> None:
        del self.banks
        self.map.close()


class GraphLockstep:
    def __init__(self, parallel, agreement: HostAgreement, max_size: int) -> None:
        self.parallel, self.agreement, self.max_size = parallel, agreement, max_size
        self.max_rank_tokens = 0        # the step's largest rank size (the driver's plan), set every step
        self.num_graph_steps = 0        # steps every rank took through a graph
        self.num_eager_steps = 0        # steps that could have and did not (some rank could not)

    def agree(self, local: int) -> int | None:
        """local: this rank's rows of a graph-ready decode step (> 0), IDLE, or NOT_A_GRAPH_STEP. -> the
        largest rank's rows where every rank can take a graph (the caller pads to the captured size
        holding it), else None. Called by every rank in every forward step, in the same order."""
        if not 0 < self.max_rank_tokens <= self.max_size:
            return None                                   # decided alike everywhere from the plan
        not_graph, rows = self.agreement.max2(int(local < 0), max(local, 0))
        if not_graph or not rows:
            self.num_eager_steps += 1
            return None
        self.num_graph_steps += 1
        return rows

    def before_forward(self, bufs) -> None:
        """Before the padded step's forward (DecodeStepBuffers `bufs`: captured, warmed up, or run eagerly on
        a CPU): its rows are the size the collectives gather from every rank; the EPLB recorder counts the
        real rows' picks only (a decode row sits at a position > 0, a padding row at 0)."""
        self.parallel.set_step_tokens(bufs.num_tokens)
        if self.parallel.recorder is not None:
            self.parallel.recorder.real_rows = bufs.v["positions"] > 0
