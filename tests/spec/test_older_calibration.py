"""The budget's older confidences, calibrated online (spec/older_calibration.py): the regression
recovers how alike consecutive proposals are, the draft book feeds it, and under proposals drawn
independently of each other (the replay mode) the calibrated budget keeps more accepted tokens per
step second than the older confidences taken at face value."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.spec.budget import VerifyBudgetPolicy
from deepinfer.spec.draft_book import DraftBook
from deepinfer.spec.older_calibration import OlderCalibration
from deepinfer.spec.policy import DraftEntry, prefix_survival
from deepinfer.spec.replay import ReplayedAcceptance
from deepinfer.spec.step_time import StepTimeModel


def _survivals(rng, n, m=0.78, kappa=0.5, k=5):
    return np.cumprod(rng.beta(m * kappa, (1 - m) * kappa, size=(n, k)).clip(1e-6, 1 - 1e-6), axis=1)


def test_unrelated_proposals_predict_the_mean_and_alike_ones_themselves():
    rng = np.random.default_rng(0)
    x, y = _survivals(rng, 3000), _survivals(rng, 3000)
    cal = OlderCalibration(5, decay=1.0)
    for a, b in zip(x, y):
        cal.observe(a.tolist(), b.tolist())
    assert all(cal.slope(j) < 0.1 for j in range(5))
    pred = np.array([cal.predict(a.tolist()) for a in x[:200]])
    assert np.abs(pred - y.mean(0)).max() < 0.12 and pred.std(0).max() < 0.05
    assert cal.mean(5) == pytest.approx(y.mean(0).tolist(), abs=0.01)

    same = OlderCalibration(5, decay=1.0)
    for a in x:
        same.observe(a.tolist(), a.tolist())
    assert all(same.slope(j) == pytest.approx(1.0, abs=1e-6) for j in range(5))
    assert same.predict(x[0].tolist()) == pytest.approx(x[0].tolist(), abs=1e-6)


def test_predictions_are_survivals_and_wait_for_data():
    cal = OlderCalibration(3, min_pairs=10)
    older = [0.9, 0.2, 0.1]
    assert cal.predict(older) == older and cal.mean(3) is None       # not ready: as they are
    rng = np.random.default_rng(1)
    for a in _survivals(rng, 50, k=3):
        cal.observe(a.tolist(), (a[::-1] * 0 + rng.random()).tolist())   # anything: clipped and monotone
    p = cal.predict([1.0, 0.99, 0.98, 0.5])                           # longer than the fit: held flat
    assert all(0.0 <= v <= 1.0 for v in p) and all(a >= b for a, b in zip(p, p[1:])) and len(p) == 4


def test_draft_book_feeds_consecutive_proposals():
    seen = []

    class Recorder:
        def assign(self, entries):
            return [e.num_drafts for e in entries]

        def observe(self, older, newest):
            seen.append((older, newest))

    book = DraftBook(Recorder())
    book.propose("a", [1, 2], [0.5, 0.1], room=5)          # no previous proposal: nothing to pair
    book.propose("a", [3, 4], [2.0, -1.0], room=5)
    book.remember("a", [1.0, 1.0])                          # an overlapped step's proposal
    book.propose("b", [5], None, room=5)                    # no confidences: nothing learned
    book.propose("b", [6], [0.3], room=5)
    assert seen == [([0.5, 0.1], [2.0, -1.0]), ([2.0, -1.0], [1.0, 1.0])]


def test_calibrated_budget_beats_face_value_on_independent_proposals():
    """Batch 1, replayed draws (independent per proposal, kappa 0.5): each step the budget is picked
    from the previous proposal's confidences and verifies a prefix of the current one. With the
    older survivals at face value the budget follows one old draw; calibrated, it learns they say
    nothing and verifies what pays on average. Scored by expected tokens per step second."""
    step = StepTimeModel([1], [0, 5], [[1.0, 1.6]])      # a draft costs 12% of a step
    replay = ReplayedAcceptance(3.5, 5, concentration=0.5, seed=4)
    logits, _ = replay.draw([("r", p) for p in range(4000)])
    scores = {}
    for name, cal in (("face value", None), ("calibrated", OlderCalibration(5))):
        policy = VerifyBudgetPolicy(step, calibration=cal)
        tokens = seconds = 0.0
        for older, newest in zip(logits, logits[1:]):
            policy.observe(older, newest)
            v = policy.assign([DraftEntry(5, newest, older)])[0]
            tokens += 1 + sum(prefix_survival(newest)[:v])
            seconds += step.time(1, v)
        scores[name] = tokens / seconds
    assert scores["calibrated"] > 1.05 * scores["face value"]


def test_a_draft_index_no_pair_reached_keeps_the_older_survival():
    """Proposals cut short (max_tokens room) never pair their later indices: those stay as they are."""
    cal = OlderCalibration(5, min_pairs=4)
    for _ in range(10):
        cal.observe([0.9, 0.5], [0.8, 0.4])
    p = cal.predict([0.9, 0.5, 0.3, 0.2, 0.1])
    assert p[:2] == pytest.approx([0.8, 0.4]) and p[2:] == pytest.approx([0.3, 0.2, 0.1])
