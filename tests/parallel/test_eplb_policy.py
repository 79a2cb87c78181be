"""EPLB policies and the load recorder (deepinfer/parallel/eplb/): map consistency, balance on a
skewed synthetic load, degenerate loads, bad arguments. CPU only; deterministic seeds."""

import pytest
import torch

from deepinfer.parallel.eplb import (
    ExpertLoadRecorder,
    balance_ratio,
    initial_placement,
    rank_loads,
    rebalance_experts,
    rebalance_experts_per_step,
    synthetic_loads,
)

NUM_LAYERS, NUM_STEPS, NUM_EXPERTS, NUM_GPUS = 4, 100, 384, 8


@pytest.fixture(scope="module")
def loads():
    return synthetic_loads(NUM_LAYERS, NUM_STEPS, NUM_EXPERTS, seed=0)  # [L, S, E]


def check_maps(maps, num_experts, num_replicas):
    phy2log, log2phy, logcnt = maps
    num_layers = phy2log.size(0)
    assert phy2log.shape == (num_layers, num_replicas) and phy2log.dtype == torch.int64
    assert logcnt.shape == (num_layers, num_experts) and (logcnt >= 1).all()
    assert int(logcnt.sum(-1).min()) == int(logcnt.sum(-1).max()) == num_replicas
    assert log2phy.shape == (num_layers, num_experts, int(logcnt.max()))
    for layer in range(num_layers):
        counted = torch.bincount(phy2log[layer], minlength=num_experts)
        assert torch.equal(counted, logcnt[layer])
        for expert in range(num_experts):
            slot_ids = log2phy[layer, expert]
            valid = slot_ids[slot_ids >= 0]
            assert valid.numel() == logcnt[layer, expert]
            assert (slot_ids[valid.numel():] == -1).all()               # padding only at the end
            assert (phy2log[layer, valid] == expert).all()


@pytest.mark.parametrize("num_groups,num_nodes", [(8, 2), (16, 1), (3, 2)])
def test_rebalance_maps_consistent(loads, num_groups, num_nodes):
    # (3, 2): 3 groups over 2 nodes do not divide, so the global policy runs
    maps = rebalance_experts(loads.sum(1), NUM_EXPERTS + 16, num_groups, num_nodes, NUM_GPUS)
    check_maps(maps, NUM_EXPERTS, NUM_EXPERTS + 16)


def test_per_step_and_initial_maps_consistent(loads):
    check_maps(rebalance_experts_per_step(loads, NUM_EXPERTS + 16, NUM_GPUS), NUM_EXPERTS, NUM_EXPERTS + 16)
    maps = initial_placement(NUM_LAYERS, NUM_EXPERTS, NUM_EXPERTS + 16)
    check_maps(maps, NUM_EXPERTS, NUM_EXPERTS + 16)
    slot_ids = torch.arange(NUM_EXPERTS + 16)
    assert torch.equal(maps[0][0], torch.where(slot_ids < NUM_EXPERTS, slot_ids, slot_ids - NUM_EXPERTS))


def test_hierarchical_keeps_groups_on_one_node(loads):
    num_groups, num_nodes, num_replicas = 8, 2, NUM_EXPERTS + 16
    phy2log = rebalance_experts(loads.sum(1), num_replicas, num_groups, num_nodes, NUM_GPUS)[0]
    node_of_slot = torch.arange(num_replicas) // (num_replicas // num_nodes)     # [P]
    group_of_slot = phy2log // (NUM_EXPERTS // num_groups)                       # [L, P]
    for layer in range(NUM_LAYERS):
        for group in range(num_groups):
            assert node_of_slot[group_of_slot[layer] == group].unique().numel() == 1
        # each node holds num_groups / num_nodes whole groups
        for node in range(num_nodes):
            assert group_of_slot[layer, node_of_slot == node].unique().numel() == num_groups // num_nodes


@pytest.mark.parametrize("num_redundant", [8, 16])
def test_both_policies_cut_rank_imbalance(loads, num_redundant):
    num_replicas = NUM_EXPERTS + num_redundant
    summed = loads.sum(1)                                                         # [L, E]
    initial = initial_placement(NUM_LAYERS, NUM_EXPERTS, num_replicas)[0]
    deepseek = rebalance_experts(summed, num_replicas, 1, 1, NUM_GPUS)[0]
    per_step = rebalance_experts_per_step(loads, num_replicas, NUM_GPUS)[0]
    ratios = {name: (balance_ratio(phy2log, summed, NUM_GPUS), balance_ratio(phy2log, loads, NUM_GPUS))
              for name, phy2log in [("initial", initial), ("deepseek", deepseek), ("per_step", per_step)]}
    print(f"\nredundant={num_redundant} max/mean rank load (summed, per-step peak): "
          + ", ".join(f"{name} {s:.3f} {p:.3f}" for name, (s, p) in ratios.items()))
    assert ratios["initial"][0] > 1.5                                             # the load is skewed
    assert ratios["deepseek"][0] < 1.05 and ratios["per_step"][1] < 1.15
    # each policy wins on the objective it optimizes
    assert ratios["per_step"][1] < ratios["deepseek"][1] < ratios["initial"][1]
    assert ratios["deepseek"][0] <= ratios["per_step"][0] < ratios["initial"][0]


