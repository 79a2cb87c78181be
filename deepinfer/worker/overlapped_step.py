"""The model runner's half of verify steps that overlap (spec/overlap.py): drafting on the device at
launch, and the forward of a verify step launched before the previous one resolves.

    draft(...)     every row of a launched step into the DSpark rings, then the next proposal from
                   the resolved anchors (static drafting buffers filled on the device; the captured
                   drafting graph when one serves the batch)
    forward(...)   the overlapped step's inputs from the previous step's resolution and proposal
                   (k_i <= K' drafts each, picked here by the policy's device half),
                   the static verify step filled on the device, then the captured verify graph
                   (CUDA) or the same static step run eagerly; the real rows gathered back
    replayed(...)  benchmark mode: a device-made proposal's replayed outcome (and confidences), from
                   tables drawn when the request was added (spec/replay.py's keys: request id, anchor position)

The runner (model_runner.py) samples, resolves and copies to the host as for any step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.kernels.batch_invariant import batch_invariant_mode
from deepinfer.spec.overlap import step_inputs, to_device
from deepinfer.spec.device_verify import verified_counts
from deepinfer.worker.input_batch import _ragged_arange


@dataclass
class OverlappedForward:
    req_ids: list[str]
    rows: np.ndarray            # [B] InputBatch rows
    q_lens: np.ndarray          # [B] 1 + K' tokens per request: the layout (rows past 1 + k_i are padding)
    num_verified: torch.Tensor  # [B] device: k_i <= K' drafts each request verifies (spec/device_verify.py)
    prev_index: np.ndarray      # [B] each request's index in the previous step
    start: torch.Tensor         # [B] device: first position of each request (the previous next_pos)
    logits: torch.Tensor        # [sum q, V] the real rows' logits
    fed: torch.Tensor           # [sum q] the ids fed at them
    positions: torch.Tensor     # [sum q] their positions
    main_hidden: torch.Tensor | None   # [sum q, .] their DSpark input rows


class OverlappedSteps:
    def __init__(self, runner) -> None:
        self.runner = runner
        self._static_steps: dict = {}     # (B, L, max_len) -> DecodeStepBuffers run eagerly
        self._static_drafts: dict = {}    # B -> DraftStepBuffers run eagerly
        self._replay_table: torch.Tensor | None = None   # [rows, positions] replayed lengths (int8)
        self._replay_conf: torch.Tensor | None = None    # [rows, positions, K] their confidence logits

    # drafting at launch ------------------------------------------------------------------------
    def draft(self, main_hidden, positions, q_lens, rows, res):
        """Every row of the step into the DSpark rings (rejected ones are overwritten later), then
        num_speculative_tokens drafts per request from its resolved anchor at next_pos - 1.
        -> (ids [B, K], confidence logits [B, K]) on the device."""
        from deepinfer.model.dspark import dspark_propose
        r = self.runner
        ib, dev, proposer = r.input_batch, r.device, r.proposer
        slots = ib.ring_slot[rows]
        cu = np.concatenate([[0], np.cumsum(q_lens)])
        proposer.absorb(main_hidden, positions, slots.tolist(), cu.tolist(), max_pos=self.max_pos())
        n, dg = len(rows), proposer.graphs
        graph = dg is not None and dg.serves(n)
        bufs = dg.graphs.static_in[dg.graphs.padded(n)][0] if graph else self._draft_buffers(n)
        bufs.fill_on_device(res.anchor, res.next_pos - 1, to_device(slots, dev))
        if graph:
            ids, conf = dg.graphs.run(bufs.num_seqs)
            dg.num_steps += 1
        else:
            with torch.inference_mode():
                out = dspark_propose(r.model, bufs.v["anchor_ids"], None, None, r.caches, static=bufs)
            ids, conf = out.draft_ids, out.confidence
        K = proposer.num_speculative_tokens
        if self._replay_conf is not None:   # benchmark mode: the replayed confidences, as the host's
            conf = self._replay_conf[to_device(rows, dev), res.next_pos - 1]
        return ids[:n, :K].clone(), conf[:n, :K].float().clone()

    def _draft_buffers(self, n: int):
        if n not in self._static_drafts:
            from deepinfer.model.dspark import DraftStepBuffers
            r = self.runner
            self._static_drafts[n] = DraftStepBuffers(
                n, window=r.model.mtp[0].attn.window, block=r.model.args.dspark_block_size,
                ring_len=r.caches.ring_len, scratch_slot=r.caches.scratch_slot, max_pos=self.max_pos(),
                device=r.device)
        return self._static_drafts[n]

    def max_pos(self) -> int:
        """The rope tables' bound for static steps: the captured graphs' (no table reallocation)."""
        from deepinfer.worker.graph_step import DRAFT_ROOM
        r = self.runner
        return r.graphs.max_pos if r.graphs is not None else r.max_model_len + DRAFT_ROOM - 1

    # benchmark mode ----------------------------------------------------------------------------
    def fill_replay_table(self, new) -> None:
        """The replayed length of every proposal the request may make (anchor positions p from its
        prompt's end to max_tokens past it), drawn now with the host's keys, so a device-made
        proposal reads its outcome by (row, p) without the host."""
        r = self.runner
        ib = r.input_batch
        if self._replay_table is None:     # int8: lengths are <= K (the table spans every position of every row)
            self._replay_table = torch.full(ib.token_ids.shape, -1, dtype=torch.int8, device=r.device)
            # the confidences too: an overlapped step's policy splits its budget by them on the device
            self._replay_conf = torch.zeros((*ib.token_ids.shape, r.proposer.num_speculative_tokens),
                                            dtype=torch.float32, device=r.device)
        row, width = ib.row_of[new.req_id], ib.token_ids.shape[1]
        lo = max(new.num_prompt_tokens - 1, 0)
        hi = min(len(new.token_ids) + new.sampling_params.max_tokens + 1, width)
        if hi <= lo:
            return
        conf, lengths = r.proposer.replay.draw([(new.req_id, p) for p in range(lo, hi)])
        self._replay_table[row, lo:hi] = to_device(np.asarray(lengths, dtype=np.int64), r.device).to(torch.int8)
        K = self._replay_conf.shape[2]
        self._replay_conf[row, lo:hi] = torch.tensor(np.asarray(conf)[:, :K], dtype=torch.float32).to(r.device)

    def replayed(self, rows: np.ndarray, res) -> torch.Tensor | None:
        """[B] replayed lengths of the proposals just made on the device (None outside benchmark mode)."""
        if self._replay_table is None:
            return None
        return self._replay_table[to_device(rows, self.runner.device), res.next_pos - 1].long()

    # the overlapped step -----------------------------------------------------------------------
    def forward(self, sched_out, prev) -> OverlappedForward:
        """Build the overlapped step from `prev`'s device-side resolution and proposal and run it
        (SchedulerOutput already applied to the InputBatch)."""
        r = self.runner
        ib = r.input_batch
        req_ids = list(sched_out.num_scheduled_tokens)
        q_lens = np.fromiter(sched_out.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        rows = np.fromiter((ib.row_of[x] for x in req_ids), dtype=np.int64, count=len(req_ids))
        where = {x: i for i, x in enumerate(prev.req_ids)}
        prev_index = np.array([where[x] for x in req_ids], dtype=np.int64)
        # the policy's device half: k_i from the newest confidences (prev's proposal, never on the host yet)
        conf = prev.device_drafts[1][to_device(prev_index, r.device)]
        k = verified_counts(sched_out.overlap_verify, conf, to_device(q_lens - 1, r.device))
        inputs = step_inputs(ib, rows, q_lens, prev.resolution, prev.device_drafts[0], prev_index, k)
        n, L = len(rows), int(q_lens.max())
        end = int((ib.num_computed[rows] + q_lens).max())   # scheduled positions: the worst case, an upper bound
        key = r.graphs.serves(n, end - 1, L) if r.graphs is not None else None
        if key is not None:
            bufs, logits, hidden = r.graphs.step_on_device(inputs, key)
        else:
            bufs = self._static_step(n, L, end)
            bufs.fill_on_device(**inputs)
            with torch.inference_mode(), batch_invariant_mode(r.batch_invariant):
                out = r.model(bufs.forward_batch(), r.caches, meta=bufs.metadata(self.max_pos()))
            logits, hidden = out.logits, out.main_hidden
        width = bufs.tokens_per_seq
        idx = to_device(np.repeat(np.arange(n) * width, q_lens) + _ragged_arange(q_lens), r.device)
        return OverlappedForward(req_ids, rows, q_lens, k, prev_index, inputs["start"], logits[idx],
                                 bufs.v["input_ids"][idx], bufs.v["positions"][idx],
                                 None if hidden is None else hidden[idx])

    def _static_step(self, n: int, length: int, end: int):
        """The static form of an n x length verify step whose positions stay below `end`, run eagerly
        (no captured graph serves it). Its compressed-entry width follows `end` (a power of two, so
        few shapes), not max_model_len: the indexer's work grows with it, and padded entries are
        masked (the numbers do not depend on the width)."""
        r = self.runner
        max_len = min(max(256, 1 << (end - 1).bit_length()), r.max_model_len)
        key = (n, length, max_len)
        if key not in self._static_steps:
            from deepinfer.model.step_metadata import DecodeStepBuffers
            args, ib = r.model.args, r.input_batch
            self._static_steps[key] = DecodeStepBuffers(
                n, window=args.window_size, ring_len=r.caches.ring_len, max_model_len=max_len,
                block_tokens=r.block_tokens, max_blocks=min(ib.block_table.shape[1], -(-max_len // r.block_tokens)),
                ngram_width=ib.ngram_width, ratios=[x for x in args.compress_ratios[:args.n_layers] if x > 0],
                scratch_slot=r.caches.scratch_slot, scratch_block=r.caches.scratch_block,
                device=r.device, tokens_per_seq=length)
        return self._static_steps[key]
