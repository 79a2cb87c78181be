"""RankKVConnector: the engine's KV connector when the caches live in rank workers
(data_parallel_size > 1); KVConnector's interface and behaviour, the NIXL side on the ranks
(rank_transfer.py: each rank's own agent over its own caches).

The engine keeps what a request's state is made of: holds and their deadlines, the pulls' states,
ring slots and block ids (each rank's KVCacheManager in the DataParallelScheduler), and the runs of
every pull, computed on a mirror of the rank's CacheLayout. Once per engine step, after the step,
while anything is open, one round trip to the ranks (executor.kv_transfer) carries the commands
gathered since the last one and brings back what happened there.

Prefill side: a request that finishes on rank r is held there; its hand-over names rank r's agent,
addresses and slot (a decode READs from that rank). Decode side: a pull is placed like a new request,
on the least loaded rank (pulls count as waiting requests) with room for its slot and blocks; that
rank's agent READs from the prefill rank's, and the request enters that rank's scheduler.

    ALLOC (slot + blocks on a rank; NOTIFY when the first token ends the request)
      -> PULL (the rank: CONNECT -> PULL -> VERIFY -> notify the peer) -> that rank's scheduler
    past the deadline, a READ in ERR, a tag that differs -> the request fails ("error"); blocks a
    stopped READ may still land in come back when the rank reports it over (`releasing`)
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

from deepinfer.disagg.connector import HandoverBook, first_token_finishes, replay_plan
from deepinfer.disagg.layout import CacheLayout
from deepinfer.disagg.params import KVTransferParams
from deepinfer.disagg.pull import PullJob, free_msg, pull_job, timed_out
from deepinfer.disagg.rank_transfer import NotifyJob, RankKVCommands, RankKVReport
from deepinfer.outputs import ReplayParams, RequestOutput
from deepinfer.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class _Held:
    rank: int
    deadline: float
    params: dict | None


@dataclass
class _Load:
    req: Request
    params: KVTransferParams
    deadline: float
    state: str = "ALLOC"                      # ALLOC | NOTIFY | PULL
    rank: int | None = None
    rank_state: str = ""                      # the rank's last word: CONNECT | PULL | VERIFY
    replay: ReplayParams | None = None
    finish_status: RequestStatus | None = None


class RankKVConnector(HandoverBook):
    # the round trip runs after the step: a hold's nonce is on its rank before the params leave
    poll_after_step = True
    _load = _Load

    def __init__(self, role: str, executor, scheduler, stats, timeout_s: float = 30.0,
                 max_model_len: int | None = None, window: bool = True, replay_tokens: int = 128) -> None:
        """executor: MultiprocExecutor (kv_transfer, rank_infos); scheduler: DataParallelScheduler."""
        self.role, self.executor, self.dp, self.stats = role, executor, scheduler, stats
        self.timeout_s, self.max_model_len = timeout_s, max_model_len
        self.window, self.replay_tokens = window, replay_tokens
        self.agents = [info["kv"] for info in executor.rank_infos]       # each rank's RankTransfer.info()
        self.layouts = [CacheLayout.mirror(a["layout"]) for a in self.agents]
        self.layout = self.layouts[0]            # every rank's has this signature (same config)
        self.held: dict[str, _Held] = {}
        self.loads: dict[str, _Load] = {}
        self.releasing: dict[str, int] = {}     # req_id -> rank: a stopped pull's blocks, freed when its READ is over
        self._cmds = [RankKVCommands() for _ in self.agents]
        self._rng = random.Random()

    def has_work(self) -> bool:
        return bool(self.held or self.loads or self.releasing or any(self._cmds))

    def owns(self, req_id: str) -> bool:
        return req_id in self.held or req_id in self.loads or req_id in self.releasing

    def _kv(self, rank: int):
        return self.dp.schedulers[rank].kv_cache

    # prefill side --------------------------------------------------------------------------------
    def request_finished(self, rank: int, req: Request) -> bool:
        """Rank `rank`'s scheduler's kv_hold: keep the finished request's slot and blocks there."""
        if self.role != "prefill" or req.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            return False
        rid, kv, agent = req.request_id, self._kv(rank), self.agents[rank]
        slot, blocks = kv.ring_slot[rid], list(kv.block_ids[rid])
        tag = self._rng.getrandbits(62) + 1
        n = req.num_tokens - 1                     # every position but the sampled token's is cached
        layout = self.layouts[rank]
        params = KVTransferParams(agent["engine_id"], agent["host"], agent["port"], rid, n, req.all_token_ids[-1],
                                  slot, tuple(blocks), tag, tuple(layout.base_addrs()), agent["tag_addr"],
                                  layout.signature, sum(layout.num_bytes(n)), layout.dev_id)
        self.held[rid] = _Held(rank, time.monotonic() + self.timeout_s, params.to_dict())
        self._cmds[rank].holds.append((rid, slot, tag))
        return True

    def _free_held(self, req_id: str) -> None:
        """After the rank zeroed the slot's tag (an unhold, or the notification it matched)."""
        self._kv(self.held.pop(req_id).rank).free(req_id)

    # decode side ---------------------------------------------------------------------------------
    def abort(self, req_id: str) -> RequestOutput:
        ld = self.loads.pop(req_id)
        if ld.state == "PULL":      # the rank tells the prefill to free now; blocks back once no READ lands
            self._cmds[ld.rank].cancels.append((req_id, "abort"))
            self.releasing[req_id] = ld.rank
        elif ld.state == "NOTIFY":
            self._cmds[ld.rank].cancels.append((req_id, "drop"))
        ld.req.status = RequestStatus.FINISHED_ABORTED
        return RequestOutput(req_id, [], "abort", ld.req.num_prompt_tokens, 0)

    def _start_loads(self) -> list[RequestOutput]:
        """ALLOC -> PULL on the rank that has room (or NOTIFY); loads past their deadline fail."""
        outs, now = [], time.monotonic()
        for rid, ld in list(self.loads.items()):
            if ld.deadline < now:              # before a transition: a cancel never precedes its pull
                outs.append(self._expire(ld))
            elif ld.state == "ALLOC":
                ld.finish_status = first_token_finishes(ld.req, self.max_model_len)
                if ld.finish_status is not None:
                    p = ld.params
                    # any rank's agent can tell the prefill rank to free: rank 0 does
                    ld.state, ld.rank = "NOTIFY", 0
                    self._cmds[0].notifies.append(NotifyJob(rid, p.engine_id, p.host, p.port,
                                                            free_msg(p.request_id, p.tag)))
                elif (rank := self._place(ld)) is not None:
                    self._cmds[rank].pulls.append(self._pull_job(ld, rank))
                    ld.state, ld.rank = "PULL", rank
        return outs

    def _place(self, ld: _Load) -> int | None:
        """The least loaded rank (pulls in progress count as waiting requests) with room for the pull."""
        loads = self.dp.rank_loads()
        for other in self.loads.values():
            if other.state == "PULL":
                loads[other.rank] += 4
        for rank in sorted(range(len(loads)), key=lambda r: (loads[r], r)):
            if self._kv(rank).allocate_slots(ld.req.request_id, ld.params.num_tokens) is not None:
                return rank
        return None

    def _pull_job(self, ld: _Load, rank: int) -> PullJob:
        p, rid, kv, layout = ld.params, ld.req.request_id, self._kv(rank), self.layouts[rank]
        ld.replay = None if self.window else replay_plan(ld.req, p.num_tokens, layout.block_tokens,
                                                         self.replay_tokens)
        return pull_job(rid, p, layout, kv.ring_slot[rid], kv.block_ids[rid], ld.replay)

    def _expire(self, ld: _Load) -> RequestOutput:
        rid, p = ld.req.request_id, ld.params
        if ld.state == "NOTIFY":                 # as on one rank: the answer is the first token anyway
            self._cmds[ld.rank].cancels.append((rid, "drop"))
            return self._finish_at_first_token(ld)
        if ld.state == "PULL":
            self._cmds[ld.rank].cancels.append((rid, "timeout"))
            self.releasing[rid] = ld.rank
        return self._fail(ld, timed_out(p.engine_id, p.host, p.port, self.timeout_s, ld.rank_state or ld.state))

    def _finish_at_first_token(self, ld: _Load) -> RequestOutput:
        del self.loads[ld.req.request_id]
        ld.req.status = ld.finish_status
        return RequestOutput(ld.req.request_id, [ld.params.first_token_id], ld.req.finish_reason,
                             ld.req.num_prompt_tokens, 1)

    def _fail(self, ld: _Load, error: str) -> RequestOutput:
        rid = ld.req.request_id
        self.loads.pop(rid, None)
        ld.req.status = RequestStatus.FINISHED_ERROR
        self.stats.inc("kv_transfer_failures_total")
        logger.warning("request %s: %s", rid, error)
        return RequestOutput(rid, [], "error", ld.req.num_prompt_tokens, 0, error=error)

    def _pulled(self, ld: _Load) -> RequestOutput:
        """Verified on its rank: the request enters that rank's scheduler at position n (or the replay's start)."""
        out = self._handed_over(ld, self.layouts[ld.rank])
        self.dp.add_request(ld.req, rank=ld.rank)      # its caches are on that rank
        return out

    def fail_all(self, error: str) -> list[RequestOutput]:
        """The ranks are gone (EngineDeadError): every pull fails; nothing is left to free."""
        self.held.clear()
        self.releasing.clear()
        return [self._fail(ld, error) for ld in list(self.loads.values())]

    # both --------------------------------------------------------------------------------------
    def poll(self) -> tuple[list[RequestOutput], list[Request]]:
        """One round trip to the ranks (when anything is open). -> (outputs, []): pulled requests are
        already in their rank's scheduler."""
        now = time.monotonic()
        expired = [rid for rid, h in self.held.items() if h.deadline < now]
        for rid in expired:
            self._cmds[self.held[rid].rank].unholds.append(rid)
        outs = self._start_loads()
        if self.held or self.releasing or any(self._cmds) or any(ld.state != "ALLOC" for ld in self.loads.values()):
            cmds, self._cmds = self._cmds, [RankKVCommands() for _ in self.agents]
            for rank, rep in enumerate(self.executor.kv_transfer(cmds)):
                outs += self._apply(rank, rep)
        for rid in expired:
            logger.warning("request %s: no decode instance read its caches in %.1f s; freed", rid, self.timeout_s)
            self._free_held(rid)
            self.stats.inc("kv_holds_expired_total")
        self.stats.set_gauges(kv_requests_held=len(self.held), kv_requests_loading=len(self.loads))
        return outs, []

    def _apply(self, rank: int, rep: RankKVReport) -> list[RequestOutput]:
        outs = []
        for rid in rep.freed:
            self._free_held(rid)
            self.stats.inc("kv_transfers_total")
        for rid in rep.released:
            self._kv(self.releasing.pop(rid)).free(rid)
        # a stopped pull is never stepped again (cancels run first on the rank): what follows is open here
        for rid, why in rep.failed.items():
            if rid in rep.landing:
                self.releasing[rid] = rank
            else:
                self._kv(rank).free(rid)
            outs.append(self._fail(self.loads[rid], why))
        for rid in rep.notified:
            outs.append(self._finish_at_first_token(self.loads[rid]))
        for rid in rep.done:
            outs.append(self._pulled(self.loads[rid]))
        for rid, state in rep.states.items():
            if (ld := self.loads.get(rid)) is not None:
                ld.rank_state = state
        return outs
