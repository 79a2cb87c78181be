"""Balanced context parallelism (DeepInfer's balanced CP, ../shared/docs/DEEPINFER.md section 10):
one long prompt prefilled by every rank at once, when a single prompt's prefill dominates.

The mirror split: the prompt's first n tokens (all but the last; see below) are cut into 2*cp chunks
of floor or ceil(n / 2cp) positions; rank r takes chunk r and chunk 2cp-1-r. Causal work grows with the
position (each query's indexer scores every earlier compressed entry), so an early chunk paired
with its mirror gives every rank the same work (exactly when 2cp divides n; else within one chunk):

    n = 16, cp = 2, C = 4:   | c0 0..3 | c1 4..7 | c2 8..11 | c3 12..15 |
                               rank 0    rank 1    rank 1     rank 0
    work(p) ~ p + 1:  rank 0 = 10 + 58 = 68,  rank 1 = 26 + 42 = 68

Per layer each rank computes its own rows; what attention needs of the others' rows is what the
compressor and the window read, so those are gathered (not the compressed KV): every rank then
builds the whole prompt's compressed KV and index keys itself (cheap next to the indexer's
quadratic scoring, which stays split) and has every latent its window lists point at. The model's
hook is StepMetadata.context_parallel (model/attention.py): `whole` is the one-sequence metadata
of the whole prefix (compressor groups, ring writes) and `gather` assembles the rows in position
order. A share's own rows form one query set whose window lists and entry counts are the whole
prefill's rows, so each row's numbers are the 1-rank prefill's (bit-identical under
batch_invariant).

Ownership: the request stays on its DP rank (the owner), whose caches get everything (ring, carry,
compressed KV, index keys) and which decodes it; the other ranks write into blocks and a ring slot
borrowed for this step and dropped after it (DataParallelScheduler takes and returns them). The
CP pass runs positions 0..n-1 with n = L - 1; the prompt's last token then runs in the owner's
ordinary step as a one-token chunk continuing the cache, so sampling, logits and async scheduling
need nothing new. With DSpark, the DSpark inputs of the prefix's last ring_len positions are gathered
to the owner (draft_ring_tail), which absorbs them into its draft rings before that step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.model.batch import ForwardBatch
from deepinfer.model.step_metadata import CompressPlan, StepMetadata

from .ep_comm import all_gather_rows


# ---- the split --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MirrorSplit:
    """Positions 0..n-1 over cp ranks in 2*cp chunks of `chunk` positions, rank r: chunks r, 2cp-1-r."""
    num_tokens: int
    cp_size: int

    @property
    def chunk(self) -> int:
        """The longest chunk: ceil(n / 2cp)."""
        return -(-self.num_tokens // (2 * self.cp_size))

    def bound(self, j: int) -> int:
        """Start of chunk j: floor(j * n / 2cp), so chunks differ by at most one position (DeepInfer
        cuts ceil-sized chunks and pads the tail, which can leave a rank's mirror chunk empty)."""
        return j * self.num_tokens // (2 * self.cp_size)

    def chunks(self, rank: int) -> list[tuple[int, int]]:
        """[(start, end)] of rank's two chunks, ascending."""
        return [(self.bound(j), self.bound(j + 1)) for j in (rank, 2 * self.cp_size - 1 - rank)]

    def positions(self, rank: int) -> np.ndarray:
        return np.concatenate([np.arange(s, e) for s, e in self.chunks(rank)]).astype(np.int64)

    @property
    def max_rows(self) -> int:
        """Rows of the largest share (what the equal-size collectives pad to)."""
        return 2 * self.chunk

    def gather_order(self) -> np.ndarray:
        """[n] row of each position in the all-gathered [cp * max_rows] buffer (rank r's rows at
        r * max_rows, in its positions' order)."""
        order = np.empty(self.num_tokens, dtype=np.int64)
        for r in range(self.cp_size):
            pos = self.positions(r)
            order[pos] = r * self.max_rows + np.arange(len(pos))
        return order


def causal_work(positions: np.ndarray) -> int:
    """Causal attention work of a set of query positions: each attends to p + 1 earlier positions."""
    return int((np.asarray(positions, dtype=np.int64) + 1).sum())


# ---- what a rank runs ---------------------------------------------------------------------------------
@dataclass
class CPShare:
    """One rank's part of a balanced-CP prefill (sent with the step's plan)."""
    req_id: str
    owner: int                  # the request's DP rank: keeps the caches and decodes it
    rank: int
    cp_size: int
    token_ids: np.ndarray       # [n] the prompt's positions 0..n-1 (all of them: Engram's history)
    block_ids: list[int]        # this rank's cache blocks for the prefix (borrowed unless owner)
    ring_slot: int              # this rank's ring slot for it (borrowed unless owner)

    @property
    def split(self) -> MirrorSplit:
        return MirrorSplit(len(self.token_ids), self.cp_size)


class _Gather:
    """StepMetadata.context_parallel: the whole prefix's metadata and the per-layer row gather."""

    def __init__(self, whole: StepMetadata, split: MirrorSplit, group) -> None:
        self.whole, self.split, self.group = whole, split, group
        self.order = torch.from_numpy(split.gather_order()).to(whole.positions.device)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """t [T_own, ...] this rank's rows -> [n, ...] every position's, in position order."""
        pad = t.new_zeros((self.split.max_rows, *t.shape[1:]))
        pad[:t.shape[0]] = t
        return all_gather_rows(pad, self.group, self.split.cp_size)[self.order]

    def gather(self, kv: torch.Tensor, raw):
        """A layer's window latents [T_own, D] and compressor input (kv, score | None) -> every row's."""
        if raw is not None and raw[1] is not None:          # ratio > 1: kv and score (fp32) in one gather
            both = self.rows(torch.stack(raw, dim=1))
            raw = (both[:, 0], both[:, 1])
        elif raw is not None:
            raw = (self.rows(raw[0]), None)
        return self.rows(kv), raw


def prefill_share(model, caches, share: CPShare, group=None) -> torch.Tensor | None:
    """Run this rank's rows of the CP prefill through every layer (no logits): the caches at
    share.block_ids / share.ring_slot end up holding positions 0..n-1 as a 1-rank prefill leaves them.
    -> the rows' DSpark inputs (ModelOutput.main_hidden, in split.positions(rank) order; None without
    DSpark layers)."""
    dev = model.embed.weight.device
    split, n = share.split, len(share.token_ids)
    ids = torch.from_numpy(np.ascontiguousarray(share.token_ids, dtype=np.int64))
    blocks = torch.tensor([share.block_ids], dtype=torch.int64)
    slot = torch.tensor([share.ring_slot], dtype=torch.int64)
    whole_batch = ForwardBatch(input_ids=ids.to(dev), positions=torch.arange(n, device=dev),
                               cu_seqlens=torch.tensor([0, n]), start_pos=torch.tensor([0]),
                               ngram_history=torch.zeros(1, 0, dtype=torch.int64), ring_slots=slot.to(dev),
                               block_tables=blocks.to(dev), logits_indices=torch.zeros(0, dtype=torch.int64))
    whole = model.step_metadata(whole_batch, caches)
    ratios = sorted({r for r in model.args.compress_ratios if r})
    meta = share_metadata(whole, split.positions(share.rank), ratios, _Gather(whole, split, group))
    width = max(model.args.engram_max_ngram_size - 1, 0)
    return model(share_batch(share, whole_batch, width), caches, meta=meta).main_hidden


def draft_ring_tail(main_hidden: torch.Tensor, share: CPShare, ring_len: int, group) -> tuple[torch.Tensor, np.ndarray]:
    """The DSpark inputs of the prefix's last ring_len positions, on every rank: each rank's rows among them
    (its split rows at or past n - ring_len: the tail of its second chunk, or of both near the middle)
    padded to ring_len rows and all-gathered (one equal-size collective), then put in position order.
    A DSpark ring holds the last ring_len positions only (dspark_absorb), so the owner absorbs these and
    its rings are what a 1-rank prefill's absorb leaves; the prompt's last token then goes through the
    owner's ordinary step, which absorbs it and drafts. -> (rows [R, k*dim], positions [R]),
    R = min(n, ring_len)."""
    split, n = share.split, len(share.token_ids)
    lo = max(0, n - ring_len)
    R = n - lo
    own = split.positions(share.rank)
    mine = np.nonzero(own >= lo)[0]
    pad = main_hidden.new_zeros((R, main_hidden.shape[1]))
    if len(mine):
        pad[:len(mine)] = main_hidden[torch.from_numpy(mine).to(main_hidden.device)]
    gathered = all_gather_rows(pad, group, split.cp_size)
    row_of = np.empty(R, dtype=np.int64)          # position lo + i -> its row in the gathered buffer
    for r in range(split.cp_size):
        pos = split.positions(r)
        tail = pos[pos >= lo]
        row_of[tail - lo] = r * R + np.arange(len(tail))
    return gathered[torch.from_numpy(row_of).to(gathered.device)], np.arange(lo, n, dtype=np.int64)


def share_batch(share: CPShare, whole: ForwardBatch, width: int) -> ForwardBatch:
    """The rank's rows as two sequences (its chunks) for what reads sequences from the batch (Engram's
    n-gram hashing: each chunk's history is the tokens before it)."""
    chunks = [(s, e) for s, e in share.split.chunks(share.rank) if e > s]
    tokens = share.token_ids
    hist = np.array([[tokens[p] if p >= 0 else -1 for p in range(s - width, s)] for s, _ in chunks],
                    dtype=np.int64).reshape(len(chunks), width)
    pos = np.concatenate([np.arange(s, e) for s, e in chunks]).astype(np.int64) if chunks else np.zeros(0, np.int64)
    lens = [e - s for s, e in chunks]
    dev = whole.input_ids.device
    B = len(chunks)
    return ForwardBatch(input_ids=whole.input_ids[torch.from_numpy(pos).to(dev)], positions=torch.from_numpy(pos).to(dev),
                        cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64),
                        start_pos=torch.tensor([s for s, _ in chunks], dtype=torch.int64),
                        ngram_history=torch.from_numpy(hist).to(dev),
                        ring_slots=whole.ring_slots.expand(B), block_tables=whole.block_tables.expand(B, -1),
                        logits_indices=torch.zeros(0, dtype=torch.int64, device=dev))


