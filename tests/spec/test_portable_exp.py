"""spec/portable_exp.py: the host's float form and the device's tensor form give the same bits, and both
are exp to within 2 ulp."""

import math

import numpy as np
import torch

from deepinfer.spec.portable_exp import exp_nonpositive, exp_nonpositive_tensor


def _points() -> list[float]:
    rng = np.random.default_rng(3)
    edges = [0.0, -0.0, -1e-300, -5e-324, -1e-17, -0.34657359027997264, -0.6931471805599453, -1.0, -20.0,
             -699.9, -700.0, -745.2, -1e6, -math.inf]
    return edges + (-rng.exponential(4.0, 5000)).tolist() + (-rng.uniform(0, 700, 2000)).tolist()


def test_float_and_tensor_forms_agree_bit_for_bit():
    pts = _points()
    host = [exp_nonpositive(t) for t in pts]
    dev = exp_nonpositive_tensor(torch.tensor(pts, dtype=torch.float64)).tolist()
    assert host == dev
    # and the same values however many elements share the call (no length-dependent vector tail)
    for n in (1, 3, 17, 64):
        assert exp_nonpositive_tensor(torch.tensor(pts[:n], dtype=torch.float64)).tolist() == host[:n]


def test_within_two_ulp_of_exp():
    for t in _points():
        want = math.exp(max(t, -700.0))
        got = exp_nonpositive(t)
        assert abs(got - want) <= 2 * math.ulp(want), (t, got, want)


def test_nan_stays_nan_in_both_forms():
    assert math.isnan(exp_nonpositive(math.nan))
    assert torch.isnan(exp_nonpositive_tensor(torch.tensor([math.nan], dtype=torch.float64))).all()
