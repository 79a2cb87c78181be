"""The static step buffers filled on the device (fill_on_device: an overlapped verify step's
positions exist only as device tensors, spec/overlap.py) hold exactly what the host fill writes,
for random ragged steps: padding in batch and length, starts near 0 and near the end, ring slots
and block tables of any shape. Plain torch on CPU; the same ops run on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.model.dspark import DraftStepBuffers
from deepinfer.model.step_metadata import DecodeStepBuffers

LAYOUT = dict(window=16, ring_len=32, max_model_len=96, block_tokens=8, max_blocks=12, ngram_width=3,
              ratios=[1, 2, 4], scratch_slot=7, scratch_block=40, extra=("pending_src",))


@pytest.mark.parametrize("seed", range(10))
def test_decode_step_fill_on_device_equals_host_fill(seed):
    rng = np.random.default_rng(seed)
    B, L = int(rng.integers(1, 6)), int(rng.integers(1, 7))
    n = int(rng.integers(1, B + 1))
    q = rng.integers(1, L + 1, size=n)
    packed = seed % 2 == 1          # odd seeds: the varlen form, T between the real rows and B * L
    rows = int(rng.integers(q.sum(), B * L + 1)) if packed else None
    bufs = DecodeStepBuffers(B, **LAYOUT, tokens_per_seq=L, num_rows=rows)
    start = rng.integers(1, LAYOUT["max_model_len"] - L, size=n)
    ids = rng.integers(0, 1000, size=(n, L))
    hist = rng.integers(-1, 1000, size=(n, 3))
    slots = rng.permutation(7)[:n]
    tables = rng.integers(-1, 40, size=(n, int(rng.integers(1, 15))))
    host = np.full(bufs.numel, 12345, dtype=np.int64)
    bufs.fill(host, positions=start, input_ids=ids, ngram_history=hist, ring_slots=slots, block_tables=tables,
              num_tokens=q, pending_src=[])
    bufs.flat.fill_(-777)
    t = torch.from_numpy
    bufs.fill_on_device(t(start), t(ids), t(hist), t(slots), t(tables), t(q))
    got = bufs.views(bufs.flat.numpy())
    for name, want in bufs.views(host).items():
        assert np.array_equal(got[name], want), name


def test_decode_step_fill_on_device_takes_narrower_ids():
    """A step of at most 2 tokens per request in buffers of L = 4 (the captured key a step takes may
    be longer than its longest request): the ids are padded with 0, as the host fill's are."""
    bufs = DecodeStepBuffers(2, **LAYOUT, tokens_per_seq=4)
    start, q, ids = np.array([5, 40]), np.array([2, 1]), np.array([[7, 8], [9, 0]])
    hist, slots, tables = np.full((2, 3), 3), np.array([1, 2]), np.arange(12).reshape(2, 6)
    host = np.zeros(bufs.numel, dtype=np.int64)
    bufs.fill(host, positions=start, input_ids=np.pad(ids, ((0, 0), (0, 2))), ngram_history=hist, ring_slots=slots,
              block_tables=tables, num_tokens=q, pending_src=[])
    t = torch.from_numpy
    bufs.fill_on_device(t(start), t(ids), t(hist), t(slots), t(tables), t(q))
    assert np.array_equal(bufs.flat.numpy(), host)


@pytest.mark.parametrize("seed", range(4))
def test_draft_step_fill_on_device_equals_host_fill(seed):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 6))
    n = int(rng.integers(0, B + 1))
    bufs = DraftStepBuffers(B, window=16, block=5, ring_len=32, scratch_slot=7, max_pos=200)
    anchors, pos, slots = rng.integers(0, 1000, size=n), rng.integers(0, 150, size=n), rng.permutation(7)[:n]
    host = np.full(bufs.numel, 12345, dtype=np.int64)
    bufs.fill(host, anchors, pos, slots)
    bufs.flat.fill_(-777)
    bufs.fill_on_device(torch.from_numpy(anchors), torch.from_numpy(pos), torch.from_numpy(slots))
    got = bufs.views(bufs.flat.numpy())
    for name, want in bufs.views(host).items():
        assert np.array_equal(got[name], want), name
