"""KVConnector: the one interface between the engine and a KV transfer (vLLM's KVConnector shape,
scheduler and worker halves in one object: an instance here runs one rank).

Prefill side (kv_role="prefill"):
    request_finished(req) -> bool     the scheduler's hook when a request finishes: True = keep its
                                      ring slot and blocks (the connector frees them later)
    take_params(req_id) -> dict       the hand-over, attached to the request's final output
Decode side (kv_role="decode"):
    start_load(req, params)           the request enters the connector, not the scheduler
    abort(req_id)                     stop a pull (blocks freed once no READ can still land in them)
Both:
    poll() -> (outputs, ready)        once per engine step: finished pulls (their requests go to the
                                      scheduler at position n with the prefill's first token), errors,
                                      frees of held caches (notification or deadline)

A pull runs as a small state machine, one transition per poll, each bounded by the deadline:

    ALLOC (wait for a slot and blocks; NOTIFY instead when the first token ends the request)
      -> PULL, pull.py's machine (the one rank workers run too): CONNECT (peer metadata)
         -> PULL (READ the runs) -> VERIFY (READ the peer's tag of the slot: the nonce of params?
         then the blocks were held during the whole PULL) -> notify the peer "free:<id>:<nonce>"
      -> the scheduler
    any state past the deadline, a READ in ERR, a tag that differs -> the request fails ("error")
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

import torch

from deepinfer.disagg.layout import CacheLayout
from deepinfer.disagg.nixl_transport import NixlTransport
from deepinfer.disagg.params import KVTransferParams
from deepinfer.disagg.pull import Pull, Puller, free_msg, parse_frees, pull_job, read_failed, timed_out
from deepinfer.outputs import ReplayParams, RequestOutput
from deepinfer.request import InvalidRequestError, Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class _Held:
    ring_slot: int
    tag: int
    deadline: float
    params: dict | None


@dataclass
class _Load:
    req: Request
    params: KVTransferParams
    deadline: float
    state: str = "ALLOC"                 # ALLOC | NOTIFY | PULL (pull.state: CONNECT .. DONE) | READY
    pull: Pull | None = None
    replay: ReplayParams | None = None   # window=False: positions [replay_start, n) are recomputed
    allocated: bool = False
    finish_status: RequestStatus | None = None   # the prefill's token already ends the request
    started: float = field(default_factory=time.monotonic)


class HandoverBook:
    """What both connectors (one rank's and rank workers', rank_connector.py) do alike: hand a held request's
    params over once, enter a pull after its checks, and count a verified one in. Needs held, loads,
    layout, timeout_s, stats and the connector's own pull record type as _load."""

    def take_params(self, req_id: str) -> dict | None:
        h = self.held.get(req_id)
        if h is None:
            return None
        params, h.params = h.params, None
        return params

    def start_load(self, req: Request, params: KVTransferParams) -> None:
        """Checks what can be checked at once (InvalidRequestError to the caller); the pull starts at
        the next poll."""
        rid = req.request_id
        self.check(rid, params, req.num_prompt_tokens)
        req.all_token_ids.append(params.first_token_id)
        self.loads[rid] = self._load(req, params, time.monotonic() + self.timeout_s)

    def check(self, rid: str, params: KVTransferParams, num_prompt_tokens: int) -> None:
        """What a hand-over must agree on with this instance and the request (InvalidRequestError);
        reads only what never changes (any thread)."""
        check_handover(self.layout, rid, params, num_prompt_tokens)

    def _handed_over(self, ld, layout: CacheLayout) -> RequestOutput:
        """Pulled and verified: the request leaves the connector at position n (or the replay's start)
        with the prefill's token."""
        p, rid = ld.params, ld.req.request_id
        del self.loads[rid]
        if ld.replay is None:
            ld.req.num_computed_tokens = p.num_tokens
            moved = layout.num_bytes(p.num_tokens)
        else:                                       # the scheduler runs [replay_start, n] first
            ld.req.num_computed_tokens, ld.req.handover_replay = ld.replay.replay_start, ld.replay
            moved = layout.num_bytes(ld.replay.hit, window=False)
            self.stats.inc("kv_transfer_replayed_tokens_total", p.num_tokens - ld.replay.replay_start)
        self.stats.inc("kv_transfers_total")
        self.stats.inc("kv_transfer_bytes_total", sum(moved))
        return RequestOutput(rid, [p.first_token_id], None, ld.req.num_prompt_tokens, 1)


