"""Independent branches of a small step on side CUDA streams.

A decode step is a few hundred kernels, many of them latency-bound (a few microseconds on a handful of
SMs): the shared expert's GEMMs beside the router and the routed experts, the compressor and indexer
beside the q path, Engram's projections (they read only the step's hash ids) ahead of their layers, the mHC
mixes' tails (their sums and Sinkhorn pass, needed only after the sublayer) beside the sublayer's first kernels.
Run on a side stream (one of LANES), such a branch fills the SMs and bandwidth the main stream leaves idle:

    pending = side_stream.branch(fn, *args, tokens=T)   # fn's kernels enqueued on the side stream
    ...                                                  # the main stream's own kernels
    value = pending.wait()                              # the main stream waits for the branch (an event)

Every kernel computes what it computes inline; only their order on the GPU changes, so a step's outputs
are bitwise the inline step's (tests/model/test_side_stream_gpu.py), eager and in CUDA graphs (the side
stream joins the capture through its events). Only graph captures fork: inline (fn runs when `branch` is
called) are eager steps (bound by the host: a fork costs host time, saves none), a CPU tensor, a step of
more than MAX_TOKENS tokens (prefill fills the GPU on its own) and DEEPINFER_SIDE_STREAMS=0.

Memory: a Pending holds fn and its arguments until the main stream has waited, so nothing the branch
reads is freed early; what the branch allocates belongs to the side stream and is next reused by a
later branch, which starts after the main stream's work enqueued before it (the fork's event).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

MAX_TOKENS = 512        # steps up to this many tokens fork (decode, DSpark verification, small chunks)
ENABLED = os.environ.get("DEEPINFER_SIDE_STREAMS", "1") != "0"

LANES = 3               # side streams a device has: branches that do not wait for each other take different lanes
TAIL_LANE = 2           # short branches (the mHC mixes' tails, the kv row): the compressor's lane would wait behind them
MHC_TAILS = os.environ.get("DEEPINFER_MHC_TAIL_FORK", "1") != "0"   # False: the tails inline (A/Bs)
# the attention's kv row beside wq_b (TAIL_LANE): opt-in until a GPU has run it (DEEPINFER_KV_ROW_FORK=1)
KV_ROW = os.environ.get("DEEPINFER_KV_ROW_FORK", "0") == "1"
_streams: dict[tuple[int, int], torch.cuda.Stream] = {}
forked_branches = 0     # branches run on a side stream so far (tests and benchmarks read it)


def _side(device: torch.device, lane: int) -> torch.cuda.Stream:
    assert 0 <= lane < LANES, lane
    key = (device.index if device.index is not None else torch.cuda.current_device(), lane)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(device=key[0])
    return _streams[key]


def forks(device: torch.device, tokens: int) -> bool:
    """Whether a branch of a step of `tokens` tokens on `device` runs on the side stream: while a CUDA graph
    is captured (an eager step of this size is bound by the host, which a fork costs ~0.1 ms more a
    step: perf/H200_NOTES.md, H100 2026-12-06)."""
    return (ENABLED and device.type == "cuda" and 0 < tokens <= MAX_TOKENS
            and torch.cuda.is_current_stream_capturing())


class Pending:
    """A branch's value; `wait()` orders the current stream (the main one, or another lane's branch that
    reads it) after the branch and returns the value. It holds the branch's inputs while it lives."""

    def __init__(self, value: Any, done: torch.cuda.Event | None, keep: tuple):
        self._value, self._done, self._keep = value, done, keep

    def wait(self) -> Any:
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
        return self._value


def branch(fn: Callable, *args, tokens: int, device: torch.device | None = None, lane: int = 0,
           fork: bool = True) -> Pending:
    """fn(*args) on side stream `lane` after everything the current stream has enqueued (and what that lane
    has); device: where the step runs (default: the first tensor argument's); fork=False: inline always (a
    branch's own switch, for A/Bs)."""
    if device is None:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    if not fork or not forks(device, tokens):
        return Pending(fn(*args), None, ())
    global forked_branches
    forked_branches += 1
    main, side = torch.cuda.current_stream(device), _side(device, lane)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        value = fn(*args)
        done = torch.cuda.Event()
        done.record(side)
    return Pending(value, done, (fn, args))

