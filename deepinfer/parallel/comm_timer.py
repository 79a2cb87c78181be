"""TimedDispatcher: wall time spent in an ExpertDispatcher's dispatch and combine, for benchmarks
(the all-to-all share of a step). On CUDA each call synchronizes before and after, which serializes
the step a little: turn it on only to measure (DEEPINFER_EP_TIMING=1 in the rank workers' env)."""

from __future__ import annotations

import os
import time

import torch

ENV = "DEEPINFER_EP_TIMING"


def timing_enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


class TimedDispatcher:
    def __init__(self, inner) -> None:
        self.inner = inner
        self.seconds = 0.0       # dispatch + combine, summed since the last reset
        self.calls = 0

    def __getattr__(self, name):               # max_tokens, num_local, ... of the wrapped one
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name in ("inner", "seconds", "calls"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def dispatch(self, x, topk_ids, topk_weights):
        return self._timed(self.inner.dispatch, x, topk_ids, topk_weights)

    def combine(self, y, handle):
        return self._timed(self.inner.combine, y, handle)

    def dispatch_dense(self, x, topk_ids, topk_weights, max_tokens):
        return self._timed(self.inner.dispatch_dense, x, topk_ids, topk_weights, max_tokens)

    def combine_dense(self, y, handle):
        return self._timed(self.inner.combine_dense, y, handle)

    def _timed(self, fn, *args):
        cuda = args[0].is_cuda
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*args)
        if cuda:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return out
