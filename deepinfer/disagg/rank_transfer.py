"""Prefill/decode disaggregation on rank workers (data_parallel_size > 1): the rank's half.

A rank's caches live in its worker process, and only the process that owns memory can register it
with NIXL, so each rank worker runs its own NIXL agent over its own caches and tag array; the engine
keeps the bookkeeping (rank_connector.py). They meet once per engine step, while any hold, pull or
release is open, in one ("kv", RankKVCommands) -> ("kv", RankKVReport) round trip per rank
(executor.kv_transfer; the pattern of image_ahead.py):

    engine (RankKVConnector)                            rank r (RankTransfer)
    holds, deadlines, ring slots and block ids,   --->  holds: tag[slot] = nonce; unholds: tag[slot] = 0
    the runs of each pull (a mirror of the              pulls: CONNECT -> PULL (READ the runs) -> VERIFY
    rank's CacheLayout), the request states             (READ the peer's tag: still the nonce?) -> notify
                                                        the peer "free:<id>:<nonce>", one transition a trip
                                                  <---  freed (holds a decode's notification released: tag
                                                        zeroed here, blocks freed by the engine), done,
                                                        failed (blocks back at once, or with `released`
                                                        once a READ still landing is over), released
                                                        (stopped pulls whose READs are over), notified

The tag of a slot is zeroed on the rank before the engine frees its blocks (a deadline's unhold goes
out, the blocks are freed on the reply), and the rank's messages run in order, so no step that reuses
the blocks runs on the rank while a decode could still read the old nonce. A hold's nonce is written
in the round trip that ends the engine step which finished the request, before its params leave.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from deepinfer.disagg.layout import CacheLayout
from deepinfer.disagg.nixl_transport import NixlTransport
from deepinfer.disagg.params import TRANSIENT_PULL_FAILURE

logger = logging.getLogger(__name__)


@dataclass
class PullJob:
    """One request's pull on the rank that got it (the runs pair up one to one)."""
    req_id: str
    peer: str                                 # the prefill rank's agent name (KVTransferParams.engine_id)
    host: str
    port: int
    local_runs: list[tuple[int, int, int]]    # (address, bytes, device id) in this rank's caches
    remote_runs: list[tuple[int, int, int]]   # the same runs in the prefill rank's caches
    local_slot: int                           # this request's ring slot here (its tag is read into it)
    remote_tag_addr: int                      # the prefill's tag of the request's slot
    tag: int                                  # the nonce that tag must still hold after the READ
    peer_req_id: str                          # the request's id on the prefill instance

    @property
    def free_msg(self) -> bytes:
        return f"free:{self.peer_req_id}:{self.tag}".encode()


@dataclass
class NotifyJob:
    """Tell a prefill rank to free once its metadata is in (the first token ended the request)."""
    req_id: str
    peer: str
    host: str
    port: int
    free_msg: bytes


@dataclass
class RankKVCommands:
    holds: list[tuple[str, int, int]] = field(default_factory=list)   # prefill: (req_id, ring slot, nonce)
    unholds: list[str] = field(default_factory=list)                  # prefill: holds past their deadline
    pulls: list[PullJob] = field(default_factory=list)                # decode: start these
    notifies: list[NotifyJob] = field(default_factory=list)           # decode: first token ended them
    cancels: list[tuple[str, str]] = field(default_factory=list)      # decode: (req_id, "abort" | "timeout" | "drop")

    def __bool__(self) -> bool:
        return bool(self.holds or self.unholds or self.pulls or self.notifies or self.cancels)


@dataclass
class RankKVReport:
    freed: list[str] = field(default_factory=list)          # prefill: holds freed by a decode's notification
    done: list[str] = field(default_factory=list)           # decode: pulled, verified, the peer told to free
    failed: dict[str, str] = field(default_factory=dict)    # decode: req_id -> why the pull failed
    landing: list[str] = field(default_factory=list)        # decode: failed, a READ still in flight (-> released)
    released: list[str] = field(default_factory=list)       # decode: stopped pulls no READ lands in any more
    notified: list[str] = field(default_factory=list)       # decode: NotifyJobs sent
    states: dict[str, str] = field(default_factory=dict)    # decode: open pulls -> CONNECT | PULL | VERIFY


@dataclass
class _Pull:
    job: PullJob
    state: str = "CONNECT"
    handle: object = None


