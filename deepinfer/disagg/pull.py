"""One request's pull of its caches from a prefill instance: the state machine both decode halves
drive, the one-rank KVConnector (connector.py) in the engine's process and each rank worker's
RankTransfer (rank_transfer.py) in its own. They differ only in whose NIXL agent and tag array
(Puller) and whose slot and blocks the runs name (PullJob); the transitions and their rules live here.

    CONNECT (wait for the peer's metadata)
      -> PULL (READ the runs; none: a replay of the whole prompt goes straight to VERIFY)
      -> VERIFY (READ the peer's tag of the slot into ours: still the nonce? then the blocks were
         held during the whole PULL) -> notify the peer "free:<id>:<nonce>" -> DONE
    a READ in ERR (the peer forgotten: it may have restarted), a tag that differs, an exception
      -> step() says why the pull failed
    stop(): abort (the peer told to free now, not at its deadline) or timeout (the peer forgotten)

A READ still in flight when a pull fails or stops stays in pull.handle: its blocks are not free
until it is over (the caller polls it). The deadline is the caller's (the engine's): timed_out()
words it alike on both.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.disagg.layout import CacheLayout
from deepinfer.disagg.nixl_transport import NixlTransport
from deepinfer.disagg.params import TRANSIENT_PULL_FAILURE, KVTransferParams
from deepinfer.outputs import ReplayParams


# the wire format of a decode's word to the prefill: free the held caches of <id> if still <nonce>
def free_msg(peer_req_id: str, tag: int) -> bytes:
    return f"free:{peer_req_id}:{tag}".encode()


def parse_frees(msgs: list[bytes]) -> list[tuple[str, str]]:
    """(request id, nonce as text) of each free_msg among a prefill agent's notifications."""
    frees = []
    for msg in msgs:
        kind, _, rest = msg.decode(errors="replace").partition(":")
        rid, _, tag = rest.rpartition(":")
        if kind == "free":
            frees.append((rid, tag))
    return frees


# a transient failure's words (the router retries those on another prefill replica: params.py)
def read_failed(peer: str, host: str, port: int, exc: Exception | None = None) -> str:
    why = "" if exc is None else f": {type(exc).__name__}: {exc}"
    return f"{TRANSIENT_PULL_FAILURE} {peer} at {host}:{port} failed{why}"


def timed_out(peer: str, host: str, port: int, timeout_s: float, state: str) -> str:
    return f"{TRANSIENT_PULL_FAILURE} {peer} at {host}:{port} timed out after {timeout_s:g} s (state {state})"


@dataclass
class PullJob:
    """One request's pull on the agent that runs it (the runs pair up one to one)."""
    req_id: str
    peer: str                                 # the prefill's agent name (KVTransferParams.engine_id)
    host: str
    port: int
    local_runs: list[tuple[int, int, int]]    # (address, bytes, device id) in this agent's caches
    remote_runs: list[tuple[int, int, int]]   # the same runs in the prefill's caches
    local_slot: int                           # this request's ring slot here (its tag is read into it)
    remote_tag_addr: int                      # the prefill's tag of the request's slot
    tag: int                                  # the nonce that tag must still hold after the READ
    peer_req_id: str                          # the request's id on the prefill instance

    @property
    def free_msg(self) -> bytes:
        return free_msg(self.peer_req_id, self.tag)


def pull_job(req_id: str, p: KVTransferParams, layout: CacheLayout, slot: int, block_ids,
             replay: ReplayParams | None) -> PullJob:
    """The runs of n = p.num_tokens positions (window rings, carry, blocks), or with a replay plan only
    the full blocks below replay.hit (the decode recomputes the window)."""
    n, window = (p.num_tokens, True) if replay is None else (replay.hit, False)
    local = layout.runs(n, slot, block_ids, window=window)
    remote = layout.runs(n, p.ring_slot, p.block_ids, p.base_addrs, window=window, dev_id=p.dev_id)
    return PullJob(req_id, p.engine_id, p.host, p.port, local, remote, slot, p.tag_addr + 8 * p.ring_slot, p.tag,
                   p.request_id)


@dataclass
class Pull:
    job: PullJob
    state: str = "CONNECT"                    # CONNECT | PULL | VERIFY | DONE
    handle: object = None                     # the READ posted (runs, or the tag)


class Puller:
    """Steps pulls over one NIXL agent and its tag array (tags[slot]: where a peer's tag is read into)."""

    def __init__(self, transport: NixlTransport, tags, mem_type: str) -> None:
        self.transport, self.tags, self.mem_type = transport, tags, mem_type

    def step(self, pull: Pull) -> str | None:
        """One transition (as far as the peer and the READs allow now). -> why the pull failed, or None
        (pull.state DONE: verified, the peer told to free)."""
        try:
            return self._advance(pull)
        except Exception as e:  # noqa: BLE001 - one failed pull fails one request
            self.drop_handle(pull)
            return read_failed(pull.job.peer, pull.job.host, pull.job.port, e)

    def _advance(self, pull: Pull) -> str | None:
        j, t = pull.job, self.transport
        if pull.state == "CONNECT" and t.peer_ready(j.peer, j.host, j.port):
            if j.local_runs:
                pull.handle, pull.state = t.read(j.peer, j.local_runs, j.remote_runs, self.mem_type), "PULL"
            else:                                   # a replay of the whole prompt: only the check
                pull.handle, pull.state = self._read_tag(j), "VERIFY"
        if pull.state in ("PULL", "VERIFY"):
            state = t.state(pull.handle)
            if state == "ERR":
                t.forget_peer(j.peer)
                self.drop_handle(pull)
                return read_failed(j.peer, j.host, j.port)
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
        """READ the peer's tag of the slot into ours (VERIFY compares it with the job's nonce)."""
        self.tags[j.local_slot] = 0
        return self.transport.read(j.peer, [(self.tags.data_ptr() + 8 * j.local_slot, 8, 0)],
                                   [(j.remote_tag_addr, 8, 0)], "DRAM")

    def stop(self, pull: Pull, why: str) -> None:
        """abort: the client left, the peer frees now (not at its deadline); timeout: ask for the peer's
        metadata afresh next time. A READ still landing stays in pull.handle."""
        j, t = pull.job, self.transport
        if why == "abort" and t.peer_ready(j.peer, j.host, j.port):
            t.notify(j.peer, j.free_msg)
        elif why == "timeout":
            t.forget_peer(j.peer)
        self.drop_handle(pull)

    def drop_handle(self, pull: Pull) -> None:
        """Release a finished READ; one still in flight stays in pull.handle."""
        if pull.handle is not None and self.transport.state(pull.handle) != "PROC":
            self.transport.release(pull.handle)
            pull.handle = None
