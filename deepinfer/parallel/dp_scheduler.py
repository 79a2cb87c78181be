"""DataParallelScheduler: one Scheduler (and KV cache) per attention-DP rank behind the Scheduler's
interface, so the Engine's step reads the same with one rank or N.

A new request goes to the rank with the least load, 4 * waiting + running (vLLM's DP front end,
../shared/docs/PARALLEL.md), ties to the lowest rank, and stays there for its life (its caches live
on that rank). With prefix caching each rank keeps its own cache (blocks, snapshots, host tier), and
placement is prefix-aware: the request goes to the rank that holds the longest prefix of it
(cached on the device or in that rank's host / disk tiers, which its admission onloads, or being
computed by a request placed there: a conversation's turns and requests sent
together with a shared prefix land together), among the ranks whose load is within
`prefix_load_slack` of the least (a prefix every request shares must not pile them all on one
rank); ties and no prefix anywhere: least loaded. Each step every rank schedules its own requests under its own budget and caps; the
executor runs the N plans in lockstep.

Balanced CP (cp_min_prompt_tokens set, parallel/cp.py): when a rank's plan starts a prompt of at
least that many tokens from position 0 (no cached prefix) in one piece (text, or with every image
encoded ahead on that rank: the shares carry its token types), the step also carries a
CPShare per rank: every rank prefills its mirrored chunks of the prompt's first L-1 tokens before
its own plan, the other ranks in cache blocks and a ring slot borrowed here for the step (returned
in update_from_output); the owner's plan then runs only the last token. Several such prompts in one
step run one after the other, longest first.
"""

from __future__ import annotations

from collections import ChainMap, Counter
from dataclasses import dataclass

import numpy as np

from deepinfer.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput
from deepinfer.request import Request, RequestStatus
from deepinfer.sched.scheduler import Scheduler

from .cp import CPShare
from .image_ahead import ON_RANK

BORROW_PREFIX = "cp-borrow:"        # a non-owner rank's cache ids of a CP prefill's temporary copy


@dataclass
class ParallelSchedulerOutput:
    per_rank: list[SchedulerOutput]        # rank r's plan
    cp: list[list[CPShare]] | None = None  # rank r's shares of this step's balanced-CP prefills, in order

    def rank_tokens(self, rank: int) -> int:
        """Tokens rank's ordinary forward runs (a CP prefill's prefix is not among the owner's; an overlapped
        verify step runs its static n x L layout, every request padded to the longest: overlapped_step.py)."""
        so = self.per_rank[rank]
        if so.overlapped:
            q = so.num_scheduled_tokens.values()
            return len(q) * max(q, default=0)
        n = so.total_num_scheduled_tokens
        for share in (self.cp[rank] if self.cp is not None else []):
            if share.owner == rank:
                n -= len(share.token_ids)
        return n

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return dict(ChainMap(*[o.num_scheduled_tokens for o in self.per_rank]))

    @property
    def spec_tokens(self) -> dict[str, list[int]]:
        return dict(ChainMap(*[o.spec_tokens for o in self.per_rank]))

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(o.total_num_scheduled_tokens for o in self.per_rank)

    @property
    def max_rank_tokens(self) -> int:
        """The largest rank's tokens: what equal-size collectives pad to (ep_comm max_tokens)."""
        return max(self.rank_tokens(r) for r in range(len(self.per_rank)))

    @property
    def is_empty(self) -> bool:
        return all(o.is_empty for o in self.per_rank)

    @property
    def overlapped(self) -> bool:
        """A verify step scheduled with the step in flight unresolved (spec/overlap.py) on some rank."""
        return any(o.overlapped for o in self.per_rank)


class _PoolView:
    """The ranks' block pools summed (prefix caching: cached-block gauge, reset_prefix_cache)."""

    def __init__(self, pools) -> None:
        self.per_rank = pools

    @property
    def num_cached_blocks(self) -> int:
        return sum(p.num_cached_blocks for p in self.per_rank)

    @property
    def num_evictions(self) -> int:
        return sum(p.num_evictions for p in self.per_rank)

    def clear_cache(self) -> int:
        return sum(p.clear_cache() for p in self.per_rank)


