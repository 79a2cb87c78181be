"""perf/spec_decode.py's measures that the DSpark figures rest on: the steady window (the whole batch
decoding, before the first request finishes) and the projection of a step to the full layer count."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
from spec_decode import project_layers, steady_window  # noqa: E402


def test_steady_window_stops_at_the_first_finish():
    # (seconds, tokens so far, all first tokens out, any request done) per step
    timeline = [(1.0, 4, True, False), (1.5, 12, True, False), (2.0, 20, True, False),
                (2.5, 26, True, True), (4.0, 30, True, True)]             # a slow straggler drains
    tokens, seconds, steps = steady_window(timeline)
    assert (tokens, seconds, steps) == (22, 1.5, 3)


def test_steady_window_waits_for_every_first_token():
    timeline = [(1.0, 2, False, False), (2.0, 6, True, False), (3.0, 10, True, False), (4.0, 14, True, True)]
    assert steady_window(timeline) == (8, 2.0, 2)


def test_steady_window_without_one_is_the_whole_run():
    assert steady_window([(0.5, 1, True, True)]) == (1, 0.5, 1)


def test_projection_scales_only_the_backbone():
    assert project_layers(0.010, 0.0, 7, 40) == pytest.approx(0.010 * 40 / 7)
    assert project_layers(0.010, 0.004, 7, 40) == pytest.approx(0.004 + 0.006 * 40 / 7)
    # a drafting share measured above the step (noise) is clamped to it, below zero to nothing
    assert project_layers(0.010, 0.02, 7, 40) == pytest.approx(0.010)
    assert project_layers(0.010, -0.001, 7, 40) == pytest.approx(0.010 * 40 / 7)
