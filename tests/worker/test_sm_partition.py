"""The vision encoder's SM share (EngineArgs.vision_sm_share, worker/sm_partition.py): the partition's size
rules, the argument's validation, and the fallback where no green context can be made (here: no CUDA
driver at all). The partition itself runs in tests/model/test_vision_gpu.py."""

from __future__ import annotations

import logging

import pytest

from deepinfer.config import EngineArgs
from deepinfer.worker.sm_partition import partition_size, sm_partition_stream


@pytest.mark.parametrize("total,share,want", [(132, 0.25, 32), (132, 0.125, 16), (132, 0.5, 64), (132, 0.01, 8),
                                              (132, 1.0, 128), (78, 0.25, 16), (16, 0.9, 8)])
def test_partition_size_follows_the_drivers_rules(total, share, want):
    """SM90: at least 8 SMs, a multiple of 8, and never the whole GPU (that would partition nothing)."""
    got = partition_size(total, share)
    assert got == want and got % 8 == 0 and 8 <= got < total


def test_partition_size_takes_other_granularities():
    assert partition_size(108, 0.25, min_sms=4, align=2) == 28
    with pytest.raises(ValueError, match="SM share"):
        partition_size(132, 0.0)
    with pytest.raises(ValueError, match="SM share"):
        partition_size(132, 1.5)


@pytest.mark.parametrize("share", [0, -0.25, 1.5])
def test_engine_args_refuse_an_sm_share_outside_0_1(share):
    with pytest.raises(ValueError, match="vision_sm_share"):
        EngineArgs(vision_sm_share=share)


def test_no_driver_means_no_partition_said_once(caplog):
    """Without a CUDA driver (this CPU host) the encoder keeps a plain stream: None, one warning."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA host makes the partition (test_vision_gpu.py)")
    with caplog.at_level(logging.WARNING, logger="deepinfer.worker.sm_partition"):
        assert sm_partition_stream(0, 0.25) is None
        assert sm_partition_stream(0, 0.25) is None
    warned = [r for r in caplog.records if "SM partition" in r.getMessage()]
    assert len(warned) == 1 and "every SM" in warned[0].getMessage()
