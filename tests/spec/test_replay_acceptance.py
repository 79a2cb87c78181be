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


def _walk(n, seed=0):
    """Anchor positions of one request's consecutive proposals (1 to 6 positions apart)."""
    rng, pos, out = np.random.default_rng(seed), 0, []
    for _ in range(n):
        out.append(pos)
        pos += 1 + int(rng.integers(0, 6))
    return out


def test_regimes_keep_the_distribution_and_make_consecutive_proposals_alike():
    positions = _walk(6000)
    plain = ReplayedAcceptance(3.5, 5, seed=2)
    regimes = ReplayedAcceptance(3.5, 5, seed=2, regime_tokens=32)
    (lp, np_), (lr, nr) = plain.draw([("q", p) for p in positions]), regimes.draw([("q", p) for p in positions])
    lr, lp = np.array(lr), np.array(lp)
    assert 1 + np.mean(nr) == pytest.approx(3.5, abs=0.08)                 # same mean accepted length
    c = 1 / (1 + np.exp(-lr))
    assert c.mean() == pytest.approx(regimes.m, abs=0.03)
    same_regime = [(a + zlib_key("q") % 32) // 32 == (b + zlib_key("q") % 32) // 32
                   for a, b in zip(positions, positions[1:])]
    shared = [np.array_equal(x, y) for x, y in zip(lr, lr[1:])]
    assert shared == same_regime and 0.8 < np.mean(shared) < 0.95        # ~1 - 3.5 / 32
    assert not any(np.array_equal(x, y) for x, y in zip(lp, lp[1:]))      # S = 0: independent
    # still a pure function of (seed, request, position): another instance, other order, same draws
    again = ReplayedAcceptance(3.5, 5, seed=2, regime_tokens=32).draw([("q", p) for p in positions[::-1][:50]])
    assert again[0] == [x.tolist() for x in lr[::-1][:50]] and again[1] == list(nr[::-1][:50])
    with pytest.raises(ValueError, match="regime_tokens"):
        ReplayedAcceptance(3.5, 5, regime_tokens=-1)


def zlib_key(req_id: str) -> int:
    import zlib
    return zlib.crc32(req_id.encode())


def test_calibration_follows_what_the_replay_makes_of_older_confidences():
    """Regimes: the calibrated budget learns the older confidences are informative (slope near 1) and
    does as well as taking them at face value, both above verify-all; independent proposals: it learns
    they are not (slope near 0) and beats the face value (tests/spec/test_older_calibration.py)."""
    from deepinfer.spec.budget import VerifyBudgetPolicy
    from deepinfer.spec.older_calibration import OlderCalibration
    from deepinfer.spec.policy import DraftEntry, prefix_survival
    from deepinfer.spec.step_time import StepTimeModel
    step = StepTimeModel([1], [0, 5], [[1.0, 1.6]])
    for regime_tokens, slope_range in ((32, (0.7, 1.0)), (0, (0.0, 0.1))):
        logits, _ = ReplayedAcceptance(3.5, 5, concentration=0.5, seed=4, regime_tokens=regime_tokens).draw(
            [("r", p) for p in _walk(3000)])
        score = {}
        for name in ("face value", "calibrated", "all"):
            cal = OlderCalibration(5) if name == "calibrated" else None
            policy = VerifyBudgetPolicy(step, calibration=cal)
            tokens = seconds = 0.0
            for older, newest in zip(logits, logits[1:]):
                policy.observe(older, newest)
                v = 5 if name == "all" else policy.assign([DraftEntry(5, newest, older)])[0]
                tokens += 1 + sum(prefix_survival(newest)[:v])
                seconds += step.time(1, v)
            score[name] = tokens / seconds
            if cal is not None:
                assert slope_range[0] <= cal.slope(0) <= slope_range[1]
        if regime_tokens:
            assert score["calibrated"] > 0.98 * score["face value"] and score["calibrated"] > 1.05 * score["all"]
        else:
            assert score["calibrated"] > 1.05 * score["face value"]