def share_metadata(whole: StepMetadata, positions: np.ndarray, ratios, ctx) -> StepMetadata:
    """The rank's rows as one query set over the whole prefix: each row keeps the whole prefill's
    window list (pointing into the fresh region, which holds every position: no ring region, as
    the prefill starts at 0) and its entry counts; groups are compressed from `whole`'s plan."""
    dev = whole.positions.device
    idx = torch.from_numpy(positions).to(dev)
    T = len(positions)
    plans = {}
    for r in ratios:
        p = whole.plan(r)
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        plans[r] = CompressPlan(num_entries=p.num_entries, lens=torch.from_numpy((positions + 1) // r).to(dev),
                                group_seq=empty, group_entry=empty, member_rows=None, member_carry=None,
                                seqs_with_new=np.zeros(1, dtype=bool))
    return StepMetadata(num_seqs=1, num_tokens=T, max_q=T, window=whole.window, ring_len=whole.ring_len,
                        starts=whole.starts, ends=whole.ends, cu=np.array([0, T]), positions=whole.positions[idx],
                        positions_host=positions, seq_of=torch.zeros(T, dtype=torch.int64, device=dev),
                        row_in_seq=torch.arange(T, device=dev), ring_slots=whole.ring_slots,
                        block_tables=whole.block_tables, ring_width=whole.ring_width, ring_read=whole.ring_read,
                        win_idx=whole.win_idx[idx], win_len=whole.win_len[idx], ring_write_rows=None,
                        ring_write=whole.ring_write, last_pos=whole.last_pos, plans=plans,
                        index_k_owner=whole.index_k_owner, context_parallel=ctx, fresh_rows=whole.num_tokens)

