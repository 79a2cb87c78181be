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

from deepinfer.host_copy import host_tensor, to_device

from . import ops
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
    entry_tables: dict = field(default_factory=dict)  # (entries per block, E) -> [B, E] pool rows (entry_rows)
    rope_rows: dict = field(default_factory=dict)     # (table kind, ratio) -> the step's rotary rows (rope)
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
        win_idx, win_len = _window_lists(pos, seq, starts, q, cu, window, wr, canonical_layout, floor, dev)
        write_from = None if batch.write_from is None else batch.write_from.numpy().astype(np.int64)
        ring_pos = starts[:, None] - wr + np.arange(wr)                      # [B, Wr]
        slots = host_tensor(batch.ring_slots, None, dev)
        to = lambda a: host_tensor(a, None, dev)   # noqa: E731 (non-blocking)
        ring_read = (slots[:, None] * ring_len + to(np.maximum(ring_pos, 0) % ring_len)).flatten()
        keep = pos >= np.repeat(ends, q) - ring_len                          # only the last RING rows
        write_rows = None if keep.all() else to(np.nonzero(keep)[0])
        ring_write = slots[to(seq[keep])] * ring_len + to(pos[keep] % ring_len)
        return cls(num_seqs=B, num_tokens=T, max_q=int(q.max(initial=0)), window=window, ring_len=ring_len,
                   starts=starts, ends=ends, cu=cu, positions=batch.positions, positions_host=pos, seq_of=to(seq),
                   row_in_seq=to(np.arange(T) - cu[seq]), ring_slots=slots, block_tables=batch.block_tables,
                   ring_width=wr, ring_read=ring_read, win_idx=win_idx, win_len=win_len,
                   ring_write_rows=write_rows, ring_write=ring_write, last_pos=int(ends.max(initial=1)) - 1,
                   index_k_owner=np.full(B, index_k_owner, dtype=np.int64), write_from=write_from)

    def window_pool(self, ring_rows: int) -> torch.Tensor:
        """win_idx in pool rows of the in-place attention sources (ring [ring_rows, D], then the step's
        T fresh rows), int32 (the attention kernels' index type: no conversion per layer): the same for
        every layer, so built once per forward."""
        if ring_rows not in self.window_pools:
            self.window_pools[ring_rows] = ops.window_pool(self.win_idx, self.ring_read, ring_rows, self.num_fresh)
        return self.window_pools[ring_rows]

    def rope(self, tables: dict, kind: str, ratio: int = 0) -> torch.Tensor:
        """Rotary rows of table `kind` (layers.rope_tables) for the step's query positions (ratio 0), or for
        the entries ratio's plan completes (each at its group's first position): the same for every layer
        of that kind, so gathered once per forward (a decode graph replayed a gather a layer)."""
        key = (kind, ratio)
        if key not in self.rope_rows:
            pos = self.positions if not ratio else self.plan(ratio).group_entry * ratio
            self.rope_rows[key] = tables[kind](pos, self.last_pos)
        return self.rope_rows[key]

    def plan(self, ratio: int) -> CompressPlan:
        if ratio not in self.plans:
            self.plans[ratio] = self._build_plan(ratio)
        return self.plans[ratio]

    def _build_plan(self, ratio: int) -> CompressPlan:
        """Entries completed in this step: group g of sequence i (entry e) covers positions
        e*ratio .. e*ratio+ratio-1; those before start[i] come from the compressor carry ring.
        A replaying sequence completes no entry below write_from[i] (cached, shared: not rewritten)."""
        dev = self.positions.device
        to = lambda a: host_tensor(a, None, dev)   # noqa: E731 (non-blocking)
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
        0 .. num_entries-1 ([B, E]), or (seq, entries) pairs ([N]). Unallocated blocks read row 0.
        The [B, E] table is built once per forward (the same for every layer of a ratio; ~9 small ops a
        layer of host time that a prefill chunk's host cannot spare)."""
        if entries is None:
            key = (entries_per_block, num_entries)
            if key not in self.entry_tables:
                entries = torch.arange(num_entries, device=self.positions.device).expand(self.num_seqs, -1)
                self.entry_tables[key] = self._entry_rows(entries_per_block, None, entries)
            return self.entry_tables[key]
        return self._entry_rows(entries_per_block, seq, entries)

    def _entry_rows(self, entries_per_block: int, seq: torch.Tensor | None, entries: torch.Tensor) -> torch.Tensor:
        from deepinfer.kernels.reference import block_rows_ref
        return block_rows_ref(self.block_tables, entries_per_block, entries, seq)


class DecodeStepBuffers:
    """A decode / verify step (L = tokens_per_seq rows per sequence, start > 0) padded to B sequences,
    in static buffers: the CUDA-graph form of ForwardBatch + StepMetadata. L = 1: a pure decode step;
    L = 1 + k: a DSpark verify step (the last known token and k drafts). Its shapes depend only on
    (B, L, window, max_model_len, ratios, block-table width), never on the step:

        T = B * L rows; ring width Wr = window - 1; window list width = window (decode layout, pads first)
        E = max_model_len // ratio      G = ceil(L / ratio) groups per sequence and ratio
        last_pos = the caller's max_pos (rope tables grown once, before capture)
        ring_write_rows = None          (L <= ring_len: a step keeps every row)

    Padding: sequences n..B-1, and rows j >= q_i of a sequence verifying fewer tokens (q_i < L), get
    index lists of -1 and lens 0; their ring / carry writes and the pool writes of every group NOT
    closed by a real row go to scratch rows (ring slot `scratch_slot`, pool block `scratch_block`)
    that no sequence owns and no list points at. A real row attends to keys at or before its own
    position only, so a padding row after it changes nothing it reads. Every tensor is a view of ONE
    int64 buffer, so a step is a numpy `fill` of a host buffer with the same layout and one copy:

        flat = | input_ids T | positions T | starts B | ngram_history B x h | ring_slots B | block_tables B x mb |
               | ring_read B*Wr | win_idx T x W | ring_write T | per ratio r: lens T, gseq, entry, rows B*G     |
               | (r > 1: member_rows, member_carry B*G x r) | cu_seqlens B+1 | seq, row_in_seq, win_len,         |
               | logits_idx T | extra B |

    Indexer scores over the padded entries are masked by lens (as in the dynamic form), and the
    lists only grow by trailing -1s, so the step computes the dynamic form's numbers.

    Packed (num_rows = T < B * L, a varlen verify step): sequence i owns rows cu_i .. cu_i + r_i - 1,
    its q_i real rows first, then e_i padding rows (r_i = q_i + e_i <= L). The T - sum q_i padding rows
    go to the tails of the sequences from the last one backwards (padding sequences first), so the
    layout is always a contiguous ragged batch (cu_seqlens) and num_rows = B * L is the padded layout
    above. A step then costs T rows, not B * L: what it verifies, rounded up to the captured T.
    """

    def __init__(self, num_seqs: int, *, window: int, ring_len: int, max_model_len: int, block_tokens: int,
                 max_blocks: int, ngram_width: int, ratios, scratch_slot: int, scratch_block: int,
                 extra: tuple[str, ...] = (), device="cpu", tokens_per_seq: int = 1, num_rows: int | None = None):
        B = self.num_seqs = num_seqs
        L = self.tokens_per_seq = tokens_per_seq
        if not 1 <= L <= ring_len:
            raise ValueError(f"tokens_per_seq must be in [1, {ring_len}], got {L}")
        T = self.num_tokens = B * L if num_rows is None else num_rows
        if not 0 < T <= B * L:
            raise ValueError(f"num_rows must be in [1, {B * L}] (batch x tokens_per_seq), got {T}")
        self.window, self.ring_len, self.block_tokens = window, ring_len, block_tokens
        self.ratios = tuple(sorted(set(ratios)))
        self.num_entries = {r: max_model_len // r for r in self.ratios}
        self.groups = {r: -(-L // r) for r in self.ratios}          # groups a sequence may close per step
        self.scratch_slot, self.scratch_block = scratch_slot, scratch_block
        shapes = {"input_ids": (T,), "positions": (T,), "starts": (B,), "ngram_history": (B, ngram_width),
                  "ring_slots": (B,), "block_tables": (B, max_blocks), "ring_read": (B * (window - 1),),
                  "win_idx": (T, window), "ring_write": (T,)}
        for r in self.ratios:
            G = T if r == 1 else B * self.groups[r]          # ratio 1: one entry per row
            shapes.update({f"lens{r}": (T,), f"gseq{r}": (G,), f"entry{r}": (G,), f"rows{r}": (G,)})
            if r > 1:
                shapes.update({f"member_rows{r}": (G, r), f"member_carry{r}": (G, r)})
        shapes.update({"cu_seqlens": (B + 1,), "seq": (T,), "row_in_seq": (T,), "win_len": (T,), "logits_idx": (T,)})
        shapes.update({name: (B,) for name in extra})
        self.extra = tuple(extra)
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
             num_tokens=None, **extra) -> None:
        """Write a step into `host` (int64, at least numel long, this layout): n = len(positions) <= B
        sequences, sequence i runs q_i = num_tokens[i] (default L) tokens input_ids[i] (a row of L
        ids, or one id when L = 1) from position positions[i] (0 < positions[i], positions[i] + q_i
        <= max_model_len). `extra`: [n] per field named at construction (padding -1)."""
        v = self.views(host[:self.numel])
        B, L, W, RL, n = self.num_seqs, self.tokens_per_seq, self.window, self.ring_len, len(positions)
        assert n <= B, (n, B)
        T, wr = self.num_tokens, W - 1
        start = np.asarray(positions, dtype=np.int64)
        slots = np.asarray(ring_slots, dtype=np.int64)
        q = np.full(n, L, dtype=np.int64) if num_tokens is None else np.asarray(num_tokens, dtype=np.int64)
        assert ((q >= 1) & (q <= L)).all(), (q, L)
        assert q.sum() <= T, (q.sum(), T)
        qq = np.zeros(B, dtype=np.int64)
        qq[:n] = q
        # rows: sequence i owns rows cu_i .. cu_i + r_i - 1 at positions start_i ..; real while j < q_i
        cu = self.row_offsets(q)
        row_seq = np.repeat(np.arange(B), np.diff(cu))
        row_j = np.arange(T) - cu[row_seq]
        st = np.zeros(B, dtype=np.int64)
        st[:n] = start
        s_rows = st[row_seq]
        real = row_j < qq[row_seq]
        pos = np.where(row_seq < n, s_rows + row_j, 0)
        ids = np.zeros((B, L), dtype=np.int64)
        if n:               # narrower ids (a step shorter than the buffer's L): 0 past them
            given = np.asarray(input_ids, dtype=np.int64).reshape(n, -1)[:, :L]
            ids[:n, :given.shape[1]] = given
        v["input_ids"][:] = ids[row_seq, row_j]
        v["positions"][:] = pos
        _put(v["starts"], start, 0)
        _put(v["ngram_history"], ngram_history, -1)
        _put(v["ring_slots"], slots, self.scratch_slot)
        bt = v["block_tables"]                      # the first max_blocks columns hold every position < max_model_len
        w = min(bt.shape[1], block_tables.shape[1])
        bt[:] = -1
        bt[:n, :w] = block_tables[:, :w]
        # ring region: positions start-Wr .. start-1 (those before 0 read row 0 and are never listed)
        rr = v["ring_read"].reshape(B, wr)
        rr[:n] = slots[:, None] * RL + np.maximum(start[:, None] - wr + np.arange(wr), 0) % RL
        rr[n:] = self.scratch_slot * RL
        # window list of row t: key k is position pos_t - Wr + k; below start: ring row seq*Wr + (key - start + Wr),
        # else the fresh row cu_seq + (key - start) after the B*Wr ring rows
        kpos = pos[:, None] - wr + np.arange(W)                                # [T, W]
        idx = np.where(kpos < s_rows[:, None], row_seq[:, None] * wr + kpos - s_rows[:, None] + wr,
                       B * wr + cu[row_seq][:, None] + kpos - s_rows[:, None])
        v["win_idx"][:] = np.where(real[:, None] & (kpos >= 0), idx, -1)
        slot_pad = np.full(B, self.scratch_slot, dtype=np.int64)
        slot_pad[:n] = slots
        v["ring_write"][:] = np.where(real, slot_pad[row_seq] * RL + pos % RL, self.scratch_slot * RL + np.arange(T) % RL)
        for r in self.ratios:
            self._fill_plan(v, r, start, q, pos, real, n, cu, row_seq, row_j)
        v["cu_seqlens"][:] = cu
        v["seq"][:] = row_seq
        v["row_in_seq"][:] = row_j
        v["win_len"][:] = W
        v["logits_idx"][:] = np.arange(T)
        for name, a in extra.items():
            _put(v[name], a, -1)

    def fill_on_device(self, start: torch.Tensor, input_ids: torch.Tensor, ngram_history: torch.Tensor,
                       ring_slots: torch.Tensor, block_tables: torch.Tensor, num_tokens: torch.Tensor,
                       layout_tokens: np.ndarray | None = None) -> None:
        """fill() into the buffers themselves, from tensors on their device: start [n], input_ids [n, <= L] (0 past),
        ngram_history [n, h], ring_slots [n], block_tables [n, w], num_tokens [n]. The same values as
        fill(), by tensor ops only (no host read): the positions of an overlapped verify step are only
        on the device (the previous step's resolution, spec/overlap.py). Extra fields get -1.
        layout_tokens [n] (host, >= num_tokens): the rows each sequence owns before the spare rows are
        added (row_offsets), so the host knows where every row is; default num_tokens."""
        v, dev = self.v, self.flat.device
        B, L, W, RL, n = self.num_seqs, self.tokens_per_seq, self.window, self.ring_len, int(start.shape[0])
        assert n <= B, (n, B)
        T, wr = self.num_tokens, W - 1
        i64 = dict(dtype=torch.int64, device=dev)
        seqs = torch.arange(B, **i64)
        st = torch.zeros(B, **i64)
        st[:n] = start
        q = torch.zeros(B, **i64)
        q[:n] = num_tokens
        slots = torch.full((B,), self.scratch_slot, **i64)
        slots[:n] = ring_slots
        if layout_tokens is None:
            cu = torch.zeros(B + 1, **i64)
            torch.cumsum(q + padding_rows(q, L, T), 0, out=cu[1:])
        else:
            from deepinfer.host_copy import to_device
            cu = to_device(self.row_offsets(layout_tokens), dev)
        row_seq = seqs.repeat_interleave(cu[1:] - cu[:-1], output_size=T)     # no host read
        row_j = torch.arange(T, **i64) - cu[row_seq]
        real = (row_seq < n) & (row_j < q[row_seq])
        s_rows = st[row_seq]
        pos = torch.where(row_seq < n, s_rows + row_j, 0)
        ids = torch.zeros((B, L), **i64)
        w = min(L, input_ids.shape[1])          # narrower ids (a captured L above the step's): 0 past them
        ids[:n, :w] = input_ids[:, :w]
        v["input_ids"].copy_(ids[row_seq, row_j])
        v["positions"].copy_(pos)
        v["starts"].copy_(st)
        v["ngram_history"].fill_(-1)
        v["ngram_history"][:n] = ngram_history
        v["ring_slots"].copy_(slots)
        bt = v["block_tables"]
        w = min(bt.shape[1], block_tables.shape[1])
        bt.fill_(-1)
        bt[:n, :w] = block_tables[:, :w]
        rr = slots[:, None] * RL + (st[:, None] - wr + torch.arange(wr, **i64)).clamp_min(0) % RL
        v["ring_read"].copy_(torch.where(seqs[:, None] < n, rr, self.scratch_slot * RL).reshape(-1))
        kpos = pos[:, None] - wr + torch.arange(W, **i64)                      # [T, W]
        rs, sr = row_seq[:, None], s_rows[:, None]
        idx = torch.where(kpos < sr, rs * wr + kpos - sr + wr, B * wr + cu[row_seq][:, None] + kpos - sr)
        v["win_idx"].copy_(torch.where(real[:, None] & (kpos >= 0), idx, -1))
        tr = torch.arange(T, **i64)
        v["ring_write"].copy_(torch.where(real, slots[row_seq] * RL + pos % RL, self.scratch_slot * RL + tr % RL))
        for r in self.ratios:
            self._fill_plan_on_device(v, r, st, q, pos, real, n, cu, row_seq, row_j)
        v["cu_seqlens"].copy_(cu)
        v["seq"].copy_(row_seq)
        v["row_in_seq"].copy_(row_j)
        v["win_len"].fill_(W)
        v["logits_idx"].copy_(tr)
        for name in self.extra:
            v[name].fill_(-1)

    def row_offsets(self, num_tokens) -> np.ndarray:
        """[B + 1] cu_seqlens of a step whose n sequences run num_tokens [n] tokens (host): sequence i's
        rows are cu_i .. cu_i + num_tokens_i - 1 (padded layout: cu_i = i * L)."""
        B, L, T = self.num_seqs, self.tokens_per_seq, self.num_tokens
        qq = np.zeros(B, dtype=np.int64)
        qq[:len(num_tokens)] = num_tokens
        cu = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(qq + padding_rows(qq, L, T), out=cu[1:])
        return cu

    def _fill_plan_on_device(self, v: dict, r: int, st: torch.Tensor, q: torch.Tensor, pos: torch.Tensor,
                             real: torch.Tensor, n: int, cu: torch.Tensor, row_seq: torch.Tensor,
                             row_j: torch.Tensor) -> None:
        """_fill_plan with st / q [B] (padded with 0) as device tensors."""
        B, L, G, epb = self.num_seqs, self.tokens_per_seq, self.groups[r], self.block_tokens // r
        i64 = dict(dtype=torch.int64, device=st.device)
        v[f"lens{r}"].copy_(torch.where(real, (pos + 1) // r, 0))
        if r == 1:
            gseq, g = row_seq, row_j
        else:
            gseq = torch.arange(B, **i64).repeat_interleave(G)
            g = torch.arange(G, **i64).repeat(B)
        entry = torch.where(gseq < n, st[gseq] // r + g, 0)
        closed = (gseq < n) & (entry * r + r - 1 < st[gseq] + q[gseq])
        v[f"gseq{r}"].copy_(gseq)
        v[f"entry{r}"].copy_(entry)
        bt = v["block_tables"]
        blocks = bt[gseq, (entry // epb).clamp_max(bt.shape[1] - 1)]
        scratch = self.scratch_block * epb + torch.arange(gseq.shape[0], **i64) % epb
        v[f"rows{r}"].copy_(torch.where(closed, blocks.clamp_min(0) * epb + entry % epb, scratch))
        if r > 1:
            mpos = entry[:, None] * r + torch.arange(r, **i64)
            s = st[gseq][:, None]
            fresh = mpos >= s
            rows = torch.where(fresh, cu[gseq][:, None] + mpos - s, -1)
            v[f"member_rows{r}"].copy_(torch.where(closed[:, None], rows, -1))
            v[f"member_carry{r}"].copy_(torch.where(closed[:, None], torch.where(fresh, -1, mpos % self.ring_len), 0))

    def _fill_plan(self, v: dict, r: int, start: np.ndarray, q: np.ndarray, pos: np.ndarray, real: np.ndarray,
                   n: int, cu: np.ndarray, row_seq: np.ndarray, row_j: np.ndarray) -> None:
        """Group slot g of sequence i: entry start_i // r + g, closed when its last member position is
        one of the sequence's real rows; an open or padding group pools garbage into a scratch row.
        Ratio 1: a group slot per row (the row's own entry)."""
        B, L, G, epb = self.num_seqs, self.tokens_per_seq, self.groups[r], self.block_tokens // r
        v[f"lens{r}"][:] = np.where(real, (pos + 1) // r, 0)
        if r == 1:
            gseq, g = row_seq, row_j
        else:
            gseq = np.repeat(np.arange(B), G)                                # [B*G]
            g = np.tile(np.arange(G), B)
        st = np.zeros(B, dtype=np.int64)
        st[:n] = start
        qq = np.zeros(B, dtype=np.int64)
        qq[:n] = q
        entry = np.where(gseq < n, st[gseq] // r + g, 0)
        closed = (gseq < n) & (entry * r + r - 1 < st[gseq] + qq[gseq])
        v[f"gseq{r}"][:] = gseq
        v[f"entry{r}"][:] = entry
        bt = v["block_tables"]
        blocks = bt[gseq, np.minimum(entry // epb, bt.shape[1] - 1)]
        scratch = self.scratch_block * epb + np.arange(len(gseq)) % epb
        v[f"rows{r}"][:] = np.where(closed, np.maximum(blocks, 0) * epb + entry % epb, scratch)
        if r > 1:
            mpos = entry[:, None] * r + np.arange(r)                          # [B*G, r] member positions
            s = st[gseq][:, None]
            fresh = mpos >= s                                                 # rows of this step, else the carry ring
            v[f"member_rows{r}"][:] = np.where(closed[:, None], np.where(fresh, cu[gseq][:, None] + mpos - s, -1), -1)
            v[f"member_carry{r}"][:] = np.where(closed[:, None], np.where(fresh, -1, mpos % self.ring_len), 0)

    def forward_batch(self, n: int | None = None, rows: int | None = None) -> ForwardBatch:
        """The ForwardBatch over the buffers (cu_seqlens and start_pos on the device here); n: its
        first n sequences only (what a caller reads back after the step, e.g. positions), which own
        the first `rows` rows (packed: the caller's cu_n; padded: n * L)."""
        v, n = self.v, self.num_seqs if n is None else n
        packed = self.num_tokens != self.num_seqs * self.tokens_per_seq
        if rows is None and packed and n != self.num_seqs:
            raise ValueError("a packed step's first n sequences need their row count (rows=)")
        t = self.num_tokens if n == self.num_seqs else rows if rows is not None else n * self.tokens_per_seq
        return ForwardBatch(input_ids=v["input_ids"][:t], positions=v["positions"][:t],
                            cu_seqlens=v["cu_seqlens"][:n + 1], start_pos=v["starts"][:n],
                            ngram_history=v["ngram_history"][:n], ring_slots=v["ring_slots"][:n],
                            block_tables=v["block_tables"][:n], logits_indices=v["logits_idx"][:t])

    def metadata(self, max_pos: int) -> StepMetadata:
        """A fresh StepMetadata over the buffers (its per-forward state, topk / candidates, is new)."""
        v, B, T = self.v, self.num_seqs, self.num_tokens
        plans = {r: CompressPlan(num_entries=self.num_entries[r], lens=v[f"lens{r}"], group_seq=v[f"gseq{r}"],
                                 group_entry=v[f"entry{r}"], member_rows=v.get(f"member_rows{r}"),
                                 member_carry=v.get(f"member_carry{r}"), seqs_with_new=np.ones(B, dtype=bool),
                                 group_rows=v[f"rows{r}"]) for r in self.ratios}
        return StepMetadata(num_seqs=B, num_tokens=T, max_q=self.tokens_per_seq, window=self.window,
                            ring_len=self.ring_len, starts=None, ends=None, cu=None, positions=v["positions"],
                            positions_host=None, seq_of=v["seq"], row_in_seq=v["row_in_seq"],
                            ring_slots=v["ring_slots"], block_tables=v["block_tables"], ring_width=self.window - 1,
                            ring_read=v["ring_read"], win_idx=v["win_idx"], win_len=v["win_len"],
                            ring_write_rows=None, ring_write=v["ring_write"], last_pos=max_pos, plans=plans,
                            index_k_owner=np.full(B, -1, dtype=np.int64))


def padding_rows(q, L: int, T: int):
    """[B] padding rows e_i of each sequence in a step of T rows whose sequences run q_i real rows
    (numpy or torch, q [B] with 0 for padding sequences): the T - sum q spare rows fill the tails
    (L - q_i each) from the last sequence backwards. T = B * L gives every sequence L rows."""
    cap = L - q
    if isinstance(q, torch.Tensor):
        after = cap.flip(0).cumsum(0).flip(0) - cap            # spare room of the sequences after i
        spare = T - q.sum()
        return torch.minimum((spare - after).clamp_min(0), cap)
    after = np.cumsum(cap[::-1])[::-1] - cap
    return np.minimum(np.maximum(T - q.sum() - after, 0), cap)


def _put(dst: np.ndarray, src, pad: int) -> None:
    """dst[:n] = src, dst[n:] = pad (n = len(src))."""
    n = len(src)
    dst[:n] = src
    dst[n:] = pad


def _window_lists(pos, seq, starts, q, cu, window: int, wr: int, canonical: bool = False, floor=None,
                  device="cpu"):
    """[T, Lw] window lists in buffer coords (ring region first, then fresh rows) and their widths [T],
    as tensors on `device`. floor [B] (replay): keys below floor[seq] are not listed.
    The per-row bounds are [T] host arrays; the [T, Lw] lists (1M entries at 8k x 128) are broadcast on
    the device: built on the host they cost ~30 ms of numpy and an 8 MB copy per prefill."""
    s, n = starts[seq], q[seq]
    prefill = (s == 0) & (not canonical)
    w = np.where(prefill, np.minimum(n, window), window)
    lw = int(w.max(initial=0))
    base = np.where(prefill, np.maximum(0, pos - window + 1), pos - window + 1)
    # key kpos = base + j is listed iff lo <= kpos <= hi (j < w; prefill: causal; decode: kpos >= 0)
    lo = np.where(prefill, base, np.maximum(base, 0))
    if floor is not None:
        lo = np.maximum(lo, floor[seq])
    hi = np.where(prefill, np.minimum(pos, base + w - 1), base + w - 1)
    ring_off = seq * wr - (s - wr)                                           # kpos < start: the ring
    fresh_off = len(starts) * wr + cu[seq] - s                              # else the step's rows
    rows = to_device(np.stack([base, lo, hi, s, ring_off, fresh_off]), device)
    base_d, lo_d, hi_d, s_d, ring_d, fresh_d = (r[:, None] for r in rows)
    kpos = base_d + torch.arange(lw, device=rows.device)                     # [T, Lw] key positions
    idx = torch.where((kpos >= lo_d) & (kpos <= hi_d), kpos + torch.where(kpos < s_d, ring_d, fresh_d), -1)
    return idx, to_device(w, device)


def _ragged_arange(counts: np.ndarray) -> np.ndarray:
    """[0..c0-1, 0..c1-1, ...] without a loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    return np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
