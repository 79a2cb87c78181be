"""DataParallelScheduler: one Scheduler (and KV cache) per attention-DP rank behind the Scheduler's
interface, so the Engine's step reads the same with one rank or N.

A new request goes to the rank with the least load, 4 * waiting + running (vLLM's DP front end,
../shared/docs/PARALLEL.md), ties to the lowest rank, and stays there for its life (its caches live
on that rank). Each step every rank schedules its own requests under its own budget and caps; the
executor runs the N plans in lockstep.
"""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass

from deepinfer.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput
from deepinfer.request import Request, RequestStatus
from deepinfer.sched.scheduler import Scheduler


@dataclass
class ParallelSchedulerOutput:
    per_rank: list[SchedulerOutput]        # rank r's plan

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return dict(ChainMap(*[o.num_scheduled_tokens for o in self.per_rank]))

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(o.total_num_scheduled_tokens for o in self.per_rank)

    @property
    def max_rank_tokens(self) -> int:
        """The largest rank's tokens: what equal-size collectives pad to (ep_comm max_tokens)."""
        return max(o.total_num_scheduled_tokens for o in self.per_rank)

    @property
    def is_empty(self) -> bool:
        return all(o.is_empty for o in self.per_rank)


class _KVCacheView:
    """The ranks' KV caches summed, for gauges and accounting checks."""

    def __init__(self, schedulers: list[Scheduler]) -> None:
        self.per_rank = [s.kv_cache for s in schedulers]

    @property
    def num_used_blocks(self) -> int:
        return sum(kv.num_used_blocks for kv in self.per_rank)

    def check(self) -> None:
        for kv in self.per_rank:
            kv.check()


class DataParallelScheduler:
    def __init__(self, schedulers: list[Scheduler]) -> None:
        self.schedulers = schedulers
        self.kv_cache = _KVCacheView(schedulers)
        self.rank_of: dict[str, int] = {}      # unfinished request id -> its rank
        self.generated = [0] * len(schedulers)  # tokens generated per rank

    # requests in and out -------------------------------------------------------------------
    @property
    def requests(self) -> ChainMap:
        return ChainMap(*[s.requests for s in self.schedulers])

    def least_loaded_rank(self) -> int:
        loads = [4 * s.num_waiting + s.num_running for s in self.schedulers]
        return loads.index(min(loads))

    def add_request(self, req: Request) -> None:
        rank = self.least_loaded_rank()
        self.schedulers[rank].add_request(req)
        self.rank_of[req.request_id] = rank

    def finish_requests(self, req_ids, status: RequestStatus, error: str | None = None) -> list[RequestOutput]:
        outs = []
        for req_id in req_ids:
            rank = self.rank_of.pop(req_id, None)
            if rank is not None:
                outs += self.schedulers[rank].finish_requests([req_id], status, error)
        return outs

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.schedulers)

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.schedulers)

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.schedulers)

    def rank_gauges(self) -> list[dict]:
        """Per rank: running, waiting, cache blocks used (metrics per rank)."""
        return [{"num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting,
                 "cache_blocks_used": s.kv_cache.num_used_blocks,
                 "cache_usage": s.kv_cache.num_used_blocks / s.kv_cache.pool.num_blocks,
                 "generation_tokens_total": n} for s, n in zip(self.schedulers, self.generated)]

    # the step --------------------------------------------------------------------------------
    def schedule(self) -> ParallelSchedulerOutput:
        return ParallelSchedulerOutput([s.schedule() for s in self.schedulers])

    def update_from_output(self, sched_out: ParallelSchedulerOutput,
                           runner_outs: list[ModelRunnerOutput]) -> list[RequestOutput]:
        outputs = []
        for rank, (sched, so, ro) in enumerate(zip(self.schedulers, sched_out.per_rank, runner_outs)):
            outs = sched.update_from_output(so, ro)
            for out in outs:
                self.generated[rank] += len(out.new_token_ids)
                if out.finished:
                    self.rank_of.pop(out.request_id, None)
            outputs += outs
        return outputs
