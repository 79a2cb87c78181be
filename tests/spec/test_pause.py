"""Pausing speculation where plain steps are faster (spec/pause.py): the gate's decisions, the budget
policy feeding it, the plain row of the step-time model, and the bad configurations refused at start."""
from __future__ import annotations

import pytest

from deepinfer import EngineArgs
from deepinfer.spec.budget import VerifyBudgetPolicy
from deepinfer.spec.pause import DraftingGate
from deepinfer.spec.policy import DraftEntry
from deepinfer.spec.step_time import StepTimeModel


def plain(t):
    return lambda n: t


def test_gate_drafts_while_speculation_pays_and_probes_during_a_pause():
    g = DraftingGate(probe_every=3)
    assert g.draft_after(plain(1.0))                 # no budget yet (new requests): draft
    g.record(4, 5.0)                                 # 5 tokens/s against a plain 4 / 1.0
    assert g.draft_after(plain(1.0)) and not g.paused
    g.record(4, 3.0)                                 # below the plain rate: pause
    assert not g.draft_after(plain(1.0)) and g.paused
    decisions = [g.draft_after(plain(1.0)) for _ in range(6)]   # plain steps: no budget to read
    assert decisions == [False, True, False, False, True, False]   # every 3rd step of the pause probes
    g.record(4, 4.5)                                 # the probe's verify step pays again
    assert g.draft_after(plain(1.0)) and not g.paused
    g.record(4, 0.1)
    assert g.draft_after(plain(None))                # no plain profile: never pause
    with pytest.raises(ValueError, match="probe_every"):
        DraftingGate(0)


def test_budget_policy_records_its_best_rate_for_the_gate():
    # t(n, B) = 1 + 0.5 B: verifying drafts costs, so a plain step of 0.5 s beats any budget below
    sizes = [1, 4]
    model = StepTimeModel(sizes, list(range(6)), [[1.0 + 0.5 * n * x for x in range(6)] for n in sizes],
                          plain_seconds=[0.5, 0.5])
    policy = VerifyBudgetPolicy(model, pause=DraftingGate())
    entries = [DraftEntry(5, [8.0] * 5), DraftEntry(5, [8.0] * 5)]
    policy.assign(entries)
    assert not policy.draft_after(2)                 # best (2 + E) / t(2, B) < 2 / 0.5
    cheap = VerifyBudgetPolicy(StepTimeModel(sizes, list(range(6)), model.seconds, plain_seconds=[5.0, 5.0]),
                               pause=DraftingGate())
    cheap.assign(entries)
    assert cheap.draft_after(2)
    assert VerifyBudgetPolicy(model).draft_after(2)  # no gate: always draft


def test_plain_time_interpolates_over_batch_sizes():
    model = StepTimeModel([1, 4], [0, 5], [[1.0, 2.0], [3.0, 4.0]], plain_seconds=[0.5, 2.0])
    assert model.plain_time(1) == 0.5 and model.plain_time(4) == 2.0 and model.plain_time(9) == 2.0
    assert model.plain_time(2) == pytest.approx(0.5 + 1.5 / 3)
    assert StepTimeModel.flat().plain_time(3) is None


def test_pause_needs_the_scheduler_policy():
    with pytest.raises(ValueError, match="spec_pause needs spec_policy='scheduler'"):
        EngineArgs("unused", speculative="dspark", spec_policy="threshold", spec_pause=True)
    with pytest.raises(ValueError, match="spec_pause_probe_every"):
        EngineArgs("unused", speculative="dspark", spec_pause=True, spec_pause_probe_every=0)
