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

Host-side ints (num_seqs, max_q, max_end, group counts) decide every shape, so the forward could be
captured in a CUDA graph once these tensors live in static buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


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


@dataclass
class StepMetadata:
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
        win_idx, win_len = _window_lists(pos, seq, starts, q, cu, window, wr, canonical_layout)
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
                   index_k_owner=np.full(B, index_k_owner, dtype=np.int64))

    def plan(self, ratio: int) -> CompressPlan:
        if ratio not in self.plans:
            self.plans[ratio] = self._build_plan(ratio)
        return self.plans[ratio]

    def _build_plan(self, ratio: int) -> CompressPlan:
        """Entries completed in this step: group g of sequence i (entry e) covers positions
        e*ratio .. e*ratio+ratio-1; those before start[i] come from the compressor carry ring."""
        dev = self.positions.device
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)   # noqa: E731
        first, last = self.starts // ratio, self.ends // ratio               # [B] entries [first, last)
        counts = last - first
        gseq = np.repeat(np.arange(self.num_seqs), counts)                    # [G]
        gentry = np.repeat(first, counts) + _ragged_arange(counts)
        member_rows = member_carry = None
        if ratio > 1:
            mpos = gentry[:, None] * ratio + np.arange(ratio)                 # [G, ratio]
            st = self.starts[gseq][:, None]
            fresh = mpos >= st
            member_rows = to(np.where(fresh, self.cu[gseq][:, None] + mpos - st, -1))
            member_carry = to(np.where(fresh, -1, mpos % self.ring_len))
        return CompressPlan(num_entries=int(last.max(initial=0)), lens=to((self.positions_host + 1) // ratio),
                            group_seq=to(gseq), group_entry=to(gentry), member_rows=member_rows,
                            member_carry=member_carry, seqs_with_new=counts > 0)

    def entry_rows(self, entries_per_block: int, num_entries: int, seq: torch.Tensor | None = None,
                   entries: torch.Tensor | None = None) -> torch.Tensor:
        """Flat rows of a [num_blocks * entries_per_block, D] pool view: for every sequence its entries
        0 .. num_entries-1 ([B, E]), or (seq, entries) pairs ([G]). Unallocated blocks read row 0."""
        if entries is None:
            entries = torch.arange(num_entries, device=self.positions.device).expand(self.num_seqs, -1)
            tables = self.block_tables
        else:
            tables = self.block_tables[seq]
        col = (entries // entries_per_block).clamp_max(self.block_tables.shape[1] - 1)
        blocks = tables.gather(-1, col) if entries.dim() == 2 else tables.gather(-1, col[:, None])[:, 0]
        return blocks.clamp_min(0) * entries_per_block + entries % entries_per_block


def _window_lists(pos, seq, starts, q, cu, window: int, wr: int, canonical: bool = False):
    """[T, Lw] window lists in buffer coords (ring region first, then fresh rows) and their widths."""
    s, n = starts[seq], q[seq]
    prefill = (s == 0) & (not canonical)
    w = np.where(prefill, np.minimum(n, window), window)
    lw = int(w.max(initial=0))
    j = np.arange(lw)
    base = np.where(prefill, np.maximum(0, pos - window + 1), pos - window + 1)
    kpos = base[:, None] + j                                                 # [T, Lw] key positions
    ok = (j < w[:, None]) & np.where(prefill[:, None], kpos <= pos[:, None], kpos >= 0)
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