class _KVCacheView:
    """The ranks' KV caches summed, for gauges and accounting checks."""

    def __init__(self, schedulers: list[Scheduler]) -> None:
        self.per_rank = [s.kv_cache for s in schedulers]

    @property
    def num_used_blocks(self) -> int:
        return sum(kv.num_used_blocks for kv in self.per_rank)

    @property
    def pool(self) -> "_PoolView":
        return _PoolView([kv.pool for kv in self.per_rank])

    def check(self) -> None:
        for kv in self.per_rank:
            kv.check()


def _images_on_owner(prompt) -> bool:
    """A prompt CP may take: text, or every image encoded ahead on the request's rank (image_ahead.py), whose
    copy the CP pass scatters; a prompt that rank did not encode (a P/D handover) runs the ordinary way."""
    return prompt is None or (prompt.ahead_key is not None and prompt.embeds is not None
                              and all(e is ON_RANK for e in prompt.embeds))


class DataParallelScheduler:
    def __init__(self, schedulers: list[Scheduler], cp_min_prompt_tokens: int | None = None,
                 prefix_load_slack: int | None = None) -> None:
        self.schedulers = schedulers
        self.cp_min_prompt_tokens = cp_min_prompt_tokens   # None = balanced CP off
        self.cp_prefills: list[tuple[str, int, int]] = []  # (req_id, owner rank, prefix tokens) per CP prefill
        self.kv_cache = _KVCacheView(schedulers)
        self.rank_of: dict[str, int] = {}      # unfinished request id -> its rank
        self.generated = [0] * len(schedulers)  # tokens generated per rank
        self.prefix_aware = schedulers[0].prefix is not None
        # how much busier (4 * waiting + running) than the least loaded a rank may be and still get
        # a request for its cached prefix: one batch's worth by default
        self.prefix_load_slack = schedulers[0].max_num_seqs if prefix_load_slack is None else prefix_load_slack
        self._placed_hashes = [Counter() for _ in schedulers]   # block hashes of the unfinished requests per rank
        self._placed: dict[str, list[bytes]] = {}                # request id -> the hashes it added there
        self.num_prefix_placements = 0          # requests placed for a cached prefix (not by load alone)

    # requests in and out -------------------------------------------------------------------
    @property
    def requests(self) -> ChainMap:
        return ChainMap(*[s.requests for s in self.schedulers])

    def scheduler_of(self, req_id: str) -> Scheduler:
        return self.schedulers[self.rank_of[req_id]]

    def least_loaded_rank(self) -> int:
        loads = self.rank_loads()
        return loads.index(min(loads))

    def rank_loads(self) -> list[int]:
        """Each rank's load, 4 * waiting + running (placement's measure)."""
        return [4 * s.num_waiting + s.num_running for s in self.schedulers]

    def prefix_rank(self, req: Request) -> int | None:
        """The rank holding the longest prefix of req among those not too busy; None when no rank
        holds a block of it."""
        loads = self.rank_loads()
        best, best_tokens = None, 0
        for r, s in enumerate(self.schedulers):
            if loads[r] > min(loads) + self.prefix_load_slack:
                continue
            n = s.prefix.cached_tokens(req, self._placed_hashes[r])
            if n > best_tokens or (n == best_tokens and best is not None and loads[r] < loads[best]):
                best, best_tokens = r, n
        return best if best_tokens > 0 else None

    def add_request(self, req: Request, rank: int | None = None) -> None:
        """Place req (least loaded / prefix-aware) or, given `rank`, put it where its caches already are
        (a decode instance's pulled request: disagg/rank_connector.py)."""
        if rank is None and self.prefix_aware:
            rank = self.prefix_rank(req)
            if rank is not None:
                self.num_prefix_placements += 1
        if rank is None:
            rank = self.least_loaded_rank()
        self.schedulers[rank].add_request(req)
        self.rank_of[req.request_id] = rank
        if self.prefix_aware:
            self._placed[req.request_id] = list(req.block_hashes)
            self._placed_hashes[rank].update(self._placed[req.request_id])

    def _forget(self, req_id: str, rank: int) -> None:
        placed = self._placed.pop(req_id, None)
        if placed:
            self._placed_hashes[rank].subtract(placed)
            self._placed_hashes[rank] = +self._placed_hashes[rank]    # drop the zeros

    def finish_requests(self, req_ids, status: RequestStatus, error: str | None = None) -> list[RequestOutput]:
        outs = []
        for req_id in req_ids:
            rank = self.rank_of.pop(req_id, None)
            if rank is not None:
                self._forget(req_id, rank)
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
        out = ParallelSchedulerOutput([s.schedule() for s in self.schedulers])
        if self.cp_min_prompt_tokens is not None:
            out.cp = self._plan_cp(out)
        return out

    def schedule_overlapped(self, in_flight: dict[str, int], num_speculative_tokens: int) -> ParallelSchedulerOutput | None:
        """The next verify step of every rank while the one in flight is unresolved (Scheduler.schedule_overlapped
        per rank; in_flight: every rank's requests -> the drafts they verify there): each rank with requests
        overlaps, a rank with none gets its empty plan; or None (nothing changed) where any rank has a
        request waiting or cannot overlap, so that every rank resolves first and schedules normally."""
        if any(s.waiting for s in self.schedulers):
            return None
        plans = []
        for s in self.schedulers:
            plan = s.overlap_plan(in_flight, num_speculative_tokens) if s.running else None
            if s.running and plan is None:
                return None
            plans.append(plan)
        if all(p is None for p in plans):
            return None
        return ParallelSchedulerOutput([s.commit_overlapped(p) if p is not None else s.schedule()
                                        for s, p in zip(self.schedulers, plans)])

    def _plan_cp(self, out: ParallelSchedulerOutput) -> list[list[CPShare]] | None:
        """Every prompt this step starts whole from position 0 with at least cp_min_prompt_tokens tokens,
        longest first, as one share per rank (rank r's list); None when there is none. A prompt for
        which some rank has no room to borrow runs the ordinary way."""
        cp = len(self.schedulers)
        found = [(rank, new) for rank, so in enumerate(out.per_rank) for new in so.new_reqs
                 if new.num_computed_tokens == 0 and _images_on_owner(new.image_prompt)
                 and so.num_scheduled_tokens.get(new.req_id) == len(new.token_ids)
                 and len(new.token_ids) - 1 >= max(self.cp_min_prompt_tokens - 1, 2 * cp)]
        shares: list[list[CPShare]] = [[] for _ in range(cp)]
        for owner, new in sorted(found, key=lambda rn: -len(rn[1].token_ids)):
            n = len(new.token_ids) - 1
            if not self._borrow(owner, BORROW_PREFIX + new.req_id, n):
                continue
            tokens = np.asarray(new.token_ids[:n], dtype=np.int64)
            p = new.image_prompt     # the ranks' span rows come from the owner's encoded copy (cp.py)
            types, key = (None, None) if p is None else (np.asarray(p.token_types[:n], dtype=np.int8), p.ahead_key)
            for r, s in enumerate(self.schedulers):
                held = new.req_id if r == owner else BORROW_PREFIX + new.req_id
                blocks = new.block_ids if r == owner else s.kv_cache.block_ids[held]
                slot = new.ring_slot if r == owner else s.kv_cache.ring_slot[held]
                shares[r].append(CPShare(new.req_id, owner, r, cp, tokens, list(blocks), slot, types, key))
            self.cp_prefills.append((new.req_id, owner, n))
        return shares if shares[0] else None

    def _borrow(self, owner: int, key: str, num_tokens: int) -> bool:
        """Blocks and a ring slot for num_tokens positions on every rank but the owner, or none at all."""
        taken = []
        for r, s in enumerate(self.schedulers):
            if r != owner:
                if s.kv_cache.allocate_slots(key, num_tokens) is None:
                    for t in taken:
                        self.schedulers[t].kv_cache.free(key)
                    return False
                taken.append(r)
        return True

    def update_from_output(self, sched_out: ParallelSchedulerOutput,
                           runner_outs: list[ModelRunnerOutput]) -> list[RequestOutput]:
        for share in (sched_out.cp[0] if sched_out.cp is not None else []):
            for r, s in enumerate(self.schedulers):       # the borrowed copies are dropped: only the owner keeps caches
                if r != share.owner:
                    s.kv_cache.free(BORROW_PREFIX + share.req_id)
        outputs = []
        for rank, (sched, so, ro) in enumerate(zip(self.schedulers, sched_out.per_rank, runner_outs)):
            outs = sched.update_from_output(so, ro)
            for out in outs:
                self.generated[rank] += len(out.new_token_ids)
                if out.finished:
                    self.rank_of.pop(out.request_id, None)
                    self._forget(out.request_id, rank)
            outputs += outs
        return outputs
