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

The model's decode step keeps that contract (worker/graph_step.py runs it; what changed to get there):
  * StepMetadata's shapes came from the step (ring width min(window-1, max start), list width,
    E = entries of the longest sequence, G = groups closed in the step, ring-write rows or None):
    model/step_metadata.py's DecodeStepBuffers fixes them per captured size (ring width window-1,
    E = max_model_len // ratio, G = B groups per ratio, scratch rows for padding and for groups a
    step does not close) and holds every index tensor in one int64 buffer, refilled each step by one
    host fill + one H2D copy.
  * Host reads on the decode path: the rope tables take last_pos from the metadata (fixed, tables
    grown before capture); Engram's hasher gets cu_seqlens on the device and sizes its
    repeat_interleave itself; the compressed KV part gathers only the top-k picks in decode (B*K
    rows, not B*E: E is now max_model_len // ratio). Data-dependent Python branches remaining
    (`if plan.group_seq.numel()`, `np.unique(owners)`) read shapes or host constants only, except
    under ModelArgs.emulate_index_k_alias (per-sequence owners): graphs are off then.
  * MoE (model/moe.py, not this package): the FP8 expert stacks (the CUDA default weight format)
    run the masked grouped form up to MASKED_MAX_PAIRS token-expert pairs, with no host read; the
    per-expert loop (dense / packed FP4 experts on CUDA) reads the counts with `.tolist()`, so
    capture fails there and worker/graph_step.py keeps decode eager (with a logged warning).
  * DSpark: verify steps are captured too (graph_step.py, L tokens per request), and the greedy
    drafting pass (DraftGraphs: its ring rows and lists prebuilt on the host, W + block wide); the
    absorb stays eager (main_kv sizes its rope table from the device positions).
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
        self.num_replays = 0            # graph replays (eager calls on the padded inputs not counted)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.static_in: dict[int, tuple[torch.Tensor, ...]] = {}
        self.static_out: dict[int, object] = {}

    def padded(self, n: int) -> int:
        """Smallest captured size >= n (n above the largest size is not served by a graph)."""
        i = bisect.bisect_left(self.batch_sizes, n)
        if i == len(self.batch_sizes):
            raise ValueError(f"batch {n} exceeds the largest captured size {self.batch_sizes[-1]}")
        return self.batch_sizes[i]

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def capture(self, make_inputs: Callable[[int], tuple]) -> None:
        """Capture from the largest size down so smaller graphs reuse the largest one's memory pool.
        make_inputs(bs) -> the static inputs of size bs (tensors, or objects holding them: `run`
        hands them to fn as they are)."""
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
        return _slice(self.run(bs), n)

    def run(self, bs: int):
        """Replay size bs on what its static inputs hold now (eagerly without CUDA); the full padded
        output (a graph's static output: the next replay overwrites it)."""
        if not self.enabled:
            return self.fn(*self.static_in[bs])
        self.graphs[bs].replay()
        self.num_replays += 1
        return self.static_out[bs]


def _slice(out, n: int):
    if isinstance(out, torch.Tensor):
        return out[:n]
    if isinstance(out, (tuple, list)):
        return type(out)(_slice(o, n) for o in out)
    return out
