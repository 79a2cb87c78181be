"""CUDA streams whose kernels run on a capped number of SMs (a CUDA green context, driver 12.4+).

A side stream's big branch (Engram's 25,600 x 6,144 projection at full width) launched on every SM takes them
from the main stream's latency-bound chain beside it: on an H100 the chain's first GEMMs ran 3-5x slower next to
it (perf/H200_NOTES.md, H100 2026-12-07). On a green context's stream the branch keeps to its SMs and the chain
keeps the rest; the kernels and so the bits are the same.

    stream = capped_stream(device_index, num_sms)   # None where the driver or torch cannot make one (said once)

torch's own GreenContext wrapper is used where it hands out a stream; else the driver API through ctypes
(cuDevSmResourceSplitByCount -> cuDevResourceGenerateDesc -> cuGreenCtxCreate -> cuGreenCtxStreamCreate).
The driver rounds num_sms up to its partition granularity (8 on SM90); sms_of(stream) says what it gave.
"""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger(__name__)

_RESOURCE_BYTES = 512          # > sizeof(CUdevResource) in every CUDA 12.4-13.x header (144-160 bytes)
_SM_COUNT_OFFSET = 96          # CUdevResource: type (4) + _internal_padding[92], then CUdevSmResource.smCount
_CU_DEV_RESOURCE_TYPE_SM = 1
_CU_GREEN_CTX_DEFAULT_STREAM = 1
_CU_STREAM_NON_BLOCKING = 1

_made: dict[tuple[int, int], tuple[torch.cuda.Stream | None, int, object]] = {}   # (device, asked) -> (stream, SMs, ctx)
_failed: set[str] = set()


def capped_stream(device_index: int, num_sms: int) -> torch.cuda.Stream | None:
    """A stream of `device_index` whose kernels run on at most ~num_sms SMs (rounded up by the driver), made
    once and kept; None (logged once) where green contexts are not available."""
    key = (device_index, num_sms)
    if key not in _made:
        try:
            _made[key] = _make(device_index, num_sms)
        except Exception as exc:                  # an old driver or torch: the lane runs uncapped
            if str(exc) not in _failed:
                _failed.add(str(exc))
                log.warning("side streams: no SM-capped stream on cuda:%d (%s): the lane uses every SM",
                            device_index, exc)
            _made[key] = (None, 0, None)
    return _made[key][0]


def sms_of(stream: torch.cuda.Stream) -> int:
    """The SMs a capped_stream stream was given (0 if it is not one)."""
    return next((sms for s, sms, _ in _made.values() if s is not None and s.cuda_stream == stream.cuda_stream), 0)


def _make(device_index: int, num_sms: int) -> tuple[torch.cuda.Stream, int, object]:
    if num_sms <= 0:
        raise ValueError(f"num_sms must be positive, got {num_sms}")
    total = torch.cuda.get_device_properties(device_index).multi_processor_count
    gc = getattr(torch.cuda, "green_contexts", None)
    if gc is not None and getattr(gc, "SUPPORTED", False) and hasattr(gc.GreenContext, "Stream"):
        ctx = gc.GreenContext.create(num_sms=num_sms, device_id=device_index)
        return ctx.Stream(), min(total, -(-num_sms // 8) * 8), ctx
    return _make_with_driver(device_index, num_sms)


def _check(rc: int, call: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{call} returned CUresult {rc}")


def _make_with_driver(device_index: int, num_sms: int) -> tuple[torch.cuda.Stream, int, object]:
    cuda = ctypes.CDLL("libcuda.so.1")
    torch.cuda.init()                              # the primary context exists before a green one is made
    dev = ctypes.c_int()
    _check(cuda.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
    whole, part, rest = (ctypes.create_string_buffer(_RESOURCE_BYTES) for _ in range(3))
    _check(cuda.cuDeviceGetDevResource(dev, whole, _CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource")
    groups = ctypes.c_uint(1)
    _check(cuda.cuDevSmResourceSplitByCount(part, ctypes.byref(groups), whole, rest, 0, num_sms),
           "cuDevSmResourceSplitByCount")
    if groups.value != 1:
        raise RuntimeError(f"the device has no group of {num_sms} SMs to split off")
    desc, green, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    _check(cuda.cuDevResourceGenerateDesc(ctypes.byref(desc), part, 1), "cuDevResourceGenerateDesc")
    _check(cuda.cuGreenCtxCreate(ctypes.byref(green), desc, dev, _CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate")
    _check(cuda.cuGreenCtxStreamCreate(ctypes.byref(stream), green, _CU_STREAM_NON_BLOCKING, 0),
           "cuGreenCtxStreamCreate")
    sms = int.from_bytes(part.raw[_SM_COUNT_OFFSET:_SM_COUNT_OFFSET + 4], "little")
    return torch.cuda.ExternalStream(stream.value, device=torch.device("cuda", device_index)), sms, green
