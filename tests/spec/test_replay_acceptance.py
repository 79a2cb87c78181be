"""The replayed acceptance distribution (spec/replay.py) is the stated one: mean accepted length of
verify-all, calibrated confidences, and verified-prefix acceptance."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.spec.replay import ReplayedAcceptance, expected_accepted_length, survival_mean_for


def test_mean_accepted_length_and_calibration():
    r = ReplayedAcceptance(3.5, 5, seed=1)
    assert r.m == pytest.approx(0.777, abs=1e-3) and expected_accepted_length(r.m, 5) == pytest.approx(3.5)
    logits, lengths = r.draw([(f"req-{i % 100}", i // 100) for i in range(40000)])
    lengths = np.array(lengths)
    assert 1 + lengths.mean() == pytest.approx(3.5, abs=0.03)
    c = 1 / (1 + np.exp(-np.array(logits)))                        # [n, 5]
    assert c.mean() == pytest.approx(r.m, abs=0.01) and c.std() > 0.2   # spread: kappa = 2
    # calibrated: among proposals whose first k drafts were accepted, draft k+1 is accepted at the
    # mean of its confidence
    for k in range(3):
        reached = lengths >= k
        hit = (lengths[reached] > k).mean()
        assert hit == pytest.approx(c[reached, k].mean(), abs=0.02)
    # confident first drafts are accepted more often (what a scheduler can exploit)
    assert (lengths[c[:, 0] > 0.9] >= 1).mean() > 0.9 > (lengths[c[:, 0] < 0.5] >= 1).mean()


def test_draws_are_a_function_of_request_and_position():
    r = ReplayedAcceptance(3.5, 5, seed=1)
    a = r.draw([("x", 10), ("y", 10), ("x", 11)])
    b = ReplayedAcceptance(3.5, 5, seed=1).draw([("x", 11), ("x", 10)])
    assert b[0] == [a[0][2], a[0][0]] and b[1] == [a[1][2], a[1][0]]
    assert a[0][0] != a[0][1] and ReplayedAcceptance(3.5, 5, seed=2).draw([("x", 10)])[0][0] != a[0][0]


def test_bad_lengths_are_refused():
    for bad in (0.5, 6.0):
        with pytest.raises(ValueError, match="mean accepted length"):
            survival_mean_for(bad, 5)
    assert survival_mean_for(1.0, 5) == pytest.approx(0.0, abs=1e-9)
