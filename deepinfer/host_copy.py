"""Host values onto the device without waiting for the stream.

A plain `.to(device)` of a host tensor is a synchronous copy: the host waits until every kernel queued
before it has run, so the host cannot queue the rest of a step while the GPU runs the first part (on
the H200, 2026-12-02, the copy of a verify step's row index right after its graph replay held the host
for the whole replay: perf/spec_step_profile.py). These copy through pinned memory, non-blocking; torch's
pinned allocator keeps the staging buffer alive until its copy has run.
"""

from __future__ import annotations

import os

import numpy as np
import torch

# DEEPINFER_HOST_COPY=blocking: plain copies (the behaviour before this module), for A/B runs: a later
# chunked-prefill run with these copies and another change was slower and the two were not separated
# (perf/H200_NOTES.md, 2026-12-02, late night)
PINNED = os.environ.get("DEEPINFER_HOST_COPY", "pinned") != "blocking"


def host_tensor(values, dtype: torch.dtype | None, device) -> torch.Tensor:
    """A list, a numpy array or a CPU tensor onto `device` (pinned and non-blocking on CUDA); a tensor
    already on a GPU passes through. dtype None: the values' own."""
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        return values.to(device=device, dtype=dtype, non_blocking=True)
    if isinstance(values, np.ndarray):
        values = np.ascontiguousarray(values)
    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda" or not PINNED:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_device(a, device) -> torch.Tensor:
    """Host int64 values (array, list, CPU tensor) onto the device, non-blocking; a device tensor keeps
    its dtype."""
    if isinstance(a, torch.Tensor) and a.device.type != "cpu":
        return a.to(device, non_blocking=True)
    return host_tensor(a, torch.int64, device)
