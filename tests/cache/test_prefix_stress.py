"""Prefix caching under pressure, scheduler + cache manager with a simulated device: 2,000 random
requests sharing prefixes (4 salts, system-prompt-like heads, multi-turn follow-ups), 20% aborted
at random moments, a block pool far smaller than the working set.

The simulated device writes (salt, token) into each block position a step computes (bounded
replay skips the cached positions, snapshots copy their tail block), so every hit is checked
against what was actually written: a block served across salts or with stale content fails.
Invariants after every step: exact reference counts (no block freed while referenced), the host
tier within its bound; at the end every request finished or was aborted and no block is in use,
only idle cached ones. Run without and with the host-memory tier (evicted blocks copied out and
brought back on a hit: their content is checked like any other hit's)."""

import random

import pytest

from deepinfer.cache.host_tier import HostTierIndex
from deepinfer.cache.kv_cache_manager import KVCacheManager
from deepinfer.cache.snapshot_index import SnapshotIndex
from deepinfer.outputs import ModelRunnerOutput
from deepinfer.request import Request, RequestStatus
from deepinfer.sampling_params import SamplingParams
from deepinfer.sched.prefix_admission import PrefixCaching
from deepinfer.sched.scheduler import Scheduler
from deepinfer.stats import EngineStats

BT = 4


