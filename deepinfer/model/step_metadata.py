"""Per-step attention metadata, built once per forward from the ForwardBatch's host-side arrays
(cu_seqlens and start_pos live on the CPU), so no layer reads a device value back to the host.

Every layer attends over ONE gathered KV buffer for the whole batch:

    buf = [ ring region: B x Wr rows | fresh rows: the step's T new latents | compressed: B x E rows ]
           seq i: positions            row cu[i] + (p - start[i])              seq i: entries 0 .. E-1
           start[i]-Wr .. start[i]-1                                           (E = max entries, per ratio)

and every query row t gets its own index list into it, in the order the per-sequence code used
(the kernel's blockwise-64 softmax rounding depends on it), padded with -1 at the end:

    row t: | its window list (w_t wide) | its compressed picks (K wide) | -1 ... |
    window list: a chunk starting at 0 uses the prefill layout (valid positions first, pads after,
    w_t = min(n, window)), any other chunk the decode layout (w_t = window, pads first); with
    canonical_layout every chunk uses the decode layout (chunking-invariant numerics).
    A replaying sequence (ForwardBatch.window_start) lists no key below its window start: those
    slots are -1 pads (in the decode layout, where pads come first anyway).

Host-side ints (num_seqs, max_q, max_end, group counts) decide every shape. `DecodeStepBuffers`
is the static form of a pure decode step (CUDA graphs): shapes fixed per padded batch size, every
tensor a view of one int64 buffer that the runner refills each step (see its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

import numpy as np
import torch

from .batch import ForwardBatch


@dataclass
class CompressPlan:
    """The compressed-KV entries of one compress ratio in this step."""
    num_entries: int                 # E = max over sequences of end // ratio (the padded width)
    lens: torch.Tensor               # [T] entries visible to each query: (p + 1) // ratio
    # groups completed in this step (ratio > 1: pooled from carry + fresh rows; ratio 1: one per row)
    group_seq: torch.Tensor          # [G] sequence of each new entry
    group_entry: torch.Tensor        # [G] its entry id
    member_rows: torch.Tensor | None     # [G, ratio] fresh row of each member, or -1 (ratio > 1)
    member_carry: torch.Tensor | None    # [G, ratio] carry-ring position of each member, or -1
    seqs_with_new: np.ndarray        # [B] bool: the sequence completed at least one entry
    group_rows: torch.Tensor | None = None   # [G] flat pool row of each new entry (static decode form,
                                             # padding groups -> a scratch row); None = from block_tables


@dataclass
class StepMetadata:
    """starts / ends / cu / positions_host are None in the static decode form (its plans are prebuilt)."""
    num_seqs: int
    num_tokens: int
    max_q: int                       # longest new-token run of a sequence
    window: int
    ring_len: int
    starts: np.ndarray               # [B] host
    ends: np.ndarray                 # [B] host
    cu: np.ndarray                   # [B+1] host
    positions: torch.Tensor          # [T] device
    positions_host: np.ndarray       # [T] host
    seq_of: torch.Tensor             # [T] device: sequence of each row
    row_in_seq: torch.Tensor         # [T] device: t - cu[seq]
    ring_slots: torch.Tensor         # [B] device
    block_tables: torch.Tensor       # [B, max_blocks] device
    ring_width: int                  # Wr: ring rows gathered per sequence
    ring_read: torch.Tensor          # [B * Wr] device: flat rows of a [slots * RING, D] ring view
    win_idx: torch.Tensor            # [T, Lw] device: window list of each row in buffer coords, -1 pads
    win_len: torch.Tensor            # [T] device: w_t
    ring_write_rows: torch.Tensor | None   # rows whose latents go to the ring (None = all rows)
    ring_write: torch.Tensor         # [rows written] flat ring rows they go to
    last_pos: int                    # largest position in the step (rope table size)
    plans: dict = field(default_factory=dict)       # ratio -> CompressPlan (built on first use)
    # state carried across the layers of one forward
    topk: dict = field(default_factory=dict)        # index source layer -> [T, K] entry ids or -1
    candidates: torch.Tensor | None = None          # [T, E] bool from the candidate source
    index_k_owner: np.ndarray | None = None         # [B] quirk emulation: last layer that published index keys
    write_from: np.ndarray | None = None            # [B] host: no compressed entry below it is written (replay)
    window_pools: dict = field(default_factory=dict)  # ring rows -> window lists in pool rows (window_pool)
    # balanced context parallelism (deepinfer/parallel/cp.py): the rows are this rank's share of one
    # prompt; the fresh region holds EVERY position's latent (gathered per layer), fresh_rows of them
    context_parallel: object | None = None
    fresh_rows: int | None = None

    @property
    def num_fresh(self) -> int:
        """Rows of the buffer's fresh region: the step's T new latents, or a CP prefill's whole prompt."""
        return self.num_tokens if self.fresh_rows is None else self.fresh_rows

    @property
    def fresh_offset(self) -> int:
        return self.num_seqs * self.ring_width

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def build(cls, batch, window: int, ring_len: int, index_k_owner: int = -1,
              canonical_layout: bool = False) -> "StepMetadata":
        cu = batch.cu_seqlens.numpy().astype(np.int64)
        starts = batch.start_pos.numpy().astype(np.int64)
        q = cu[1:] - cu[:-1]
        B, T = len(starts), int(cu[-1])
        ends = starts + q
        dev = batch.positions.device
        seq = np.repeat(np.arange(B), q)                                     # [T]
        pos = np.repeat(starts - cu[:-1], q) + np.arange(T)                  # [T] (== batch.positions)
        wr = int(min(window - 1, starts.max(initial=0)))
        floor = None if batch.window_start is None else batch.window_start.numpy().astype(np.int64)
        win_idx, win_len = _window_lists(pos, seq, starts, q, cu, window, wr, canonical_layout, floor)
        write_from = None if batch.write_from is None else batch.write_from.numpy().astype(np.int64)
        ring_pos = starts[:, None] - wr + np.arange(wr)                      # [B, Wr]
        slots = batch.ring_slots.to(dev)
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)   # noqa: E731
        ring_read = (slots[:, None] * ring_len + to(np.maximum(ring_pos, 0) % ring_len)).flatten()
        keep = pos >= np.repeat(ends, q) - ring_len                          # only the last RING rows
        write_rows = None if keep.all() else to(np.nonzero(keep)[0])
        ring_write = slots[to(seq[keep])] * ring_len + to(pos[keep] % ring_len)
        return cls(num_seqs=B, num_tokens=T, max_q=int(q.max(initial=0)), window=window, ring_len=ring_len,
                   starts=starts, ends=ends, cu=cu, positions=batch.positions, positions_host=pos, seq_of=to(seq),
                   row_in_seq=to(np.arange(T) - cu[seq]), ring_slots=slots, block_tables=batch.block_tables,
                   ring_width=wr, ring_read=ring_read, win_idx=to(win_idx), win_len=to(win_len),
                   ring_write_rows=write_rows, ring_write=ring_write, last_pos=int(ends.max(initial=1)) - 1,
                   index_k_owner=np.full(B, index_k_owner, dtype=np.int64), write_from=write_from)

    def window_pool(self, ring_rows: int) -> torch.Tensor:
        """win_idx in pool rows of the in-place attention sources (ring [ring_rows, D], then the step's
        T fresh rows): the same for every layer, so built once per forward."""
        if ring_rows not in self.window_pools:
            fresh = ring_rows + torch.arange(self.num_fresh, device=self.ring_read.device)
            table = torch.cat([self.ring_read, fresh])
            self.window_pools[ring_rows] = torch.where(self.win_idx >= 0, table[self.win_idx.clamp_min(0)], -1)
        return self.window_pools[ring_rows]

    def plan(self, ratio: int) -> CompressPlan:
        if ratio not in self.plans:
            self.plans[ratio] = self._build_plan(ratio)
        return self.plans[ratio]

    def _build_plan(self, ratio: int) -> CompressPlan:
        """Entries completed in this step: group g of sequence i (entry e) covers positions
        e*ratio .. e*ratio+ratio-1; those before start[i] come from the compressor carry ring.
        A replaying sequence completes no entry below write_from[i] (cached, shared: not rewritten)."""
        dev = self.positions.device
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)   # noqa: E731
        first, last = self.starts // ratio, self.ends // ratio               # [B] entries [first, last)
        if self.write_from is not None:
            first = np.maximum(first, -(-self.write_from // ratio))
        counts = np.maximum(last - first, 0)
        gseq = np.repeat(np.arange(self.num_seqs), counts)                    # [G]
        gentry = np.repeat(first, counts) + _ragged_arange(counts)
        member_rows = member_carry = None
        if ratio > 1:
            mpos = gentry[:, None] * ratio + np.arange(ratio)                 # [G, ratio]
            st = self.starts[gseq][:, None]
            fresh = mpos >= st
            member_rows = to(np.where(fresh, self.cu[gseq][:, None] + mpos - st, -1))
            member_carry = to(np.where(fresh, -1, mpos % self.ring_len))
        elif self.write_from is not None:   # ratio 1 with rows skipped: each entry's row
            member_rows = to((self.cu[gseq] + gentry - self.starts[gseq])[:, None])
        return CompressPlan(num_entries=int(last.max(initial=0)), lens=to((self.positions_host + 1) // ratio),
                            group_seq=to(gseq), group_entry=to(gentry), member_rows=member_rows,
                            member_carry=member_carry, seqs_with_new=counts > 0)

    def entry_rows(self, entries_per_block: int, num_entries: int, seq: torch.Tensor | None = None,
                   entries: torch.Tensor | None = None) -> torch.Tensor:
        """Flat rows of a [num_blocks * entries_per_block, D] pool view: for every sequence its entries
        0 .. num_entries-1 ([B, E]), or (seq, entries) pairs ([N]). Unallocated blocks read row 0."""
        if entries is None:
            entries = torch.arange(num_entries, device=self.positions.device).expand(self.num_seqs, -1)
        col = (entries // entries_per_block).clamp_max(self.block_tables.shape[1] - 1)
        blocks = self.block_tables.gather(-1, col) if seq is None else self.block_tables[seq, col]
        return blocks.clamp_min(0) * entries_per_block + entries % entries_per_block


class DecodeStepBuffers:
    """A pure decode step (one new token per sequence, start > 0, no drafts) padded to B sequences,
    in static buffers: the CUDA-graph form of ForwardBatch + StepMetadata. Its shapes depend only on
    (B, window, max_model_len, ratios, block-table width), never on the step:

        ring width Wr = window - 1      window list width = window (decode layout, pads first)
        E = max_model_len // ratio      G = B groups per ratio (a decode token closes at most one)
        last_pos = the caller's max_pos (rope tables grown once, before capture)
        ring_write_rows = None          (a one-token step keeps every row)

    Rows n..B-1 are padding: index lists of -1, lens 0. Their ring / carry writes and the pool writes
    of every group NOT closed in this step go to scratch rows (ring slot `scratch_slot`, pool block
    `scratch_block`) that no sequence owns and no list points at. Every tensor is a view of ONE
    int64 buffer, so a step is a numpy `fill` of a host buffer with the same layout and one copy:

        flat = | input_ids B | positions B | ngram_history B x h | ring_slots B | block_tables B x mb |
               | ring_read B*Wr | win_idx B x W | ring_write B | per ratio r: lens, entry, rows B     |
               | (r > 1: member_rows, member_carry B x r) | cu_seqlens B+1 | seq, zeros, win_len B | extra B |

    Indexer scores over the padded entries are masked by lens (as in the dynamic form), and the
    lists only grow by trailing -1s, so the step computes the dynamic form's numbers.
    """

    def __init__(self, num_seqs: int, *, window: int, ring_len: int, max_model_len: int, block_tokens: int,
                 max_blocks: int, ngram_width: int, ratios, scratch_slot: int, scratch_block: int,
                 extra: tuple[str, ...] = (), device="cpu"):
        B = self.num_seqs = num_seqs
        self.window, self.ring_len, self.block_tokens = window, ring_len, block_tokens
        self.ratios = tuple(sorted(set(ratios)))
        self.num_entries = {r: max_model_len // r for r in self.ratios}
        self.scratch_slot, self.scratch_block = scratch_slot, scratch_block
        shapes = {"input_ids": (B,), "positions": (B,), "ngram_history": (B, ngram_width), "ring_slots": (B,),
                  "block_tables": (B, max_blocks), "ring_read": (B * (window - 1),), "win_idx": (B, window),
                  "ring_write": (B,)}
        for r in self.ratios:
            shapes.update({f"lens{r}": (B,), f"entry{r}": (B,), f"rows{r}": (B,)})
            if r > 1:
                shapes.update({f"member_rows{r}": (B, r), f"member_carry{r}": (B, r)})
        shapes.update({"cu_seqlens": (B + 1,), "seq": (B,), "zeros": (B,), "win_len": (B,)})
        shapes.update({name: (B,) for name in extra})
        self.shapes = shapes
        self.numel = sum(prod(s) for s in shapes.values())
        self.flat = torch.zeros(self.numel, dtype=torch.int64, device=device)
        self.v = self.views(self.flat)

    def views(self, buf) -> dict:
        """name -> view of `buf` (a torch tensor or a numpy array with this layout)."""
        out, off = {}, 0
        for name, shape in self.shapes.items():
            n = prod(shape)
            out[name] = buf[off:off + n].reshape(shape)
            off += n
        return out

    def fill(self, host: np.ndarray, positions, input_ids, ngram_history, ring_slots, block_tables,
             **extra) -> None:
        """Write a step into `host` (int64, at least numel long, this layout): n = len(positions) <= B
        sequences, sequence i runs token input_ids[i] at positions[i] (0 < positions[i] <
        max_model_len). `extra`: [n] per field named at construction (padding -1)."""
        v = self.views(host[:self.numel])
        B, W, RL, n = self.num_seqs, self.window, self.ring_len, len(positions)
        assert n <= B, (n, B)
        wr, seq = W - 1, np.arange(n)
        pos = np.asarray(positions, dtype=np.int64)
        slots = np.asarray(ring_slots, dtype=np.int64)
        _put(v["input_ids"], input_ids, 0)
        _put(v["positions"], pos, 0)
        _put(v["ngram_history"], ngram_history, -1)
        _put(v["ring_slots"], slots, self.scratch_slot)
        bt = v["block_tables"]                      # the first max_blocks columns hold every position < max_model_len
        w = min(bt.shape[1], block_tables.shape[1])
        bt[:] = -1
        bt[:n, :w] = block_tables[:, :w]
        # ring region: positions pos-Wr .. pos-1 (those before 0 read row 0 and are never listed)
        rr = v["ring_read"].reshape(B, wr)
        rr[:n] = slots[:, None] * RL + np.maximum(pos[:, None] - wr + np.arange(wr), 0) % RL
        rr[n:] = self.scratch_slot * RL
        # window list: key j is position pos-Wr+j, ring row seq*Wr + j; the last key is the fresh row
        j = np.arange(W)
        idx = np.where(j < wr, seq[:, None] * wr + j, B * wr + seq[:, None])
        v["win_idx"][:n] = np.where(pos[:, None] - wr + j >= 0, idx, -1)
        v["win_idx"][n:] = -1
        pad = np.arange(B)
        v["ring_write"][:n] = slots * RL + pos % RL
        v["ring_write"][n:] = self.scratch_slot * RL + pad[n:] % RL
        for r in self.ratios:
            self._fill_plan(v, r, pos, n)
        v["cu_seqlens"][:] = np.arange(B + 1)
        v["seq"][:] = pad
        v["zeros"][:] = 0
        v["win_len"][:] = W
        for name, a in extra.items():
            _put(v[name], a, -1)

    def _fill_plan(self, v: dict, r: int, pos: np.ndarray, n: int) -> None:
        """Group g = sequence g: closed when its token is the group's last member ((pos+1) % r == 0);
        an open or padding group pools garbage into a scratch row."""
        B, epb, seq = self.num_seqs, self.block_tokens // r, np.arange(n)
        entry = pos // r
        closed = (pos + 1) % r == 0
        _put(v[f"lens{r}"], (pos + 1) // r, 0)
        _put(v[f"entry{r}"], entry, 0)
        bt = v["block_tables"]
        blocks = bt[seq, np.minimum(entry // epb, bt.shape[1] - 1)]
        scratch = self.scratch_block * epb + np.arange(B) % epb
        rows = v[f"rows{r}"]
        rows[:] = scratch
        rows[:n] = np.where(closed, np.maximum(blocks, 0) * epb + entry % epb, scratch[:n])
        if r > 1:
            mpos = entry[:, None] * r + np.arange(r)                  # [n, r] member positions
            fresh = mpos >= pos[:, None]                              # the token itself (closed groups)
            v[f"member_rows{r}"][:n] = np.where(fresh, seq[:, None], -1)
            v[f"member_rows{r}"][n:] = -1
            v[f"member_carry{r}"][:n] = np.where(fresh, -1, mpos % self.ring_len)
            v[f"member_carry{r}"][n:] = 0

    def forward_batch(self, n: int | None = None) -> ForwardBatch:
        """The ForwardBatch over the buffers (cu_seqlens and start_pos on the device here); n: its
        first n sequences only (what a caller reads back after the step, e.g. positions)."""
        v, n = self.v, self.num_seqs if n is None else n
        return ForwardBatch(input_ids=v["input_ids"][:n], positions=v["positions"][:n],
                            cu_seqlens=v["cu_seqlens"][:n + 1], start_pos=v["positions"][:n],
                            ngram_history=v["ngram_history"][:n], ring_slots=v["ring_slots"][:n],
                            block_tables=v["block_tables"][:n], logits_indices=v["seq"][:n])

    def metadata(self, max_pos: int) -> StepMetadata:
        """A fresh StepMetadata over the buffers (its per-forward state, topk / candidates, is new)."""
        v, B = self.v, self.num_seqs
        plans = {r: CompressPlan(num_entries=self.num_entries[r], lens=v[f"lens{r}"], group_seq=v["seq"],
                                 group_entry=v[f"entry{r}"], member_rows=v.get(f"member_rows{r}"),
                                 member_carry=v.get(f"member_carry{r}"), seqs_with_new=np.ones(B, dtype=bool),
                                 group_rows=v[f"rows{r}"]) for r in self.ratios}
        return StepMetadata(num_seqs=B, num_tokens=B, max_q=1, window=self.window, ring_len=self.ring_len,
                            starts=None, ends=None, cu=None, positions=v["positions"], positions_host=None,
                            seq_of=v["seq"], row_in_seq=v["zeros"], ring_slots=v["ring_slots"],
                            block_tables=v["block_tables"], ring_width=self.window - 1, ring_read=v["ring_read"],
                            win_idx=v["win_idx"], win_len=v["win_len"], ring_write_rows=None,
                            ring_write=v["ring_write"], last_pos=max_pos, plans=plans,
                            index_k_owner=np.full(B, -1, dtype=np.int64))


def _put(dst: np.ndarray, src, pad: int) -> None:
    """dst[:n] = src, dst[n:] = pad (n = len(src))."""
    n = len(src)
    dst[:n] = src
    dst[n:] = pad


def _window_lists(pos, seq, starts, q, cu, window: int, wr: int, canonical: bool = False, floor=None):
    """[T, Lw] window lists in buffer coords (ring region first, then fresh rows) and their widths.
    floor [B] (replay): keys below floor[seq] are not listed."""
    s, n = starts[seq], q[seq]
    prefill = (s == 0) & (not canonical)
    w = np.where(prefill, np.minimum(n, window), window)
    lw = int(w.max(initial=0))
    j = np.arange(lw)
    base = np.where(prefill, np.maximum(0, pos - window + 1), pos - window + 1)
    kpos = base[:, None] + j                                                 # [T, Lw] key positions
    ok = (j < w[:, None]) & np.where(prefill[:, None], kpos <= pos[:, None], kpos >= 0)
    if floor is not None:
        ok &= kpos >= floor[seq][:, None]
    ring = seq[:, None] * wr + kpos - (s[:, None] - wr)
    fresh = len(starts) * wr + cu[seq][:, None] + kpos - s[:, None]
    idx = np.where(ok, np.where(kpos < s[:, None], ring, fresh), -1)
    return idx, w


def _ragged_arange(counts: np.ndarray) -> np.ndarray:
    """[0..c0-1, 0..c1-1, ...] without a loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    return np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
