"""ParallelState: which rank this process is, of how many, and the process group the MoE's
collectives run on. Passed explicitly to the model (no module globals: one process may hold several
models, and tests build 1-rank and N-rank models side by side)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ParallelState:
    rank: int = 0                 # this process's rank in the expert-parallel group
    world_size: int = 1           # ranks in the group (= data_parallel_size: EP = DP x TP, TP = 1)
    group: Any = None             # torch.distributed ProcessGroup; None = the default group
    backend: str = "allgather"    # EP dispatch backend (ep_comm.make_dispatcher): "allgather"
                                  # (all-gather / reduce-scatter) | "alltoall"
    placement: Any = None         # placement.ExpertPlacement of the backbone's routed experts
    recorder: Any = None          # eplb.ExpertLoadRecorder, or None (EPLB off)
    dispatcher: Any = None        # ep_comm.ExpertDispatcher, shared by every MoE layer (make_dispatcher)
    engram_sharded: bool = False  # Engram table rows split over the ranks (model/engram.py ShardedEngramTable)
    # the /dev/shm name prefix of the node's one copy of the Engram tables in host memory (engram_placement="host":
    # model/host_tables.py; the executor's, removed at its stop); None: not in host memory, or one rank
    host_tables: str | None = None
    # step-scoped: the largest token count of any rank this step (the driver knows every plan); the
    # equal-size collectives pad to it; None = found by an all-reduce (deepinfer-score's steps)
    step_max_tokens: int | None = None
    # the shared-memory segment the ranks agree on each step's CUDA graph through (lockstep.HostAgreement;
    # the executor makes it); None: rank workers decode eagerly
    host_agreement: str | None = None

    def set_step_tokens(self, n: int | None) -> None:
        """The step's largest rank size (None: found by an all-reduce), for every equal-size collective."""
        self.step_max_tokens = n
        if self.dispatcher is not None:
            self.dispatcher.max_tokens = n
        if self.recorder is not None:
            self.recorder.real_rows = None        # an eager step: every row is a request's

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    @classmethod
    def single(cls) -> "ParallelState":
        return cls()

    def ep_layer(self, layer_id: int, num_layers: int) -> bool:
        """Whether a layer's routed experts are split over the ranks: the backbone's are; the DSpark
        draft blocks' stay whole on every rank (the proposer then runs with no collectives)."""
        return self.placement is not None and layer_id < num_layers

    def make_dispatcher(self):
        if self.dispatcher is None:
            from .ep_comm import make_dispatcher
            self.dispatcher = make_dispatcher(self.backend if self.is_parallel else "local",
                                              self.placement.num_local, self.rank, self.world_size, self.group)
            from .comm_timer import TimedDispatcher, timing_enabled
            if timing_enabled():
                self.dispatcher = TimedDispatcher(self.dispatcher)
        return self.dispatcher
