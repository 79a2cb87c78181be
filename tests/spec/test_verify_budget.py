"""The verification policies' math (spec/policy.py, spec/budget.py, spec/step_time.py), and the
scheduler's DraftBook hook on a real Scheduler: no model, plain floats."""

from __future__ import annotations

import math
import random

import pytest

from deepinfer.cache.kv_cache_manager import KVCacheManager
from deepinfer.outputs import ModelRunnerOutput
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from deepinfer.sched.scheduler import Scheduler
from deepinfer.spec.budget import VerifyBudgetPolicy, split_budget
from deepinfer.spec.policy import (DraftEntry, FixedDraftsPolicy, StaticThresholdPolicy, VerifyAllPolicy,
                                   prefix_survival)
from deepinfer.spec.step_time import StepTimeModel, non_decreasing


def logit(c: float) -> float:
    return math.log(c / (1 - c))


def entry(cs, older=None):
    return DraftEntry(len(cs), [logit(c) for c in cs], None if older is None else [logit(c) for c in older])


def linear_model(t0: float, per_draft: float, sizes=(1, 8, 64), k: int = 5) -> StepTimeModel:
    """t(n, B) = t0 + per_draft * B exactly on the grid (and so everywhere: it is bilinear)."""
    return StepTimeModel(list(sizes), list(range(k + 1)), [[t0 + per_draft * n * x for x in range(k + 1)] for n in sizes])


def brute_force_budget(n: int, survivals: list[float], t) -> int:
    a = sorted(survivals, reverse=True)
    scores = [(n + sum(a[:b])) / t(n, b) for b in range(len(a) + 1)]
    return max(range(len(scores)), key=lambda b: (scores[b], -b))


def test_step_time_model_interpolates_and_clamps():
    m = StepTimeModel([1, 4], [0, 5], [[1.0, 2.0], [3.0, 8.0]])
    assert m.time(1, 0) == 1.0 and m.time(4, 20) == 8.0
    assert m.time(1, 5) == pytest.approx(2.0) and m.time(1, 2) == pytest.approx(1.4)
    assert m.time(2, 0) == pytest.approx(1 + 2 / 3)                 # between the batch sizes
    assert m.time(4, 10) == pytest.approx(5.5)                      # 2.5 drafts each
    assert m.time(64, 0) == 3.0 and m.time(1, 50) == 2.0            # clamped to the grid


@pytest.mark.parametrize("seed", range(20))
def test_profiled_rows_are_fit_non_decreasing(seed):
    """The least-squares monotone fit, against brute force over the fits that pool runs of equal
    values: non-decreasing, same mean, and no other non-decreasing fit of pooled runs is closer."""
    import itertools
    rng = random.Random(seed)
    ys = [rng.uniform(5, 10) for _ in range(rng.randint(1, 6))]
    fit = non_decreasing(ys)
    assert len(fit) == len(ys) and all(a <= b + 1e-12 for a, b in zip(fit, fit[1:]))
    assert sum(fit) == pytest.approx(sum(ys))
    err = sum((a - b) ** 2 for a, b in zip(fit, ys))
    for cuts in itertools.product([0, 1], repeat=len(ys) - 1):   # every partition into runs
        cand, start = [], 0
        for i, cut in enumerate(list(cuts) + [1]):
            if cut:
                run = ys[start:i + 1]
                cand += [sum(run) / len(run)] * len(run)
                start = i + 1
        if all(a <= b for a, b in zip(cand, cand[1:])):
            assert err <= sum((a - b) ** 2 for a, b in zip(cand, ys)) + 1e-9
    assert non_decreasing([6.4, 9.7, 9.2, 9.3, 9.8, 6.6]) == pytest.approx([6.4] + [(9.7 + 9.2 + 9.3 + 9.8 + 6.6) / 5] * 5)
    assert non_decreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("seed", range(5))