class RankTransfer:
    def __init__(self, role: str, caches, num_ring_slots: int, host: str, port: int, rank: int) -> None:
        self.layout = CacheLayout(caches)
        self.transport = NixlTransport(role, host, port, label=f"rank{rank}",
                                       progress_wait_us=1000 if self.layout.mem_type == "DRAM" else 0)
        self.transport.register(self.layout.registrations(), self.layout.mem_type)
        # prefill: tags[slot] = nonce while held (0 = free); decode: where a peer's tag is read back into
        self.tags = torch.zeros(num_ring_slots, dtype=torch.int64)
        self.transport.register([(self.tags.data_ptr(), self.tags.numel() * 8, 0, "")], "DRAM")
        self.held: dict[str, tuple[int, int]] = {}        # prefill: req_id -> (ring slot, nonce)
        self.pulls: dict[str, _Pull] = {}
        self.notifies: dict[str, NotifyJob] = {}
        self.abandoned: dict[str, object] = {}            # req_id -> READ still landing in its blocks

    def info(self) -> dict:
        """What the engine puts in this rank's hand-overs and computes its runs with."""
        t = self.transport
        return {"engine_id": t.name, "host": t.host, "port": t.port, "tag_addr": self.tags.data_ptr(),
                "layout": self.layout.describe()}

    def handle(self, cmds: RankKVCommands) -> RankKVReport:
        rep = RankKVReport()
        for rid, slot, tag in cmds.holds:
            self.tags[slot] = tag
            self.held[rid] = (slot, tag)
        for rid in cmds.unholds:                    # zeroed before the engine frees the blocks
            self.tags[self.held.pop(rid)[0]] = 0
        self._read_notifications(rep)
        for rid, why in cmds.cancels:
            self._cancel(rid, why, rep)
        self.pulls.update((j.req_id, _Pull(j)) for j in cmds.pulls)
        self.notifies.update((j.req_id, j) for j in cmds.notifies)
        for rid, pull in list(self.pulls.items()):
            self._step(pull, rep)
        self._send_notifies(rep)
        self._poll_abandoned(rep)
        return rep

    # prefill -------------------------------------------------------------------------------------
    def _read_notifications(self, rep: RankKVReport) -> None:
        for msg in self.transport.notifications():
            kind, _, rest = msg.decode(errors="replace").partition(":")
            rid, _, tag = rest.rpartition(":")
            h = self.held.get(rid)
            if kind == "free" and h is not None and str(h[1]) == tag:
                del self.held[rid]
                self.tags[h[0]] = 0
                rep.freed.append(rid)

    # decode --------------------------------------------------------------------------------------
    def _step(self, pull: _Pull, rep: RankKVReport) -> None:
        """One transition of a pull (connector.KVConnector._advance's CONNECT .. VERIFY, on this rank)."""
        j = pull.job
        try:
            why = self._advance(pull)
        except Exception as e:  # noqa: BLE001 - one failed pull fails one request
            why = f"{TRANSIENT_PULL_FAILURE} {j.peer} at {j.host}:{j.port} failed: {type(e).__name__}: {e}"
            self._drop_handle(pull)
        if why is not None:
            del self.pulls[j.req_id]
            rep.failed[j.req_id] = why
            if pull.handle is not None:         # a READ the failure left in flight: its blocks wait for it
                self.abandoned[j.req_id] = pull.handle
                rep.landing.append(j.req_id)
        elif pull.state == "DONE":
            del self.pulls[j.req_id]
            rep.done.append(j.req_id)
        else:
            rep.states[j.req_id] = pull.state

    def _advance(self, pull: _Pull) -> str | None:
        """-> why the pull failed, or None."""
        j, t = pull.job, self.transport
        if pull.state == "CONNECT" and t.peer_ready(j.peer, j.host, j.port):
            if j.local_runs:
                pull.handle, pull.state = t.read(j.peer, j.local_runs, j.remote_runs, self.layout.mem_type), "PULL"
            else:                                   # a replay of the whole prompt: only the check
                pull.handle, pull.state = self._read_tag(j), "VERIFY"
        if pull.state in ("PULL", "VERIFY"):
            state = t.state(pull.handle)
            if state == "ERR":
                t.forget_peer(j.peer)
                self._drop_handle(pull)
                return f"{TRANSIENT_PULL_FAILURE} {j.peer} at {j.host}:{j.port} failed"
            if state == "DONE":
                t.release(pull.handle)
                pull.handle = None
                if pull.state == "PULL":
                    pull.handle, pull.state = self._read_tag(j), "VERIFY"
                elif int(self.tags[j.local_slot]) != j.tag:
                    return (f"the KV blocks of request {j.peer_req_id} no longer exist on prefill instance "
                            f"{j.peer} (freed after its kv_transfer_timeout_s, or never held)")
                else:
                    t.notify(j.peer, j.free_msg)
                    pull.state = "DONE"
        return None

    def _read_tag(self, j: PullJob):
        self.tags[j.local_slot] = 0
        return self.transport.read(j.peer, [(self.tags.data_ptr() + 8 * j.local_slot, 8, 0)],
                                   [(j.remote_tag_addr, 8, 0)], "DRAM")

    def _drop_handle(self, pull: _Pull) -> None:
        """Release a finished handle; one still in flight stays in pull.handle (abandoned by the caller)."""
        if pull.handle is not None and self.transport.state(pull.handle) != "PROC":
            self.transport.release(pull.handle)
            pull.handle = None

    def _cancel(self, rid: str, why: str, rep: RankKVReport) -> None:
        """Stop a pull (abort: tell the peer to free now; timeout: ask for its metadata afresh next time)
        or a notification; a pull's blocks are the engine's again once no READ can land in them."""
        if self.notifies.pop(rid, None) is not None:
            return
        pull = self.pulls.pop(rid, None)
        if pull is None:
            rep.released.append(rid)
            return
        j, t = pull.job, self.transport
        if why == "abort" and t.peer_ready(j.peer, j.host, j.port):
            t.notify(j.peer, j.free_msg)            # the prefill frees now, not at its deadline
        elif why == "timeout":
            t.forget_peer(j.peer)
        self._drop_handle(pull)
        if pull.handle is not None:
            self.abandoned[rid] = pull.handle
        else:
            rep.released.append(rid)

    def _send_notifies(self, rep: RankKVReport) -> None:
        for rid, j in list(self.notifies.items()):
            if self.transport.peer_ready(j.peer, j.host, j.port):
                self.transport.notify(j.peer, j.free_msg)
                del self.notifies[rid]
                rep.notified.append(rid)

    def _poll_abandoned(self, rep: RankKVReport) -> None:
        for rid, handle in list(self.abandoned.items()):
            if self.transport.state(handle) != "PROC":
                self.transport.release(handle)
                del self.abandoned[rid]
                rep.released.append(rid)
