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
from deepinfer.host_copy import to_device
from deepinfer.parallel import lockstep as lockstep_mod
from deepinfer.spec.overlap import step_inputs
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
        -> (ids [B, K], confidence logits [B, K], q [B, K, V] | None) on the device; q: the draft
        probabilities of the requests that sample their drafts (spec_acceptance="sampled", T > 0;
        zeros for the others), drawn eagerly with the DRAFT stream at the device positions."""
        from deepinfer.model.dspark import dspark_propose
        r = self.runner
        ib, dev, proposer = r.input_batch, r.device, r.proposer
        slots = self.absorb(main_hidden, positions, q_lens, rows)
        n, dg = len(rows), proposer.graphs
        sampler = self._draft_sampler(rows, res.next_pos - 1)
        graph = sampler is None and dg is not None and dg.serves(n)
        bufs = dg.graphs.static_in[dg.graphs.padded(n)][0] if graph else self._draft_buffers(n)
        bufs.fill_on_device(res.anchor, res.next_pos - 1, to_device(slots, dev))
        if graph:
            ids, conf = dg.graphs.run(bufs.num_seqs)
            dg.num_steps += 1
        else:
            with torch.inference_mode():
                out = dspark_propose(r.model, bufs.v["anchor_ids"], None, None, r.caches, sample=sampler,
                                     static=bufs)
            ids, conf = out.draft_ids, out.confidence
        K = proposer.num_speculative_tokens
        if self._replay_conf is not None:   # benchmark mode: the replayed confidences, as the host's
            conf = self._replay_conf[to_device(rows, dev), res.next_pos - 1]
        q = None
        if sampler is not None:
            stacked = torch.stack(sampler.q[:K], dim=1)                          # [len(idx), K, V]
            q = torch.zeros((n, K, stacked.shape[-1]), dtype=torch.float32, device=dev)
            q[to_device(np.asarray(sampler.idx), dev)] = stacked
        return ids[:n, :K].clone(), conf[:n, :K].float().clone(), q

    def absorb(self, main_hidden, positions, q_lens, rows) -> np.ndarray:
        """Every row of the step into the DSpark rings, on the device (a paused step stops here:
        spec/pause.py). -> the requests' ring slots."""
        slots = self.runner.input_batch.ring_slot[rows]
        cu = np.concatenate([[0], np.cumsum(q_lens)])
        self.runner.proposer.absorb(main_hidden, positions, slots.tolist(), cu.tolist(), max_pos=self.max_pos())
        return slots

    def _draft_sampler(self, rows: np.ndarray, positions: torch.Tensor):
        """The DSpark sample callback of the requests that sample their drafts ("sampled" rule, T > 0;
        as ModelRunner._draft_sampling), positions p on the device; None: every draft greedy."""
        from deepinfer.spec.dspark_proposer import _DraftSampler
        r = self.runner
        if r.proposer.acceptance != "sampled":
            return None
        ib = r.input_batch
        sampling = []
        for row in rows.tolist():
            p, state = ib.params[row], ib.sampling_state[row]
            sampling.append((p, state.seed) if p is not None and not p.greedy and state is not None else None)
        if all(x is None for x in sampling):
            return None
        return _DraftSampler(sampling, positions)

    # sampling an overlapped step ---------------------------------------------------------------
    def sample(self, f: "OverlappedForward", prev) -> torch.Tensor:
        """[sum q] tokens of the overlapped step's logits rows, on the device: argmax, or the seeded
        sample at the row's position (f.positions + 1, device), or ("sampled" rule) the accept /
        residual draw of the draft the row verifies with prev's device q (sample/device_sampling.py).
        can_draft_on_device admitted only requests that need nothing else."""
        from deepinfer.sample.device_sampling import DeviceRows, penalized, sample_on_device
        r = self.runner
        ib, dev = r.input_batch, r.device
        params = [ib.params[row] for row in f.rows.tolist()]
        logits = self._penalized(f, prev, params) if any(penalized(p) for p in params) else f.logits
        if all(p is None or p.greedy for p in params):
            return logits.argmax(dim=-1)
        seeds = []
        for row, p in zip(f.rows.tolist(), params):
            if ib.sampling_state[row] is None and not p.greedy:
                ib.sampling_state[row] = r._new_state(row)
            seeds.append(0 if p.greedy else ib.sampling_state[row].seed)
        req = np.repeat(np.arange(len(params)), f.q_lens)
        rows = DeviceRows([params[i] for i in req], [seeds[i] for i in req], f.positions + 1)
        q = getattr(prev, "draft_probs_dev", None)
        if q is not None:    # row j < k_i verifies draft d_(j+1) (fed at the next row) sampled from q_(j+1)
            j = to_device(_ragged_arange(f.q_lens), dev)
            req_d = to_device(req, dev)
            has_q = to_device(np.array([not p.greedy for p in params], dtype=np.int64)[req], dev) > 0
            rows.verifies = has_q & (j < f.num_verified[req_d])
            rows.draft_ids = torch.roll(f.fed, -1).to(torch.int64)
            b = to_device(f.prev_index, dev)[req_d]
            rows.draft_probs = q[b, j.clamp(max=q.shape[1] - 1)]
        with torch.inference_mode():
            return sample_on_device(logits, rows)

    def _penalized(self, f: "OverlappedForward", prev, params) -> torch.Tensor:
        """f's logits with the presence / frequency penalties of the requests that ask for them: row j of
        request i counts i's outputs the host knows, prev's new tokens for it (on the device: prev is
        unresolved) and the j drafts fed before row j in this step (sample/device_sampling.py)."""
        from deepinfer.sample.device_sampling import penalize_on_device, penalized
        ib = self.runner.input_batch
        cu = np.concatenate([[0], np.cumsum(f.q_lens)])
        rows, row_params, known, owner, req, j = [], [], [], [], [], []
        for i, (row, p) in enumerate(zip(f.rows.tolist(), params)):
            if not penalized(p):
                continue
            known.append(ib.token_ids[row, ib.num_prompt[row]:ib.num_tokens[row]])
            for k in range(int(f.q_lens[i])):
                rows.append(int(cu[i]) + k)
                row_params.append(p)
                owner.append(len(known) - 1)
                req.append(i)
                j.append(k)
        dev = f.logits.device
        new = prev.resolution.tokens[to_device(f.prev_index[req], dev)]              # [n, L_prev], -1 past the end
        L = int(f.q_lens.max())
        take = np.minimum(cu[req][:, None] + 1 + np.arange(L)[None, :], cu[-1] - 1)  # the drafts fed after row 0
        lookahead = f.fed[to_device(take, dev)]
        return penalize_on_device(f.logits, rows, row_params, known, owner, new, lookahead, j)

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
        inputs["layout_tokens"] = q_lens      # rows laid out by K'_i (host), real ones by k_i (device)
        n, L = len(rows), int(q_lens.max())
        end = int((ib.num_computed[rows] + q_lens).max())   # scheduled positions: the worst case, an upper bound
        key = r.graphs.serves(n, end - 1, L, rows=int(q_lens.sum())) if r.graphs is not None else None
        if r.lockstep is not None:     # rank workers: the key every rank takes, or eager everywhere
            key = (r._lockstep_key(n, L, int(q_lens.sum())) if key is not None
                   else r._lockstep_key(lockstep_mod.NOT_A_GRAPH_STEP))
        if key is not None:
            bufs, logits, hidden = r.graphs.step_on_device(inputs, key)
        else:
            bufs = self._static_step(n, L, end)
            bufs.fill_on_device(**inputs)
            with torch.inference_mode(), batch_invariant_mode(r.batch_invariant):
                out = r.model(bufs.forward_batch(), r.caches, meta=bufs.metadata(self.max_pos()))
            logits, hidden = out.logits, out.main_hidden
        cu = bufs.row_offsets(q_lens)
        idx = to_device(np.repeat(cu[:n], q_lens) + _ragged_arange(q_lens), r.device)
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