def test_budget_is_the_argmax_of_expected_tokens_per_second(seed):
    rng = random.Random(seed)
    entries = [entry([rng.random() * 0.98 + 0.01 for _ in range(5)]) for _ in range(rng.randint(1, 40))]
    model = linear_model(t0=0.02, per_draft=rng.choice([0.0001, 0.001, 0.01]))
    pol = VerifyBudgetPolicy(model, budget_confidences="newest")
    survivals = [a for e in entries for a in prefix_survival(e.newest)]
    want = brute_force_budget(len(entries), survivals, model.time)
    got = pol.assign(entries)
    assert sum(got) == want
    assert all(0 <= g <= e.num_drafts for g, e in zip(got, entries))


def test_flat_step_time_verifies_everything_and_steep_verifies_little():
    entries = [entry([0.9, 0.5, 0.2, 0.1, 0.05]), entry([0.3, 0.3, 0.3, 0.3, 0.3])]
    assert VerifyBudgetPolicy(StepTimeModel.flat(), budget_confidences="newest").assign(entries) == [5, 5]
    # each draft costs as much as a whole step's fixed part: only a near-certain draft could pay
    steep = VerifyBudgetPolicy(linear_model(0.01, 0.01), budget_confidences="newest")
    assert steep.assign(entries) == [0, 0]
    # 10% per draft: a = .9, .45, .3 pay (2/.01 = 200 -> 2.9/.011 = 264 -> 3.35/.012 = 279 -> 3.65/.013 = 281),
    # then .09 does not (3.74/.014 = 267): the newest split is .9 .45 (request 0) and .3 (request 1)
    mid = VerifyBudgetPolicy(linear_model(0.01, 0.001), budget_confidences="newest")
    assert mid.assign(entries) == [2, 1]


@pytest.mark.parametrize("seed", range(6))
def test_acceptance_floor_keeps_the_expected_accepted_tokens(seed):
    """With a floor f the budget is the argmax or, where that cuts deeper, the smallest B whose expected
    accepted tokens n + sum of the B best survivals reach f x verify-all's (brute force over B)."""
    rng = random.Random(seed)
    entries = [entry([rng.random() * 0.98 + 0.01 for _ in range(5)]) for _ in range(rng.randint(1, 40))]
    model = linear_model(t0=0.01, per_draft=rng.choice([0.001, 0.01]))       # steep: the argmax cuts deep
    survivals = sorted((a for e in entries for a in prefix_survival(e.newest)), reverse=True)
    n, full = len(entries), len(entries) + sum(survivals)
    argmax = brute_force_budget(n, survivals, model.time)
    for f in (0.5, 0.9, 0.98, 1.0):
        got = sum(VerifyBudgetPolicy(model, budget_confidences="newest", acceptance_floor=f).assign(entries))
        least = next(b for b in range(len(survivals) + 1) if n + sum(survivals[:b]) >= f * full * (1 - 1e-12))
        assert got == max(argmax, least), (f, got, argmax, least)
        assert n + sum(survivals[:got]) >= f * full * (1 - 1e-12)
    assert sum(VerifyBudgetPolicy(model, budget_confidences="newest").assign(entries)) == argmax


def test_acceptance_floor_bounds_the_padded_cap():
    """Padded steps: the cap L is at least the smallest whose expected tokens reach the floor."""
    entries = [entry([0.9, 0.8, 0.7, 0.6, 0.5]), entry([0.9, 0.9, 0.9, 0.9, 0.9])]
    steep = linear_model(0.01, 0.01)
    padded = lambda n, length: True  # noqa: E731 (every (n, length) has a padded graph)
    assert VerifyBudgetPolicy(steep, budget_confidences="newest", padded=padded).assign(entries) == [0, 0]
    # survivals .9 .72 .504 .3024 .1512 and .9 .81 .729 .6561 .59049: full = 2 + 6.2; 0.9 x 8.2 = 7.38 needs
    # cap 4 (2 + 1.8 + 1.53 + 1.233 + .9585 = 7.52; cap 3 gives 6.56)
    floored = VerifyBudgetPolicy(steep, budget_confidences="newest", padded=padded, acceptance_floor=0.9)
    assert floored.assign(entries) == [4, 4]


