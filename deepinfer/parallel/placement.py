"""ExpertPlacement: where each backbone layer's routed experts live across the EP ranks.

Per layer (EPLB's three maps, ../shared/docs/PARALLEL.md):
    phy2log [L, P]          logical expert held by physical slot p (P = experts + redundant)
    log2phy [L, E, R]       the physical replicas of logical expert e, -1 padded
    logcnt  [L, E]          how many replicas e has
Rank r holds the contiguous slots [r * P/N, (r+1) * P/N): its local slot i is physical r*P/N + i.

    slots:   | rank 0: 0 .. S-1 | rank 1: S .. 2S-1 | ... |        (S = P / N local slots)

A token's pick of logical e goes to replica (token index + pick index) mod logcnt[e]: the same
rule on every rank, with no state. Which replica serves a pair changes no bits (replicas hold the
same weights and each pair is computed alone), so outputs do not depend on the placement.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


class PlacementError(ValueError):
    """Parallel sizes or a placement file that do not fit the model."""


@dataclass
class ExpertPlacement:
    phy2log: torch.Tensor      # [L, P] int64
    log2phy: torch.Tensor      # [L, E, R] int64, -1 padded
    logcnt: torch.Tensor       # [L, E] int64
    world_size: int

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_logical(self) -> int:
        return self.logcnt.shape[1]

    @property
    def num_local(self) -> int:
        return self.num_physical // self.world_size

    def local_logical(self, layer: int, rank: int) -> list[int]:
        """The logical expert of each local slot of `rank` at `layer`."""
        s = self.num_local
        return self.phy2log[layer, rank * s:(rank + 1) * s].tolist()

    @classmethod
    def from_maps(cls, phy2log: torch.Tensor, world_size: int) -> "ExpertPlacement":
        """Build log2phy / logcnt from phy2log [L, P]; checks every expert has a replica."""
        phy2log = phy2log.long().cpu()
        L, P = phy2log.shape
        if P % world_size:
            raise PlacementError(f"{P} physical expert slots do not divide over {world_size} ranks")
        E = int(phy2log.max()) + 1
        logcnt = torch.zeros(L, E, dtype=torch.long)
        logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
        if (logcnt == 0).any():
            layer, e = (logcnt == 0).nonzero()[0].tolist()
            raise PlacementError(f"layer {layer}: logical expert {e} has no physical slot")
        R = int(logcnt.max())
        log2phy = torch.full((L, E, R), -1, dtype=torch.long)
        for layer in range(L):
            seen = [0] * E
            for p, e in enumerate(phy2log[layer].tolist()):
                log2phy[layer, e, seen[e]] = p
                seen[e] += 1
        return cls(phy2log, log2phy, logcnt, world_size)

    @classmethod
    def initial(cls, num_layers: int, num_experts: int, num_redundant: int, world_size: int) -> "ExpertPlacement":
        """The static default: slots 0..E-1 hold experts 0..E-1, redundant slot E+i holds i mod E
        (DeepInfer 0.1.0 mx/eplb/__init__.py:21-39)."""
        P = num_experts + num_redundant
        check_sizes(num_experts, num_redundant, world_size)
        row = torch.arange(P) % num_experts
        return cls.from_maps(row.expand(num_layers, P).clone(), world_size)

    # files: a static placement loaded at start (EngineArgs.eplb_placement_file) ---------------
    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"world_size": self.world_size, "phy2log": self.phy2log.tolist()}))

    @classmethod
    def load(cls, path: str | Path, num_layers: int, num_experts: int, world_size: int) -> "ExpertPlacement":
        try:
            raw = json.loads(Path(path).read_text())
            phy2log = torch.tensor(raw["phy2log"], dtype=torch.long)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PlacementError(f"{path}: not a placement file ({e})") from None
        if phy2log.dim() != 2 or phy2log.shape[0] != num_layers:
            raise PlacementError(f"{path}: phy2log must be [{num_layers} layers, slots], got {list(phy2log.shape)}")
        if phy2log.min() < 0 or phy2log.max() >= num_experts:
            raise PlacementError(f"{path}: expert ids must be in [0, {num_experts})")
        placement = cls.from_maps(phy2log, world_size)
        if placement.num_logical != num_experts:
            raise PlacementError(f"{path}: covers {placement.num_logical} experts, the model has {num_experts}")
        return placement


def check_sizes(num_experts: int, num_redundant: int, world_size: int) -> None:
    """One clear message naming the number that is wrong."""
    if world_size < 1:
        raise PlacementError(f"data_parallel_size must be >= 1, got {world_size}")
    if num_redundant < 0:
        raise PlacementError(f"num_redundant_experts must be >= 0, got {num_redundant}")
    if (num_experts + num_redundant) % world_size:
        raise PlacementError(f"{num_experts} routed experts + {num_redundant} redundant do not divide over "
                             f"data_parallel_size={world_size} ranks (expert parallelism needs an equal share "
                             f"per rank; choose num_redundant_experts so the sum divides)")


class LayerPlacement:
    """One layer's maps on the device, for the MoE forward: logical top-k ids -> physical slots."""

    def __init__(self, placement: ExpertPlacement, layer: int, device) -> None:
        # [E, R]: as many replica columns as any placement of these slots can need (1 + the redundant
        # slots), so a rebalance rewrites the maps in place: a captured graph keeps reading these buffers
        E = placement.num_logical
        self.log2phy = torch.full((E, placement.num_physical - E + 1), -1, dtype=torch.long, device=device)
        self.logcnt = torch.zeros(E, dtype=torch.long, device=device)
        self.update(placement, layer)

    def update(self, placement: ExpertPlacement, layer: int) -> None:
        """The new maps, written in place."""
        log2phy = placement.log2phy[layer]
        self.log2phy.fill_(-1)
        self.log2phy[:, :log2phy.shape[1]].copy_(log2phy)
        self.logcnt.copy_(placement.logcnt[layer])

    def to_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T, K] logical -> [T, K] physical: pair (t, k) takes replica (t + k) mod logcnt."""
        T, K = topk_ids.shape
        turn = torch.arange(T, device=topk_ids.device)[:, None] + torch.arange(K, device=topk_ids.device)
        replica = turn % self.logcnt[topk_ids]
        return self.log2phy[topk_ids, replica]
