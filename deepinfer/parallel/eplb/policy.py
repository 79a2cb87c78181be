"""EPLB policies: which logical expert each physical expert slot holds, per MoE layer.

Pure torch on CPU. Every policy returns the same three maps:

    phy2log  [L, P]          logical expert held by physical slot p
    log2phy  [L, E, maxcnt]  the slots holding expert e, ascending, padded with -1
    logcnt   [L, E]          replicas of expert e (>= 1); maxcnt = logcnt.max()

P = num_replicas physical slots go to G = num_gpus ranks contiguously:

    slot   0  1  2 | 3  4  5 | 6  7  8        P = 9, G = 3, P/G = 3 slots per rank
    rank      0    |    1    |    2

- rebalance_experts: DeepSeek's policy over one load vector per layer (github deepseek-ai/EPLB
  eplb.py @ d52c72d: :5-41 balanced packing, :44-71 replication, :74-129 hierarchical, :131-162
  entry point and log2phy). Hierarchical when num_groups % num_nodes == 0: expert groups are packed
  onto nodes, the hottest experts are replicated inside their node, and each node's physical
  experts are packed onto its GPUs; otherwise the same with one group and one node (global).
- rebalance_experts_per_step: DeepInfer 0.1.0's variant over a window of per-step loads
  (deepinfer/model_executor/eplb/policy.py:105-123 replication, :12-70 rank packing). It balances
  each step's peak rather than the window's sum, which is what a lockstep MoE layer waits for.
- initial_placement: the static layout before any load is known (deepinfer/model_executor/eplb/
  __init__.py:31-39).
- rank_loads / balance_ratio: how well a placement spreads a given load.

Load prediction (a moving average, a decay) is the caller's; these functions take the loads as given.
"""

from __future__ import annotations

import torch
from torch import Tensor

Maps = tuple[Tensor, Tensor, Tensor]  # phy2log [L, P], log2phy [L, E, maxcnt], logcnt [L, E]


# --- argument checks ---------------------------------------------------------------------------

def _check_sizes(num_experts: int, num_replicas: int, num_gpus: int) -> None:
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts}: need at least one expert")
    if num_gpus < 1:
        raise ValueError(f"num_gpus={num_gpus}: need at least one GPU")
    if num_replicas < num_experts:
        raise ValueError(f"num_replicas={num_replicas} < num_experts={num_experts}: "
                         "every logical expert needs a physical slot")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas={num_replicas} is not a multiple of num_gpus={num_gpus}: "
                         "every rank holds the same number of slots")


def _check_hierarchy(num_experts: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_groups={num_groups} does not divide num_experts={num_experts}")
    if num_nodes < 1 or num_gpus % num_nodes:
        raise ValueError(f"num_nodes={num_nodes} does not divide num_gpus={num_gpus}")


def _as_loads(loads: Tensor, ndim: int, name: str) -> Tensor:
    """A float32 CPU copy of a load tensor, rejecting what no policy can balance."""
    if loads.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(loads.shape)}")
    loads = loads.detach().to("cpu", torch.float32)
    if not torch.isfinite(loads).all() or (loads < 0).any():
        raise ValueError(f"{name} must be finite and non-negative")
    return loads


# --- maps --------------------------------------------------------------------------------------

def logical_maps(phy2log: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """log2phy [L, E, maxcnt] (-1 padded, slots ascending) and logcnt [L, E] from phy2log [L, P]."""
    num_layers, num_slots = phy2log.shape
    phy2log = phy2log.to(torch.int64)
    logcnt = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=phy2log.device)
    logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    # a stable sort lists each expert's slots together, in ascending slot order
    sorted_expert_ids, slot_ids = phy2log.sort(dim=-1, stable=True)            # [L, P]
    first = logcnt.cumsum(-1) - logcnt                                          # [L, E] first sorted position
    replica_idx = torch.arange(num_slots, device=phy2log.device) - first.gather(-1, sorted_expert_ids)
    max_cnt = max(int(logcnt.max()), 1) if logcnt.numel() else 1
    log2phy = torch.full((num_layers, num_experts * max_cnt), -1, dtype=torch.int64, device=phy2log.device)
    log2phy.scatter_(1, sorted_expert_ids * max_cnt + replica_idx, slot_ids)
    return log2phy.view(num_layers, num_experts, max_cnt), logcnt


def _with_logical_maps(phy2log: Tensor, num_experts: int) -> Maps:
    return (phy2log, *logical_maps(phy2log, num_experts))


def initial_placement(num_layers: int, num_experts: int, num_replicas: int) -> Maps:
    """The layout before any load is known: slots 0..E-1 hold experts 0..E-1 and redundant slot
    E + i holds expert i mod E (DeepInfer deepinfer/model_executor/eplb/__init__.py:31-39)."""
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers}: need at least one layer")
    _check_sizes(num_experts, num_replicas, 1)
    phy2log = (torch.arange(num_replicas) % num_experts).expand(num_layers, -1).contiguous()
    return _with_logical_maps(phy2log, num_experts)


