"""Expert stacks dequantized to bf16 ahead of their GEMMs, on a side stream (long prefill steps).

A long step's MoE dequantizes its whole expert stack to bf16 for one grouped GEMM (select.py's bf16
path; memory-bound, ~1.3 ms a layer at release-ep8 on an H200, ~53 ms of a 1 x 8k prefill's 560). The
block starts that dequant before its attention, on a side stream, so it runs beside compute-bound
kernels instead of between them; the MoE's GEMMs wait for it where they would have run it.

    start(device, stacks)   queue the dequant of each (w, w_scale, dequant) on the device's side stream, after
                            all the current stream has queued (the buffer's last readers: the previous
                            layer's GEMMs); entries of an earlier start are dropped
    take(w)                 the bf16 stack of w if start queued it (the current stream then waits for the
                            side stream's event), else None: the caller dequantizes as before

The buffer is one per device and holds one layer's stacks (both projections), so nothing here outlives
a step but the buffer. DEEPINFER_MOE_DEQUANT_AHEAD: "low" (default: the side stream at the least priority,
the main stream's own), "high" (the greatest: its blocks go first where both streams wait for SMs), or "0"
(off: the dequant runs in the MoE, as before).
"""

from __future__ import annotations

import os
import weakref
from typing import Callable

import torch

MODE = os.environ.get("DEEPINFER_MOE_DEQUANT_AHEAD", "low")
if MODE not in ("low", "high", "0"):
    raise ValueError(f"DEEPINFER_MOE_DEQUANT_AHEAD must be low, high or 0, got {MODE!r}")

_STREAMS: dict[tuple, torch.cuda.Stream] = {}           # (device, MODE) -> the side stream
_BUFFERS: dict[torch.device, torch.Tensor] = {}
# device -> {id(w): (weakref to w, its bf16 stack in the buffer, the side stream's event after it)}
_QUEUED: dict[torch.device, dict[int, tuple]] = {}


def enabled() -> bool:
    return MODE != "0"


def _stream(device: torch.device) -> torch.cuda.Stream:
    s = _STREAMS.get((device, MODE))
    if s is None:
        # 0 is the least priority (every stream's default); a very negative one maps to the greatest
        s = _STREAMS[(device, MODE)] = torch.cuda.Stream(device, priority=0 if MODE == "low" else -100)
    return s


def _buffer(device: torch.device, numel: int) -> torch.Tensor:
    buf = _BUFFERS.get(device)
    if buf is None or buf.numel() < numel:
        _BUFFERS.pop(device, None)                             # free the old one before the larger allocation
        buf = _BUFFERS[device] = torch.empty(numel, dtype=torch.bfloat16, device=device)
    return buf


def start(device: torch.device, stacks: list[tuple[torch.Tensor, tuple[int, int, int],
                                                  Callable[[torch.Tensor], torch.Tensor]]]) -> None:
    """stacks: (w, its dense shape (E, N, K), dequant(out [E*N, K] bf16) writing w's bf16 values into out)."""
    queued = _QUEUED.setdefault(device, {})
    queued.clear()
    sizes = [e * n * k for _, (e, n, k), _ in stacks]
    buf = _buffer(device, sum(sizes))
    main, side = torch.cuda.current_stream(device), _stream(device)
    side.wait_stream(main)                                     # the buffer's last readers come first
    off = 0
    with torch.cuda.stream(side):
        for (w, (e, n, k), dequant), size in zip(stacks, sizes):
            out = buf[off:off + size].view(e * n, k)
            dequant(out)
            ev = torch.cuda.Event()
            ev.record(side)
            queued[id(w)] = (weakref.ref(w), out.view(e, n, k), ev)
            off += size


def take(w: torch.Tensor) -> torch.Tensor | None:
    """w's bf16 stack [E, N, K] from start (the current stream waits for it; taken once), or None."""
    queued = _QUEUED.get(w.device)
    hit = queued.pop(id(w), None) if queued else None
    if hit is None or hit[0]() is not w:
        return None
    torch.cuda.current_stream(w.device).wait_event(hit[2])
    return hit[1]


def drop(device: torch.device) -> None:
    """Forget what start queued (a step that took another path must not hand a later one stale stacks)."""
    _QUEUED.pop(device, None)
