"""Load-balanced expert picks for random-weight models (load_format="dummy"; EngineArgs.dummy_routing).

Random gates route a step's tokens to a few experts (13-16 of 48 at batch 16-128 on full-width-ep8: an H100,
2026-12-06), so a benchmark on dummy weights reads about a third of the expert bytes a trained,
load-balanced router makes a step read, and its tokens/s come out optimistic. `install(model)` makes every
MoE gate route its T tokens' k picks to experts (t k + j) mod E over the gate's (logical) experts: each
expert once before any twice, a token's k picks distinct while k <= E. The routing weights stay the gate's.

    handles = install(model)        # before CUDA graphs are captured: the graphs keep the picks
    ...
    for h in handles: h.remove()    # the gates' own picks again

A shape's picks are made by its first call (eager, or inside a capture, which then replays the arange) and
reused by every later call of that shape. Data-parallel ranks (rank r of world_size) start their picks at
expert r E / world_size, so small steps on every rank do not all land on the first ranks' experts.
"""

from __future__ import annotations

import torch
from torch import nn


def install(model: nn.Module, rank: int = 0, world_size: int = 1) -> list:
    """Forward hooks on every MoE gate of model (the main layers and DSpark's draft blocks); -> the handles."""
    from .moe import MoE
    made: dict[tuple, torch.Tensor] = {}

    def picks_for(T: int, k: int, E: int, like: torch.Tensor) -> torch.Tensor:
        key = (T, k, E, like.device, like.dtype)
        if key not in made:
            start = rank * E // world_size
            made[key] = ((torch.arange(T * k, device=like.device).view(T, k) + start) % E).to(like.dtype)
        return made[key]

    def balanced(gate, inp, out):
        weights, indices = out
        return weights, picks_for(*indices.shape, gate.weight.shape[0], indices)

    return [m.gate.register_forward_hook(balanced) for m in model.modules()
            if isinstance(m, MoE) and getattr(m, "gate", None) is not None]
