"""The scheduler's acceptance floor (EngineArgs.spec_acceptance_floor, spec/budget.py) through the real
engine: the argument reaches every draft book's policy, a floor of 1 verifies what verify-all verifies
where the step-time model alone stops short, and the tokens stay the reference's (test_spec_overlap.py's
reference and oracle drafts: one draft in four corrupted, so steps accept 0..K)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deepinfer import EngineArgs
from deepinfer.engine import Engine
from deepinfer.spec.policy import VerifyAllPolicy
from tests.engine.conftest import greedy
from tests.engine.test_spec_overlap import N_OUT, PROMPTS, _budget_policy, args, oracle_drafts, ref, run  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def verified(engine: Engine, policy, ref) -> tuple[dict, int]:
    engine.scheduler.draft_book.policy = policy
    oracle_drafts(engine, ref)
    got = run(engine, [greedy(N_OUT) for _ in PROMPTS])[0]
    return got, engine.stats.snapshot()["counters"]["spec_draft_tokens_verified_total"]


def test_the_floor_reaches_the_policy(args):
    e = Engine(EngineArgs(**{**args, "spec_policy": "scheduler"}, spec_acceptance_floor=0.98))
    policy = e.scheduler.draft_book.policy
    assert e.step_time_model is not None and policy.acceptance_floor == 0.98


def test_a_full_floor_verifies_what_verify_all_does(args, ref):
    """Under a step-time model where the budget stops well short of every draft (t = 1 + 0.1 B), a floor
    of 1 keeps every draft with a non-zero survival: verify-all's count, the reference's tokens."""
    argmax_tokens, argmax_n = verified(Engine(EngineArgs(**args)), _budget_policy(), ref)
    floor_tokens, floor_n = verified(Engine(EngineArgs(**args)), replace(_budget_policy(), acceptance_floor=1.0), ref)
    all_tokens, all_n = verified(Engine(EngineArgs(**args)), VerifyAllPolicy(), ref)
    assert argmax_tokens == floor_tokens == all_tokens == ref
    assert argmax_n < floor_n == all_n