def test_rank_loads_split_evenly_over_replicas():
    phy2log = torch.tensor([[0, 1, 0, 2]])                                       # expert 0 on ranks 0 and 1
    loads = torch.tensor([[10.0, 3.0, 4.0]])
    assert torch.equal(rank_loads(phy2log, loads, 2), torch.tensor([[8.0, 9.0]]))
    per_step = torch.tensor([[[10.0, 3.0, 4.0], [0.0, 0.0, 2.0]]])               # [1, 2, 3]
    assert torch.equal(rank_loads(phy2log, per_step, 2), torch.tensor([[[8.0, 9.0], [0.0, 2.0]]]))
    assert balance_ratio(phy2log, per_step, 2) == pytest.approx((9 + 2) / (8.5 + 1))


def test_zero_load():
    zeros = torch.zeros(2, 10, 16)
    for maps in (rebalance_experts(zeros.sum(1), 20, 4, 2, 4), rebalance_experts_per_step(zeros, 20, 4)):
        check_maps(maps, 16, 20)
        assert balance_ratio(maps[0], zeros, 4) == 1.0


def test_all_load_on_one_expert():
    loads = torch.zeros(2, 10, 16)
    loads[:, :, 5] = 100.0
    for phy2log, _, logcnt in (rebalance_experts(loads.sum(1), 24, 1, 1, 4),
                               rebalance_experts_per_step(loads, 24, 4)):
        assert (logcnt[:, 5] == 9).all()                                          # every redundant slot
        # 9 replicas over 4 ranks of 6 slots: the best split is 3/2/2/2 replicas, peak 300/9 tokens
        assert balance_ratio(phy2log, loads, 4) == pytest.approx((300 / 9) / 25)


def test_no_redundant_slots_and_one_gpu(loads):
    summed = loads[:1].sum(1)
    for phy2log, _, logcnt in (rebalance_experts(summed, NUM_EXPERTS, 8, 1, NUM_GPUS),
                               rebalance_experts_per_step(loads[:1], NUM_EXPERTS, NUM_GPUS)):
        assert (logcnt == 1).all() and torch.equal(phy2log.sort(-1).values[0], torch.arange(NUM_EXPERTS))
        assert balance_ratio(phy2log, summed, NUM_GPUS) < 1.05
    for maps in (rebalance_experts(summed, NUM_EXPERTS + 8, 8, 1, 1),
                 rebalance_experts_per_step(loads[:1], NUM_EXPERTS + 8, 1)):
        check_maps(maps, NUM_EXPERTS, NUM_EXPERTS + 8)
        assert balance_ratio(maps[0], summed, 1) == 1.0


@pytest.mark.parametrize("call,match", [
    (lambda w: rebalance_experts(w, 20, 4, 2, 3), "multiple of num_gpus"),
    (lambda w: rebalance_experts(w, 12, 4, 2, 4), "num_replicas=12 < num_experts=16"),
    (lambda w: rebalance_experts(w, 20, 5, 1, 4), "num_groups=5 does not divide"),
    (lambda w: rebalance_experts(w, 24, 4, 3, 4), "num_nodes=3 does not divide"),
    (lambda w: rebalance_experts(w, 20, 4, 2, 0), "num_gpus=0"),
    (lambda w: rebalance_experts(-w, 20, 4, 2, 4), "non-negative"),
    (lambda w: rebalance_experts(w[None], 20, 4, 2, 4), "2 dims"),
    (lambda w: rebalance_experts_per_step(w, 20, 4), "3 dims"),
    (lambda w: rebalance_experts_per_step(w[:, None], 18, 4), "multiple of num_gpus"),
    (lambda w: initial_placement(2, 16, 15), "num_replicas=15 < num_experts=16"),
    (lambda w: rank_loads(torch.zeros(2, 16, dtype=torch.int64), w, 4), "without a replica"),
])
def test_bad_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.ones(2, 16))


def test_recorder_window_ring():
    rec = ExpertLoadRecorder(num_layers=2, num_experts=3, window=3)
    assert rec.window_loads().shape == (2, 0, 3)
    for step in range(5):                                                        # steps 0..4; 2..4 remain
        rec.record(0, torch.tensor([step, 0, 1], dtype=torch.int32))
        rec.record(0, torch.tensor([1, 0, 0]))                                    # accumulates within a step
        rec.record(1, torch.tensor([0, step, 0]))
        rec.end_step()
    rec.record(0, torch.tensor([100, 100, 100]))                                  # open step: not reported
    window = rec.window_loads()                                                   # [L, S, E]
    assert window.dtype == torch.int64 and window.shape == (2, 3, 3)
    assert window[0, :, 0].tolist() == [3, 4, 5] and window[1, :, 1].tolist() == [2, 3, 4]
    assert torch.equal(rec.summed(), window.sum(1))
    rec.reset()
    assert rec.num_window_steps == 0 and rec.window_loads().shape == (2, 0, 3)
    rec.end_step()
    assert rec.window_loads().sum() == 0                                           # reset cleared the open step


def test_recorder_feeds_policies():
    loads = synthetic_loads(2, 20, 32, seed=1)                                   # [L, S, E]
    rec = ExpertLoadRecorder(2, 32, window=20, device="cpu")
    for step in range(20):
        for layer in range(2):
            rec.record(layer, loads[layer, step])
        rec.end_step()
    assert torch.equal(rec.window_loads(), loads)
    check_maps(rebalance_experts(rec.summed(), 40, 4, 2, 4), 32, 40)
    check_maps(rebalance_experts_per_step(rec.window_loads(), 40, 4), 32, 40)
    with pytest.raises(ValueError, match="shape"):
        rec.record(0, torch.zeros(31))
