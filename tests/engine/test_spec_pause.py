"""Speculation paused and resumed (spec/pause.py, SchedulerOutput.draft_after) through the real engine:
a step scheduled with draft_after=False absorbs its accepted rows into the DSpark rings and proposes
nothing, the next steps are plain decode steps, and drafting resumes when a later step asks. The
tokens stay those of the synchronous engine with every draft verified (test_spec_overlap.py's
reference and oracle drafts), synchronous and under async scheduling with overlapped verify steps."""

from __future__ import annotations

import itertools

import pytest

from deepinfer import EngineArgs
from deepinfer.engine import Engine
from deepinfer.spec.policy import FixedDraftsPolicy, StaticThresholdPolicy
from tests.engine.conftest import greedy
from tests.engine.test_spec_overlap import N_OUT, PROMPTS, args, oracle_drafts, ref, run  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


class ScriptedPauses(StaticThresholdPolicy):
    """Verify every draft; draft after a step as the script says (cycled), counting the pauses."""

    def __init__(self, script):
        super().__init__(0.0)
        object.__setattr__(self, "script", itertools.cycle(script))
        object.__setattr__(self, "calls", [])

    def draft_after(self, num_seqs: int) -> bool:
        d = next(self.script)
        self.calls.append(d)
        return d


def scripted(engine: Engine, script) -> ScriptedPauses:
    policy = ScriptedPauses(script)
    engine.scheduler.draft_book.policy = policy
    return policy


def counters(engine: Engine) -> dict:
    return engine.stats.snapshot()["counters"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pauses_and_resumes_keep_the_tokens(args, ref, async_scheduling):
    e = Engine(EngineArgs(**args, async_scheduling=async_scheduling))
    oracle_drafts(e, ref)
    policy = scripted(e, [True, True, False, False, False, True, False])
    got = run(e, [greedy(N_OUT) for _ in PROMPTS])[0]
    assert got == ref
    c = counters(e)
    assert False in policy.calls and c["spec_draft_tokens_verified_total"] > 0
    assert 0.3 * c["spec_draft_tokens_verified_total"] < c["spec_draft_tokens_accepted_total"]
    full = Engine(EngineArgs(**args, async_scheduling=async_scheduling))
    oracle_drafts(full, ref)
    assert run(full, [greedy(N_OUT) for _ in PROMPTS])[0] == ref
    # paused steps proposed nothing: fewer drafts made, more (plain) steps taken
    assert c["spec_draft_tokens_proposed_total"] < counters(full)["spec_draft_tokens_proposed_total"]
    assert c["steps_total"] > counters(full)["steps_total"]
    assert c["spec_paused_steps_total"] == policy.calls.count(False) > 0
    assert counters(full)["spec_paused_steps_total"] == 0
    if async_scheduling:
        assert e.num_verify_steps_overlapped > 0


def test_never_drafting_is_plain_decoding(args, ref):
    e = Engine(EngineArgs(**args))
    e.scheduler.draft_book.policy = FixedDraftsPolicy(5, draft=False)
    assert run(e, [greedy(N_OUT) for _ in PROMPTS])[0] == ref
    c = counters(e)
    assert c["spec_draft_tokens_proposed_total"] == 0 and c["spec_draft_tokens_verified_total"] == 0


def test_the_scheduler_with_pause_profiles_plain_steps(args, ref):
    """spec_pause: the start-up profile times plain steps beside the verify grid, and whatever the
    gate decides on this machine the tokens are the reference's."""
    e = Engine(EngineArgs(**{**args, "spec_policy": "scheduler"}, spec_pause=True, spec_pause_probe_every=2))
    model = e.step_time_model
    assert model is not None and model.plain_seconds is not None
    assert len(model.plain_seconds) == len(model.batch_sizes) and all(t > 0 for t in model.plain_seconds)
    assert e.scheduler.draft_book.policy.pause is not None
    oracle_drafts(e, ref)
    assert run(e, [greedy(N_OUT) for _ in PROMPTS])[0] == ref
