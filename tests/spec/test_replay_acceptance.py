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


def test_best_accepted_length_ratio_is_the_oracle_cut():
    """The bound a scheduler is judged against: cutting nothing keeps everything, cutting more keeps
    less, and sharper confidences (small kappa) keep more at the same cut; at kappa = 2 no policy
    keeps 0.98 of the accepted length with 25% fewer drafts, at kappa = 0.5 one can."""
    r = ReplayedAcceptance(3.5, 5, seed=1)
    assert r.best_accepted_length_ratio(0.0, samples=20000) == pytest.approx(1.0)
    cuts = [r.best_accepted_length_ratio(f, samples=20000) for f in (0.1, 0.25, 0.5)]
    assert cuts[0] > cuts[1] > cuts[2]
    assert 0.94 < cuts[1] < 0.97
    sharp = ReplayedAcceptance(3.5, 5, concentration=0.5, seed=1).best_accepted_length_ratio(0.25, samples=20000)
    assert sharp > 0.99
    # a direct check on the same draws: dropping the pooled lowest survivals of a small sample by hand
    small = ReplayedAcceptance(2.5, 3, seed=3)
    c = np.random.default_rng(3).beta(small.m * 2, (1 - small.m) * 2, size=(50, 3)).clip(1e-6, 1 - 1e-6)
    a = np.cumprod(c, axis=1)
    kept = 50 + a.sum() - np.sort(a.ravel())[:15].sum()
    assert small.best_accepted_length_ratio(0.1, samples=50) == pytest.approx(kept / (50 + a.sum()))
    with pytest.raises(ValueError, match="fewer"):
        r.best_accepted_length_ratio(1.5)


def test_replay_concentration_is_an_engine_arg():
    from deepinfer.config import EngineArgs
    with pytest.raises(ValueError, match="spec_replay_concentration"):
        EngineArgs("unused", spec_replay_concentration=0.0)._check_spec_args()
