"""CSA2 attention (reference model.py `Attention`, `Compressor`, `Indexer`, `select_candidate_blocks`),
generalized from "prefill at 0 / one-token decode" to any chunk of new tokens per sequence.

Per layer: q (low-rank, RoPE on the last rope_head_dim dims), one latent per token (K = V, RoPE'd
and FP8-rounded) attended over a 128-token sliding window; layers with compress ratio > 0 also attend
to `index_topk` compressed entries of their KV source, chosen by the latest index source's indexer.
Output: RoPE removed again, grouped low-rank wo_a, then wo_b.

Per-query attention lists keep the reference's order, since the kernel's blockwise softmax rounding
depends on it: a chunk starting at 0 uses the prefill layout (valid window positions first, -1 pads
after, width min(n, window)); any other chunk the decode layout (width window, pads first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .layers import ACT, Linear, RMSNorm


@dataclass
class SeqStep:
    """One sequence's part of a step (host-side ints plus small device tensors)."""
    rows: slice                  # its rows of the flat batch
    start: int                   # first new position
    n: int                       # new tokens
    ring_slot: int
    block_table: torch.Tensor    # [max_blocks] int64 on device
    positions: torch.Tensor      # [n] int64 on device
    topk: dict = field(default_factory=dict)        # index source layer -> [n, K] entry ids or -1
    candidates: torch.Tensor | None = None          # [n, entries] bool, from the candidate source
    index_k_owner: int = -1                         # quirk emulation: last layer that published index keys

    @property
    def end(self) -> int:
        return self.start + self.n


def window_lists(start: int, n: int, window: int, first_pos: int, device) -> torch.Tensor:
    """[n, L] indices into a buffer holding positions first_pos.. ascending, -1 = nothing."""
    t = torch.arange(start, start + n, device=device)[:, None]
    if start == 0:     # prefill layout: max(0, t-W+1) + arange(min(n, W)), beyond t -> -1
        pos = (t - window + 1).clamp_min(0) + torch.arange(min(n, window), device=device)
        return torch.where(pos > t, -1, pos - first_pos)
    pos = t - window + 1 + torch.arange(window, device=device)      # decode layout: oldest first
    return torch.where(pos < 0, -1, pos - first_pos)


def select_candidate_blocks(scores: torch.Tensor, compress_lens: torch.Tensor, topk_blocks: int,
                            block_size: int) -> torch.Tensor:
    """Level one of the two-level top-k. scores [n, W] (unreachable already -inf). Block score = max
    over its positions; the block holding the query's newest entry is pinned in (+inf); keep the
    top `topk_blocks`, dropping -inf picks. Returns a bool mask [n, W]."""
    width = scores.size(-1)
    b = F.pad(scores, (0, -width % block_size), value=-torch.inf).unflatten(-1, (-1, block_size)).amax(-1)
    last = (compress_lens - 1) // block_size
    b = b.masked_fill(torch.arange(b.size(-1), device=b.device) == last[:, None], torch.inf)
    top = b.topk(min(topk_blocks, b.size(-1)), dim=-1)
    keep = torch.zeros_like(b, dtype=torch.bool).scatter_(-1, top.indices, top.values > -torch.inf)
    return keep.repeat_interleave(block_size, dim=-1)[..., :width]


