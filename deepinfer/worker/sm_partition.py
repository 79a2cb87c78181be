"""A share of a GPU's SMs for side work: a CUDA green context (driver API through ctypes) and a stream on it.
Kernels launched on that stream run on the partition's SMs only, so side work cannot crowd the engine's
steps off the rest of the GPU; the steps themselves still run on every SM.

    partition_size(total, share, min_sms, align)  SMs of a partition asked as a share (the driver's rules:
                                                  at least min_sms, a multiple of align; SM90: 8 and 8)
    sm_partition_stream(device, share)            -> SmPartition (stream, num_sms, total_sms) or None where
                                                  the driver has no green contexts (CUDA < 12.5), said once

Why (the vision tower, worker/image_embeds.py): image encodes ran on their own stream but took every SM
they found, so a batch-16 decode step took 3.5x longer while photos encoded back to back (H200,
2026-12-02, perf/vision_encode.py); steps on a high-priority stream did not help (priorities order the
block scheduler's queue; blocks already running hold their SMs).

A partition lives as long as the process (the engine's encoder holds it; nothing destroys the context).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging

import torch

logger = logging.getLogger(__name__)

CU_DEV_RESOURCE_TYPE_SM = 1
CU_GREEN_CTX_DEFAULT_STREAM = 1
CU_STREAM_NON_BLOCKING = 1


class _SmResource(ctypes.Structure):
    """CUdevResource (cuda.h, RESOURCE_ABI_VERSION 1: 144 bytes) with its union read as the SM resource; CUDA
    13.1's header adds a flags field and a trailing nextResource pointer inside the same 144 bytes (left zero:
    one resource). tests/worker/test_sm_partition.py checks the layout against the cuda.h files at hand."""
    _fields_ = [("type", ctypes.c_int), ("_internal_padding", ctypes.c_ubyte * 92),
                ("smCount", ctypes.c_uint), ("minSmPartitionSize", ctypes.c_uint),
                ("smCoscheduledAlignment", ctypes.c_uint), ("_oversize", ctypes.c_ubyte * (48 - 12))]


assert ctypes.sizeof(_SmResource) == 144


@dataclasses.dataclass(frozen=True)
class SmPartition:
    stream: torch.cuda.Stream       # work launched here runs on the partition's SMs
    num_sms: int                    # SMs the driver gave the partition (the asked count rounded to its rules)
    total_sms: int


def partition_size(total: int, share: float, min_sms: int = 8, align: int = 8) -> int:
    """SMs for `share` of `total`: rounded to a multiple of `align`, at least `min_sms`, and fewer than
    `total` (a partition of the whole GPU partitions nothing)."""
    if not 0 < share <= 1:
        raise ValueError(f"an SM share must be in (0, 1], got {share!r}")
    want = max(min_sms, int(round(share * total / align)) * align)
    return min(want, max(min_sms, (total - 1) // align * align))


def _driver():
    from deepinfer.kernels.cuda_driver import _check, _libcuda
    lib = _libcuda()
    P, U, I = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
    res = ctypes.POINTER(_SmResource)
    sigs = {"cuDeviceGetDevResource": [I, res, I],
            "cuDevSmResourceSplitByCount": [res, ctypes.POINTER(U), res, res, U, U],
            "cuDevResourceGenerateDesc": [ctypes.POINTER(P), res, U],
            "cuGreenCtxCreate": [ctypes.POINTER(P), P, I, U],
            "cuGreenCtxStreamCreate": [ctypes.POINTER(P), P, U, I]}
    for name, args in sigs.items():
        fn = getattr(lib, name)          # AttributeError: a driver without green contexts
        fn.argtypes, fn.restype = args, I
    return lib, _check


@functools.lru_cache(maxsize=None)
def _create(device: int, share: float) -> SmPartition:
    lib, check = _driver()
    torch.cuda.init()
    dev = ctypes.c_int()
    check(lib, lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    whole = _SmResource()
    check(lib, lib.cuDeviceGetDevResource(dev.value, ctypes.byref(whole), CU_DEV_RESOURCE_TYPE_SM),
          "cuDeviceGetDevResource")
    want = partition_size(whole.smCount, share, max(whole.minSmPartitionSize, 1),
                          max(whole.smCoscheduledAlignment, 1))
    part, rest, groups = _SmResource(), _SmResource(), ctypes.c_uint(1)
    check(lib, lib.cuDevSmResourceSplitByCount(ctypes.byref(part), ctypes.byref(groups), ctypes.byref(whole),
                                               ctypes.byref(rest), 0, want), "cuDevSmResourceSplitByCount")
    desc, gctx, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    check(lib, lib.cuDevResourceGenerateDesc(ctypes.byref(desc), ctypes.byref(part), 1), "cuDevResourceGenerateDesc")
    check(lib, lib.cuGreenCtxCreate(ctypes.byref(gctx), desc, dev.value, CU_GREEN_CTX_DEFAULT_STREAM),
          "cuGreenCtxCreate")
    check(lib, lib.cuGreenCtxStreamCreate(ctypes.byref(stream), gctx, CU_STREAM_NON_BLOCKING, 0),
          "cuGreenCtxStreamCreate")
    ext = torch.cuda.ExternalStream(stream.value, device=torch.device("cuda", device))
    with torch.cuda.stream(ext):        # one launch and a wait at start: a stream that cannot run work is
        probe = torch.ones(8, device=torch.device("cuda", device)).cumsum(0)   # refused here, not mid-serving
    ext.synchronize()
    if probe[-1].item() != 8:
        raise RuntimeError("a kernel on the partition's stream computed a wrong value")
    logger.info("SM partition on cuda:%d: %d of %d SMs (share %.3g asked)", device, part.smCount, whole.smCount, share)
    return SmPartition(ext, int(part.smCount), int(whole.smCount))


def sm_partition_stream(device: torch.device | int, share: float) -> SmPartition | None:
    """A stream whose kernels run on `share` of the device's SMs (one partition per (device, share), made
    once); None, logged once, where the driver cannot make one (no green contexts, a failed split)."""
    index = device if isinstance(device, int) else (device.index if device.index is not None
                                                    else torch.cuda.current_device())
    try:
        return _create(index, float(share))
    except (AttributeError, OSError, RuntimeError) as e:
        _warn_once(f"SM partition of share {share} on cuda:{index} unavailable ({e}); side work takes every SM")
        return None


@functools.lru_cache(maxsize=None)
def _warn_once(msg: str) -> None:
    logger.warning(msg)
