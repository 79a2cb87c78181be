"""The online correction of the step-time model (EngineArgs.spec_step_time_online,
spec/step_time_online.py) through the real engine on the tiny model: with the profile made 4x too fast,
the served verify steps pull the model back up, and the greedy tokens stay plain decoding's."""

from __future__ import annotations

import pytest

from deepinfer import EngineArgs
from deepinfer.engine import Engine
from tests.engine.test_spec_decode import MAX_TOKENS, PROMPTS, params, plain, run, spec_args  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def test_served_steps_correct_a_profile_that_is_too_fast(spec_args, plain):
    engine = Engine(EngineArgs(**spec_args, speculative="dspark", spec_step_time_online=True))
    m, obs = engine.step_time_model, engine.step_time_observer
    assert obs is not None and obs.model is m
    quarter = [[t / 4 for t in row] for row in m.seconds]
    for row, q in zip(m.seconds, quarter):
        row[:] = q
    m._rows.clear()                 # the policy's row cache of the profiled times
    got, _ = run(engine, PROMPTS, [params(n) for n in MAX_TOKENS])
    assert got == plain[0]
    assert obs.observed >= 5
    grown = max(t / q for row, qrow in zip(m.seconds, quarter) for t, q in zip(row, qrow))
    # each timed step lands at >= 2x its (quartered) prediction, clamped to 2x: +5% of a cell at full weight
    assert grown > 1.1, (grown, obs.observed)


def test_off_by_default_and_only_with_the_scheduler(spec_args):
    assert Engine(EngineArgs(**spec_args, speculative="dspark")).step_time_observer is None
    with pytest.raises(ValueError, match="spec_step_time_online needs spec_policy='scheduler'"):
        EngineArgs(**spec_args, speculative="dspark", spec_policy="all", spec_step_time_online=True)
