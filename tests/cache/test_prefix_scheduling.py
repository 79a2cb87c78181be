"""The scheduler's use of the prefix cache, with a fake runner: a request whose prefix another
running request is computing waits for those blocks instead of computing them twice; hits start
past the prefix (replay start, or a snapshot's end); num_cached_tokens reaches the outputs."""

from deepinfer.cache.kv_cache_manager import KVCacheManager
from deepinfer.cache.snapshot_index import SnapshotIndex
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from deepinfer.sched.prefix_admission import PrefixCaching
from deepinfer.sched.scheduler import Scheduler
from deepinfer.stats import EngineStats
from tests.engine.conftest import fake_runner_output


def make(snapshots=0, budget=64):
    stats = EngineStats()
    kv = KVCacheManager(64, 4, num_ring_slots=8, enable_prefix_caching=True)
    prefix = PrefixCaching(kv, replay_tokens=8, snapshots=SnapshotIndex(snapshots, 4) if snapshots else None, stats=stats)
    return Scheduler(8, budget, 256, kv, stats, prefix=prefix), stats


def req(rid, tokens, max_tokens=2):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def step(sched):
    out = sched.schedule()
    return out, sched.update_from_output(out, fake_runner_output(out, sched))


def test_second_request_waits_for_blocks_the_first_computes():
    sched, stats = make()
    shared = list(range(10, 30))                  # 5 full blocks of 4
    sched.add_request(req("a", shared + [1, 2]))
    sched.add_request(req("b", shared + [3, 4]))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 22}  # b waits: a is computing its blocks
    out, _ = step(sched)
    assert out.new_reqs[0].req_id == "b" and out.new_reqs[0].replay.hit == 20
    assert out.num_scheduled_tokens["b"] == 22 - 12   # replay [12, 20) + its own 2 tokens
    assert stats.counters["computed_tokens_total"] == 22 + 1 + 10


def test_without_shared_blocks_nobody_waits():
    sched, _ = make()
    sched.add_request(req("a", list(range(10, 30))))
    sched.add_request(req("b", list(range(40, 60))))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 20, "b": 20}


def test_next_turn_lands_on_the_snapshot_and_reports_cached_tokens():
    sched, stats = make(snapshots=4)
    p1 = list(range(10, 21))                      # 11 tokens
    sched.add_request(req("t1", p1, max_tokens=3))
    finals = []
    while sched.has_unfinished_requests():
        finals += [o for o in step(sched)[1] if o.finished]
    t1 = p1 + [7, 7, 7]                           # the fake runner samples 7
    sched.add_request(req("t2", t1 + [50, 51]))
    out, res = step(sched)
    assert [s.snapshot_slot for s in out.snapshot_saves] == [0]      # t1's window state, copied out first
    new = out.new_reqs[0]
    assert new.restore is not None and new.replay is None
    assert new.num_computed_tokens == len(t1) - 1 == 13              # C: t1's last token never ran
    assert new.restore.tail_block == new.block_ids[3]                # positions 12..13 in a partial block
    assert out.num_scheduled_tokens == {"t2": 3}
    assert res[0].num_cached_tokens == 13 and finals[0].num_cached_tokens == 0
    assert stats.counters["prefix_cache_snapshot_hits_total"] == 1