# --- DeepSeek's policy (one load vector per layer) ---------------------------------------------

def _inverse(perm: Tensor) -> Tensor:
    """Row-wise inverse of a permutation: inv[perm[i]] = i."""
    ids = torch.arange(perm.size(1), dtype=torch.int64).expand_as(perm)
    return torch.empty_like(perm).scatter_(1, perm, ids)


def balanced_packing(weight: Tensor, num_packs: int) -> Tensor:
    """Split each row's n items into num_packs packs of n/num_packs items: heaviest item first, each
    into the lightest pack that still has room (eplb.py:5-41, batched over rows here).

    weight [X, n] -> pos [X, n]: item i goes to packed position pos[i], pack pos[i] // (n/num_packs).
    """
    num_rows, num_items = weight.shape
    per_pack = num_items // num_packs
    if num_packs == 1 or per_pack == 1:
        # any order is equally balanced: keep items where they are (fewer weight moves)
        return torch.arange(num_items).expand(num_rows, -1).contiguous()
    order = weight.argsort(dim=-1, descending=True, stable=True)                # [X, n]
    pack_weight = torch.zeros(num_rows, num_packs)
    pack_fill = torch.zeros(num_rows, num_packs, dtype=torch.int64)
    pos = torch.empty(num_rows, num_items, dtype=torch.int64)
    rows = torch.arange(num_rows)
    for k in range(num_items):
        item_ids = order[:, k]                                                  # [X]
        pack_ids = pack_weight.masked_fill(pack_fill == per_pack, float("inf")).argmin(-1)
        pos[rows, item_ids] = pack_ids * per_pack + pack_fill[rows, pack_ids]
        pack_fill[rows, pack_ids] += 1
        pack_weight[rows, pack_ids] += weight[rows, item_ids]
    return pos


def replicate_experts(weight: Tensor, num_slots: int) -> tuple[Tensor, Tensor]:
    """Give each redundant slot to the expert with the highest load per replica, which minimizes the
    largest per-replica load (eplb.py:44-71). weight [X, n] -> phy2log [X, num_slots], logcnt [X, n];
    slots 0..n-1 hold experts 0..n-1."""
    num_rows, num_items = weight.shape
    phy2log = torch.empty(num_rows, num_slots, dtype=torch.int64)
    phy2log[:, :num_items] = torch.arange(num_items)
    logcnt = torch.ones(num_rows, num_items, dtype=torch.int64)
    rows = torch.arange(num_rows)
    for slot in range(num_items, num_slots):
        hot_ids = (weight / logcnt).argmax(-1)                                 # [X], first on ties
        phy2log[:, slot] = hot_ids
        logcnt[rows, hot_ids] += 1
    return phy2log, logcnt


