"""CUDA-graph decode on the rank workers (deepinfer/parallel/lockstep.py): every rank takes the same
captured size in a step, or every rank runs eagerly. On a CPU the captured step's code runs eagerly on
the same padded static buffers (cuda_graph_sizes given: the test mode), with real gloo rank workers,
so the protocol (the agreement, a rank padded to the largest rank's size, an idle rank's all-padding
step, the collectives' per-rank size) is what these tests exercise; the capture itself is tested on
a GPU (tests/parallel/test_ep_gpu.py)."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import torch.multiprocessing as mp

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineArgs
from deepinfer.parallel.eplb.recorder import ExpertLoadRecorder
from deepinfer.parallel.lockstep import HostAgreement, rank_graph_sizes
from deepinfer.parallel.placement import ExpertPlacement, LayerPlacement
from tests.conftest import build_fixture
from tests.parallel.test_dp_engine import PROMPTS

SIZES = (2, 4)            # no size 1 or 3: a decode step of 1 or 3 requests a rank is padded


def _run(ckpt: str, params, ref_kw: dict, **extra):
    ref = LLM(ckpt, **ref_kw).generate(PROMPTS, params)
    llm = LLM(ckpt, data_parallel_size=2, worker_threads=1, cuda_graph_sizes=SIZES, **ref_kw, **extra)
    try:
        outs = llm.generate(PROMPTS, params)
        pings = llm.engine.runner.ping()
    finally:
        llm.engine.shutdown()
    return ref, outs, pings, llm


def _post(name: str, rank: int, world: int, steps: int, out) -> None:
    import random
    agree = HostAgreement(name, rank, world)
    rnd = random.Random(rank)
    got = []
    for step in range(steps):
        if rnd.random() < 0.3:
            time.sleep(rnd.random() * 1e-3)          # ranks arrive in every order
        got.append(agree.max_fields(int((step * 7 + rank) % 11 == 0), (step * 13 + rank * 5) % 97))
    out.put((rank, got))


def test_host_agreement_gives_every_rank_each_steps_maxima():
    """Three processes, 300 steps, arrivals in random order (a fast rank posts the next step while a slow
    one still reads this one): every rank gets every step's (max flag, max rows)."""
    ctx = mp.get_context("spawn")
    name = HostAgreement.create(3)
    try:
        q = ctx.Queue()
        procs = [ctx.Process(target=_post, args=(name, r, 3, 300, q)) for r in range(3)]
        for p in procs:
            p.start()
        got = dict(q.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(30)
    finally:
        HostAgreement.unlink(name)
    want = [(max(int((s * 7 + r) % 11 == 0) for r in range(3)), max((s * 13 + r * 5) % 97 for r in range(3)))
            for s in range(300)]
    assert got[0] == got[1] == got[2] == want
    assert not os.path.exists(f"/dev/shm/{name}")


@pytest.mark.parametrize("extra", [{}, {"async_scheduling": True}])
def test_lockstep_graph_steps_give_one_ranks_tokens(extra, tmp_path_factory):
    """Six requests of different lengths over 2 ranks (greedy and seeded sampling): decode steps go
    through the padded captured step on both ranks at once, a rank with fewer requests padded to the
    other's size and a rank with none replaying an all-padding step; prefill steps on either rank send
    both to the eager forward. Tokens equal one rank's eager run bit for bit (batch_invariant)."""
    ckpt = str(build_fixture("v41-tiny", tmp_path_factory))
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0 if i % 2 else 0.9, top_p=0.95, seed=5 + i,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    ref, outs, pings, llm = _run(ckpt, params, dict(max_num_seqs=4, max_num_batched_tokens=4, batch_invariant=True,
                                               device="cpu"), **extra)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert not os.path.exists(f"/dev/shm/{llm.engine.runner.agreement}")       # the segment went with the ranks
    steps = [p["graph_steps"] for p in pings]
    assert steps[0] == steps[1] > 10, pings                       # every graph step ran on both ranks
    assert sum(p["graph_padding_steps"] for p in pings) > 0, pings  # a rank with nothing replayed padding
    # a prompt chunk on one rank (every step fits the largest size: the ranks agree) sends both to eager
    assert pings[0]["lockstep_eager_steps"] == pings[1]["lockstep_eager_steps"] > 0, pings


def test_lockstep_verify_steps_give_one_ranks_tokens(tmp_path_factory):
    """DSpark across 2 ranks with the captured steps: verify steps take the packed key holding both ranks'
    steps (a rank verifying fewer drafts, or none, padded into it), the drafting pass each rank's own; the
    tokens equal one rank's without speculation ("identical" acceptance), drafts were verified."""
    ckpt = str(build_fixture("v41-tiny", tmp_path_factory))
    params = [SamplingParams(max_tokens=8 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(len(PROMPTS))]
    kw = dict(max_num_seqs=4, batch_invariant=True, device="cpu")
    ref = LLM(ckpt, **kw).generate(PROMPTS, params)
    llm = LLM(ckpt, data_parallel_size=2, worker_threads=1, cuda_graph_sizes=SIZES, speculative="dspark",
              spec_policy="threshold", spec_confidence_threshold=0.0, **kw)
    try:
        outs = llm.generate(PROMPTS, params)
        pings = llm.engine.runner.ping()
        verified = llm.stats()["counters"]["spec_draft_tokens_proposed_total"]
    finally:
        llm.engine.shutdown()
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert verified > 0
    assert pings[0]["graph_verify_steps"] == pings[1]["graph_verify_steps"] > 3, pings


def test_lockstep_graph_steps_with_live_rebalance(tmp_path_factory):
    """EPLB moving experts between ranks while decode steps take the padded captured step: the maps are
    rewritten in place (the graph's buffers), the tokens stay one rank's, the placement did change."""
    ckpt = str(build_fixture("v41-tiny", tmp_path_factory))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref, outs, pings, llm = _run(ckpt, params, dict(max_num_seqs=6, batch_invariant=True, device="cpu"),
                            num_redundant_experts=2, enable_eplb=True, eplb_step_interval=4, eplb_window_size=4)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert all(p["num_rebalances"] >= 3 and p["graph_steps"] > 5 for p in pings), pings
    assert sum(p["num_moved"] for p in pings) > 0, pings


def test_rank_graph_sizes_follow_what_a_captured_step_can_hold():
    margs = SimpleNamespace(emulate_index_k_alias=False, n_activated_experts=6)
    base = dict(max_num_seqs=256, data_parallel_size=8)
    # EP 8, top-6: 8 x 64 x 6 = 3,072 gathered picks fit the masked form's 4,096, 128 does not
    assert rank_graph_sizes(EngineArgs(**base), margs, "cuda:0", 8) == (1, 2, 4, 8, 16, 32, 64)
    assert rank_graph_sizes(EngineArgs(**base), margs, "cuda:0", 2) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert rank_graph_sizes(EngineArgs(**base, expert_parallel=False), margs, "cuda:0", 8)[-1] == 128
    for off in (dict(ep_backend="alltoall"), dict(enforce_eager=True)):
        assert rank_graph_sizes(EngineArgs(**base, **off), margs, "cuda:0", 8) == ()
    # DSpark: the decode sizes as without it (its verify keys are capped by DecodeGraphs' gathered_ranks)
    assert rank_graph_sizes(EngineArgs(**base, speculative="dspark"), margs, "cuda:0", 8)[-1] == 64
    assert rank_graph_sizes(EngineArgs(**base), margs, "cpu", 8) == ()                  # CPU: only when asked
    assert rank_graph_sizes(EngineArgs(**base, cuda_graph_sizes=(3, 1)), margs, "cpu", 8) == (1, 3)


def test_layer_maps_keep_their_buffers_across_placements():
    """A captured step reads the maps' tensors: a rebalance to a placement with more replicas of an expert
    rewrites them in place, and the lookup follows the new maps."""
    initial = ExpertPlacement.initial(1, 6, 2, 2)                # 8 slots, 2 redundant
    maps = LayerPlacement(initial, 0, "cpu")
    ptrs = (maps.log2phy.data_ptr(), maps.logcnt.data_ptr())
    phy2log = torch.tensor([[0, 0, 0, 1, 2, 3, 4, 5]])          # expert 0 on three slots
    maps.update(ExpertPlacement.from_maps(phy2log, 2), 0)
    assert (maps.log2phy.data_ptr(), maps.logcnt.data_ptr()) == ptrs
    ids = torch.zeros(6, 1, dtype=torch.long)                    # six tokens on expert 0
    assert sorted(maps.to_physical(ids).flatten().tolist()) == [0, 0, 1, 1, 2, 2]
    assert maps.to_physical(torch.tensor([[5]])).item() == 7


def test_padding_rows_add_no_expert_load():
    """The recorder counts the real rows' picks of a padded step only (real_rows), every row otherwise."""
    from deepinfer.model.moe import _ExpertParallel
    rec = ExpertLoadRecorder(1, 4, 2)
    ep = _ExpertParallel.__new__(_ExpertParallel)
    ep.parallel, ep.layer_id = SimpleNamespace(recorder=rec), 0
    picks = torch.tensor([[0, 1], [2, 3], [0, 0 + 2]])
    rec.real_rows = torch.tensor([True, False, True])
    ep.record(picks)
    rec.end_step()
    rec.real_rows = None
    ep.record(picks)
    rec.end_step()
    assert rec.window_loads()[0].tolist() == [[2, 1, 1, 0], [2, 1, 2, 1]]
