"""DSpark verify steps that overlap across data-parallel ranks (spec/overlap.py on rank workers): the engine
asks every rank about its launched step (MultiprocExecutor.must_resolve_before_next / overlap_drafts, one
round trip), DataParallelScheduler.schedule_overlapped plans every rank's next verify step before any
commits, and each rank launches its part from its own step's device state. Real gloo rank workers on a
CPU under batch_invariant=True: the tokens are one rank's without speculation, verify steps did overlap,
with the captured steps' padded protocol (lockstep) and without, and with prefix caching on."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineArgs
from deepinfer.parallel.dp_scheduler import DataParallelScheduler
from deepinfer.request import Request
from deepinfer.sched.scheduler import Scheduler
from tests.conftest import build_fixture
from tests.parallel.test_dp_engine import PROMPTS


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(build_fixture("v41-tiny", tmp_path_factory))


@pytest.fixture(scope="module")
def one_rank(ckpt):
    params = [SamplingParams(max_tokens=10 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(len(PROMPTS))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return params, [o.token_ids for o in LLM(ckpt, max_num_seqs=4, batch_invariant=True, device="cpu")
                        .generate(PROMPTS, params)]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("extra", [{}, {"cuda_graph_sizes": (2, 4)}, {"enable_prefix_caching": True}])
def test_overlapped_verify_steps_across_ranks_give_one_ranks_tokens(ckpt, one_rank, extra):
    params, want = one_rank
    llm = LLM(ckpt, max_num_seqs=4, batch_invariant=True, device="cpu", data_parallel_size=2, worker_threads=1,
              async_scheduling=True, speculative="dspark", spec_policy="threshold", spec_confidence_threshold=0.0,
              **extra)
    try:
        got = [o.token_ids for o in llm.generate(PROMPTS, params)]
        overlapped = llm.engine.num_verify_steps_overlapped
        counters = llm.stats()["counters"]
        llm.engine.kv_cache.check()
        assert llm.engine.kv_cache.num_used_blocks == 0
    finally:
        llm.engine.shutdown()
    assert got == want
    assert overlapped > 3, overlapped
    assert counters["spec_draft_tokens_verified_total"] > 0


def _prompted(n_ranks: int, n_reqs: int) -> DataParallelScheduler:
    """Real per-rank Schedulers, n_reqs requests spread over the ranks with their prompts run and a first
    token sampled (each rank's runner output), so that each could verify drafts next."""
    from deepinfer.cache.kv_cache_manager import KVCacheManager
    from deepinfer.outputs import ModelRunnerOutput
    dps = DataParallelScheduler([Scheduler(4, 256, 512, KVCacheManager(64, 16, 4)) for _ in range(n_ranks)])
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(n_reqs):
        dps.add_request(Request(f"r{i}", list(range(5 + i, 20 + i)), sp))
    out = dps.schedule()
    dps.update_from_output(out, [ModelRunnerOutput(list(o.num_scheduled_tokens), [[7]] * len(o.num_scheduled_tokens))
                                 for o in out.per_rank])
    return dps


def test_schedule_overlapped_commits_on_every_rank_or_none():
    """A rank that cannot overlap (a request waiting there) leaves every rank unchanged: no position advanced
    and no block reserved on the ranks that could have; once nothing waits, every rank with requests
    overlaps and an idle rank gets its empty plan."""
    from deepinfer.request import RequestStatus
    dps = _prompted(3, 2)
    ranks = {dps.rank_of["r0"], dps.rank_of["r1"]}
    assert len(ranks) == 2
    state = lambda: ({r: dps.requests[r].num_computed_tokens for r in ("r0", "r1")},   # noqa: E731
                     [s.kv_cache.num_used_blocks for s in dps.schedulers])
    before = state()
    dps.add_request(Request("late", list(range(40)), SamplingParams(max_tokens=4)))
    assert dps.schedule_overlapped({"r0": 2, "r1": 2}, 3) is None
    assert state() == before
    dps.finish_requests(["late"], RequestStatus.FINISHED_ABORTED)
    assert dps.schedule_overlapped({"r0": 2}, 3) is None          # r1 was not in the step in flight
    assert state() == before
    out = dps.schedule_overlapped({"r0": 2, "r1": 2}, 3)
    assert out is not None and out.overlapped
    idle = ({0, 1, 2} - ranks).pop()
    assert out.per_rank[idle].is_empty and not out.per_rank[idle].overlapped
    assert all(out.per_rank[r].overlapped for r in ranks)
    assert out.num_scheduled_tokens == {"r0": 4, "r1": 4}         # the anchor + the 3 drafts proposed on the device
    assert state()[0] == {r: n + 4 for r, n in before[0].items()}