class SimDevice:
    """Block contents and snapshot tails, written the way the runner writes the real caches."""

    def __init__(self, sched):
        self.sched = sched
        self.content: dict[int, dict[int, tuple]] = {}
        self.snap_tail: dict[int, dict[int, tuple]] = {}
        self.host: dict[int, dict[int, tuple]] = {}
        self.disk: dict[str, dict[int, tuple]] = {}      # block files by name
        self.tables: dict[str, list[int]] = {}
        self.write_from: dict[str, int] = {}
        self.violations: list[str] = []

    def run(self, out) -> ModelRunnerOutput:
        for save in out.snapshot_saves:
            self.snap_tail[save.snapshot_slot] = dict(self.content.get(save.tail_block, {})) if save.tail_block >= 0 else {}
        for copy in out.block_copies:                 # the host and disk tiers, in decision order
            if copy.kind == "offload":
                self.host[copy.host_slot] = dict(self.content.get(copy.block, {}))
            elif copy.kind == "onload":
                self.content[copy.block] = dict(self.host[copy.host_slot])
            elif copy.kind == "spill":
                self.disk[copy.key] = dict(self.host[copy.host_slot])
            elif copy.kind == "disk_onload":
                self.content[copy.block] = dict(self.disk[copy.key])
            else:
                assert copy.kind == "disk_drop", copy
                del self.disk[copy.key]
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.tables.pop(rid, None)
        starts = {}
        for new in out.new_reqs:
            self.tables[new.req_id] = list(new.block_ids)
            self.write_from[new.req_id] = new.replay.hit if new.replay else 0
            if new.restore is not None and new.restore.tail_block >= 0:
                self.content[new.restore.tail_block] = dict(self.snap_tail[new.restore.snapshot_slot])
            req = self.sched.requests[new.req_id]
            cached = new.replay.hit if new.replay else new.num_computed_tokens
            for p in range(cached):   # what the hit promises
                got = self.content.get(self.tables[new.req_id][p // BT], {}).get(p % BT)
                if got != (req.cache_salt, req.all_token_ids[p]):
                    self.violations.append(f"{new.req_id} pos {p}: cached {got}, wants {(req.cache_salt, req.all_token_ids[p])}")
            starts[new.req_id] = new.num_computed_tokens
        for diff in out.cached_reqs:
            t = self.tables[diff.req_id]
            del t[diff.num_blocks:]
            t.extend(diff.new_block_ids)
            starts[diff.req_id] = diff.num_computed_tokens
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            start = starts[rid]
            for p in range(start, start + n):
                if p < self.write_from[rid] or p >= req.num_tokens:
                    continue
                self.content.setdefault(self.tables[rid][p // BT], {})[p % BT] = (req.cache_salt, req.all_token_ids[p])
            req_ids.append(rid)
            sampled.append([] if req.num_computed_tokens < req.num_tokens else [req.num_tokens % 97 + 3])
        return ModelRunnerOutput(req_ids, sampled)


@pytest.mark.parametrize("host_slots", [0, 40])
def test_two_thousand_requests_sharing_prefixes_with_aborts(host_slots):
    rng = random.Random(17)
    stats = EngineStats()
    host = HostTierIndex(host_slots) if host_slots else None
    kv = KVCacheManager(48, BT, num_ring_slots=12, enable_prefix_caching=True, host_tier=host)
    prefix = PrefixCaching(kv, replay_tokens=8, snapshots=SnapshotIndex(32, BT, ttl_s=1e9), stats=stats)
    sched = Scheduler(12, 40, 48 * BT, kv, stats, prefix=prefix)
    dev = SimDevice(sched)
    heads = {salt: [[rng.randrange(10, 90) for _ in range(rng.randint(4, 30))] for _ in range(3)]
             for salt in (None, "a", "b", "c")}
    history: list[tuple] = []          # (salt, prompt + output) of finished requests: next turns
    finished, aborted, submitted, n = {}, set(), 0, 2000
    to_abort: dict[str, int] = {}
    while len(finished) + len(aborted) < n:
        while submitted < n and len(sched.requests) < 30:
            salt = rng.choice([None, "a", "b", "c"])
            if history and rng.random() < 0.4:
                salt, base = rng.choice(history[-4:])                 # a later turn of a recent conversation
            else:
                base = rng.choice(heads[salt])
            prompt = list(base) + [rng.randrange(10, 90) for _ in range(rng.randint(1, 12))]
            if len(prompt) > 120:
                prompt = prompt[-60:]
            req = Request(f"r{submitted}", prompt, SamplingParams(max_tokens=rng.randint(1, 6), temperature=0,
                                                                   ignore_eos=True), cache_salt=salt)
            sched.add_request(req)
            if rng.random() < 0.2:
                to_abort[req.request_id] = rng.randint(0, 8)   # steps from now (it may finish first)
            submitted += 1
        for rid, left in list(to_abort.items()):
            if left == 0:
                del to_abort[rid]
                for o in sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED):
                    aborted.add(o.request_id)
            else:
                to_abort[rid] = left - 1
        out = sched.schedule()
        reqs = {r: sched.requests[r] for r in out.num_scheduled_tokens}
        for o in sched.update_from_output(out, dev.run(out)):
            if o.finished:
                finished[o.request_id] = o
                r = reqs[o.request_id]
                assert o.num_cached_tokens <= r.num_prompt_tokens
                if rng.random() < 0.5:
                    history.append((r.cache_salt, list(r.all_token_ids)))
        kv.check()
        if host is not None:
            host.check()
            assert len(host) <= host_slots and len(dev.host) <= host_slots
    dev.run(sched.schedule())  # the last snapshot saves
    assert not dev.violations, dev.violations[:5]
    assert len(aborted) >= 0.1 * n and len(finished) + len(aborted) == n
    assert all(o.finish_reason == "length" for o in finished.values())
    assert not sched.requests and kv.num_used_blocks == 0
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    kv.check()
    c = stats.counters
    print({k: v for k, v in c.items() if k.startswith("prefix") or k == "preemptions_total"})
    assert c["prefix_cache_hits_total"] > 0.2 * c["prefix_cache_queries_total"]
    assert c["prefix_cache_replayed_tokens_total"] > 0 and c["prefix_cache_snapshot_hits_total"] > 0
    assert c["prefix_cache_evictions_total"] > 0 and c["preemptions_total"] > 0
    if host is not None:
        assert c["prefix_cache_host_offloads_total"] > 0 and c["prefix_cache_host_hits_total"] > 0