class KVConnector(HandoverBook):
    poll_after_step = False       # polled before the step (rank workers' RankKVConnector: after it)
    _load = _Load

    def __init__(self, role: str, caches, kv_cache, stats, host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = 30.0, max_model_len: int | None = None, window: bool = True,
                 replay_tokens: int = 128) -> None:
        self.role = role
        # decode: pull the window rings + carry (exact), or only full blocks and replay (window=False)
        self.window = window
        self.replay_tokens = replay_tokens
        self.kv_cache = kv_cache            # KVCacheManager: ring slots and block tables by request id
        self.stats = stats
        self.timeout_s = timeout_s
        self.max_model_len = max_model_len
        self.layout = CacheLayout(caches)
        # host caches: the progress thread waits in poll() (1 ms timeout) instead of spinning a core
        self.transport = NixlTransport(role, host, port,
                                       progress_wait_us=1000 if self.layout.mem_type == "DRAM" else 0)
        self.transport.register(self.layout.registrations(), self.layout.mem_type)
        # prefill: tags[slot] = nonce while the slot's request is held (0 = free); decode: where a
        # peer's tag is read back into (indexed by the local slot)
        self.tags = torch.zeros(kv_cache.num_ring_slots, dtype=torch.int64)
        self.transport.register([(self.tags.data_ptr(), self.tags.numel() * 8, 0, "")], "DRAM")
        self.puller = Puller(self.transport, self.tags, self.layout.mem_type)
        self.held: dict[str, _Held] = {}
        self.loads: dict[str, _Load] = {}
        self._abandoned: list[tuple[object, str]] = []   # (handle, req_id): READs still landing in blocks
        self._rng = random.Random()

    def has_work(self) -> bool:
        return bool(self.held or self.loads or self._abandoned)

    def owns(self, req_id: str) -> bool:
        return req_id in self.held or req_id in self.loads or any(r == req_id for _, r in self._abandoned)

    # prefill side --------------------------------------------------------------------------------
    def request_finished(self, req: Request) -> bool:
        if self.role != "prefill" or req.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            return False
        rid = req.request_id
        slot, blocks = self.kv_cache.ring_slot[rid], list(self.kv_cache.block_ids[rid])
        tag = self._rng.getrandbits(62) + 1
        self.tags[slot] = tag
        n = req.num_tokens - 1                     # every position but the sampled token's is cached
        ring, pool = self.layout.num_bytes(n)
        params = KVTransferParams(self.transport.name, self.transport.host, self.transport.port, rid, n,
                                  req.all_token_ids[-1], slot, tuple(blocks), tag,
                                  tuple(self.layout.base_addrs()), self.tags.data_ptr(), self.layout.signature,
                                  ring + pool, self.layout.dev_id)
        self.held[rid] = _Held(slot, tag, time.monotonic() + self.timeout_s, params.to_dict())
        return True

    def _release(self, req_id: str) -> None:
        h = self.held.pop(req_id)
        self.tags[h.ring_slot] = 0                 # before the free: a late VERIFY sees the blocks gone
        self.kv_cache.free(req_id)

    def _poll_held(self) -> None:
        for rid, tag in parse_frees(self.transport.notifications()):
            h = self.held.get(rid)
            if h is not None and str(h.tag) == tag:
                self._release(rid)
                self.stats.inc("kv_transfers_total")
        now = time.monotonic()
        for rid in [r for r, h in self.held.items() if h.deadline < now]:
            logger.warning("request %s: no decode instance read its caches in %.1f s; freed", rid, self.timeout_s)
            self._release(rid)
            self.stats.inc("kv_holds_expired_total")

    # decode side ---------------------------------------------------------------------------------
    def abort(self, req_id: str) -> RequestOutput:
        ld = self.loads.pop(req_id)
        p = ld.params
        if ld.pull is not None:
            # the client left mid-pull: the prefill frees its held caches now, not at its deadline
            # (a READ still in flight only lands in our abandoned blocks)
            self.puller.stop(ld.pull, "abort")
        elif ld.state == "NOTIFY" and self.transport.peer_ready(p.engine_id, p.host, p.port):
            self.transport.notify(p.engine_id, free_msg(p.request_id, p.tag))
        self._drop(ld)
        ld.req.status = RequestStatus.FINISHED_ABORTED
        return RequestOutput(req_id, [], "abort", ld.req.num_prompt_tokens, 0)

    def _poll_loads(self) -> tuple[list[RequestOutput], list[Request]]:
        outs, ready = [], []
        for rid, ld in list(self.loads.items()):
            try:
                out = self._advance(ld)
            except Exception as e:  # noqa: BLE001 - one failed pull fails one request
                p = ld.params
                out = self._fail(ld, read_failed(p.engine_id, p.host, p.port, e))
            if out is not None:
                outs.append(out)
                if ld.state == "READY":
                    ready.append(ld.req)
        return outs, ready

    def _advance(self, ld: _Load) -> RequestOutput | None:
        """One transition; an output when the request leaves the connector."""
        p, rid, t = ld.params, ld.req.request_id, self.transport
        if ld.state == "ALLOC":
            ld.finish_status = self._first_token_finishes(ld.req)
            if ld.finish_status is not None:
                ld.state = "NOTIFY"
            elif self.kv_cache.allocate_slots(rid, p.num_tokens) is not None:
                ld.allocated = True
                ld.replay = self._replay_plan(ld.req, p.num_tokens)
                ld.pull = Pull(pull_job(rid, p, self.layout, self.kv_cache.ring_slot[rid],
                                        self.kv_cache.block_ids[rid], ld.replay))
                ld.state = "PULL"
        if ld.state == "NOTIFY" and (t.peer_ready(p.engine_id, p.host, p.port) or time.monotonic() > ld.deadline):
            return self._finish_at_first_token(ld)
        if ld.state == "PULL":
            why = self.puller.step(ld.pull)
            if why is not None:
                return self._fail(ld, why)
            if ld.pull.state == "DONE":
                ld.state = "READY"
                return self._handed_over(ld, self.layout)
        if time.monotonic() > ld.deadline:
            t.forget_peer(p.engine_id)
            state = ld.state if ld.pull is None else ld.pull.state
            return self._fail(ld, timed_out(p.engine_id, p.host, p.port, self.timeout_s, state))
        return None

    def _replay_plan(self, req: Request, n: int) -> ReplayParams | None:
        return None if self.window else replay_plan(req, n, self.layout.block_tokens, self.replay_tokens)

    def _first_token_finishes(self, req: Request) -> RequestStatus | None:
        return first_token_finishes(req, self.max_model_len)

    def _finish_at_first_token(self, ld: _Load) -> RequestOutput:
        """Nothing to pull: tell the prefill to free (it frees at its deadline if the peer is unreachable)."""
        p = ld.params
        del self.loads[ld.req.request_id]
        ld.req.status = ld.finish_status
        if self.transport.peer_ready(p.engine_id, p.host, p.port):
            self.transport.notify(p.engine_id, free_msg(p.request_id, p.tag))
        return RequestOutput(ld.req.request_id, [p.first_token_id], ld.req.finish_reason, ld.req.num_prompt_tokens, 1)

    def _fail(self, ld: _Load, error: str) -> RequestOutput:
        rid = ld.req.request_id
        self.loads.pop(rid, None)
        self._drop(ld)
        ld.req.status = RequestStatus.FINISHED_ERROR
        self.stats.inc("kv_transfer_failures_total")
        logger.warning("request %s: %s", rid, error)
        return RequestOutput(rid, [], "error", ld.req.num_prompt_tokens, 0, error=error)

    def _drop(self, ld: _Load) -> None:
        """Free what a pull holds; blocks a READ may still land in wait until it is over."""
        if ld.pull is not None:
            self.puller.drop_handle(ld.pull)
            if ld.pull.handle is not None:
                self._abandoned.append((ld.pull.handle, ld.req.request_id))
                return
        if ld.allocated:
            self.kv_cache.free(ld.req.request_id)

    def _poll_abandoned(self) -> None:
        keep = []
        for handle, rid in self._abandoned:
            if self.transport.state(handle) == "PROC":
                keep.append((handle, rid))
                continue
            self.transport.release(handle)
            self.kv_cache.free(rid)
        self._abandoned = keep

    # both --------------------------------------------------------------------------------------
    def poll(self) -> tuple[list[RequestOutput], list[Request]]:
        self._poll_held()
        self._poll_abandoned()
        outs, ready = self._poll_loads()
        self.stats.set_gauges(kv_requests_held=len(self.held), kv_requests_loading=len(self.loads))
        return outs, ready


