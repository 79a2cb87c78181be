"""Prefix caching, the scheduler's side: what a new request reuses, and what an ending one leaves.

The Scheduler calls five hooks (and nothing else of this module decides its loop):

    on_add(req)          hash the prompt's full blocks (cache/block_hash.py chain, cache_salt at the root)
    plan_hit(req)        at admission: the longest reuse, one of
                           snapshot  positions [0, C) from a window snapshot + cached blocks: exact
                           replay    a run of k cached blocks, H = k*B: start at s = H - min(R, H)
                                     and rebuild the window over [s, H) (outputs.ReplayParams)
                           wait      the next block is being computed by a running request: come
                                     back next step rather than compute it twice
    after_step(running)  register blocks that became full and written (shared from now on)
    on_release(req)      preempted or finished: forget what it was computing
    on_finish(req, ok)   a request that ended normally leaves a window snapshot at C = tokens - 1

Two read-only looks come from outside the Scheduler:

    expected_start(req)  (the engine, at add_request) the start a hit would give now: images whose
                         spans end before it are not encoded
    cached_tokens(req)   (parallel/dp_scheduler.py) how much of the request this rank's cache holds:
                         prefix-aware DP placement

Requests with images key their span positions by the image's content (cache/image_keys.py), in
the block hashes and the snapshot tails alike; a replay never starts inside an image span (it
moves back to the span's start) and a snapshot ending inside one is not used.

A hit needs at least one block (or a snapshot) and leaves at least the prompt's last token to run
(its logits). A snapshot is chosen over replay when it covers at least H - R positions (then it
costs no more compute, and it is exact).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.cache.block_hash import extend_block_hashes, root_hash
from deepinfer.cache.image_keys import request_cache_keys
from deepinfer.cache.kv_cache_manager import KVCacheManager
from deepinfer.cache.snapshot_index import SnapshotIndex
from deepinfer.outputs import ReplayParams, SnapshotCopy
from deepinfer.request import Request
from deepinfer.stats import EngineStats


@dataclass
class PrefixHit:
    blocks: list[int]                   # cached blocks that lead the request's table (shared)
    num_cached_tokens: int              # positions whose KV comes from the cache (H, or C for a snapshot)
    start: int                          # num_computed_tokens to admit the request with (s, or C)
    replay: ReplayParams | None = None
    snapshot_slot: int | None = None
    wait: bool = False                  # a running request is computing the next block: not now


class PrefixCaching:
    def __init__(self, kv_cache: KVCacheManager, replay_tokens: int, snapshots: SnapshotIndex | None,
                 stats: EngineStats) -> None:
        self.kv = kv_cache
        self.block_tokens = kv_cache.block_tokens
        self.replay_tokens = replay_tokens
        self.snapshots = snapshots
        self.stats = stats
        self._computing: dict[bytes, str] = {}     # hash of a block a running request is computing -> req_id
        self._saves: list[SnapshotCopy] = []       # snapshots to copy out at the next step
        self._seen: dict[str, int] = {}            # pool / host-tier counts already added to stats

    def _hashes(self, req: Request) -> list[bytes]:
        return extend_block_hashes(req.block_hashes, request_cache_keys(req), self.block_tokens, req.cache_salt)

    def on_add(self, req: Request) -> None:
        self._hashes(req)

    # admission ---------------------------------------------------------------------------------
    def plan_hit(self, req: Request) -> PrefixHit | None:
        B, N = self.block_tokens, req.num_tokens
        hashes = self._hashes(req)
        max_blocks = (N - 1) // B
        blocks = self.kv.find_cached_blocks(hashes, max_blocks)
        if len(blocks) < max_blocks and self.kv.onload(hashes, max_blocks):   # the host tier extends it
            blocks = self.kv.find_cached_blocks(hashes, max_blocks)
        k = len(blocks)
        if k < len(hashes) and self._computing.get(hashes[k], req.request_id) != req.request_id:
            return PrefixHit([], 0, 0, wait=True)
        H = k * B
        snap = self._find_snapshot(req, hashes, k, H)
        if snap is not None:
            j = snap.num_tokens // B
            return PrefixHit(blocks[:j], snap.num_tokens, snap.num_tokens, snapshot_slot=snap.slot)
        if k == 0:
            return None
        s = H - min(self.replay_tokens, H)
        for a, b in req.image_spans:       # chunks never cut an image: replay its whole span
            if a < s < b:
                s = a
        return PrefixHit(blocks, H, s, replay=ReplayParams(s, H))

    def expected_start(self, req: Request) -> int:
        """Where plan_hit would start the request now, from device blocks alone: the images whose
        spans end at or before it need no encode (never read). Changes nothing but a snapshot's
        LRU place; a guess (a host-tier onload may change the plan), checked again at admission."""
        B, N = self.block_tokens, req.num_tokens
        hashes = self._hashes(req)
        k = len(self.kv.find_cached_blocks(hashes, (N - 1) // B))
        H = k * B
        snap = self._find_snapshot(req, hashes, k, H)
        if snap is not None:
            return snap.num_tokens
        s = H - min(self.replay_tokens, H)
        for a, b in req.image_spans:
            if a < s < b:
                s = a
        return s

    def cached_tokens(self, req: Request, also: set | None = None) -> int:
        """Prompt positions this rank could serve from its cache now (device blocks, then the blocks its
        host / disk tiers hold past them, which an admission onloads; or a longer window snapshot), for
        placement (parallel/dp_scheduler.py). `also`: block hashes counted as cached (being computed by
        requests placed here). Changes nothing but a snapshot's LRU place."""
        B, N = self.block_tokens, req.num_tokens
        hashes = self._hashes(req)
        max_blocks = (N - 1) // B
        k = len(self.kv.find_cached_blocks(hashes, max_blocks))
        k += self.kv.tiered_run(hashes, k, max_blocks)
        if also:
            while k < max_blocks and hashes[k] in also:
                k += 1
        snap = self._find_snapshot(req, hashes, k, k * B)
        return max(k * B, snap.num_tokens if snap is not None else 0)

    def _find_snapshot(self, req: Request, hashes: list[bytes], k: int, H: int):
        if self.snapshots is None or not len(self.snapshots):
            return None
        B, N = self.block_tokens, req.num_tokens
        for j in range(k, -1, -1):
            if j * B < H - self.replay_tokens:
                break
            parent = hashes[j - 1] if j else root_hash(req.cache_salt)
            snap = self.snapshots.find(parent, request_cache_keys(req), j * B, min(N - 1, (j + 1) * B - 1))
            if snap is not None and not any(a < snap.num_tokens < b for a, b in req.image_spans):
                return snap
        return None

    def admitted(self, req: Request, hit: PrefixHit | None) -> None:
        """The request got its blocks: count the hit, remember which prompt blocks it computes."""
        cached = hit.num_cached_tokens if hit is not None else 0
        if req.num_cached_tokens is None:          # the first admission is what the caller is told
            req.num_cached_tokens = min(cached, req.num_prompt_tokens)
        self.stats.inc("prefix_cache_queries_total", req.num_tokens)
        self.stats.inc("prefix_cache_hits_total", cached)
        if hit is not None and hit.replay is not None:
            self.stats.inc("prefix_cache_replayed_tokens_total", hit.replay.hit - hit.replay.replay_start)
        if hit is not None and hit.snapshot_slot is not None:
            self.stats.inc("prefix_cache_snapshot_hits_total")
        hashes = req.block_hashes
        for h in hashes[len(hit.blocks) if hit is not None else 0:]:
            self._computing.setdefault(h, req.request_id)

    # while running -----------------------------------------------------------------------------
    def after_step(self, running: list[Request]) -> None:
        for name, now in (("prefix_cache_evictions_total", self.kv.pool.num_evictions),
                          ("prefix_cache_host_offloads_total", self.kv.num_offloads),
                          ("prefix_cache_host_hits_total", self.kv.num_onloads - self.kv.num_disk_onloads),
                          ("prefix_cache_disk_spills_total", self.kv.num_spills),
                          ("prefix_cache_disk_hits_total", self.kv.num_disk_onloads)):
            seen = self._seen.get(name, 0)
            if now != seen:
                self.stats.inc(name, now - seen)
                self._seen[name] = now
        for req in running:
            hashes = self._hashes(req)
            before = self.kv.num_hashed.get(req.request_id, 0)
            self.kv.cache_full_blocks(req.request_id, hashes, min(req.num_computed_tokens, req.num_tokens))
            for h in hashes[before:self.kv.num_hashed.get(req.request_id, 0)]:
                if self._computing.get(h) == req.request_id:
                    del self._computing[h]

    def on_release(self, req: Request) -> None:
        for h in req.block_hashes:
            if self._computing.get(h) == req.request_id:
                del self._computing[h]

    def on_finish(self, req: Request, ended_normally: bool, failed: bool) -> None:
        """Before the request's blocks are freed: cache what it wrote (nothing if its step failed),
        and leave a window snapshot when it ended normally."""
        rid = req.request_id
        if rid not in self.kv.block_ids:
            return
        if failed:
            self.kv.forget_blocks(rid)
            return
        hashes = self._hashes(req)
        self.kv.cache_full_blocks(rid, hashes, min(req.num_computed_tokens, req.num_tokens))
        C = req.num_tokens - 1
        if not ended_normally or self.snapshots is None or req.num_computed_tokens < C or C < 1:
            return
        B = self.block_tokens
        j = C // B
        if self.kv.num_hashed[rid] < j:
            return   # the blocks under it are not all cached (duplicates held elsewhere): no anchor
        parent = hashes[j - 1] if j else root_hash(req.cache_salt)
        slot = self.snapshots.add(parent, C, tuple(request_cache_keys(req)[j * B:C]))
        if slot is None:
            return
        table = self.kv.block_ids[rid]
        self._saves.append(SnapshotCopy(slot, self.kv.ring_slot[rid], table[j] if C % B else -1))
        self.stats.inc("prefix_cache_snapshots_saved_total")

    def take_saves(self) -> list[SnapshotCopy]:
        saves, self._saves = self._saves, []
        return saves