def test_acceptance_floor_is_checked():
    from deepinfer.config import EngineArgs
    with pytest.raises(ValueError, match="spec_acceptance_floor"):
        VerifyBudgetPolicy(StepTimeModel.flat(), acceptance_floor=1.5)
    with pytest.raises(ValueError, match="spec_acceptance_floor"):
        EngineArgs(checkpoint="x", spec_acceptance_floor=0.0)._check_spec_args()
    with pytest.raises(ValueError, match="needs spec_policy='scheduler'"):
        EngineArgs(checkpoint="x", spec_policy="all", spec_acceptance_floor=0.98)._check_spec_args()
    EngineArgs(checkpoint="x", spec_acceptance_floor=0.98)._check_spec_args()


def test_split_goes_by_newest_confidence_as_prefixes():
    entries = [entry([0.6, 0.5, 0.5]), entry([0.95, 0.9, 0.9]), entry([0.7, 0.1, 0.9])]
    counts = split_budget(entries, 4)
    assert counts == [0, 3, 1]              # a: .6 .3 .15 | .95 .855 .77 | .7 .07 .063
    assert split_budget(entries, 0) == [0, 0, 0] and split_budget(entries, 99) == [3, 3, 3]
    tie = [entry([0.5, 0.5]), entry([0.5, 0.5])]
    assert split_budget(tie, 1) == [1, 0] and split_budget(tie, 3) == [2, 1]   # ties: the earlier request


def test_budget_from_older_confidences_split_by_newest():
    """The budget comes from the previous proposal (two steps old), the split from the newest."""
    model = linear_model(0.01, 0.001)
    entries = [entry([0.05, 0.05], older=[0.99, 0.99]), entry([0.99, 0.99], older=[0.05, 0.05])]
    older = VerifyBudgetPolicy(model, budget_confidences="older").assign(entries)
    newest = VerifyBudgetPolicy(model, budget_confidences="newest").assign(entries)
    assert older == [0, 2] and newest == [0, 2]
    entries = [entry([0.95, 0.95], older=[0.05, 0.05]), entry([0.95, 0.95], older=[0.05, 0.05])]
    assert VerifyBudgetPolicy(model, budget_confidences="older").assign(entries) == [0, 0]   # budget 0
    assert sum(VerifyBudgetPolicy(model, budget_confidences="newest").assign(entries)) == 4
    # no older proposal: each draft counts 1.0 in the budget (DeepInfer's padding)
    fresh = [entry([0.95, 0.95]), entry([0.2, 0.2])]
    assert VerifyBudgetPolicy(model, budget_confidences="older").assign(fresh) == [2, 2]


def test_early_stop_stops_at_the_first_budget_that_does_not_pay():
    """A step time with a jump (a larger captured size) then a plateau: the global argmax lies past the
    jump; early stop halts before it."""
    model = StepTimeModel([4], [0, 1, 2, 3], [[1.0, 1.0, 1.6, 1.6]])   # B <= 4 free, 5..8 costs 60%, then flat
    entries = [entry([0.95, 0.95, 0.95]) for _ in range(4)]
    full = VerifyBudgetPolicy(model, budget_confidences="newest").assign(entries)
    stop = VerifyBudgetPolicy(model, early_stop=True, budget_confidences="newest").assign(entries)
    assert sum(stop) == 4 and sum(full) == 12


def test_static_threshold_verify_all_fixed():
    logits = [2.0, 1.0, 0.0, -1.0, 3.0]
    a = prefix_survival(logits)
    assert a == sorted(a, reverse=True) and a[2] == pytest.approx(a[1] * 0.5)
    assert StaticThresholdPolicy(0.0).num_to_verify(logits) == 5
    assert StaticThresholdPolicy(0.5).num_to_verify(logits) == 2     # a = .88 .64 .32 ...
    assert StaticThresholdPolicy(0.5).assign([DraftEntry(1, logits)]) == [1]   # capped by the room
    assert VerifyAllPolicy().assign([DraftEntry(3, logits), DraftEntry(0, [])]) == [3, 0]
    assert FixedDraftsPolicy(2).assign([DraftEntry(3, logits), DraftEntry(1, logits)]) == [2, 1]
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            StaticThresholdPolicy(bad)
    with pytest.raises(ValueError, match="older"):
        VerifyBudgetPolicy(StepTimeModel.flat(), budget_confidences="stale")


