"""The next MoE layer's expert stacks dequantized to bf16 ahead of use, on a side stream.

    StackPrefetcher(dequant)          two slots per stack shape and device, alternating
      .prefetch(w, w_scale)           dequantize w into the slot the layer before last used, on the side
                                      stream (CUDA) after everything the main stream has enqueued so far
      .take(w) -> bf16 [E, N, K] | None   the prefetched stack (the main stream waits for it), or None
                                      where none is ready for this very tensor

Why: a long prefill step's bf16 grouped GEMM dequantizes each layer's whole stack first (H200, 2026-12-03:
81 ms of a 650 ms 40-layer 1 x 8192 prefill), a copy-bound pass serialized with compute-bound GEMMs. Made
one layer ahead on a side stream it runs under the current layer's GEMMs.

Safety: a slot is overwritten only by a prefetch issued after the GEMMs that read it were enqueued (the
side stream first waits for the main stream), and a take checks the slot still holds its tensor (a newer
prefetch into the slot drops the older entry). Costs two slots per stack shape (~6.8 GB for a full-width
layer's w13 + w2 at 48 local experts). Opt-in: DEEPINFER_MOE_PREFETCH=1 (select.py); not yet measured.
"""

from __future__ import annotations

import weakref

import torch


class StackPrefetcher:
    def __init__(self, dequant):
        self.dequant = dequant                 # (w2d [R, K], scale2d, out [R, K]) -> out
        self._slots: dict[tuple, list] = {}    # (device, shape) -> [[buffer, owner weakref or None, event]] x 2
        self._next: dict[tuple, int] = {}      # which slot the next prefetch of that shape fills
        self._streams: dict = {}

    def prefetch(self, w: torch.Tensor, w_scale: torch.Tensor) -> None:
        e, n, k = w.shape
        key = (w.device, (e, n, k))
        slots = self._slots.setdefault(key, [[None, None, None], [None, None, None]])
        i = self._next.get(key, 0)
        self._next[key] = 1 - i
        slot = slots[i]
        if slot[0] is None:
            slot[0] = torch.empty(e * n, k, dtype=torch.bfloat16, device=w.device)
        slot[1] = None                          # whatever it held is about to be overwritten
        if w.is_cuda:
            side = self._side(w.device)
            side.wait_stream(torch.cuda.current_stream(w.device))
            with torch.cuda.stream(side):
                self.dequant(w.view(e * n, k), w_scale.flatten(0, 1), slot[0])
                ev = torch.cuda.Event()
                ev.record(side)
        else:
            self.dequant(w.view(e * n, k), w_scale.flatten(0, 1), slot[0])
            ev = None
        slot[1], slot[2] = weakref.ref(w), ev

    def take(self, w: torch.Tensor) -> torch.Tensor | None:
        e, n, k = w.shape
        for slot in self._slots.get((w.device, (e, n, k)), ()):
            if slot[1] is not None and slot[1]() is w:
                if slot[2] is not None:
                    torch.cuda.current_stream(w.device).wait_event(slot[2])
                return slot[0].view(e, n, k)
        return None

    def _side(self, device) -> "torch.cuda.Stream":
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]
