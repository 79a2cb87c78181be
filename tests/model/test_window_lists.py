"""The step's window lists (step_metadata._window_lists, broadcast on the device from per-row bounds)
against a per-row loop that spells the layout out: prefill rows list their causal window first and
pad after; decode rows (start > 0, or the canonical layout) list the W keys ending at their position,
pads first while the sequence is shorter than W; keys before the step's start come from the ring
region (Wr rows per sequence), later ones from the step's fresh rows; a replay floor drops keys."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.model.step_metadata import _window_lists


def loop_reference(starts, q, window, wr, canonical, floor):
    B = len(starts)
    cu = np.concatenate([[0], np.cumsum(q)])
    rows, widths = [], []
    for i in range(B):
        for r in range(q[i]):
            p, prefill = starts[i] + r, starts[i] == 0 and not canonical
            w = min(q[i], window) if prefill else window
            first = max(0, p - window + 1) if prefill else p - window + 1
            row = []
            for j in range(w):
                k = first + j
                ok = (k <= p) if prefill else (k >= 0)
                if floor is not None and k < floor[i]:
                    ok = False
                if not ok:
                    row.append(-1)
                elif k < starts[i]:
                    row.append(i * wr + k - (starts[i] - wr))
                else:
                    row.append(B * wr + cu[i] + k - starts[i])
            rows.append(row)
            widths.append(w)
    lw = max(widths, default=0)
    return [r + [-1] * (lw - len(r)) for r in rows], widths


@pytest.mark.parametrize("case", range(12))
def test_window_lists_match_a_per_row_loop(case):
    rng = np.random.default_rng(case)
    window = int(rng.choice([4, 7, 16, 128]))
    B = int(rng.integers(1, 6))
    canonical = bool(case % 5 == 4)
    starts = np.where(rng.random(B) < 0.4, 0, rng.integers(1, 3 * window, B)).astype(np.int64)
    q = rng.integers(1, 2 * window + 3, B).astype(np.int64)
    floor = rng.integers(0, 2 * window, B).astype(np.int64) if case % 3 == 2 else None
    cu = np.concatenate([[0], np.cumsum(q)]).astype(np.int64)
    seq = np.repeat(np.arange(B), q)
    pos = np.repeat(starts - cu[:-1], q) + np.arange(int(cu[-1]))
    wr = int(min(window - 1, starts.max()))
    idx, w = _window_lists(pos, seq, starts, q, cu, window, wr, canonical, floor, "cpu")
    want, widths = loop_reference(starts, q, window, wr, canonical, floor)
    assert idx.tolist() == want and w.tolist() == widths


@pytest.mark.gpu
def test_window_lists_on_cuda_equal_cpu():
    rng = np.random.default_rng(7)
    starts, q = np.array([0, 300, 5], dtype=np.int64), np.array([8192, 4, 1], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(q)])
    seq = np.repeat(np.arange(3), q)
    pos = np.repeat(starts - cu[:-1], q) + np.arange(int(cu[-1]))
    floor = rng.integers(0, 50, 3)
    cpu = _window_lists(pos, seq, starts, q, cu, 128, 127, False, floor, "cpu")
    gpu = _window_lists(pos, seq, starts, q, cu, 128, 127, False, floor, "cuda")
    assert gpu[0].is_cuda and torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1])
