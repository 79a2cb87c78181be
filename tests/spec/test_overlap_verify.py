"""The verification policy inside overlapped verify steps (spec/overlap_verify.py, the host half;
spec/device_verify.py, the device half): the device's split of the budget equals
spec/budget.split_budget on the host, and its threshold counts equal
StaticThresholdPolicy's, on random ragged batches with ties; the host half picks B from the older
confidences exactly as VerifyBudgetPolicy.best_budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.spec.budget import VerifyBudgetPolicy, split_budget, split_by_survival
from deepinfer.spec.device_verify import (prefix_survival_on_device, split_budget_on_device,
                                          threshold_counts_on_device, verified_counts)
from deepinfer.spec.overlap_verify import OverlapVerify, plan_overlapped
from deepinfer.spec.policy import (DraftEntry, FixedDraftsPolicy, StaticThresholdPolicy, VerifyAllPolicy,
                                   prefix_survival)
from deepinfer.spec.step_time import StepTimeModel

K = 5


def _batch(rng: np.random.Generator, ties: bool):
    """[n, K] confidence logits and ragged K'_i in 0..K; ties: logits from a few values, repeated
    across and within requests (equal survivals at equal prefixes), some certain (+inf)."""
    n = int(rng.integers(1, 9))
    if ties:
        conf = rng.choice([0.0, 1.5, -0.5, 3.0, np.inf], size=(n, K))
        conf[rng.random(n) < 0.5] = conf[0]          # whole rows equal to the first one
    else:
        conf = rng.normal(1.0, 2.0, size=(n, K))
    num = rng.integers(0, K + 1, size=n)
    return conf, num


@pytest.mark.parametrize("ties", [False, True])
def test_device_split_equals_split_budget(ties):
    rng = np.random.default_rng(19 + ties)
    checked = 0
    for _ in range(200):
        conf, num = _batch(rng, ties)
        entries = [DraftEntry(int(k), conf[i].tolist()) for i, k in enumerate(num) if k > 0]
        total = int(num.sum())
        for budget in sorted({0, 1, total // 2, total, int(rng.integers(0, total + 1))}):
            want = iter(split_budget(entries, budget))
            want = [next(want) if k > 0 else 0 for k in num]
            got = split_budget_on_device(torch.tensor(conf), torch.tensor(num), budget).tolist()
            assert got == want, (conf, num, budget)
            assert sum(got) == min(budget, total)
            checked += 1
    assert checked > 400


def test_device_split_breaks_ties_toward_the_earlier_request():
    conf = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])      # every request: 0.5, 0.25
    got = split_budget_on_device(conf, torch.tensor([2, 2, 2]), 4).tolist()
    assert got == [2, 1, 1]          # 0.5 x3 first, then the first 0.25 (request 0's)
    assert got == split_budget([DraftEntry(2, [0.0, 0.0])] * 3, 4)


def test_device_survival_and_threshold_equal_the_host():
    rng = np.random.default_rng(7)
    for _ in range(100):
        conf, num = _batch(rng, ties=bool(rng.integers(2)))
        a = prefix_survival_on_device(torch.tensor(conf)).tolist()
        assert a == [prefix_survival(row.tolist()) for row in conf]
        for t in (0.0, 0.25, 0.5, 1.0):
            want = [StaticThresholdPolicy(t).assign([DraftEntry(int(k), row.tolist())])[0] for k, row in zip(num, conf)]
            assert threshold_counts_on_device(torch.tensor(conf), torch.tensor(num), t).tolist() == want


def _step_time(per_draft=0.08):
    """t(n, B) = 1 + per_draft * B at the profiled n (the grid is by drafts per request x = B / n)."""
    sizes = [1, 8]
    return StepTimeModel(sizes, list(range(K + 1)), [[1.0 + per_draft * n * x for x in range(K + 1)] for n in sizes])


def test_host_half_picks_b_from_the_older_confidences():
    policy = VerifyBudgetPolicy(_step_time())
    num = [5, 3, 0, 5]
    older = [[2.0, 1.0, 0.0, -1.0, -2.0], None, [1.0] * 5, [3.0, 3.0]]
    ks, plan = plan_overlapped(policy, num, older)
    entries = [DraftEntry(5, [], older[0]), DraftEntry(3, [], None), DraftEntry(5, [], older[3])]
    survivals = [policy._budget_survival(e) for e in entries]
    survival = sorted((a for s in survivals for a in s), reverse=True)
    budget = policy.best_budget(3, survival)
    assert 0 < budget < sum(num)               # the step-time model makes some drafts not pay
    # the rows laid out (K'_i) are the host's split of B by the same survivals: a step costs B + n rows,
    # and the device verifies every draft laid out (a trim within them would save no rows)
    caps = split_by_survival(survivals, budget)
    assert ks == [caps[0], caps[1], 0, caps[2]] and sum(ks) == budget
    assert plan is None
    assert all(k <= m for k, m in zip(ks, num))
    # budget_confidences="newest" has no newest on the host: the older ones, the same B
    newest = VerifyBudgetPolicy(policy.step_time, budget_confidences="newest")
    assert plan_overlapped(newest, num, older) == (ks, plan)


def test_host_half_of_the_other_policies():
    assert plan_overlapped(VerifyAllPolicy(), [5, 2], [None, None]) == ([5, 2], None)
    assert plan_overlapped(FixedDraftsPolicy(3), [5, 2], [None, None]) == ([3, 2], None)
    assert plan_overlapped(StaticThresholdPolicy(0.4), [5, 2], [None, None]) == ([5, 2], OverlapVerify(threshold=0.4))
    conf = torch.zeros(2, K)
    assert verified_counts(None, conf, torch.tensor([5, 2])).tolist() == [5, 2]
    assert verified_counts(OverlapVerify(threshold=0.4), conf, torch.tensor([5, 2])).tolist() == [1, 1]
    assert verified_counts(OverlapVerify(budget=3), conf, torch.tensor([5, 2])).tolist() == [2, 1]


def test_host_half_caps_padded_steps_on_the_host():
    """Padded overlapped steps (CUDA graphs): the cap from the older confidences shortens K'_i on the
    host (the step's layout, so its graph), and nothing is left for the device to split."""
    step_time = _step_time()
    policy = VerifyBudgetPolicy(step_time, padded=lambda n, length: True)
    num = [5, 3, 0, 5]
    older = [[2.0, 1.0, 0.0, -1.0, -2.0], None, [1.0] * 5, [3.0, 3.0]]
    entries = [DraftEntry(5, [], older[0]), DraftEntry(3, [], None), DraftEntry(5, [], older[3])]
    cap = policy.best_cap([e.num_drafts for e in entries], [policy._budget_survival(e) for e in entries])
    assert cap is not None and 0 <= cap <= 5
    assert plan_overlapped(policy, num, older) == ([min(k, cap) for k in num], None)
    unpadded = VerifyBudgetPolicy(step_time, padded=lambda n, length: False)
    ks, plan = plan_overlapped(unpadded, num, older)
    assert plan is None and sum(ks) < sum(num)      # varlen steps: B split on the host, all of it verified
