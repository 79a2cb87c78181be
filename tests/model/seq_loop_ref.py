"""The per-sequence attention the batched one replaced (deepinfer/model/attention.py before the
batching), kept as the test oracle: one sparse_attn call per sequence per layer over that sequence's
own buffer [ring positions lo..start-1 | its new rows | its compressed entries]. It shares
index_topk / select_candidate_blocks / window_lists with the model, so a comparison isolates the
batching (buffer layout, padding, per-row offsets) from the selection rules.

    with loop_attention(): out = model(batch, caches)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from deepinfer.model import ops
from deepinfer.model.attention import (Attention, Indexer, index_topk, select_candidate_blocks,
                                       window_lists)
from deepinfer.model.step_metadata import StepMetadata


@dataclass
class SeqStep:
    rows: slice
    start: int
    n: int
    ring_slot: int
    block_table: torch.Tensor
    positions: torch.Tensor
    topk: dict = field(default_factory=dict)
    candidates: torch.Tensor | None = None
    index_k_owner: int = -1

    @property
    def end(self) -> int:
        return self.start + self.n


def _seqs(meta: StepMetadata) -> list[SeqStep]:
    if not hasattr(meta, "_loop_seqs"):
        slots = meta.ring_slots.tolist()
        meta._loop_seqs = [
            SeqStep(rows=slice(int(meta.cu[i]), int(meta.cu[i + 1])), start=int(meta.starts[i]),
                    n=int(meta.cu[i + 1] - meta.cu[i]), ring_slot=slots[i], block_table=meta.block_tables[i],
                    positions=meta.positions[int(meta.cu[i]):int(meta.cu[i + 1])],
                    index_k_owner=int(meta.index_k_owner[i]))
            for i in range(meta.num_seqs)]
    return meta._loop_seqs


def loop_forward(self, x, meta, caches, rope_tables, x_rounded=None):
    seqs = _seqs(meta)
    cis = rope_tables[self.rope_kind](meta.positions)
    qr, qr_rounded, q, kv = self.qkv(x, cis, x_rounded)
    raw = self.compressor.project(x) if self.compressor is not None else None
    iq = self.indexer.queries(x, qr, cis, qr_rounded) if self.indexer is not None else None
    o = torch.empty_like(q)
    for s in seqs:
        r = s.rows
        lo = max(0, s.start - self.window + 1)
        old = caches.read_ring(self.layer_id, s.ring_slot, torch.arange(lo, s.start, device=x.device))
        buf = torch.cat([old.to(kv.dtype), kv[r]])
        idx = window_lists(s.start, s.n, self.window, lo, x.device)
        if self.ratio:
            if self.is_kv_source:
                _compress(self, s, raw, caches, rope_tables)
            if self.is_index_source:
                s.topk[self.layer_id] = _index(self, s, iq, caches)
            topk = s.topk[self.index_source]
            n_entries = s.end // self.ratio
            comp = caches.read_entries(caches.compressed_kv, self.kv_source, s.block_table, n_entries)
            idx = torch.cat([idx, torch.where(topk >= 0, topk + buf.shape[0], -1)], dim=1)
            buf = torch.cat([buf, comp.to(buf.dtype)])
        o[r] = ops.sparse_attn(q[r], buf, self.attn_sink, idx, self.scale)
    for s in seqs:
        caches.write_ring(self.layer_id, s.ring_slot, s.positions, kv[s.rows])
    return self.out(o, cis)


def _compress(self, s, raw, caches, rope_tables):
    ratio, dev = self.ratio, s.positions.device
    kv_new, score_new = raw[0][s.rows], (raw[1][s.rows] if raw[1] is not None else None)
    first_entry, end_entry = s.start // ratio, s.end // ratio
    if ratio == 1:
        latent = self.compressor.norm(kv_new)
    else:
        g0 = first_entry * ratio
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
    cis = rope_tables[self.rope_kind](entries * ratio)
    if self.indexer is not None:
        k = self.indexer.k_norm(self.indexer.wk(latent))
        k = ops.fp4_quant(ops.rope(k, cis), 32)
        caches.write_entries(caches.index_k, self.layer_id, s.block_table, entries, k)
        s.index_k_owner = self.layer_id
    latent = ops.fp4_quant(ops.rope(latent, cis), 16)
    caches.write_entries(caches.compressed_kv, self.layer_id, s.block_table, entries, latent)


def _index(self, s, iq, caches):
    ratio, dev = self.ratio, s.positions.device
    n_entries = s.end // ratio
    if n_entries == 0:
        return torch.empty(s.n, 0, dtype=torch.int64, device=dev)
    key_src = self.kv_source
    if self.args.emulate_index_k_alias and s.index_k_owner >= 0:
        key_src = s.index_k_owner
    keys = caches.read_entries(caches.index_k, key_src, s.block_table, n_entries)
    q, w = iq[0][s.rows], iq[1][s.rows]
    score = Indexer.scores(q, w, keys)
    lens = (s.positions + 1) // ratio
    score = score.masked_fill(torch.arange(n_entries, device=dev) >= lens[:, None], -torch.inf)
    if self.is_candidate_source:
        s.candidates = select_candidate_blocks(score, lens, self.args.candidate_topk_blocks,
                                               self.args.candidate_block_size)
    return index_topk(score, lens, self.args.index_topk, s.candidates if self.uses_candidates else None)


@contextlib.contextmanager
def loop_attention():
    saved = Attention.forward
    Attention.forward = loop_forward
    try:
        yield
    finally:
        Attention.forward = saved
