"""EPLB while serving: sum the ranks' load windows, run the policy, move expert weights between
ranks, switch the maps. Runs on every rank at the same point between steps (the driver orders it).

Per layer, each physical slot p whose logical expert changes takes it from a slot that held it
before: on its own rank if one did (a local copy), else the lowest such slot (a peer-to-peer
send). Every rank derives the same move list from the same maps, in destination-slot order, so
each pair of ranks posts its sends and receives in matching order (batch_isend_irecv). Sources
are snapshotted before anything is written: a slot can be a source and a destination at once.

Weights keep their format (dense, packed FP4, FP8 stacks); they are copied in place, so the
expert Linears' views and any captured graph keep reading the same buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepinfer.parallel.placement import ExpertPlacement

from .policy import balance_ratio, rebalance_experts_per_step


def rebalance_now(model, parallel) -> dict:
    """-> {"balance_before", "balance_after", "num_moved"} (balance: Σmax/Σmean rank load over the window)."""
    old = parallel.placement
    loads = _summed_window(parallel)                                     # [L, S, E]
    before = balance_ratio(old.phy2log, loads, parallel.world_size)
    phy2log, _, _ = rebalance_experts_per_step(loads, old.num_physical, parallel.world_size)
    new = ExpertPlacement.from_maps(phy2log, parallel.world_size)
    after = balance_ratio(new.phy2log, loads, parallel.world_size)
    if after >= before:            # the window says the current placement is as good: move nothing
        return {"balance_before": before, "balance_after": before, "num_moved": 0}
    moved = 0
    for layer in model.layers:
        moe = layer.ffn
        if moe.ep is not None:
            moved += _move_layer(moe, old.phy2log[moe.layer_id], new.phy2log[moe.layer_id], parallel)
    parallel.placement = new
    for layer in model.layers:
        if layer.ffn.ep is not None:
            layer.ffn.ep.maps.update(new, layer.ffn.layer_id)
    return {"balance_before": before, "balance_after": after, "num_moved": moved}


def _summed_window(parallel) -> torch.Tensor:
    loads = parallel.recorder.window_loads()
    if dist.get_backend(parallel.group) == "nccl":
        loads = loads.cuda()
    dist.all_reduce(loads, group=parallel.group)
    return loads.cpu()


def plan_moves(old: list[int], new: list[int], num_local: int) -> list[tuple[int, int]]:
    """(destination slot, source slot) for every slot whose logical expert changes."""
    moves = []
    for p, e in enumerate(new):
        if old[p] == e:
            continue
        holders = [q for q, le in enumerate(old) if le == e]
        same_rank = [q for q in holders if q // num_local == p // num_local]
        moves.append((p, (same_rank or holders)[0]))
    return moves


def slot_tensors(moe, i: int) -> list[torch.Tensor]:
    """Every tensor that holds local slot i's weights, in a fixed order (any weight format)."""
    st = moe.stacks
    if st is not None:
        ts = [st.w13[i], st.s13[i], st.w2[i], st.s2[i]]
        return ts + [r[i] for r in (st.r13, st.r2) if r is not None]
    out = []
    for lin in (moe.experts[i].w1, moe.experts[i].w3, moe.experts[i].w2):
        out += list(lin.packed) if lin.packed is not None else [lin.weight]
    return out


def _move_layer(moe, old_row: torch.Tensor, new_row: torch.Tensor, parallel) -> int:
    S, me = parallel.placement.num_local, parallel.rank
    moves = plan_moves(old_row.tolist(), new_row.tolist(), S)
    # snapshots of every local source slot first
    snap = {q: [t.clone() for t in slot_tensors(moe, q - me * S)] for _, q in moves if q // S == me}
    ops, landing = [], []
    for p, q in moves:
        dst_rank, src_rank = p // S, q // S
        if dst_rank == me and src_rank == me:
            landing.append((p, snap[q]))
        elif src_rank == me:
            ops += [dist.P2POp(dist.isend, t, dst_rank, parallel.group) for t in snap[q]]
        elif dst_rank == me:
            bufs = [torch.empty_like(t) for t in slot_tensors(moe, p - me * S)]
            ops += [dist.P2POp(dist.irecv, t, src_rank, parallel.group) for t in bufs]
            landing.append((p, bufs))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for p, bufs in landing:
        for dst, src in zip(slot_tensors(moe, p - me * S), bufs):
            dst.copy_(src)
    return len(moves)
