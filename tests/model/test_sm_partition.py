"""sm_partition declines cleanly: where no green-context stream can be made (no CUDA here, a bad SM count) it
returns None and says so once in the log, and the side stream's lane falls back to a plain stream."""

from __future__ import annotations

import logging

import pytest
import torch

from deepinfer.model import sm_partition


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers a device that can make one")
def test_no_capped_stream_without_cuda_said_once(caplog, monkeypatch):
    monkeypatch.setattr(sm_partition, "_made", {})
    monkeypatch.setattr(sm_partition, "_failed", set())
    with caplog.at_level(logging.WARNING, logger=sm_partition.__name__):
        assert sm_partition.capped_stream(0, 16) is None
        assert sm_partition.capped_stream(0, 16) is None
        assert sm_partition.capped_stream(0, 24) is None
    said = [r for r in caplog.records if "no SM-capped stream" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


def test_zero_sms_is_refused(monkeypatch):
    monkeypatch.setattr(sm_partition, "_made", {})
    with pytest.raises(ValueError, match="num_sms must be positive"):
        sm_partition._make(0, 0)
