"""Programmatic dependent launch (PDL) for the small Triton kernels of a decode step.

A decode step is a few hundred dependent launches; between two of them the GPU drains one grid before
it starts the next. A kernel launched with PDL (`launch_pdl=True`, SM90+) is scheduled while the kernel
before it in the stream finishes; `pdl_enter(PDL)`, its first statement, waits (griddepcontrol.wait)
until that kernel has completed and its writes are visible, then lets the next PDL kernel be scheduled
the same way (griddepcontrol.launch_dependents). Waiting first keeps every read and write in stream
order: a kernel that completes has waited for its predecessor, so completion stays transitive along the
stream, and a kernel launched plainly after it waits for it as always. Saved: 0.3-0.8 us a boundary
(perf/bench_pdl_chain.py, H100 2026-12-06); captured CUDA graphs keep the programmatic edges.

    kernel[grid](..., **pdl_args())       # the kernel takes `PDL: tl.constexpr = False`, calls pdl_enter(PDL)

Only in CUDA graph captures (pdl_args); off (no extra launch arguments) in eager launches, the Triton
interpreter, on GPUs before SM90 and with DEEPINFER_TRITON_PDL=0.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:     # a Triton without griddepcontrol: PDL stays off
    gdc_launch_dependents = gdc_wait = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ENABLED = os.environ.get("DEEPINFER_TRITON_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def supported() -> bool:
    """This process's GPU takes PDL kernels (SM90+, CUDA, a Triton with griddepcontrol, not interpreted)."""
    if INTERPRET or gdc_wait is None or torch.version.hip is not None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability()[0] >= 9


_ARGS = {"PDL": True, "launch_pdl": True}


def pdl_args() -> dict:
    """The launch arguments of a PDL kernel: only while a CUDA graph is captured. An eager decode step is
    bound by the host, and a programmatic launch costs it ~5 us more (the eager step 16.3 -> 17.3 ms for
    ~190 launches, H100 2026-12-06), where the graph's replay saves 0.3-0.8 us a launch. {} = a plain launch."""
    if ENABLED and supported() and torch.cuda.is_current_stream_capturing():
        return _ARGS
    return {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A PDL kernel's first statement: wait for the grid before it, then release the grid after it."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
