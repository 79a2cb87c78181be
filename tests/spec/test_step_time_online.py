"""The online correction of the step-time model (StepTimeModel.observe, spec/step_time_online.py): plain
floats and real SchedulerOutput / ModelRunnerOutput records, a stepped clock."""

from __future__ import annotations

import pytest

from deepinfer.outputs import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.step_time import StepTimeModel
from deepinfer.spec.step_time_online import StepTimeObserver, verify_shape


def model() -> StepTimeModel:
    # t = 10 ms + 1 ms per verified row at every batch size (n = 1, 8, 64; x = 0..5 drafts per request)
    sizes, xs = [1, 8, 64], list(range(6))
    return StepTimeModel(sizes, xs, [[0.010 + 0.001 * n * x for x in xs] for n in sizes])


def test_repeated_measurements_pull_a_grid_point_to_them():
    m = model()
    before = [row[:] for row in m.seconds]
    for _ in range(200):
        m.observe(8, 8 * 3, 0.040, alpha=0.05)             # (8, 3 a request): predicted 0.034 s
    assert m.time(8, 24) == pytest.approx(0.040, rel=1e-3)
    assert m.seconds[0] == before[0] and m.seconds[2] == before[2]      # other batch sizes untouched
    assert all(a <= b for a, b in zip(m.seconds[1], m.seconds[1][1:]))  # still non-decreasing in drafts
    assert m.times(8, 24)[24] == m.time(8, 24)                           # the row cache was dropped


def test_a_point_between_grid_points_splits_the_error_by_its_weights():
    m = model()
    pred = m.time(36, 36 * 2)                      # halfway between n = 8 and 64, on x = 2
    m.observe(36, 72, pred + 0.01, alpha=0.5)
    assert m.seconds[1][2] - model().seconds[1][2] == pytest.approx(0.5 * 0.5 * 0.01)
    assert m.seconds[2][2] - model().seconds[2][2] == pytest.approx(0.5 * 0.5 * 0.01)
    assert m.time(36, 72) == pytest.approx(pred + 0.5 * (0.25 + 0.25) * 0.01)     # alpha x the sum of w^2


def test_a_row_stays_non_decreasing():
    """A measurement above the next grid points' times pools them (the monotone fit)."""
    m = model()
    m.observe(1, 2, 0.024, alpha=1.0)                # x = 2 to 24 ms, above x = 3..5's 13-15 ms
    assert m.seconds[0][:2] == [0.010, 0.011]
    assert m.seconds[0][2:] == pytest.approx([(0.024 + 0.013 + 0.014 + 0.015) / 4] * 4)


def test_one_stall_moves_the_model_by_at_most_the_clamp():
    m = model()
    pred = m.time(1, 5)
    m.observe(1, 5, 100.0, alpha=0.05)             # a 100 s hiccup counts as 2x the prediction
    assert m.time(1, 5) == pytest.approx(pred + 0.05 * pred)


def _params():
    return SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def step(drafts: dict[str, int], prompt_chunk: str | None = None, draft_after: bool = True) -> SchedulerOutput:
    counts = {r: 1 + k for r, k in drafts.items()}
    new = []
    if prompt_chunk is not None:
        counts[prompt_chunk] = 7
        new = [NewRequestData(prompt_chunk, list(range(7)), 7, 0, _params(), [0], 0)]
    return SchedulerOutput(new, [CachedRequestData(r, 10, 2, []) for r in drafts], counts, sum(counts.values()),
                           {r: [5] * k for r, k in drafts.items() if k}, draft_after=draft_after)


def test_verify_shape_takes_whole_batch_verify_steps_only():
    assert verify_shape(step({"a": 3, "b": 0, "c": 5}), None) == (3, 8)
    assert verify_shape(step({"a": 3}, prompt_chunk="p"), None) is None          # a prompt chunk beside
    assert verify_shape(step({"a": 3}, draft_after=False), None) is None         # a paused, plain step
    assert verify_shape(SchedulerOutput([], [], {}, 0), None) is None            # empty
    # an overlapped step verifies what the device picked, not the reserved drafts
    out = ModelRunnerOutput(["a", "b"], [[1], [2]], num_verified=[1, 0])
    assert verify_shape(step({"a": 5, "b": 5}), out) == (2, 1)


def test_the_observer_times_consecutive_verify_steps():
    now = [0.0]
    m = model()
    obs = StepTimeObserver(m, alpha=1.0, clock=lambda: now[0])
    for t, s in ((1.0, step({"a": 5}, prompt_chunk="p")),   # a prompt step: no interval ends here
                 (1.5, step({"a": 5})),                       # after a prompt step: not timed
                 (1.54, step({"a": 5}))):                      # 40 ms after a verify step: timed
        now[0] = t
        obs.finished(s, None)
    assert obs.observed == 1 and m.time(1, 5) == pytest.approx(0.030)        # clamped: 2 x 15 ms
    now[0] = 1.56
    obs.finished(step({"a": 5}, prompt_chunk="q"), None)
    now[0] = 1.57
    obs.finished(step({"a": 5}), None)
    assert obs.observed == 1                                   # the interval after a prompt step is left out
