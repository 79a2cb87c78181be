"""ExpertLoadRecorder: per-step token counts per MoE layer and logical expert, over the last
`window` steps: the input to the EPLB policies (policy.py).

The MoE layer calls record() with its routed-token counts each forward; the runner calls end_step()
once per step. Everything stays on the counts' device, preallocated, so the hot path is one
in-place add per layer and no host sync; only window_loads() / summed() copy to the CPU.

    open   [L, E]             the step being recorded; record() always writes this one buffer,
                              so a captured CUDA graph that records keeps hitting the right place
    ring   [window, L, E]     closed steps; end_step() copies open into slot num_steps % window

    ring slot    0    1    2                window = 3, after the closed steps s0..s4:
    step        s3   s4   s2                oldest first is slots 2, 0, 1 (s2, s3, s4)

DeepInfer keeps the same per-step time series over a 100-step window
(deepinfer/model_executor/eplb/__init__.py:131-165).
"""

from __future__ import annotations

import torch
from torch import Tensor


class ExpertLoadRecorder:

    def __init__(self, num_layers: int, num_experts: int, window: int, device: torch.device | str | None = None):
        if num_layers < 1 or num_experts < 1 or window < 1:
            raise ValueError(f"num_layers={num_layers}, num_experts={num_experts}, window={window}: "
                             "all must be >= 1")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.window = window
        self.num_steps = 0                  # steps closed since construction or reset()
        # [T] bool: which rows of the running forward are requests' (a captured decode step's padding rows
        # are not, parallel/lockstep.py); None = every row. The MoE layers weight their picks by it.
        self.real_rows: Tensor | None = None
        # allocated on the first record() when no device is given: the caller need not know where
        # the router runs
        self._open: Tensor | None = None    # [L, E]
        self._ring: Tensor | None = None    # [window, L, E]
        if device is not None:
            self._allocate(torch.device(device))

    def _allocate(self, device: torch.device) -> None:
        self._open = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64, device=device)
        self._ring = torch.zeros(self.window, self.num_layers, self.num_experts, dtype=torch.int64,
                                 device=device)

    @property
    def num_window_steps(self) -> int:
        """Closed steps held: S of window_loads()."""
        return min(self.num_steps, self.window)

    def record(self, layer_idx: int, counts: Tensor) -> None:
        """Add counts [E] (tokens routed to each logical expert) to the open step of one layer."""
        if counts.shape != (self.num_experts,):
            raise ValueError(f"counts must have shape ({self.num_experts},), got {tuple(counts.shape)}")
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx={layer_idx} out of range [0, {self.num_layers})")
        if self._open is None:
            self._allocate(counts.device)
        self._open[layer_idx].add_(counts.to(torch.int64))

    def end_step(self) -> None:
        """Close the open step into the ring, over the oldest step once the ring is full."""
        if self._open is not None:
            self._ring[self.num_steps % self.window].copy_(self._open)
            self._open.zero_()
        self.num_steps += 1

    def window_loads(self) -> Tensor:
        """[L, S, E] int64 on the CPU: the last S = num_window_steps closed steps, oldest first."""
        num_held = self.num_window_steps
        if self._ring is None:
            return torch.zeros(self.num_layers, num_held, self.num_experts, dtype=torch.int64)
        slot_ids = [(self.num_steps - num_held + k) % self.window for k in range(num_held)]
        slot_ids = torch.tensor(slot_ids, dtype=torch.int64, device=self._ring.device)
        return self._ring.index_select(0, slot_ids).transpose(0, 1).cpu()

    def summed(self) -> Tensor:
        """[L, E] int64 on the CPU: the window's loads summed over steps (rebalance_experts' weight)."""
        return self.window_loads().sum(1)

    def reset(self) -> None:
        """Forget every step, closed and open."""
        self.num_steps = 0
        if self._open is not None:
            self._open.zero_()
            self._ring.zero_()
