"""Pull a weight into the GPU's L2 ahead of the GEMM that reads it, on a side stream beside latency-bound kernels.

A decode step's layer window is a chain of small kernels (mHC mixes, norms, attention, the router) that leave
HBM idle, broken by M <= 64 GEMMs that read tens of MB and run at about half of copy bandwidth. A prefetch
issued during the idle stretch moves the next GEMM's bytes while nothing else wants them, so the GEMM reads L2.

    prefetch_l2(t)          # PROGRAMS programs, MODE form; enqueue on the current stream; no result, no effect on values

Forms (`mode`): "bulk" issues `cp.async.bulk.prefetch.L2` (SM90's copy engine, one instruction a CHUNK);
"line" issues `prefetch.global.L2::evict_last` a 128-byte line (any SM80+). Neither reads into registers, so a
few programs (SMs) keep the whole transfer in flight. Prefetches are hints: no value depends on them, which is
why they need no reference path; on CPU, or where a tensor is not contiguous, the call does nothing.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

LINE = 128          # bytes an L2 line holds
CHUNK = 16384       # bytes one bulk prefetch asks for
LANES = 32          # prefetches a program issues per iteration (one warp's lanes)
PROGRAMS = 8        # programs (SMs) a prefetch takes: a few keep the bytes in flight, the rest stay free
MODE = "bulk"

if triton is not None:
    @triton.jit
    def _prefetch_bulk_kernel(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        lane = tl.arange(0, LANES)
        n_chunks = tl.cdiv(nbytes, CHUNK)
        for c0 in range(pid * LANES, n_chunks, nprog * LANES):
            c = (c0 + lane).to(tl.int64)
            off = c * CHUNK
            # sizes are multiples of 16 bytes: the caller rounds nbytes down, a chunk past the end asks for 0
            size = tl.where(c < n_chunks, tl.minimum(nbytes - off, CHUNK), 0).to(tl.int32)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [base + tl.where(c < n_chunks, off, 0), size], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _prefetch_line_kernel(base, nbytes, LINE: tl.constexpr, LANES: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        lane = tl.arange(0, LANES)
        n_lines = tl.cdiv(nbytes, LINE)
        for l0 in range(pid * LANES, n_lines, nprog * LANES):
            ln = (l0 + lane).to(tl.int64)
            tl.inline_asm_elementwise(
                "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;",
                "=r,l", [base + tl.where(ln < n_lines, ln * LINE, 0)], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(t: torch.Tensor, programs: int | None = None, mode: str | None = None, lanes: int = LANES) -> None:
    """Ask L2 to hold t's bytes (a hint: values are never touched). Enqueued on the current stream."""
    programs, mode = programs or PROGRAMS, mode or MODE
    if triton is None or not t.is_cuda or not t.is_contiguous() or t.numel() == 0:
        return
    flat = t.view(torch.uint8).view(-1) if t.dtype != torch.uint8 else t.view(-1)
    nbytes = flat.numel() // 16 * 16
    if mode == "bulk":
        _prefetch_bulk_kernel[(programs,)](flat, nbytes, CHUNK=CHUNK, LANES=lanes, num_warps=1)
    elif mode == "line":
        _prefetch_line_kernel[(programs,)](flat, nbytes, LINE=LINE, LANES=lanes, num_warps=max(1, lanes // 32))
    else:
        raise ValueError(f"prefetch_l2: mode {mode!r} is not 'bulk' or 'line'")
