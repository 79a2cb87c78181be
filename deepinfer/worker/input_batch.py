"""Persistent per-request arrays on the host, and the step's ForwardBatch built from them.

One row per running request (rows are reused). Token ids live here, not in the scheduler's
Request copies, so building a step is a handful of numpy gathers, not a Python loop over tokens:

    step with 3 requests, q_lens = [4, 1, 2], start_pos = [0, 9, 5]:
    cu_seqlens = [0, 4, 5, 7]
    positions  = [0 1 2 3 | 9 | 5 6]         = repeat(start - cu[:-1], q) + arange(T)
    input_ids  = token_ids[repeat(rows, q), positions]

A request admitted on a prefix hit by bounded replay (outputs.ReplayParams) keeps two per-row
values, window_start and write_from, sent with every step until its rows are past them (then they
change nothing and the step takes the plain path, CUDA graphs included).
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.host_copy import host_tensor
from deepinfer.model.batch import ForwardBatch
from deepinfer.outputs import CachedRequestData, NewRequestData
from deepinfer.sampling_params import SamplingParams


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_req: int, ngram_width: int,
                 window: int = 128, yoco_keep_tokens: int = 0) -> None:
        self.max_num_seqs = max_num_seqs
        self.yoco_keep_tokens = yoco_keep_tokens           # YOCO truncation (model/yoco.py): 0 = off
        self.window = window
        self.ngram_width = ngram_width                      # max_ngram_size - 1 previous tokens
        self.token_ids = np.zeros((max_num_seqs, max_model_len + 16), dtype=np.int64)  # + room for drafts
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)     # known tokens per row
        self.num_computed = np.zeros(max_num_seqs, dtype=np.int64)   # positions in the caches
        self.num_prompt = np.zeros(max_num_seqs, dtype=np.int64)
        self.block_table = np.full((max_num_seqs, max_blocks_per_req), -1, dtype=np.int64)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.ring_slot = np.zeros(max_num_seqs, dtype=np.int64)
        self.window_start = np.zeros(max_num_seqs, dtype=np.int64)   # replay: first existing window key
        self.write_from = np.zeros(max_num_seqs, dtype=np.int64)     # replay: first compressed entry to write
        self.params: list[SamplingParams | None] = [None] * max_num_seqs
        self.sampling_state: list = [None] * max_num_seqs            # Sampler's SamplingState per row
        self.needs_sampler = np.zeros(max_num_seqs, dtype=bool)      # not plain greedy argmax
        self.forced: dict[int, list[int]] = {}               # row -> forced output ids (teacher forcing)
        self.return_logits: set[int] = set()                 # rows that keep their logits
        self.row_of: dict[str, int] = {}
        # token types (TEXT -1, image span 0..3: deepinfer.model.vision) of rows whose prompt has images
        self.token_types = np.full((max_num_seqs, max_model_len + 16), -1, dtype=np.int8)
        self.has_images = np.zeros(max_num_seqs, dtype=bool)
        # async scheduling: row -> index of its not-yet-known token in the last launched step's
        # device-side samples (-1 = none); build() patches those input ids on the device
        self.pending_index = np.full(max_num_seqs, -1, dtype=np.int64)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    # bookkeeping -------------------------------------------------------------------------------
    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self.params[row] = None
        self.sampling_state[row] = None
        self.needs_sampler[row] = False
        self.forced.pop(row, None)
        self.return_logits.discard(row)
        self.block_table[row, :self.num_blocks[row]] = -1
        self.num_blocks[row] = 0
        self.pending_index[row] = -1
        if self.has_images[row]:
            self.token_types[row] = -1
            self.has_images[row] = False
        self.window_start[row] = self.write_from[row] = 0
        self._free_rows.append(row)

    def add(self, new: NewRequestData) -> None:
        row = self._free_rows.pop()
        self.row_of[new.req_id] = row
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_computed[row] = new.num_computed_tokens
        self.num_prompt[row] = new.num_prompt_tokens
        nb = len(new.block_ids)
        self.block_table[row, :nb] = new.block_ids
        self.num_blocks[row] = nb
        self.ring_slot[row] = new.ring_slot
        if new.replay is not None:
            self.window_start[row], self.write_from[row] = new.replay.replay_start, new.replay.hit
        self.params[row] = new.sampling_params
        self.needs_sampler[row] = needs_sampler(new.sampling_params)
        if new.forced_token_ids is not None:
            self.forced[row] = new.forced_token_ids
        if new.return_logits:
            self.return_logits.add(row)
        if new.image_prompt is not None:
            types = new.image_prompt.token_types
            self.token_types[row, :len(types)] = types
            self.has_images[row] = True

    def update(self, diff: CachedRequestData) -> None:
        row = self.row_of[diff.req_id]
        self.num_computed[row] = diff.num_computed_tokens
        nb = diff.num_blocks + len(diff.new_block_ids)
        self.block_table[row, nb:self.num_blocks[row]] = -1  # blocks freed by a rollback
        self.block_table[row, diff.num_blocks:nb] = diff.new_block_ids
        self.num_blocks[row] = nb

    def write_drafts(self, req_id: str, drafts: list[int]) -> None:
        row = self.row_of[req_id]
        n = self.num_tokens[row]
        self.token_ids[row, n:n + len(drafts)] = drafts

    def append_tokens(self, rows: np.ndarray, sampled: list[list[int]]) -> None:
        if all(len(s) == 1 for s in sampled):  # the common case: one token each, one scatter
            self.token_ids[rows, self.num_tokens[rows]] = [s[0] for s in sampled]
            self.num_tokens[rows] += 1
            return
        for row, toks in zip(rows, sampled):
            n = self.num_tokens[row]
            self.token_ids[row, n:n + len(toks)] = toks
            self.num_tokens[row] = n + len(toks)

    # the step's tensors ------------------------------------------------------------------------
    def build(self, req_ids: list[str], q_lens: np.ndarray, num_spec: np.ndarray, device,
              prev_sampled: torch.Tensor | None = None) -> tuple[ForwardBatch, np.ndarray, np.ndarray]:
        """ForwardBatch for these requests; also the rows, and how many logits rows each request has
        (0 for a chunk that stops short of the request's last known token, else 1 + drafts).
        prev_sampled: the previous step's samples on the device, for tokens not yet known here."""
        rows = np.fromiter((self.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        start = self.num_computed[rows]                                       # [B]
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        T = int(cu[-1])
        positions = np.repeat(start - cu[:-1], q_lens) + np.arange(T)       # [T]
        rows_rep = np.repeat(rows, q_lens)
        input_ids = self.token_ids[rows_rep, positions]                      # [T]
        hist = self._history(rows, start)
        pending = self.pending_index[rows] >= 0
        reaches_end = start + q_lens - num_spec >= self.num_tokens[rows] + pending
        num_logits = np.where(reaches_end, 1 + num_spec, 0)                 # [B]
        ends = cu[1:]
        logits_indices = np.repeat(ends - num_logits, num_logits) + _ragged_arange(num_logits)
        max_nb = max(int(self.num_blocks[rows].max()), 1)
        to = lambda a: host_tensor(a, None, device)   # noqa: E731 (pinned, non-blocking)
        replaying = self._replaying(rows, start).any()
        batch = ForwardBatch(
            input_ids=to(input_ids), positions=to(positions),
            cu_seqlens=torch.from_numpy(cu), start_pos=torch.from_numpy(start),
            ngram_history=to(hist), ring_slots=to(self.ring_slot[rows]),
            block_tables=to(np.ascontiguousarray(self.block_table[rows, :max_nb])),
            logits_indices=to(logits_indices),
            window_start=torch.from_numpy(self.window_start[rows]) if replaying else None,
            write_from=torch.from_numpy(self.write_from[rows]) if replaying else None)
        if self.yoco_keep_tokens:            # decoder rows from (tokens known) - N on: only prompt chunks lose rows
            keep_from = np.maximum(self.num_tokens[rows] - self.yoco_keep_tokens, 0)
            if (keep_from > start).any():
                batch.yoco_keep_from = torch.from_numpy(keep_from)
        if self.has_images[rows].any():      # False inside image spans: VL router bias, Engram dead
            batch.token_mask = to(self.token_types[rows_rep, positions] < 0)
        if prev_sampled is not None and pending.any():
            src = self.pending_index[rows_rep]
            unknown = np.nonzero((src >= 0) & (positions >= self.num_tokens[rows_rep]))[0]
            batch.input_ids[to(unknown)] = prev_sampled[to(src[unknown])]
        return batch, rows, num_logits

    def decode_rows(self, req_ids: list[str], q_lens: np.ndarray, num_spec: np.ndarray) -> np.ndarray | None:
        """The rows of a decode / verify step (every request runs its next token at a start > 0, then
        its drafts if any: q = 1 + drafts, and samples), else None: the steps a CUDA graph can serve."""
        if (q_lens != 1 + num_spec).any():
            return None
        rows = np.fromiter((self.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        start = self.num_computed[rows]
        pending = self.pending_index[rows] >= 0
        if (start == 0).any() or (start + 1 < self.num_tokens[rows] + pending).any():
            return None
        if self._replaying(rows, start).any():
            return None
        return rows

    def _replaying(self, rows: np.ndarray, start: np.ndarray) -> np.ndarray:
        """[B] bool: a replay rule can still matter for a step starting at `start` (a window key
        below window_start is in reach, or a compressed entry below write_from is not yet behind)."""
        ws = self.window_start[rows]
        return ((ws > 0) & (start - self.window + 1 < ws)) | (start < self.write_from[rows])

    def decode_inputs(self, rows: np.ndarray, q_lens: np.ndarray | None = None,
                      length: int = 1) -> dict[str, np.ndarray]:
        """Host arrays of a decode step, or (q_lens, padded to `length` tokens) of a verify step
        (DecodeStepBuffers.fill's arguments). pending_src: index of the row's input token in the last
        launched step's device samples, -1 = known here."""
        start = self.num_computed[rows]                                      # [B] = the new token's position
        out = dict(positions=start, input_ids=self.token_ids[rows, start],
                   ngram_history=self._history(rows, start), ring_slots=self.ring_slot[rows],
                   block_tables=self.block_table[rows],
                   pending_src=np.where(start >= self.num_tokens[rows], self.pending_index[rows], -1))
        if length > 1:      # the last known token, then the drafts (written after it), then padding
            j = np.arange(length)
            ids = self.token_ids[rows[:, None], start[:, None] + j]
            out["input_ids"] = np.where(j < q_lens[:, None], ids, 0)
            out["num_tokens"] = q_lens
        return out

    def _history(self, rows: np.ndarray, start: np.ndarray) -> np.ndarray:
        """[B, n-1] token ids at start-n+1 .. start-1 (Engram's look-back), -1 before position 0,
        -2 (engram.DEAD) at image-span positions."""
        hist_pos = start[:, None] + np.arange(-self.ngram_width, 0)
        hist = self.token_ids[rows[:, None], np.maximum(hist_pos, 0)]
        if self.has_images[rows].any():
            hist[self.token_types[rows[:, None], np.maximum(hist_pos, 0)] >= 0] = -2
        hist[hist_pos < 0] = -1
        return hist


def needs_sampler(p: SamplingParams) -> bool:
    """False when argmax alone gives the token (the fast path, no host sync on the device)."""
    return not p.greedy or p.logprobs is not None or p.constraint is not None or bool(
        p.presence_penalty or p.frequency_penalty)


def _ragged_arange(counts: np.ndarray) -> np.ndarray:
    """[0..c0-1, 0..c1-1, ...] without a loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total) - offsets