def _rebalance_hierarchical(weight: Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                            num_gpus: int) -> Tensor:
    """phy2log [L, P] (eplb.py:74-129). "Node-major" ids number experts node by node, so each node's
    experts (and, later, its slots) are one contiguous block that the per-node steps can view as rows."""
    num_layers, num_experts = weight.shape
    group_size = num_experts // num_groups
    experts_per_node = num_experts // num_nodes

    # 1. pack groups onto nodes: a group's experts stay on one node (its traffic stays on NVLink)
    group_weight = weight.view(num_layers, num_groups, group_size).sum(-1)     # [L, num_groups]
    group_pos = balanced_packing(group_weight, num_nodes)                       # [L, num_groups]
    log2node_major = (group_pos.unsqueeze(-1) * group_size + torch.arange(group_size)).flatten(1)  # [L, E]
    node_major2log = _inverse(log2node_major)                                   # [L, E]

    # 2. replicate the hottest experts inside each node
    node_weight = weight.gather(-1, node_major2log).view(num_layers * num_nodes, experts_per_node)
    phy2node_major, node_logcnt = replicate_experts(node_weight, num_replicas // num_nodes)  # [L*N, P/N]

    # 3. pack each node's physical experts onto that node's GPUs
    slot_weight = (node_weight / node_logcnt).gather(-1, phy2node_major)        # [L*N, P/N]
    slot_pos = balanced_packing(slot_weight, num_gpus // num_nodes)             # [L*N, P/N]
    packed = phy2node_major.gather(-1, _inverse(slot_pos))                      # [L*N, P/N] node-local ids
    node_offset = (torch.arange(num_nodes) * experts_per_node).view(1, num_nodes, 1)
    packed = (packed.view(num_layers, num_nodes, -1) + node_offset).flatten(1)  # [L, P] node-major ids
    return node_major2log.gather(-1, packed)


def rebalance_experts(weight: Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> Maps:
    """DeepSeek's EPLB (eplb.py:131-162). weight [L, E]: each expert's predicted load per layer.
    Hierarchical when num_groups % num_nodes == 0, else global (one group, one node)."""
    weight = _as_loads(weight, 2, "weight")
    num_experts = weight.size(1)
    _check_sizes(num_experts, num_replicas, num_gpus)
    _check_hierarchy(num_experts, num_groups, num_nodes, num_gpus)
    if num_groups % num_nodes == 0:
        phy2log = _rebalance_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log = _rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    return _with_logical_maps(phy2log, num_experts)


# --- DeepInfer's per-step variant (a window of per-step loads) ---------------------------------

def _replicate_per_step(loads: Tensor, num_slots: int) -> tuple[Tensor, Tensor]:
    """Give each redundant slot to the expert whose extra replica lowers Σ_steps max_e(load / count)
    the most (DeepInfer policy.py:105-123). loads [L, S, E] -> phy2log [L, num_slots], logcnt [L, E].

    Only a step's hottest expert can lower that step's peak, to max(runner-up, its load / (cnt+1)).
    Where no replica lowers any peak (ties at the top, zero load) we fall back to DeepSeek's rule,
    the highest summed load per replica; DeepInfer breaks those ties with a 1e-4 * expert id bias.
    """
    num_layers, num_steps, num_experts = loads.shape
    phy2log = torch.empty(num_layers, num_slots, dtype=torch.int64)
    phy2log[:, :num_experts] = torch.arange(num_experts)
    logcnt = torch.ones(num_layers, num_experts, dtype=torch.int64)
    rows = torch.arange(num_layers)
    for slot in range(num_experts, num_slots):
        per_replica = loads / logcnt.unsqueeze(1)                              # [L, S, E]
        top = per_replica.topk(min(2, num_experts), dim=-1)                    # [L, S, k]
        peak, hot_ids, runner_up = top.values[..., 0], top.indices[..., 0], top.values[..., -1]  # [L, S]
        split = loads.gather(-1, hot_ids.unsqueeze(-1)).squeeze(-1) / (logcnt.gather(-1, hot_ids) + 1)
        step_gain = peak - torch.maximum(runner_up, split)                     # [L, S]
        gain = torch.zeros(num_layers, num_experts).scatter_add_(1, hot_ids, step_gain)  # [L, E]
        fallback_ids = per_replica.sum(1).argmax(-1)                           # [L]
        chosen_ids = torch.where(gain.amax(-1) > 0, gain.argmax(-1), fallback_ids)
        phy2log[:, slot] = chosen_ids
        logcnt[rows, chosen_ids] += 1
    return phy2log, logcnt


def _pack_per_step(loads: Tensor, phy2log: Tensor, logcnt: Tensor, num_gpus: int) -> Tensor:
    """Replicas, heaviest summed load first, each onto the non-full rank that keeps Σ_steps
    max_rank(load) lowest (DeepInfer policy.py:12-70). Returns the new phy2log [L, P].

    NOTE: many ranks tie on that score (a light replica under every step's peak costs nothing);
    like DeepInfer we take the lowest rank id. Taking the least-loaded tied rank instead moved the
    per-step peak ratio by under 0.001 either way on synthetic_loads, so it did not earn its code.
    """
    num_layers, num_steps, _ = loads.shape
    num_slots = phy2log.size(1)
    slots_per_rank = num_slots // num_gpus
    if num_gpus == 1 or slots_per_rank == 1:
        return phy2log  # one rank, or one slot per rank: every arrangement gives the same rank loads
    index = phy2log.unsqueeze(1).expand(num_layers, num_steps, num_slots)
    slot_loads = (loads / logcnt.unsqueeze(1)).gather(-1, index).transpose(1, 2).contiguous()  # [L, P, S]
    order = slot_loads.sum(-1).argsort(dim=-1, descending=True, stable=True)  # [L, P]
    rank_load = torch.zeros(num_layers, num_gpus, num_steps)                   # [L, G, S]
    peak = torch.zeros(num_layers, num_steps)                                  # [L, S]
    rank_fill = torch.zeros(num_layers, num_gpus, dtype=torch.int64)           # [L, G]
    packed = torch.empty_like(phy2log)
    rows = torch.arange(num_layers)
    for k in range(num_slots):
        slot_ids = order[:, k]                                                  # [L]
        vec = slot_loads[rows, slot_ids]                                        # [L, S]
        score = torch.maximum(rank_load + vec.unsqueeze(1), peak.unsqueeze(1)).sum(-1)  # [L, G]
        score.masked_fill_(rank_fill == slots_per_rank, float("inf"))
        rank_ids = score.argmin(-1)                                             # [L], lowest id on ties
        packed[rows, rank_ids * slots_per_rank + rank_fill[rows, rank_ids]] = phy2log[rows, slot_ids]
        rank_fill[rows, rank_ids] += 1
        rank_load[rows, rank_ids] += vec
        peak = torch.maximum(peak, rank_load[rows, rank_ids])
    return packed


def rebalance_experts_per_step(loads: Tensor, num_replicas: int, num_gpus: int) -> Maps:
    """DeepInfer's EPLB: loads [L, S, E] are per-step token counts over a window of S steps; the
    placement minimizes the summed per-step peak instead of the peak of the summed load."""
    loads = _as_loads(loads, 3, "loads")
    num_experts = loads.size(2)
    _check_sizes(num_experts, num_replicas, num_gpus)
    phy2log, logcnt = _replicate_per_step(loads, num_replicas)
    phy2log = _pack_per_step(loads, phy2log, logcnt, num_gpus)
    return _with_logical_maps(phy2log, num_experts)


# --- evaluation --------------------------------------------------------------------------------

def rank_loads(phy2log: Tensor, loads: Tensor, num_gpus: int) -> Tensor:
    """Tokens each rank computes when an expert's load splits evenly over its replicas.
    loads [L, E] -> [L, G]; loads [L, S, E] -> [L, S, G]. Rank r holds slots [r*P/G, (r+1)*P/G)."""
    if loads.dim() not in (2, 3):
        raise ValueError(f"loads must be [L, E] or [L, S, E], got shape {tuple(loads.shape)}")
    per_step = loads.float() if loads.dim() == 3 else loads.float().unsqueeze(1)  # [L, S, E]
    num_layers, num_steps, num_experts = per_step.shape
    phy2log = phy2log.to(per_step.device, torch.int64)
    num_slots = phy2log.size(1)
    if phy2log.size(0) != num_layers:
        raise ValueError(f"phy2log has {phy2log.size(0)} layers, loads {num_layers}")
    _check_sizes(num_experts, num_slots, num_gpus)
    logcnt = logical_maps(phy2log, num_experts)[1]
    if (logcnt == 0).any():
        raise ValueError("phy2log leaves some logical experts without a replica")
    index = phy2log.unsqueeze(1).expand(num_layers, num_steps, num_slots)
    slot_loads = (per_step / logcnt.unsqueeze(1)).gather(-1, index)             # [L, S, P]
    per_rank = slot_loads.view(num_layers, num_steps, num_gpus, -1).sum(-1)     # [L, S, G]
    return per_rank if loads.dim() == 3 else per_rank.squeeze(1)


def balance_ratio(phy2log: Tensor, loads: Tensor, num_gpus: int) -> float:
    """Σ max_rank / Σ mean_rank of the rank loads, summed over layers (and steps for [L, S, E]):
    each layer's (each step's) slowest rank is what the lockstep MoE waits for. 1.0 is perfect and
    also what an all-zero load gives."""
    per_rank = rank_loads(phy2log, loads, num_gpus)                            # [L, (S,) G]
    total_mean = float(per_rank.mean(-1).sum())
    return float(per_rank.amax(-1).sum()) / total_mean if total_mean > 0 else 1.0


# --- simulated loads (tests, perf) -------------------------------------------------------------

def synthetic_loads(num_layers: int, num_steps: int, num_experts: int, *, num_hot: int = 4,
                    hot_factor: float = 8.0, zipf_s: float = 0.8, step_noise: float = 0.5,
                    tokens_per_step: int = 256, top_k: int = 6, seed: int = 0) -> Tensor:
    """Per-step token counts [L, S, E] (int64) with a skew like a real router's: zipf-like expert
    popularity shuffled per layer, num_hot experts hot_factor times hotter, and log-normal per-step
    noise so the hot set moves from step to step (what the per-step policy is for)."""
    gen = torch.Generator().manual_seed(seed)
    zipf = torch.arange(1, num_experts + 1, dtype=torch.float64).pow(-zipf_s)  # [E]
    popularity = torch.stack([zipf[torch.randperm(num_experts, generator=gen)] for _ in range(num_layers)])
    for layer in range(num_layers):
        hot_ids = torch.randperm(num_experts, generator=gen)[:num_hot]
        popularity[layer, hot_ids] *= hot_factor
    popularity /= popularity.sum(-1, keepdim=True)                              # [L, E]
    noise = (step_noise * torch.randn(num_layers, num_steps, num_experts, generator=gen,
                                      dtype=torch.float64)).exp()              # [L, S, E]
    rate = noise * popularity.unsqueeze(1)
    rate *= tokens_per_step * top_k / rate.sum(-1, keepdim=True)
    return torch.poisson(rate, generator=gen).to(torch.int64)
