"""The engine's verification policy from EngineArgs (spec_policy and its knobs): built once the
scheduler exists, since "scheduler" profiles step times through the engine's own steps first
(spec/step_time.py). The policy goes into every scheduler's DraftBook (one per data-parallel rank)."""

from __future__ import annotations

from dataclasses import replace

from deepinfer.spec.budget import VerifyBudgetPolicy
from deepinfer.spec.older_calibration import OlderCalibration
from deepinfer.spec.pause import DraftingGate
from deepinfer.spec.policy import StaticThresholdPolicy, VerifyAllPolicy
from deepinfer.spec import step_time_cache
from deepinfer.spec.step_time import profile_step_times
from deepinfer.spec.step_time_online import StepTimeObserver


def set_verification_policy(engine) -> None:
    a = engine.args
    if a.spec_policy == "threshold":
        policy = StaticThresholdPolicy(a.spec_confidence_threshold)
    elif a.spec_policy == "all":
        policy = VerifyAllPolicy()
    else:
        model = _profile(engine, plain=a.spec_pause)
        policy = VerifyAllPolicy() if model is None else VerifyBudgetPolicy(
            model, early_stop=a.spec_early_stop, budget_confidences=a.spec_budget_confidences,
            padded=_padded_steps(engine), acceptance_floor=a.spec_acceptance_floor,
            calibration=OlderCalibration(a.num_speculative_tokens) if a.spec_calibrate_older else None)
    engine.step_time_model = getattr(policy, "step_time", None)
    if a.spec_step_time_online and engine.step_time_model is not None:
        engine.step_time_observer = StepTimeObserver(engine.step_time_model)
    pause = a.spec_pause and isinstance(policy, VerifyBudgetPolicy)
    for book in _draft_books(engine):
        # each data-parallel rank's batch pauses on its own (the gate holds that batch's state)
        book.policy = replace(policy, pause=DraftingGate(a.spec_pause_probe_every)) if pause else policy


def _padded_steps(engine):
    """(n, length) -> whether a verify step of n requests up to `length` tokens runs padded (the
    runner's captured (batch, length) graphs, worker/graph_step.py VerifyKeys); None without graphs
    or with packed (varlen) verify graphs."""
    graphs = getattr(engine.runner, "graphs", None)
    keys = getattr(graphs, "keys", None)
    if keys is None or keys.packed:       # packed verify graphs cost the rows verified: not padded
        return None
    return lambda n, length: keys.key(n, length) is not None


def _profile(engine, plain: bool = False):
    """The step-time model: read from EngineArgs.spec_step_time_cache when a start with the same
    fingerprint saved one (spec/step_time_cache.py), else profiled (and saved there)."""
    folder = engine.args.spec_step_time_cache
    if folder is None:
        return _measure(engine, plain)
    fp = step_time_cache.fingerprint(engine, plain)
    model = step_time_cache.load(folder, fp)
    if model is None:
        model = _measure(engine, plain)
        if model is not None:
            step_time_cache.save(folder, fp, model)
    return model


def _measure(engine, plain: bool):
    """Profile with scratch statistics, so the engine's counters start at zero."""
    from deepinfer.stats import EngineStats
    real, scratch = engine.stats, EngineStats()
    scheds = _schedulers(engine)
    engine.stats = scratch
    for s in scheds:
        s.stats = scratch
    try:
        return profile_step_times(engine, plain=plain)
    finally:
        engine.stats = real
        for s in scheds:
            s.stats = real


def _schedulers(engine) -> list:
    s = engine.scheduler
    return list(getattr(s, "schedulers", [s]))


def _draft_books(engine) -> list:
    return [s.draft_book for s in _schedulers(engine)]
