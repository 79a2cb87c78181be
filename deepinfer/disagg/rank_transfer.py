"""Prefill/decode disaggregation on rank workers (data_parallel_size > 1): the rank's half.

A rank's caches live in its worker process, and only the process that owns memory can register it
with NIXL, so each rank worker runs its own NIXL agent over its own caches and tag array (the pulls
step through pull.py's state machine, as the one-rank connector's do); the engine keeps the
bookkeeping (rank_connector.py). They meet once per engine step, while any hold, pull or
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

from dataclasses import dataclass, field

import torch

from deepinfer.disagg.layout import CacheLayout
from deepinfer.disagg.nixl_transport import NixlTransport
from deepinfer.disagg.pull import Pull, Puller, PullJob, parse_frees


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


class RankTransfer:
    def __init__(self, role: str, caches, num_ring_slots: int, host: str, port: int, rank: int) -> None:
        self.layout = CacheLayout(caches)
        self.transport = NixlTransport(role, host, port, label=f"rank{rank}",
                                       progress_wait_us=1000 if self.layout.mem_type == "DRAM" else 0)
        self.transport.register(self.layout.registrations(), self.layout.mem_type)
        # prefill: tags[slot] = nonce while held (0 = free); decode: where a peer's tag is read back into
        self.tags = torch.zeros(num_ring_slots, dtype=torch.int64)
        self.transport.register([(self.tags.data_ptr(), self.tags.numel() * 8, 0, "")], "DRAM")
        self.puller = Puller(self.transport, self.tags, self.layout.mem_type)
        self.held: dict[str, tuple[int, int]] = {}        # prefill: req_id -> (ring slot, nonce)
        self.pulls: dict[str, Pull] = {}
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
        self.pulls.update((j.req_id, Pull(j)) for j in cmds.pulls)
        self.notifies.update((j.req_id, j) for j in cmds.notifies)
        for rid, pull in list(self.pulls.items()):
            self._step(pull, rep)
        self._send_notifies(rep)
        self._poll_abandoned(rep)
        return rep

    # prefill -------------------------------------------------------------------------------------
    def _read_notifications(self, rep: RankKVReport) -> None:
        for rid, tag in parse_frees(self.transport.notifications()):
            h = self.held.get(rid)
            if h is not None and str(h[1]) == tag:
                del self.held[rid]
                self.tags[h[0]] = 0
                rep.freed.append(rid)

    # decode --------------------------------------------------------------------------------------
    def _step(self, pull: Pull, rep: RankKVReport) -> None:
        """One transition of a pull (pull.py), what came of it into the report."""
        j = pull.job
        why = self.puller.step(pull)
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

    def _cancel(self, rid: str, why: str, rep: RankKVReport) -> None:
        """Stop a pull (abort: tell the peer to free now; timeout: ask for its metadata afresh next time)
        or a notification; a pull's blocks are the engine's again once no READ can land in them."""
        if self.notifies.pop(rid, None) is not None:
            return
        pull = self.pulls.pop(rid, None)
        if pull is None:
            rep.released.append(rid)
            return
        self.puller.stop(pull, why)
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