class Compressor(nn.Module):
    """Pools `ratio` consecutive positions into one latent (softmax gate per channel, fp32) and
    RMS-norms it; ratio 1 is a plain bf16 projection. The latent is returned before RoPE."""

    def __init__(self, args, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(args.dim, args.head_dim)
        self.wgate = Linear(args.dim, args.head_dim) if ratio > 1 else None
        self.norm = RMSNorm(args.head_dim, args.norm_eps)

    def project(self, x: torch.Tensor):
        if self.ratio == 1:
            return self.wkv(x), None
        return self.wkv.forward_fp32(x), self.wgate.forward_fp32(x)

    def pool(self, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        """kv, score [groups, ratio, D] fp32 -> latents [groups, D] bf16."""
        return self.norm((kv * score.softmax(dim=1)).sum(dim=1).to(ACT))


class Indexer(nn.Module):
    def __init__(self, args, owns_k: bool):
        super().__init__()
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = Linear(args.dim, self.n_heads)
        if owns_k:
            self.wk = Linear(args.head_dim, self.head_dim)
            self.k_norm = RMSNorm(self.head_dim, args.norm_eps)

    def queries(self, x, qr, cis):
        """fp4-rounded RoPE'd index queries [T, IH, ID] and head weights [T, IH] (bf16)."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = ops.fp4_quant(ops.rope(q, cis), 32)
        w = self.weights_proj(x) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        return q, w

    @staticmethod
    def scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q [n, IH, ID], w [n, IH], keys [E, ID] -> [n, E] bf16: sum_h relu(q_h . k) * w_h, with the
        reference's bf16 rounding after the product, the weighting and the head sum."""
        s = torch.einsum("nhd,ed->nhe", q.float(), keys.float()).to(ACT)
        s = s.relu() * w.unsqueeze(-1)
        return s.float().sum(1).to(ACT)


class Attention(nn.Module):
    def __init__(self, args, layer_id: int):
        super().__init__()
        self.layer_id, self.args = layer_id, args
        self.n_heads, self.head_dim, self.rd = args.n_heads, args.head_dim, args.rope_head_dim
        self.window = args.window_size
        self.ratio = args.compress_ratios[layer_id]
        self.n_groups, self.o_lora_rank = args.o_groups, args.o_lora_rank
        self.scale = self.head_dim ** -0.5
        self.rope_kind = "yarn" if self.ratio else "local"
        backbone = layer_id < args.n_layers
        self.is_kv_source = backbone and layer_id in args.kv_source_layers
        self.is_index_source = backbone and layer_id in args.index_source_layers
        self.kv_source = args.kv_source_of(layer_id) if self.ratio else -1
        self.index_source = args.index_source_of(layer_id) if self.ratio else -1
        self.is_candidate_source = layer_id == args.candidate_source_layer
        self.uses_candidates = 0 <= args.candidate_source_layer < layer_id and self.is_index_source

        self.register_buffer("attn_sink", torch.zeros(self.n_heads), persistent=False)
        self.wq_a = Linear(args.dim, args.q_lora_rank)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.wkv = Linear(args.dim, self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, args.norm_eps)
        self.wo_a = Linear(self.n_heads * self.head_dim // self.n_groups, self.n_groups * self.o_lora_rank)
        self.wo_b = Linear(self.n_groups * self.o_lora_rank, args.dim)
        self.compressor = Compressor(args, self.ratio) if self.is_kv_source else None
        self.indexer = Indexer(args, owns_k=self.is_kv_source) if self.is_index_source else None

    # ---- shared pieces -------------------------------------------------------------------------
    def qkv(self, x: torch.Tensor, cis: torch.Tensor):
        """qr [T, q_lora], q [T, H, D] (RoPE'd), kv [T, D] (RoPE'd, FP8-rounded over all D dims)."""
        qr = self.q_norm(self.wq_a(x))
        q = ops.rope(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), cis)
        kv = ops.act_quant(ops.rope(self.kv_norm(self.wkv(x)), cis))
        return qr, q, kv

    def out(self, o: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        """o [T, H, D] -> RoPE removed, grouped wo_a (block-diagonal, bf16, no act rounding), wo_b."""
        o = ops.rope(o, cis, inverse=True).flatten(1).unflatten(-1, (self.n_groups, -1))
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        o = torch.einsum("tgd,grd->tgr", o.to(wo_a.dtype), wo_a).to(ACT)
        return self.wo_b(o.flatten(1))

    # ---- the forward over a step --------------------------------------------------------------
    def forward(self, x: torch.Tensor, seqs: list[SeqStep], caches, rope_tables, positions) -> torch.Tensor:
        cis = rope_tables[self.rope_kind](positions)
        qr, q, kv = self.qkv(x, cis)
        raw = self.compressor.project(x) if self.compressor is not None else None
        iq = self.indexer.queries(x, qr, cis) if self.indexer is not None else None
        o = torch.empty_like(q)
        for s in seqs:
            r = s.rows
            lo = max(0, s.start - self.window + 1)
            old = caches.read_ring(self.layer_id, s.ring_slot, torch.arange(lo, s.start, device=x.device))
            buf = torch.cat([old.to(kv.dtype), kv[r]])                         # positions lo .. end-1
            idx = window_lists(s.start, s.n, self.window, lo, x.device)
            if self.ratio:
                if self.is_kv_source:
                    self._compress(s, raw, caches, rope_tables)
                if self.is_index_source:
                    s.topk[self.layer_id] = self._index(s, iq, caches)
                topk = s.topk[self.index_source]
                n_entries = s.end // self.ratio
                comp = caches.read_entries(caches.compressed_kv, self.kv_source, s.block_table, n_entries)
                idx = torch.cat([idx, torch.where(topk >= 0, topk + buf.shape[0], -1)], dim=1)
                buf = torch.cat([buf, comp.to(buf.dtype)])
            o[r] = ops.sparse_attn(q[r], buf, self.attn_sink, idx, self.scale)
        for s in seqs:
            caches.write_ring(self.layer_id, s.ring_slot, s.positions, kv[s.rows])
        return self.out(o, cis)

    def _compress(self, s: SeqStep, raw, caches, rope_tables) -> None:
        """New compressed entries of this sequence (groups completed in this step) -> the pools."""
        ratio, dev = self.ratio, s.positions.device
        kv_new, score_new = raw[0][s.rows], (raw[1][s.rows] if raw[1] is not None else None)
        first_entry, end_entry = s.start // ratio, s.end // ratio
        if ratio == 1:
            latent = self.compressor.norm(kv_new)
        else:
            g0 = first_entry * ratio                         # first position of the first open group
            carry_pos = torch.arange(g0, s.start, device=dev)
            ckv = caches.carry_kv[self.layer_id][s.ring_slot, carry_pos % caches.ring_len]
            csc = caches.carry_score[self.layer_id][s.ring_slot, carry_pos % caches.ring_len]
            keep = slice(max(0, s.n - caches.ring_len), None)
            caches.carry_kv[self.layer_id][s.ring_slot, s.positions[keep] % caches.ring_len] = kv_new[keep]
            caches.carry_score[self.layer_id][s.ring_slot, s.positions[keep] % caches.ring_len] = score_new[keep]
            n_groups = end_entry - first_entry
            if n_groups <= 0:
                return
            kv_all = torch.cat([ckv, kv_new])[: n_groups * ratio].unflatten(0, (n_groups, ratio))
            sc_all = torch.cat([csc, score_new])[: n_groups * ratio].unflatten(0, (n_groups, ratio))
            latent = self.compressor.pool(kv_all, sc_all)
        entries = torch.arange(first_entry, end_entry, device=dev)
        if latent.shape[0] == 0:
            return
        cis = rope_tables[self.rope_kind](entries * ratio)    # an entry rotates at its group's first position
        if self.indexer is not None:
            k = self.indexer.k_norm(self.indexer.wk(latent))
            k = ops.fp4_quant(ops.rope(k, cis), 32)
            caches.write_entries(caches.index_k, self.layer_id, s.block_table, entries, k)
            s.index_k_owner = self.layer_id
        latent = ops.fp4_quant(ops.rope(latent, cis), 16)
        caches.write_entries(caches.compressed_kv, self.layer_id, s.block_table, entries, latent)

    def _index(self, s: SeqStep, iq, caches) -> torch.Tensor:
        """[n, K] chosen compressed entry ids per query (ascending), -1 for unreachable picks."""
        ratio, dev = self.ratio, s.positions.device
        n_entries = s.end // ratio
        if n_entries == 0:
            return torch.empty(s.n, 0, dtype=torch.int64, device=dev)
        key_src = self.kv_source
        if self.args.emulate_index_k_alias and s.index_k_owner >= 0:
            key_src = s.index_k_owner
        keys = caches.read_entries(caches.index_k, key_src, s.block_table, n_entries)
        q, w = iq[0][s.rows], iq[1][s.rows]
        score = Indexer.scores(q, w, keys)                                       # [n, E]
        lens = (s.positions + 1) // ratio                                        # visible entries per query
        score = score.masked_fill(torch.arange(n_entries, device=dev) >= lens[:, None], -torch.inf)
        if self.is_candidate_source:
            s.candidates = select_candidate_blocks(score, lens, self.args.candidate_topk_blocks,
                                                   self.args.candidate_block_size)
        return index_topk(score, lens, self.args.index_topk, s.candidates if self.uses_candidates else None)


def index_topk(score: torch.Tensor, lens: torch.Tensor, topk: int, candidates: torch.Tensor | None = None):
    """score [n, E] (entries >= lens already -inf) -> [n, min(topk, E)] entry ids ascending, -1 where
    the pick is not reachable. A re-indexer (candidates given) scores only inside the candidate
    blocks of its candidate source: everything else is -inf before the top-k."""
    if candidates is not None:
        score = score.masked_fill(~candidates, -torch.inf)
    k = min(topk, score.shape[-1])
    idx = score.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    return torch.where(idx < lens[:, None], idx, -1)
