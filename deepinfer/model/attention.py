"""CSA2 attention (reference model.py `Attention`, `Compressor`, `Indexer`, `select_candidate_blocks`),
generalized from "prefill at 0 / one-token decode" to any chunk of new tokens per sequence.

Per layer: q (low-rank, RoPE on the last rope_head_dim dims), one latent per token (K = V, RoPE'd
and FP8-rounded) attended over a 128-token sliding window; layers with compress ratio > 0 also attend
to `index_topk` compressed entries of their KV source, chosen by the latest index source's indexer.
Output: RoPE removed again, grouped low-rank wo_a, then wo_b.

Per-query attention lists keep the reference's order, since the kernel's blockwise softmax rounding
depends on it: a chunk starting at 0 uses the prefill layout (valid window positions first, -1 pads
after, width min(n, window)); any other chunk the decode layout (width window, pads first); the
compressed picks follow right after each row's own window list. All sequences of a step share one
gathered buffer and one sparse_attn call per layer (model/step_metadata.py draws the layout);
tests/model/seq_loop_ref.py keeps the per-sequence loop this replaced, and the test holds them
bitwise equal.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from . import ops, side_stream
from .fused_linears import fuse_linears
from .layers import ACT, Linear, RMSNorm
from .step_metadata import StepMetadata


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
    top `topk_blocks`, dropping -inf picks. Returns a bool mask [n, W] (ops.candidate_blocks: one
    kernel on a GPU; no host read)."""
    return ops.candidate_blocks(scores, compress_lens, topk_blocks, block_size)


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

    def queries(self, x, qr, cis, qr_rounded: bool = False):
        """fp4-rounded RoPE'd index queries [T, IH, ID] and head weights [T, IH] (bf16). qr_rounded: qr is
        act_quant's output already (Attention.qkv)."""
        q = self.wq_b(qr, rounded=qr_rounded).unflatten(-1, (self.n_heads, self.head_dim))
        q = ops.rope_fp4_quant(q, cis, 32)                                   # RoPE, fp4_quant per 32
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
        self.wqkv_a: Linear | None = None     # wq_a and wkv stacked (fuse_input_linears)
        self.compressor = Compressor(args, self.ratio) if self.is_kv_source else None
        self.indexer = Indexer(args, owns_k=self.is_kv_source) if self.is_index_source else None

    # ---- shared pieces -------------------------------------------------------------------------
    def fuse_input_linears(self) -> bool:
        """wq_a and wkv (both read x) as one GEMM, FP8 or dense (model/fused_linears.py); True if fused."""
        self.wqkv_a = fuse_linears([self.wq_a, self.wkv])
        return self.wqkv_a is not None

    def input_linears(self) -> tuple[Linear, ...]:
        """The linears that read the attention's normed input and round it (Block: attn_norm.with_rounded)."""
        return (self.wqkv_a,) if self.wqkv_a is not None else (self.wq_a, self.wkv)

    def qkv(self, x: torch.Tensor, cis: torch.Tensor, x_rounded: torch.Tensor | None = None, ring=None):
        """qr [T, q_lora] as wq_b read it, qr_rounded (qr is q_norm's rows FP8-rounded, for the indexer's
        wq_b too), q [T, H, D] (RoPE'd), kv [T, D] (RoPE'd, FP8-rounded over all D dims).
        x_rounded: act_quant(x) from the norm's launch (RMSNorm.with_rounded), read by the input linears.
        ring (ring rows [R, D], row ids [T]): kv also written there, by the kernel that makes it."""
        qr, qr_rounded, kv = self.q_latent(x, x_rounded)
        q, kv = self.q_heads(qr, qr_rounded, kv, cis, ring)
        return qr, qr_rounded, q, kv

    def q_latent(self, x: torch.Tensor, x_rounded: torch.Tensor | None = None):
        """(qr, qr_rounded, the raw kv latent [T, D]): qkv's first half, what the indexer reads too."""
        xin = x if x_rounded is None else x_rounded
        if self.wqkv_a is not None:
            qa, kv = self.wqkv_a(xin, rounded=x_rounded is not None).split(
                [self.wq_a.out_features, self.head_dim], dim=-1)
        else:
            qa, kv = self.wq_a(xin, rounded=x_rounded is not None), self.wkv(xin, rounded=x_rounded is not None)
        qr, qr_q = self.q_norm.with_rounded(qa, self.wq_b, self.indexer.wq_b if self.indexer is not None else None)
        qr_rounded = qr_q is not None
        return (qr_q if qr_rounded else qr), qr_rounded, kv

    def q_heads(self, qr: torch.Tensor, qr_rounded: bool, kv: torch.Tensor, cis: torch.Tensor, ring=None):
        """(q [T, H, D] RoPE'd, kv [T, D] normed, RoPE'd, FP8-rounded): qkv's second half."""
        # the kv row (kv_norm, RoPE, act_quant, its ring write) reads only the input GEMM's output: in a small
        # captured step it runs on a side stream beside wq_b (model/side_stream.py)
        kv_row = side_stream.branch(ops.norm_rope_quant, kv, self.kv_norm.weight, self.kv_norm.eps, cis, ring,
                                    tokens=kv.shape[0], lane=side_stream.TAIL_LANE, fork=side_stream.KV_ROW)
        # in place: both are fresh outputs; only their rope dims are read and written
        q = ops.rope(self.wq_b(qr, rounded=qr_rounded).unflatten(-1, (self.n_heads, self.head_dim)), cis,
                     inplace=True)
        return q, kv_row.wait()

    def out(self, o: torch.Tensor, cis: torch.Tensor | None = None) -> torch.Tensor:
        """o [T, H, D] -> RoPE removed (here with cis; None: sparse_attn's unrope did it), grouped wo_a
        (block-diagonal, bf16, no act rounding), wo_b."""
        if cis is not None:
            o = ops.rope(o, cis, inverse=True, inplace=True)
        o = o.flatten(1).unflatten(-1, (self.n_groups, -1))
        blocks = self.wo_a.fp8_blocks
        # FP8 blocks: half the bytes, the same products; where a bf16 copy is held too (dense_bf16), decode-sized
        # calls only (ops.grouped_takes_fp8)
        if blocks is not None and (self.wo_a.weight.numel() == 0 or ops.grouped_takes_fp8(o, *blocks)):
            o = ops.grouped_w8a16(o, *blocks)
        else:
            wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
            o = ops.grouped_mm_token_major(o.to(wo_a.dtype), wo_a).to(ACT)
        return self.wo_b(o.flatten(1))

    # ---- the forward over a step --------------------------------------------------------------
    def forward(self, x: torch.Tensor, meta: StepMetadata, caches, rope_tables,
                x_rounded: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, d] normed rows of every sequence -> [T, d]. One sparse_attn call for the whole batch
        over one gathered buffer (step_metadata.py draws its layout). x_rounded: act_quant(x), if the
        norm's launch made it (qkv)."""
        cis = meta.rope(rope_tables, self.rope_kind)
        ring = caches.window_kv[self.layer_id].flatten(0, 1)                   # [slots * RING, D]
        # the step's latents go to the ring as they are made where no read of this step needs the rows they
        # replace: the ring holds 2 x window positions a sequence, the queries read the window - 1 before the
        # step's first, so runs of up to a window overwrite none of those (else: after the attention)
        early = meta.context_parallel is None and meta.ring_write_rows is None and meta.max_q <= self.window
        ring_arg = (ring, meta.ring_write) if early else None
        E = meta.plan(self.ratio).num_entries if self.ratio else 0
        compresses, indexes = self.ratio and self.is_kv_source, self.ratio and self.is_index_source
        if meta.context_parallel is None:
            # the compressor reads x, the indexer x and qr, neither q: in a small step they run on two side
            # streams (the indexer's scores wait for the keys the compressor writes) while the main stream
            # makes qr, q and the kv row (model/side_stream.py)
            T = x.shape[0]
            comp = side_stream.branch(self._compress_step, x, meta, caches, rope_tables, tokens=T) \
                if compresses else None
            qr, qr_rounded, kv = self.q_latent(x, x_rounded)
            index = side_stream.branch(self._index_step, x, qr, qr_rounded, cis, meta, caches, comp, tokens=T,
                                       lane=1) if indexes else None
            q, kv = self.q_heads(qr, qr_rounded, kv, cis, ring_arg)
            for p in (comp, index):
                if p is not None:
                    p.wait()
        else:       # a balanced-CP share (parallel/cp.py): the compressor sees every position's rows, gathered
            qr, qr_rounded, q, kv = self.qkv(x, cis, x_rounded, ring_arg)
            raw = self.compressor.project(x) if self.compressor is not None else None
            kv, raw = meta.context_parallel.gather(kv, raw)
            if compresses:
                self._compress(meta.context_parallel.whole, raw, caches, rope_tables)
            if indexes:
                self._index_step(x, qr, qr_rounded, cis, meta, caches)
        o = self._attend_step(q, meta, caches, ring, kv, E, cis)
        if not early:
            whole = meta if meta.context_parallel is None else meta.context_parallel.whole
            new = kv if whole.ring_write_rows is None else kv[whole.ring_write_rows]
            ring[whole.ring_write] = new.to(ring.dtype)
        return self.out(o)

    def _compress_step(self, x, meta: StepMetadata, caches, rope_tables) -> None:
        """This step's compressed entries (a KV source) into the pools."""
        self._compress(meta, self.compressor.project(x), caches, rope_tables)

    def _index_step(self, x, qr, qr_rounded: bool, cis, meta: StepMetadata, caches,
                    keys: side_stream.Pending | None = None) -> None:
        """This step's picks (an index source) into meta.topk; keys: the compressor's branch writing this
        step's keys, waited for after the queries are made."""
        iq = self.indexer.queries(x, qr, cis, qr_rounded)
        if keys is not None:
            keys.wait()
        meta.topk[self.layer_id] = self._index(meta, iq, caches)

    def _attend_step(self, q, meta: StepMetadata, caches, ring, kv, E: int, cis) -> torch.Tensor:
        """The step's rows: [ring[ring_read] (B*Wr) | kv (T) | E > 0: compressed picks]. In-place attention
        gets the window lists in pool rows once per step (meta.window_pool) and, in a decode step, a
        layer's picks turned into pool rows by one kernel (ops.pool_lists); otherwise _attend over the
        buffer-coordinate lists. The output comes with its RoPE removed (sparse_attn's unrope=cis)."""
        topk = meta.topk[self.index_source] if E else None
        if ops.sparse_attn_in_place(q):
            win = meta.window_pool(ring.shape[0])
            if not E:
                return ops.sparse_attn(q, (ring, kv), self.attn_sink, win, self.scale, unrope=cis)
            if topk.numel() < meta.num_seqs * E:          # the picks are fewer than the entries: decode
                pool = caches.compressed_kv[self.kv_source].flatten(0, 1)
                idx = ops.pool_lists(win, meta.win_len, topk, meta.seq_of, meta.block_tables,
                                     caches.entries_per_block(self.kv_source), ring.shape[0] + kv.shape[0])
                return ops.sparse_attn(q, (ring, kv, pool), self.attn_sink, idx, self.scale, unrope=cis)
        sources, idx = [(ring, meta.ring_read), (kv, None)], meta.win_idx
        if E:
            rows, comp = self._compressed_rows(meta, caches, topk, E)
            sources.append((caches.compressed_kv[self.kv_source].flatten(0, 1), rows))
            idx = append_lists(idx, meta.win_len, comp)
        return self._attend(q, sources, idx, cis)

    def _attend(self, q: torch.Tensor, sources: list, idx: torch.Tensor, cis=None) -> torch.Tensor:
        """Sink attention of q over the rows (tensor, row ids or None = all) of `sources` in order,
        idx [T, L] counting rows across them. A kernel that reads several tensors in place
        (select.sparse_attn_in_place) gets the pools and idx mapped to pool rows: the gathered
        copy and its concatenation (at batch 64 and 8k context ~33k rows a layer) are never written."""
        if not ops.sparse_attn_in_place(q) or ops.sparse_prefill_gathers(q):
            rows = [t if r is None else t[r] for t, r in sources]
            return ops.sparse_attn(q, torch.cat([r.to(q.dtype) for r in rows]), self.attn_sink, idx, self.scale,
                                   unrope=cis)
        table, base = [], 0
        for t, r in sources:
            table.append(base + (r if r is not None else torch.arange(t.shape[0], device=q.device)))
            base += t.shape[0]
        table = torch.cat(table)
        pool_idx = torch.where(idx >= 0, table[idx.clamp_min(0)], -1)
        return ops.sparse_attn(q, tuple(t for t, _ in sources), self.attn_sink, pool_idx, self.scale, unrope=cis)

    def _compressed_rows(self, meta: StepMetadata, caches, topk: torch.Tensor, E: int):
        """Pool rows to gather after the fresh rows, and each query's picks in buffer coords ([T, K],
        -1 kept). Whichever is fewer: every entry 0..E-1 of every sequence ([B*E] rows: a prefill)
        or only the picks ([T*K] rows: a decode step, where E may be the static max_model_len // ratio).
        The lists point at the same rows in the same order either way, so the numbers agree."""
        epb = caches.entries_per_block(self.kv_source)
        base = meta.fresh_offset + meta.num_fresh
        T, K = topk.shape
        if T * K < meta.num_seqs * E:
            seq = meta.seq_of[:, None].expand(T, K).flatten()
            rows = meta.entry_rows(epb, 0, seq, topk.clamp_min(0).flatten())                 # [T*K]
            at = base + torch.arange(T * K, device=topk.device).view(T, K)
        else:
            rows = meta.entry_rows(epb, E).flatten()                                         # [B*E]
            at = topk + base + meta.seq_of[:, None] * E
        return rows, torch.where(topk >= 0, at, -1)

    def _compress(self, meta: StepMetadata, raw, caches, rope_tables) -> None:
        """Entries completed in this step, all sequences at once -> the pools. A ratio>1 group that
        straddles steps takes its first members from the compressor carry ring."""
        ratio, L = self.ratio, self.layer_id
        plan = meta.plan(ratio)
        if ratio == 1:
            latent = self.compressor.norm(raw[0])                                # [T, D]: one entry per row
            if plan.member_rows is not None:                                     # replay: only rows >= write_from
                latent = latent[plan.member_rows[:, 0]]
                if latent.shape[0] == 0:      # every row below write_from (YOCO's decoder step): no entry to write
                    return
        else:
            carry_kv, carry_sc = caches.carry_kv[L].flatten(0, 1), caches.carry_score[L].flatten(0, 1)
            latent = None
            if plan.group_seq.numel():          # [G, D]: Compressor.pool of the members, one kernel on a GPU
                norm = self.compressor.norm
                latent = ops.compress_pool(raw[0], raw[1], carry_kv, carry_sc, plan.member_rows, plan.member_carry,
                                           meta.ring_slots, plan.group_seq, meta.ring_len, norm.weight, norm.eps)
            # the step's rows into the carry ring, after compress_pool read the carry rows it needs
            ops.carry_write(raw[0], raw[1], carry_kv, carry_sc, meta.ring_write, meta.ring_write_rows)
            if latent is None:
                return
        entries = plan.group_entry
        cis = meta.rope(rope_tables, self.rope_kind, ratio)                   # an entry rotates at its group's first position
        dst = plan.group_rows if plan.group_rows is not None else \
            meta.entry_rows(caches.entries_per_block(L), 0, plan.group_seq, entries)
        if self.indexer is not None:
            k = self.indexer.k_norm(self.indexer.wk(latent))
            ops.rope_fp4_quant(k, cis, 32, dst, caches.index_k[L].flatten(0, 1))        # RoPE, fp4, the pool write
            meta.index_k_owner[plan.seqs_with_new] = L
        ops.rope_fp4_quant(latent, cis, 16, dst, caches.compressed_kv[L].flatten(0, 1))

    def _index(self, meta: StepMetadata, iq, caches) -> torch.Tensor:
        """[T, K] chosen compressed entry ids per query (ascending), -1 for unreachable picks;
        K = min(index_topk, E) with E the step's widest sequence (narrower ones pad with -1)."""
        plan = meta.plan(self.ratio)
        E = plan.num_entries
        if E == 0:
            return torch.empty(meta.num_tokens, 0, dtype=torch.int64, device=meta.positions.device)
        if self.args.emulate_index_k_alias:
            keys = self._index_keys(meta, caches, E)                             # [B, E, ID]
            score = ops.index_scores_paged(iq[0], iq[1], keys, meta.seq_of, meta.row_in_seq, meta.max_q, plan.lens,
                                           cu=meta.cu)
        else:   # the keys stay in the pool, read through the block tables
            src = self.kv_source
            score = ops.index_scores_pool(iq[0], iq[1], caches.index_k[src].flatten(0, 1), meta.block_tables,
                                          caches.entries_per_block(src), E, meta.seq_of, meta.row_in_seq, meta.max_q,
                                          plan.lens, cu=meta.cu)
        if self.is_candidate_source:
            meta.candidates = select_candidate_blocks(score, plan.lens, self.args.candidate_topk_blocks,
                                                      self.args.candidate_block_size)
        return index_topk(score, plan.lens, self.args.index_topk, meta.candidates if self.uses_candidates else None)

    def _index_keys(self, meta: StepMetadata, caches, E: int) -> torch.Tensor:
        """[B, E, ID] index keys of every sequence. Quirk emulation: a sequence reads the keys of the
        last layer that published index keys for it (a loop over those few layers, not sequences)."""
        owners = np.full(meta.num_seqs, self.kv_source)
        if self.args.emulate_index_k_alias:
            owners = np.where(meta.index_k_owner >= 0, meta.index_k_owner, owners)
        keys = None
        for src in np.unique(owners).tolist():
            k = caches.index_k[src].flatten(0, 1)[meta.entry_rows(caches.entries_per_block(src), E)]
            if k.dtype == torch.uint8:                                   # packed FP4 rows
                k = ops.fp4_unpack_rows(k, self.args.index_head_dim)
            if keys is None:
                keys = k
            else:
                sel = torch.from_numpy(owners == src).to(k.device)
                keys = torch.where(sel[:, None, None], k, keys)
        return keys


def append_lists(win: torch.Tensor, win_len: torch.Tensor, comp: torch.Tensor) -> torch.Tensor:
    """win [T, Lw] (-1 beyond win_len[t]), comp [T, K] -> [T, Lw + K]: each row's compressed picks
    right after ITS OWN window list, as the per-sequence lists had them; -1 after."""
    T, K = comp.shape
    out = torch.cat([win, win.new_full((T, K), -1)], dim=1)
    return out.scatter_(1, win_len[:, None] + torch.arange(K, device=win.device), comp)


# ids of the k largest per row, ties to the lowest id (kernels/reference.py topk_ids_ref)
topk_ids = ops.topk_ids


def index_topk(score: torch.Tensor, lens: torch.Tensor, topk: int, candidates: torch.Tensor | None = None):
    """score [n, E] (entries >= lens already -inf) -> [n, min(topk, E)] entry ids ascending, -1 where
    the pick is not reachable (-inf score, or id >= lens). A re-indexer (candidates given) scores
    only inside the candidate blocks of its candidate source: everything else is -inf before the
    top-k. The rule is kernels/reference.py index_topk_ref; ops picks the Triton kernel on a GPU."""
    return ops.index_topk(score, lens, topk, candidates)
