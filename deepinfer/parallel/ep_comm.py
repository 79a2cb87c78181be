"""MoE expert-parallel dispatch / combine: one interface, several transports.

Each of N ranks holds `num_local` physical expert slots; physical slot p lives on rank p // num_local
as its local slot p % num_local. The caller has already mapped logical experts to physical slots
(EPLB replicas included: two slots may hold one logical expert, we only route by slot).

    lt, handle = dispatcher.dispatch(x, topk_ids, topk_weights)   # x [T, d], ids / weights [T, K]
    y = experts(lt)                                                # [P, d]: one row per pair of lt
    out = dispatcher.combine(y, handle)                            # [T, K, d]: this rank's own pairs

Backends (DISPATCHERS; make_dispatcher picks one by name, ParallelState.backend):
    local      one rank: x as is, the T*K pairs t-major; combine is a reshape
    allgather  all-gather x / ids / weights padded to max_tokens rows per rank (equal-size
               collectives: CUDA-graph safe on NCCL), local pairs selected; combine scatters the
               pair outputs into zeros and reduce-scatters (sum) them back. vLLM's default
               `allgather_reducescatter` (../shared/docs/PARALLEL.md).
    alltoall   all-to-all-v: a count exchange, then each token once per rank that holds any of its
               picks, plus its pair list; the outputs come back by the reverse splits. Fewer bytes
               (top-6 of 384 on 8 ranks: ~4.4 ranks per token, not 8), but the splits are host ints:
               NOT CUDA-graph safe.
DeepEP-class kernels join as more classes in DISPATCHERS (register_dispatcher).

Collectives go through the small helpers at the bottom, one code path per primitive: NCCL (and any
backend with the primitive) runs it natively; gloo emulates reduce-scatter with an all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class LocalTokens:
    """What this rank's experts compute: pair i is expert pair_expert[i] on row x[pair_token[i]],
    its output scaled by pair_weight[i]. Rows that no pair reads may be present (allgather)."""
    x: Tensor              # [M, d] bf16: token rows received, each source token at most once
    pair_token: Tensor     # [P] int64: row of x each (token, pick) pair reads
    pair_expert: Tensor    # [P] int64: local slot id, 0 .. num_local - 1
    pair_weight: Tensor    # [P] fp32: routing weight


class ExpertDispatcher:
    """Base class. max_tokens is step-scoped: the largest T of any rank this step (the driver knows
    every rank's plan and sets it before the forward); None = find it with a tiny all_reduce MAX.
    Only backends with equal-size collectives (allgather) read it."""
    name = ""

    def __init__(self, num_local: int, rank: int, world_size: int, group=None):
        self.num_local, self.rank, self.world_size, self.group = num_local, rank, world_size, group
        self.max_tokens: int | None = None

    def dispatch(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> tuple[LocalTokens, Any]:
        """x [T, d] bf16, topk_ids [T, K] int64 physical slots in [0, N * num_local) (not checked:
        that would cost a host read), topk_weights [T, K] fp32. Every rank calls it, T = 0 too."""
        raise NotImplementedError

    def combine(self, y: Tensor, handle: Any) -> Tensor:
        """y [P, d] bf16 (LocalTokens order) -> [T, K, d] bf16: this rank's pairs in (t, k) layout."""
        raise NotImplementedError

    # dispatch_dense / combine_dense: the fixed-shape form (allgather only)
    dense = False

    def step_tokens(self, num_tokens: int, device) -> int:
        """M, the step's largest token count of any rank (every rank calls it: an all-reduce where the
        driver did not set max_tokens)."""
        if self.max_tokens is None:
            return all_reduce_max(num_tokens, device, self.group)
        if num_tokens > self.max_tokens:
            raise ValueError(f"rank {self.rank} has {num_tokens} tokens > max_tokens {self.max_tokens}")
        return self.max_tokens


DISPATCHERS: dict[str, type[ExpertDispatcher]] = {}


def register_dispatcher(name: str) -> Callable[[type[ExpertDispatcher]], type[ExpertDispatcher]]:
    def deco(cls):
        cls.name = name
        DISPATCHERS[name] = cls
        return cls
    return deco


def make_dispatcher(backend: str, num_local: int, rank: int, world_size: int, group=None) -> ExpertDispatcher:
    cls = DISPATCHERS.get(backend)
    if cls is None:
        raise ValueError(f"unknown EP dispatch backend {backend!r}; choices: {', '.join(sorted(DISPATCHERS))}")
    return cls(num_local, rank, world_size, group)


# --- local ------------------------------------------------------------------------------------

@dataclass
class LocalHandle:
    num_tokens: int
    topk: int


@register_dispatcher("local")
class LocalDispatcher(ExpertDispatcher):
    """One rank: every slot is local; pair i = t * K + k."""

    def __init__(self, num_local: int, rank: int = 0, world_size: int = 1, group=None):
        if world_size != 1:
            raise ValueError(f"the local EP backend runs on one rank, not {world_size}")
        super().__init__(num_local, rank, world_size, group)

    def dispatch(self, x, topk_ids, topk_weights):
        T, K = topk_ids.shape
        pair_token = torch.arange(T * K, device=x.device) // K                         # [T*K]
        lt = LocalTokens(x, pair_token, topk_ids.reshape(-1), topk_weights.reshape(-1))
        return lt, LocalHandle(T, K)

    def combine(self, y, handle):
        return y.view(handle.num_tokens, handle.topk, y.shape[-1])                     # [T, K, d]


# --- all-gather / reduce-scatter ----------------------------------------------------------------

@dataclass
class GatherHandle:
    pair_q: Tensor         # [P] int64: flat index (src * M + t) * K + k of each local pair
    max_tokens: int        # M: rows per rank in the gathered buffers
    num_tokens: int        # T: this rank's real rows
    topk: int


@register_dispatcher("allgather")
class AllGatherDispatcher(ExpertDispatcher):
    """Every rank sees every token; each keeps the pairs whose slot is local.

        gathered rows  | rank 0: t 0..T0-1, pad | rank 1: t 0..T1-1, pad | ...   (M rows per rank)
        pad rows carry slot -1: they route nowhere

    Combine: pair outputs scattered into zeros [N * M, K, d], reduce-scattered (sum) back to the
    owners. Exact: each (t, k) is non-zero on exactly one rank, so the sum adds only zeros to it
    (an output of -0.0 comes back as +0.0: equal, not the same bits).
    NOTE(graph): the collectives have fixed sizes; selecting the local pairs (nonzero) does not (a host
    read a layer). dispatch_dense / combine_dense keep every gathered pick instead, other ranks' as
    dropped ids: fixed shapes, no host read (the MoE's masked form drops them, MoE._forward_ep)."""

    dense = True

    def dispatch(self, x, topk_ids, topk_weights):
        T, K = topk_ids.shape
        M = self.step_tokens(T, x.device)
        if M == 0:                                   # no rank has tokens: every rank skips alike
            return _empty_local(x), GatherHandle(_empty_index(x), 0, 0, K)
        x_all = all_gather_rows(_pad_rows(x, M, 0), self.group, self.world_size)        # [N*M, d]
        meta = _pack_pairs(_pad_rows(topk_ids, M, -1), _pad_rows(topk_weights, M, 0))   # [M, 2, K]
        meta = all_gather_rows(meta, self.group, self.world_size)                       # [N*M, 2, K]
        ids, weights = meta[:, 0].long(), meta[:, 1].contiguous().view(torch.float32)   # [N*M, K]
        pair_q = ((ids // self.num_local) == self.rank).flatten().nonzero().squeeze(1)  # [P]
        lt = LocalTokens(x_all, pair_q // K, ids.flatten()[pair_q] % self.num_local,
                         weights.flatten()[pair_q])
        return lt, GatherHandle(pair_q, M, T, K)

    def dispatch_dense(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, max_tokens: int):
        """The fixed-shape form: (x_all [N*M, d], local_ids [N*M, K] int64, weights [N*M, K] fp32, handle):
        every rank's rows padded to M = max_tokens (step_tokens), each pick as this rank's local slot, or
        num_local where another rank holds it (and on pad rows): the MoE's routing drops those."""
        T, K = topk_ids.shape
        M = max_tokens
        x_all = all_gather_rows(_pad_rows(x, M, 0), self.group, self.world_size)        # [N*M, d]
        meta = _pack_pairs(_pad_rows(topk_ids, M, -1), _pad_rows(topk_weights, M, 0))   # [M, 2, K]
        meta = all_gather_rows(meta, self.group, self.world_size)                       # [N*M, 2, K]
        ids, weights = meta[:, 0].long(), meta[:, 1].contiguous().view(torch.float32)   # [N*M, K]
        mine = (ids >= 0) & (ids // self.num_local == self.rank)
        local = torch.where(mine, ids % self.num_local, self.num_local)
        return x_all, local, weights, GatherHandle(_empty_index(x), M, T, K)

    def combine_dense(self, y: Tensor, h: GatherHandle) -> Tensor:
        """y [N*M, K, d]: this rank's picks' outputs at their (row, k), zeros elsewhere -> [T, K, d]: the
        sum over ranks (each pick non-zero on one rank only) of this rank's own rows."""
        return reduce_scatter_rows(y, self.group, self.world_size)[:h.num_tokens]

    def combine(self, y, h):
        d = y.shape[-1]
        if h.max_tokens == 0:
            return y.new_empty(0, h.topk, d)
        buf = y.new_zeros(self.world_size * h.max_tokens * h.topk, d)                  # [N*M*K, d]
        buf[h.pair_q] = y
        out = reduce_scatter_rows(buf.view(-1, h.topk, d), self.group, self.world_size)  # [M, K, d]
        return out[:h.num_tokens]


# --- all-to-all-v -------------------------------------------------------------------------------

@dataclass
class AllToAllHandle:
    pair_q: Tensor             # [T*K] int64: t * K + k of each sent pair, in send order
    send_pairs: list[int]      # pairs sent to each rank (the outputs come back in these splits)
    recv_pairs: list[int]      # pairs received from each rank
    num_tokens: int
    topk: int


@register_dispatcher("alltoall")
class AllToAllDispatcher(ExpertDispatcher):
    """Each token goes once to every rank that holds any of its picks, with its pair list.

        send buffer   | to rank 0: its tokens, t ascending | to rank 1: ... |
        pair list     | to rank 0: (row in that chunk, local slot, weight) in (t, k) order | ...

    The receiver's pairs are grouped by source rank; the sender keeps which (t, k) each of its pairs
    was (handle.pair_q), so the outputs that come back in the same order land at their (t, k).
    NOTE(graph): the splits are host ints (one device->host copy per dispatch): not graph-safe."""

    def dispatch(self, x, topk_ids, topk_weights):
        T, K = topk_ids.shape
        N, dev = self.world_size, x.device
        dest = (topk_ids // self.num_local).flatten()                                  # [T*K] owner rank
        pair_q = torch.argsort(dest, stable=True)                                      # [T*K] by rank, (t, k) inside
        sends = torch.zeros(T, N, dtype=torch.bool, device=dev)
        sends.view(-1)[torch.arange(T * K, device=dev) // K * N + dest] = True         # [T, N] token t -> rank r
        chunk_row = sends.long().cumsum(0) - 1                                         # [T, N] row in r's chunk
        _, send_t = sends.T.nonzero(as_tuple=True)                                     # send order: r, then t
        meta = _pack_pair_list(chunk_row[pair_q // K, dest[pair_q]], topk_ids.flatten()[pair_q] % self.num_local,
                               topk_weights.flatten()[pair_q])                         # [T*K, 3] int32
        counts = torch.stack([sends.sum(0), torch.bincount(dest, minlength=N)], 1)     # [N, 2]: tokens, pairs
        send_tok, send_pairs, recv_tok, recv_pairs = self._exchange_counts(counts)
        recv_x = all_to_all_rows(x[send_t], recv_tok, send_tok, self.group)            # [R, d]
        recv_meta = all_to_all_rows(meta, recv_pairs, send_pairs, self.group)          # [Pr, 3]
        lt = _unpack_pair_list(recv_x, recv_meta, recv_tok, recv_pairs)
        return lt, AllToAllHandle(pair_q, send_pairs, recv_pairs, T, K)

    def _exchange_counts(self, counts: Tensor) -> tuple[list[int], ...]:
        """counts [N, 2] (tokens, pairs to each rank) -> the four split lists, in one host read."""
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        c = torch.cat([counts, recv], 1).tolist()                                       # [N, 4]
        return tuple([row[i] for row in c] for i in range(4))

    def combine(self, y, h):
        d = y.shape[-1]
        back = all_to_all_rows(y, h.send_pairs, h.recv_pairs, self.group)              # [T*K, d] send order
        out = y.new_empty(h.num_tokens * h.topk, d)
        out[h.pair_q] = back                                                           # every (t, k) is one pair
        return out.view(h.num_tokens, h.topk, d)


# --- packing -------------------------------------------------------------------------------------

def _pad_rows(t: Tensor, rows: int, value) -> Tensor:
    """t [T, ...] -> [rows, ...], the extra rows filled with value."""
    if t.shape[0] == rows:
        return t.contiguous()
    out = t.new_full((rows, *t.shape[1:]), value)
    out[:t.shape[0]] = t
    return out


def _pack_pairs(ids: Tensor, weights: Tensor) -> Tensor:
    """ids [M, K] int64 + weights [M, K] fp32 -> [M, 2, K] int32 (fp32 bits as is): one gather, not two."""
    return torch.stack([ids.to(torch.int32), weights.contiguous().view(torch.int32)], 1)


def _pack_pair_list(row: Tensor, slot: Tensor, weight: Tensor) -> Tensor:
    """[P] row, local slot, fp32 weight -> [P, 3] int32 (weight bits as is): one all-to-all."""
    return torch.stack([row.to(torch.int32), slot.to(torch.int32), weight.contiguous().view(torch.int32)], 1)


def _unpack_pair_list(recv_x: Tensor, meta: Tensor, recv_tok: list[int], recv_pairs: list[int]) -> LocalTokens:
    """The received pair lists [Pr, 3], grouped by source rank, -> LocalTokens over recv_x: a pair's
    row is its row in its source's chunk plus where that chunk starts."""
    dev = recv_x.device
    tok = torch.tensor(recv_tok, device=dev)
    start = tok.cumsum(0) - tok                                                       # [N] chunk starts
    src = torch.repeat_interleave(torch.arange(len(recv_pairs), device=dev),
                                  torch.tensor(recv_pairs, device=dev), output_size=meta.shape[0])  # [Pr]
    return LocalTokens(recv_x, meta[:, 0].long() + start[src], meta[:, 1].long(),
                       meta[:, 2].contiguous().view(torch.float32))


def _empty_local(x: Tensor) -> LocalTokens:
    e = _empty_index(x)
    return LocalTokens(x[:0], e, e, torch.empty(0, dtype=torch.float32, device=x.device))


def _empty_index(x: Tensor) -> Tensor:
    return torch.empty(0, dtype=torch.long, device=x.device)


# --- collectives: one code path per primitive ------------------------------------------------------

def _is_gloo(group, device: torch.device) -> bool:
    """Does this tensor's collective run on gloo? (A group may map devices to backends,
    e.g. "cpu:gloo,cuda:nccl".)"""
    backend = str(dist.get_backend(group))
    if ":" in backend:
        backend = dict(part.split(":") for part in backend.split(",")).get(device.type, "")
    return backend == "gloo"


def all_reduce_max(value: int, device, group) -> int:
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


# torch >= 2.13 names them *_single (the *_tensor names are deprecated aliases)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_rows(t: Tensor, group, world_size: int) -> Tensor:
    """t [M, ...] on every rank -> [N * M, ...], rank r's rows at r * M."""
    out = t.new_empty((world_size * t.shape[0], *t.shape[1:]))
    _all_gather_single(out, t.contiguous(), group=group)
    return out


def reduce_scatter_rows(t: Tensor, group, world_size: int) -> Tensor:
    """t [N * M, ...] on every rank -> [M, ...]: rank r gets the sum over ranks of rows r*M .. r*M+M-1.
    gloo: an all-to-all of the row blocks, summed here (older torch's gloo has no reduce-scatter;
    the same bytes move either way)."""
    rows = t.shape[0] // world_size
    if _is_gloo(group, t.device):
        parts = torch.empty_like(t)
        dist.all_to_all_single(parts, t.contiguous(), group=group)
        return _sum_blocks(parts.view(world_size, rows, *t.shape[1:]))
    out = t.new_empty((rows, *t.shape[1:]))
    _reduce_scatter_single(out, t.contiguous(), group=group)
    return out


def _sum_blocks(parts: Tensor) -> Tensor:
    """parts [N, M, ...] -> [M, ...]: elementwise adds (on CPU 9x faster than bf16 .sum(0) at
    [2, 256, 6, 512]); bf16 + zeros, so exact whatever the order."""
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


def all_to_all_rows(t: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    """t [sum(in_splits), ...]: in_splits[r] rows go to rank r -> [sum(out_splits), ...]: out_splits[r]
    rows from rank r, in rank order."""
    out = t.new_empty((sum(out_splits), *t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=group)
    return out
