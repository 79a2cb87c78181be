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


def _cuda_headers() -> list[str]:
    """cuda.h files on this host: Triton's bundled one (always installed with the kernels) and a toolkit's."""
    import glob
    import os

    import triton
    found = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include", "cuda.h"))
    found += [p for p in ("/usr/local/cuda/include/cuda.h",) if os.path.exists(p)]
    return found


@pytest.mark.parametrize("header", _cuda_headers())
def test_the_ctypes_resource_matches_cuda_h(header):
    """_SmResource mirrors CUdevResource as cuda.h declares it (ABI version 1: the type, 92 padding bytes, then the
    union whose SM member starts with smCount, minSmPartitionSize, smCoscheduledAlignment; 144 bytes in all,
    CUDA 13.1's trailing nextResource pointer included), and the enum values the module passes."""
    import ctypes
    import re

    from deepinfer.worker import sm_partition as sp
    text = open(header).read()
    assert int(re.search(r"#define RESOURCE_ABI_VERSION (\d+)", text).group(1)) == 1
    abi = int(re.search(r"#define RESOURCE_ABI_(?:EXTERNAL_)?BYTES (\d+)", text).group(1))
    body = re.search(r"typedef struct CUdevResource_st \{(.*?)\}\s*_CONCAT_OUTER", text, re.S).group(1)
    assert re.search(r"CUdevResourceType type;.*unsigned char _internal_padding\[92\];\s*union", body, re.S)
    pointer = ctypes.sizeof(ctypes.c_void_p) if "nextResource" in body else 0
    union = max(abi, 16)
    end = 4 + 92 + union
    assert -(-end // 8) * 8 + pointer == ctypes.sizeof(sp._SmResource) == 144
    sm = re.search(r"typedef struct CUdevSmResource_st \{(.*?)\}", text, re.S).group(1)
    assert re.findall(r"unsigned int (\w+);", sm)[:3] == ["smCount", "minSmPartitionSize", "smCoscheduledAlignment"]
    assert sp._SmResource.smCount.offset == 96
    for name, value in (("CU_DEV_RESOURCE_TYPE_SM", sp.CU_DEV_RESOURCE_TYPE_SM),
                        ("CU_GREEN_CTX_DEFAULT_STREAM", sp.CU_GREEN_CTX_DEFAULT_STREAM),
                        ("CU_STREAM_NON_BLOCKING", sp.CU_STREAM_NON_BLOCKING)):
        assert int(re.search(rf"{name}\s*=\s*(0x[0-9a-fA-F]+|\d+)", text).group(1), 0) == value