def test_scheduler_plans_the_batch_from_the_draft_book():
    """A real Scheduler: proposals from a runner output wait in the DraftBook; the next schedule()
    verifies what the policy picked over the batch, capped by max_tokens."""
    kv = KVCacheManager(64, 4, 8)
    sched = Scheduler(8, 64, 256, kv)
    sched.draft_book.policy = VerifyBudgetPolicy(linear_model(0.01, 0.001), budget_confidences="newest")
    for i in range(3):
        sched.add_request(Request(str(i), [1, 2, 3, 4], SamplingParams(max_tokens=4 if i == 2 else 20, temperature=0)))
    out = sched.schedule()
    confs = [[logit(c) for c in cs] for cs in ([0.99, 0.99, 0.2], [0.3, 0.3, 0.3], [0.99, 0.99, 0.99])]
    runner_out = ModelRunnerOutput(list(out.num_scheduled_tokens), [[7], [7], [7]],
                                   draft_token_ids=[[11, 12, 13]] * 3, draft_confidences=confs)
    sched.update_from_output(out, runner_out)
    assert sched.draft_book.pending("0") == [11, 12, 13] and sched.draft_book.pending("2") == [11, 12]  # room 2
    out = sched.schedule()
    assert out.spec_tokens == {"0": [11, 12], "2": [11, 12]}
    assert out.num_scheduled_tokens == {"0": 3, "1": 1, "2": 3}
    assert sched.draft_book.pending("0") == []




def brute_force_cap(entries: list[DraftEntry], t, survival) -> int:
    n, k = len(entries), max(e.num_drafts for e in entries)
    a = [survival(e) for e in entries]
    scores = [(n + sum(sum(ar[:min(cap, e.num_drafts)]) for ar, e in zip(a, entries))) / t(n, n * cap)
              for cap in range(k + 1)]
    return max(range(k + 1), key=lambda c: (scores[c], -c))


@pytest.mark.parametrize("seed", range(5))
def test_padded_steps_take_the_cap_that_pays_on_the_padded_cost(seed):
    """Steps padded to the longest request (CUDA graphs): every request verifies min(L, k_r) for the L
    maximizing expected tokens / t(n, n L); the ragged split is not used there."""
    rng = random.Random(seed)
    entries = [entry([rng.random() * 0.98 + 0.01 for _ in range(rng.randint(1, 5))]) for _ in range(rng.randint(2, 40))]
    model = linear_model(t0=0.02, per_draft=rng.choice([0.0001, 0.0005, 0.002]))
    pol = VerifyBudgetPolicy(model, budget_confidences="newest", padded=lambda n, length: True)
    want = brute_force_cap(entries, model.time, lambda e: prefix_survival(e.newest))
    got = pol.assign(entries)
    assert got == [min(want, e.num_drafts) for e in entries]
    # the same policy on unpadded steps splits the budget (ragged), as before
    ragged = VerifyBudgetPolicy(model, budget_confidences="newest", padded=lambda n, length: False).assign(entries)
    assert sum(ragged) == brute_force_budget(len(entries), [a for e in entries for a in prefix_survival(e.newest)],
                                             model.time)


def test_padded_cap_keeps_drafts_a_ragged_split_would_drop_for_nothing():
    """One confident request and one unsure one: the ragged split verifies 5 + 0 drafts, and padded
    that step costs 2 x 6 tokens anyway; the cap verifies 5 + 5 for the same step time."""
    model = linear_model(t0=0.01, per_draft=0.0005, sizes=(1, 2, 8))
    sure, unsure = entry([0.99] * 5), entry([0.3, 0.2, 0.2, 0.2, 0.2])
    ragged = VerifyBudgetPolicy(model, budget_confidences="newest").assign([sure, unsure])
    padded = VerifyBudgetPolicy(model, budget_confidences="newest", padded=lambda n, length: True).assign([sure, unsure])
    assert ragged[0] == 5 and ragged[1] < 5
    assert padded == [5, 5]


def test_steep_padded_cost_caps_everyone_short():
    model = linear_model(t0=0.001, per_draft=0.01)
    pol = VerifyBudgetPolicy(model, budget_confidences="newest", padded=lambda n, length: True)
    assert pol.assign([entry([0.6] * 5), entry([0.9] * 3)]) == [0, 0]