# what a pull decides the same way on one rank and on rank workers (rank_connector.py) --------------
def check_handover(layout: CacheLayout, rid: str, params: KVTransferParams, num_prompt_tokens: int) -> None:
    """What a hand-over must agree on with this instance's layout and the request (InvalidRequestError)."""
    if params.layout != layout.signature:
        raise InvalidRequestError(f"request {rid}: the prefill instance's cache layout ({params.layout}) "
                                  f"differs from this decode instance's ({layout.signature}): "
                                  "same checkpoint, block_tokens and dtype on both")
    if params.num_tokens != num_prompt_tokens:
        raise InvalidRequestError(f"request {rid}: kv_transfer_params cover {params.num_tokens} positions, "
                                  f"the prompt has {num_prompt_tokens} tokens")
    if len(params.base_addrs) != len(layout.regions):
        raise InvalidRequestError(f"request {rid}: kv_transfer_params name {len(params.base_addrs)} "
                                  f"regions, this layout has {len(layout.regions)}")


def first_token_finishes(req: Request, max_model_len: int | None) -> RequestStatus | None:
    """The request may end at the prefill's token, under this instance's sampling params."""
    sp, tok = req.sampling_params, req.all_token_ids[-1]
    if not sp.ignore_eos and tok == req.eos_token_id or tok in sp.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if sp.max_tokens <= 1 or (max_model_len is not None and req.num_tokens >= max_model_len):
        return RequestStatus.FINISHED_LENGTH
    return None


def replay_plan(req: Request, n: int, block_tokens: int, replay_tokens: int) -> ReplayParams | None:
    """kv_transfer_window=False: pull the full blocks below H (a block boundary, so every compressed entry
    below it is complete and none is rewritten) and replay from s = H - min(R, H): the window keys a
    query at n or later reads all lie at or past s. None = pull the window (an image span in [s, n):
    this instance would need its embeddings to replay it)."""
    H = n // block_tokens * block_tokens
    s = H - min(replay_tokens, H)
    if any(a < n and b > s for a, b in req.image_spans):
        return None
    return ReplayParams(s, H)
