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
    lock = GraphLockstep(parallel, HostAgreement(name, rank, world_size, GraphLockstep.FIELDS))
    lock.max_rank_tokens = n          # each step, from the driver's plan (every rank gets the same n)
    most = lock.agree(n, length, rows)   # this rank's step (requests, tokens per request, rows); n = 0 idle,
                                      # -1 not a graph step -> the most of every rank's, or None: all eager
    lock.before_forward(bufs)         # DecodeGraphs' captured function: the collectives' per-rank size

DSpark's verify steps take the same path: the key holding the most requests, tokens per request and rows
of any rank holds every rank's step (packed verify keys); a rank verifying nothing pads its decode rows into
it. The drafting pass runs each rank's own graphs (the draft blocks' experts are whole on every rank: no
collective there).

The agreement reads nothing from the GPU and waits for no step in flight: the ranks (one host, as the
executor starts them) post their step's four small integers, packed in one word, to a shared-memory
segment and read everyone's, a few microseconds where a gloo all-reduce takes hundreds
(perf/bench_lockstep.py measures both). It runs only when the step could take a graph at all (the
driver's largest rank size within the captured steps' rows), which every rank knows alike from the plan.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets

import numpy as np

logger = logging.getLogger(__name__)

IDLE = 0             # agree(): this rank has no request this step
NOT_A_GRAPH_STEP = -1


def rank_graph_sizes(args, model_args, device: str, world_size: int) -> tuple[int, ...]:
    """The decode batch sizes every rank captures (the same on every rank: the arguments are), or () where
    a captured step could not hold its collectives: the all-to-all dispatcher (host-read split sizes), and
    on CUDA sizes whose gathered picks (world_size x size x top-k) pass the MoE's masked form (the
    fixed-shape form a graph holds; DSpark's verify keys are capped the same way, DecodeGraphs
    gathered_ranks); none past GraphLockstep.FIELDS' widths."""
    from deepinfer.model.moe import MASKED_MAX_PAIRS
    from deepinfer.worker.graph_step import graph_sizes
    sizes = tuple(s for s in graph_sizes(args, model_args, device) if s < 1 << GraphLockstep.FIELDS[1])
    if not sizes:
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
    """The ranks' small non-negative integers combined by max, field by field, through a shared-memory segment:
    each rank posts its fields packed with the step's sequence number in one aligned 64-bit store (atomic),
    then reads until every rank has posted that number. Two banks by the number's parity: a rank that finished
    step g may post g + 1 while a slower one still reads g's bank, never g + 2 (that needs everyone's g + 1)."""

    SPINS_BEFORE_YIELD = 200        # then sched_yield between reads (more ranks than cores: let them run)

    def __init__(self, name: str, rank: int, world_size: int, bits: tuple[int, ...] = (1, 23)) -> None:
        """bits: each field's width (low fields last), the sequence number in the rest of the 63 bits."""
        assert sum(bits) <= 40, bits
        self.rank, self.world_size, self.bits = rank, world_size, bits
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

    def max_fields(self, *values: int) -> tuple[int, ...]:
        """Each field's max over every rank; each rank calls it once a step, in the same order."""
        assert len(values) == len(self.bits), (values, self.bits)
        word = 0
        for v, b in zip(values, self.bits):
            assert 0 <= v < 1 << b, (values, self.bits)
            word = (word << b) | v
        width = sum(self.bits)
        self.seq += 1
        bank = self.banks[self.seq & 1]
        bank[self.rank] = (self.seq << width) | word
        spins = 0
        while True:
            posted = bank.copy()
            if ((posted >> width) == self.seq).all():
                break
            spins += 1
            if spins > self.SPINS_BEFORE_YIELD:
                os.sched_yield()
        out, shift = [], width
        for b in self.bits:
            shift -= b
            out.append(int(((posted >> shift) & ((1 << b) - 1)).max()))
        return tuple(out)


class GraphLockstep:
    # the agreement's fields: not-a-graph-step flag, requests, tokens per request, rows (their widths in bits)
    FIELDS = (1, 10, 4, 14)

    def __init__(self, parallel, agreement: HostAgreement) -> None:
        self.parallel, self.agreement = parallel, agreement
        self.max_rows = 0               # the captured steps' most rows (the runner sets it once they exist)
        self.max_rank_tokens = 0        # the step's largest rank size (the driver's plan), set every step
        self.num_graph_steps = 0        # steps every rank took through a graph
        self.num_eager_steps = 0        # steps that could have and did not (some rank could not)

    def agree(self, n: int, length: int = 1, rows: int | None = None) -> tuple[int, int, int] | None:
        """This rank's step: n requests of up to `length` tokens, `rows` in all (default n x length) where a
        captured key holds it, n = IDLE (no request) or NOT_A_GRAPH_STEP. -> (the most requests, tokens per
        request, rows of any rank) where every rank can take a graph (the caller takes the captured key
        holding them: it holds every rank's step), else None. Every rank calls it in every forward step."""
        if not 0 < self.max_rank_tokens <= self.max_rows:
            return None                                   # decided alike everywhere from the plan
        if n <= 0:                                        # not a graph step / idle: no rows of its own
            local = (int(n < 0), 0, 0, 0)
        else:
            local = (0, n, length, n * length if rows is None else rows)
        not_graph, n, length, rows = self.agreement.max_fields(*local)
        if not_graph or not n:
            self.num_eager_steps += 1
            return None
        self.num_graph_steps += 1
        return n, length, rows

    def before_forward(self, bufs) -> None:
        """Before the padded step's forward (DecodeStepBuffers `bufs`: captured, warmed up, or run eagerly on
        a CPU): its rows are the size the collectives gather from every rank; the EPLB recorder counts the
        real rows' picks only (a decode row sits at a position > 0, a padding row at 0)."""
        self.parallel.set_step_tokens(bufs.num_tokens)
        if self.parallel.recorder is not None:
            self.parallel.recorder.real_rows = bufs.v["positions"] > 0
