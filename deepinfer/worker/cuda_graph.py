"""CUDA graphs for decode steps: capture a step function once per padded batch size, then replay it
with the step's inputs copied into static buffers (no launch gaps, no Python per kernel).

    graphs = CudaGraphRunner(step_fn, batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128))
    graphs.capture(make_inputs)          # make_inputs(bs) -> tuple of tensors, dim 0 = batch
    out = graphs(*inputs)                # n rows in; padded to the next captured size; n rows out

Rules the step function must keep (the usual CUDA-graph contract): fixed shapes for a given batch
size, no host synchronization (.item(), .tolist(), data-dependent Python branches), state it
mutates (KV caches, rings) lives in tensors allocated before capture. Padding rows are copied from
`pad_fill` (zeros by default): make them harmless for the step (e.g. attention index lists of -1,
slot mappings to a scratch row). On a device without CUDA (or enabled=False) the runner calls the
function eagerly on the padded inputs, so the padding logic is testable on a CPU.

Where the model forward stands (Transformer.forward): every shape and every index list comes from
host-side ints (ForwardBatch.cu_seqlens / start_pos are CPU tensors; model/step_metadata.py builds
the attention metadata once per step; rope tables take the step's last position from it; Engram's
repeat_interleave has its output size), so the decode forward reads nothing back from the device,
except:
  * MoE with packed FP4 experts (the CUDA loader's format): one `bincount(...).tolist()` per layer
    for the per-expert loop. Capture needs the grouped form there (capacity = T rows per expert, or
    a masked grouped GEMM: perf/H200_NOTES.md's MoE kernels), not validated without a GPU.
  * StepMetadata's tensors are built per step with numpy and copied to the device: for capture they
    must be copied into static buffers sized for the padded batch (index lists padded with -1,
    ring writes pointed at a scratch slot), and shapes that depend on the step (max entries E,
    ring width, list width) fixed per captured size (E from max_model_len, width window + topk).
  * DSpark's main_kv (absorb) still sizes its rope table from the device positions.
"""

from __future__ import annotations

import bisect
from typing import Callable, Sequence

import torch


class CudaGraphRunner:
    def __init__(self, fn: Callable, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128),
                 enabled: bool | None = None, warmup: int = 2):
        self.fn = fn
        self.batch_sizes = sorted(batch_sizes)
        self.enabled = torch.cuda.is_available() if enabled is None else enabled
        self.warmup = warmup
        self.pool = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.static_in: dict[int, tuple[torch.Tensor, ...]] = {}
        self.static_out: dict[int, object] = {}

    def padded(self, n: int) -> int:
        """Smallest captured size >= n (n above the largest size is not served by a graph)."""
        i = bisect.bisect_left(self.batch_sizes, n)
        if i == len(self.batch_sizes):
            raise ValueError(f"batch {n} exceeds the largest captured size {self.batch_sizes[-1]}")
        return self.batch_sizes[i]

    def capture(self, make_inputs: Callable[[int], tuple[torch.Tensor, ...]]) -> None:
        """Capture from the largest size down so smaller graphs reuse the largest one's memory pool."""
        for bs in reversed(self.batch_sizes):
            inputs = tuple(make_inputs(bs))
            self.static_in[bs] = inputs
            if not self.enabled:
                continue
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(self.warmup):          # compile / autotune / allocate outside capture
                    self.fn(*inputs)
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.static_out[bs] = self.fn(*inputs)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[bs] = g
        if self.enabled:
            torch.cuda.synchronize()

    def __call__(self, *inputs: torch.Tensor, pad_fill: Sequence[float | int] | None = None):
        n = inputs[0].shape[0]
        bs = self.padded(n)
        static = self.static_in[bs]
        assert len(static) == len(inputs)
        for i, (dst, src) in enumerate(zip(static, inputs)):
            dst[:n].copy_(src)
            if n < bs:
                dst[n:].fill_(0 if pad_fill is None else pad_fill[i])
        if self.enabled:
            self.graphs[bs].replay()
            out = self.static_out[bs]
        else:
            out = self.fn(*static)
        return _slice(out, n)


def _slice(out, n: int):
    if isinstance(out, torch.Tensor):
        return out[:n]
    if isinstance(out, (tuple, list)):
        return type(out)(_slice(o, n) for o in out)
    return out
