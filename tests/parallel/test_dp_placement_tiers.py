"""Prefix-aware DP placement counts the ranks' host / disk tiers: a conversation's next turn goes to the rank
whose host tier holds its earlier turn's blocks (evicted from that rank's device pool), and is admitted there
with those blocks onloaded. Real Schedulers, KV managers and tier indexes; the device is simulated
(tests/cache/test_prefix_stress.SimDevice writes and checks the block contents the runner would)."""

from __future__ import annotations

import pytest

from deepinfer.cache.disk_tier import DiskTierIndex
from deepinfer.cache.host_tier import HostTierIndex
from deepinfer.cache.kv_cache_manager import KVCacheManager
from deepinfer.parallel.dp_scheduler import DataParallelScheduler
from deepinfer.request import Request, RequestStatus
from deepinfer.sampling_params import SamplingParams
from deepinfer.sched.prefix_admission import PrefixCaching
from deepinfer.sched.scheduler import Scheduler
from deepinfer.stats import EngineStats
from tests.cache.test_prefix_stress import BT, SimDevice


def rank(host_slots: int = 0, disk_blocks: int = 0):
    """One rank's Scheduler with prefix caching (host / disk tiers where given slots) and its simulated device."""
    host = HostTierIndex(host_slots) if host_slots else None
    disk = DiskTierIndex(disk_blocks) if disk_blocks else None
    kv = KVCacheManager(10, BT, num_ring_slots=4, enable_prefix_caching=True, host_tier=host, disk_tier=disk)
    sched = Scheduler(4, 64, 10 * BT, kv, EngineStats(),
                      prefix=PrefixCaching(kv, replay_tokens=4, snapshots=None, stats=EngineStats()))
    return sched, SimDevice(sched)


def req(rid: str, prompt: list[int], max_tokens: int = 2) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def run(dp, devs, rid: str):
    """Steps every rank through the DP scheduler (placement's bookkeeping included) until rid finishes."""
    while True:
        out = dp.schedule()
        for o in dp.update_from_output(out, [d.run(so) for d, so in zip(devs, out.per_rank)]):
            if o.request_id == rid and o.finished:
                return o


def story(dp, devs, turn1: list[int]) -> None:
    """A busy request on rank 0 sends the first turn to rank 1 (least loaded), then a filler prompt takes
    rank 1's whole pool (the first turn's idle cached blocks are evicted: to the tiers where there are
    some), then the busy request ends: both ranks idle, so placement by load alone would say rank 0."""
    dp.add_request(req("busy", list(range(50, 54)), max_tokens=30))
    dp.add_request(req("t1", turn1))
    assert dp.rank_of == {"busy": 0, "t1": 1}
    run(dp, devs, "t1")
    dp.add_request(req("filler", list(range(200, 238)), max_tokens=1))
    assert dp.rank_of["filler"] == 1
    run(dp, devs, "filler")
    dp.finish_requests(["busy"], RequestStatus.FINISHED_ABORTED)
    assert not dp.rank_of and not any(dp._placed_hashes)


@pytest.mark.parametrize("host_slots,disk_blocks", [(16, 0), (2, 16)])   # the host tier alone; spilled to disk
def test_next_turn_goes_to_the_rank_whose_tiers_hold_its_prefix(host_slots, disk_blocks):
    (s0, d0), (s1, d1) = rank(host_slots, disk_blocks), rank(host_slots, disk_blocks)
    dp = DataParallelScheduler([s0, s1])
    turn1 = list(range(10, 30))                                   # 20 tokens: 4 full blocks before the last
    story(dp, [d0, d1], turn1)
    turn2 = turn1 + [7, 8, 9, 11, 12, 13]
    probe = req("probe", turn2)
    assert s1.kv_cache.find_cached_blocks(s1.prefix._hashes(probe), 6) == []      # off the device pool
    lru_before = list(s1.kv_cache.host._lru)
    disk_before = list(s1.kv_cache.disk._lru) if disk_blocks else []

    dp.add_request(req("t2", turn2))
    assert dp.rank_of["t2"] == 1 and dp.num_prefix_placements == 1
    assert list(s1.kv_cache.host._lru) == lru_before                 # placement only looked
    assert (list(s1.kv_cache.disk._lru) if disk_blocks else []) == disk_before
    out = run(dp, [d0, d1], "t2")
    assert out.num_cached_tokens >= 4 * BT                          # admitted with the tiers' blocks onloaded
    assert not d1.violations, d1.violations[:3]
    if disk_blocks:
        assert s1.kv_cache.num_spills > 0 and s1.kv_cache.num_disk_onloads > 0   # the disk tier served it


def test_without_tiers_placement_falls_back_to_the_least_loaded_rank():
    """The same story with no host tier: the evicted prefix is gone, so the next turn is placed by load."""
    (s0, d0), (s1, d1) = rank(), rank()
    dp = DataParallelScheduler([s0, s1])
    turn1 = list(range(10, 30))
    story(dp, [d0, d1], turn1)
    dp.add_request(req("t2", turn1 + [7, 8, 9, 11, 12, 13]))
    assert dp.rank_of["t2"] == 0 and dp.num_prefix_placements == 0
