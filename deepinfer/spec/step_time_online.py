"""The step-time model corrected by the steps the engine runs (EngineArgs.spec_step_time_online).

The profile (spec/step_time.py) times verify steps of 16-token prompts at start. Serving moves those
times: contexts grow (the indexer scores every compressed key of a sequence for each verified row), other
work shares the device. So each finished verify step is one more measurement of t(n, B), blended into
the grid points that interpolate it (StepTimeModel.observe, weight `alpha`).

What is measured: the time between two finished steps, both verify steps of the whole running batch
(no prompt chunk in either). That is what the profile measures (engine.step() after engine.step(),
under async scheduling one step's device time overlapped with the next one's host work), and a prompt
chunk or an idle engine between the two leaves the interval out. A plain step (speculation paused,
spec/pause.py) has no drafting pass and is left out too.
"""

from __future__ import annotations

import time

from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.spec.step_time import StepTimeModel

ALPHA = 0.05          # weight of one step: ~20 steps move a grid point most of the way


class StepTimeObserver:
    def __init__(self, model: StepTimeModel, alpha: float = ALPHA, clock=time.perf_counter) -> None:
        self.model, self.alpha, self.clock = model, alpha, clock
        self._last: float | None = None        # when the previous step finished, if it was a verify step
        self.observed = 0

    def finished(self, sched_out, runner_out: ModelRunnerOutput | None) -> None:
        """A step was resolved into the scheduler: time it if it and the one before were verify steps."""
        now = self.clock()
        shape = verify_shape(sched_out, runner_out)
        last, self._last = self._last, (now if shape is not None else None)
        if shape is None or last is None:
            return
        self.model.observe(shape[0], shape[1], now - last, self.alpha)
        self.observed += 1


def verify_shape(sched_out, runner_out: ModelRunnerOutput | None) -> tuple[int, int] | None:
    """(requests, drafts verified) of a step in which every request decoded and drafted, else None
    (a prompt chunk, a new or resumed request, a paused plain step, an empty step, or another kind of
    step output: a data-parallel step's per-rank outputs)."""
    if not isinstance(sched_out, SchedulerOutput) or sched_out.is_empty or sched_out.new_reqs \
            or not sched_out.draft_after:
        return None
    spec = sched_out.spec_tokens
    counts = sched_out.num_scheduled_tokens
    if any(n != 1 + len(spec.get(r, ())) for r, n in counts.items()):
        return None
    verified = getattr(runner_out, "num_verified", None)
    drafts = sum(verified) if verified is not None else sum(len(spec.get(r, ())) for r in counts)
    return len(counts), drafts
