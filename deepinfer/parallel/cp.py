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

Images: a prompt's image spans may fall anywhere in the split, across chunk and rank boundaries; the
model reads them per row (the span embedding replaces the token's, `token_mask` drives the VL router bias
and Engram's dead positions), so a share needs, for its rows only, their span embeddings, their token
types and a chunk history with span positions DEAD. The owner encoded the images ahead (image_ahead.py;
the scheduler plans CP only for such prompts) and scatters each rank its rows' embeddings (why not each
rank encoding: the NOTE at owner_span_rows); the types travel in the CPShare.

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
import torch.distributed as dist

from deepinfer.model.batch import ForwardBatch
from deepinfer.model.engram import DEAD
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
    token_types: np.ndarray | None = None   # [n] int8 span roles of positions 0..n-1 (TEXT -1, model/vision/
                                            # spans.py); None: a text prompt
    ahead_key: str | None = None            # the owner's encoded copy of the images (ImagePrompt.ahead_key)

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


def prefill_share(model, caches, share: CPShare, group=None, images=None) -> torch.Tensor | None:
    """Run this rank's rows of the CP prefill through every layer (no logits): the caches at
    share.block_ids / share.ring_slot end up holding positions 0..n-1 as a 1-rank prefill leaves them.
    images: the runner's ImageEmbeds (the owner reads its encoded copy of the prompt's images there).
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
    batch = share_batch(share, whole_batch, width)
    if share.token_types is not None:
        own = split.positions(share.rank)
        batch.token_mask = torch.from_numpy(share.token_types[own] < 0).to(dev)   # False in spans: VL bias, Engram dead
        owner_rows = owner_span_rows(images, share) if share.rank == share.owner else None
        batch.image_rows, batch.image_embeds = scatter_image_rows(share, owner_rows, group, model.args.dim, dev)
    return model(batch, caches, meta=meta).main_hidden


# ---- image spans -----------------------------------------------------------------------------------------
# NOTE: why the owner's embeddings are scattered rather than each rank encoding the images its chunks
# overlap: the owner already encoded every image ahead, on its SM share, before the request was admitted
# (image_ahead.py; the scheduler plans CP only for such prompts). Encoding again on the borrowed ranks
# would repeat the tower for every image a share touches (a span straddling a chunk boundary on two or
# three ranks), put it on the CP step's critical path (every rank waits for the slowest in the first
# layer's gather), and move a failing image's error into a step, where it takes every rank down; this
# way an image that fails, fails ahead on the owner, before any block is borrowed, and the request
# fails alone. The cost is one scatter per CP prefill with spans: each rank receives only its rows
# (at most 2 * chunk, padded to the largest share's count), bf16 copied bit for bit.
def owner_span_rows(images, share: CPShare) -> torch.Tensor:
    """[span positions, dim]: the owner's encoded embeddings of every span, in position order (spans in
    prompt order, each span's rows in order: the k-th span position of the prompt takes row k)."""
    prompt = None if images is None else images.ahead.get(share.ahead_key)
    if prompt is None or prompt.missing(0):
        raise RuntimeError(f"request {share.req_id}: rank {share.rank} holds no encoded images for its CP prefill")
    if prompt.event is not None:           # encoded on the vision stream: the step stream waits for it
        stream = torch.cuda.current_stream()
        stream.wait_event(prompt.event)
        for e in prompt.embeds:
            e.record_stream(stream)
    return torch.cat(prompt.embeds)


def scatter_image_rows(share: CPShare, owner_rows: torch.Tensor | None, group, dim: int, device):
    """Every rank's share rows inside image spans get their embeddings from the owner (owner_rows: its
    owner_span_rows, None elsewhere): one scatter of [M, dim] per rank, M the largest share's span-row
    count (every rank computes it from token_types). -> (rows [k] of this share's T rows, embeds [k, dim])
    for ForwardBatch.image_rows / .image_embeds, or (None, None) where this share has no span rows.

        n = 16, cp = 2, a span at 2..5:  | c0 0..3 | c1 4..7 | c2 8..11 | c3 12..15 |
                                           rank 0    rank 1    rank 1     rank 0
        rank 0: positions 2, 3 = its rows 2, 3;  rank 1: positions 4, 5 = its rows 0, 1
    """
    from deepinfer.model.vision.vit import ACT
    split, cp = share.split, share.cp_size
    span = share.token_types >= 0                                          # [n]
    mine = [np.nonzero(span[split.positions(r)])[0] for r in range(cp)]   # rank r's share rows in spans
    M = max(len(m) for m in mine)
    if M == 0:
        return None, None
    parts = None
    if share.rank == share.owner:
        row_of = np.cumsum(span) - 1                       # span position -> its row of owner_rows
        parts = []
        for r in range(cp):
            idx = torch.from_numpy(row_of[split.positions(r)[mine[r]]]).to(owner_rows.device)
            part = torch.zeros((M, dim), dtype=ACT, device=owner_rows.device)
            part[:len(idx)] = owner_rows[idx]
            parts.append(part)
    if cp == 1:
        out = parts[0]
    else:
        out = torch.empty((M, dim), dtype=ACT, device=device)
        dist.scatter(out, parts, group=group, group_src=share.owner)
    k = len(mine[share.rank])
    if k == 0:
        return None, None
    return torch.from_numpy(mine[share.rank]).to(device), out[:k]


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
    n-gram hashing: each chunk's history is the tokens before it, DEAD at image-span positions)."""
    chunks = [(s, e) for s, e in share.split.chunks(share.rank) if e > s]
    tokens, types = share.token_ids, share.token_types
    hist = np.array([[-1 if p < 0 else DEAD if types is not None and types[p] >= 0 else tokens[p]
                      for p in range(s - width, s)] for s, _ in chunks], dtype=np.int64).reshape(len(chunks), width)
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

