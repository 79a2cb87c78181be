"""The model runner: SchedulerOutput -> device tensors -> model -> sampled tokens.

It holds the model, its caches and the persistent InputBatch; it decides nothing (which requests,
how many tokens, which blocks: all of that is in the SchedulerOutput). Per step:

    1. drop finished / preempted requests, add new ones, apply block-table diffs
    2. write draft tokens to verify after each request's last known token
    3. build the ForwardBatch (vectorized gathers, input_batch.py), run the model
    4. sample the logits rows (last token, or 1 + drafts for verification), accept drafts,
       apply teacher forcing, append the results to the InputBatch

Draft verification: logits rows r_0..r_k of a request with drafts d_1..d_k give one token g_j
each (its seeded sample, or under the "sampled" rule the accepted draft / residual token,
sample/rejection.py); d_j is accepted while d_j == g_(j-1), and the sampled list is g_0..g_a
(a accepted drafts + 1 new token); with a proposer this is computed on the device at launch
(spec/device_resolution.py, one host copy read at resolve; _accept is its host reference and the
path without speculation). The scheduler then lowers
num_computed_tokens by the k - a rejected positions and frees the blocks past them; the caches
need nothing else (addressed by absolute position).

DSpark (a DSparkProposer, when EngineArgs.speculative == "dspark"): after the acceptance, the
main_hidden rows of the accepted positions go into the DSpark rings and every request that sampled
gets num_speculative_tokens drafts with their confidence logits (ModelRunnerOutput); the scheduler
picks how many to verify (spec/dspark_proposer.py has the position ruler).

Async scheduling splits execute() into launch() (steps 1-3, the samples stay on the device and
are copied back asynchronously) and resolve() (step 4). Between them the engine schedules and
launches the next step, whose tokens that are not yet known on the host are gathered from the
previous step's device-side samples (InputBatch.pending_index). execute() = resolve(launch()).
With speculation a step whose requests qualify also drafts at launch, on the device, and the next
verify step may be launched before it resolves (launch_overlapped: its inputs and metadata filled
on the device from the resolution, spec/overlap.py).

Prefix caching asks two things of the runner, both values in the SchedulerOutput: window snapshots
(cache/snapshot_store.py) are saved out of ended requests' ring slots before anything else of a
step runs, and restored into a new request's ring slot before its first forward; and a request
admitted by bounded replay carries its ReplayParams into the InputBatch, which hands the model the
window floor and the write floor (model/step_metadata.py applies them).

CUDA graphs (graph_sizes, worker/graph_step.py): a decode or verify step (every request runs its
next token and its drafts, if any) that a captured (batch size, tokens per request) holds replays
the captured forward instead of step 3; prefill chunks and mixed steps run eagerly. The DSpark
drafting pass with greedy drafts replays its own graphs (graph_step.DraftGraphs, in the proposer).
On a rank worker (`lockstep`, parallel/lockstep.py) the ranks agree first: every rank replays the key
holding every rank's decode or verify step (idle_step: all padding where it has none), or all run eagerly.
"""

from __future__ import annotations

import numpy as np
import torch

from dataclasses import dataclass

from deepinfer.kernels.batch_invariant import batch_invariant_mode
from deepinfer.parallel import lockstep as lockstep_mod
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.spec.device_resolution import resolve_on_device
from deepinfer.host_copy import to_device
from deepinfer.sample.device_sampling import DeviceLogprobs, logprobs_on_device
from deepinfer.spec.overlap import can_draft_on_device
from deepinfer.worker.input_batch import InputBatch, _ragged_arange


def sample_greedy(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] fp32 -> [N] int64: the fast path when every row is plain greedy (stays on the device)."""
    return logits.argmax(dim=-1)


@dataclass
class _InFlight:
    """A launched step: what resolve() needs to finish it."""
    req_ids: list[str]
    rows: np.ndarray            # [B] InputBatch rows
    num_logits: np.ndarray      # [B] logits rows per request (0 = no sample)
    num_spec: np.ndarray        # [B] drafts verified per request
    sampled: torch.Tensor       # [N] int64, on the host (pinned) once `done` has fired
    done: object | None         # CUDA event after the device-to-host copy; None on CPU
    fed: torch.Tensor | None    # [N] token fed at each logits row (draft verification only)
    logits: torch.Tensor | None # [N, V] fp32, only when some request returns logits
    logprobs: "list | DeviceLogprobs | None" = None  # [N] TokenLogprob | None per logits row (Sampler), or
                                                     # their host copies (an overlapped step's, on the device)
    seq: int = 0                # launch sequence number
    spec: "_SpecInputs | None" = None   # what the DSpark proposer needs (speculative decoding only)
    # speculation: accepted counts / new tokens / next positions on the device (spec/device_resolution.py),
    # and their host copy [B, 1 + L] (count, tokens), started at launch, read at resolve
    resolution: object | None = None
    resolution_host: torch.Tensor | None = None
    # drafted on the device at launch (spec/overlap.py): (ids [B, K], confidence logits [B, K]) there,
    # and their host copies read at resolve; the next step may verify them before this one resolves
    device_drafts: tuple | None = None
    drafts_host: tuple | None = None
    replay_dev: torch.Tensor | None = None   # [B] replayed lengths of those drafts (benchmark mode), device
    verified_host: torch.Tensor | None = None  # [B] an overlapped step: drafts the device's policy verified
    draft_probs_dev: torch.Tensor | None = None  # [B, K, V] q of device-made sampled drafts ("sampled")
    draft_after: bool = True                 # False: speculation paused (absorb only, spec/pause.py)


@dataclass
class _SpecInputs:
    main_hidden: torch.Tensor   # [T, k*dim] the step's DSpark input rows
    q_lens: np.ndarray          # [B] tokens run per request
    start: np.ndarray           # [B] position of each request's first row
    ring_slots: np.ndarray      # [B]


class ModelRunner:
    def __init__(self, model, caches, device: torch.device, max_num_seqs: int, max_model_len: int,
                 block_tokens: int, ngram_width: int = 3, sampler=None, batch_invariant: bool = False,
                 proposer=None, graph_sizes: tuple[int, ...] = (), graph_max_len: int = 8192,
                 num_snapshot_slots: int = 0, num_host_slots: int = 0, yoco_keep_tokens: int = 0,
                 disk_cache_dir: str | None = None, packed_verify: bool = True, lockstep=None) -> None:
        self.model = model
        self.proposer = proposer      # deepinfer.spec.DSparkProposer; None = no drafts
        self.batch_invariant = batch_invariant   # torch path: row-by-row GEMMs (kernels/batch_invariant.py)
        self.sampler = sampler        # deepinfer.sample.Sampler; None = greedy only
        self.caches = caches
        self.device = torch.device(device)
        max_blocks = -(-(max_model_len + 16) // block_tokens)
        self.input_batch = InputBatch(max_num_seqs, max_model_len, max_blocks, ngram_width, window=caches.ring_len // 2,
                                      yoco_keep_tokens=yoco_keep_tokens)
        self.snapshots = None         # SnapshotStore: window state of ended requests (prefix caching)
        if num_snapshot_slots:
            from deepinfer.cache.snapshot_store import SnapshotStore
            self.snapshots = SnapshotStore(caches, num_snapshot_slots)
        self.host_blocks = None       # HostBlockStore: the prefix cache's host-memory tier
        if num_host_slots:
            from deepinfer.cache.host_tier import HostBlockStore
            self.host_blocks = HostBlockStore(caches, num_host_slots)
        self.disk_blocks = None       # DiskBlockStore: the disk tier under the host tier
        if num_host_slots and disk_cache_dir:
            from deepinfer.cache.disk_tier import DiskBlockStore
            self.disk_blocks = DiskBlockStore(caches, self.host_blocks, disk_cache_dir)
        self._prev_sampled: torch.Tensor | None = None   # [N] device samples of the last launched step
        # verify steps that overlap (worker/overlapped_step.py): build_rank enables them (async
        # scheduling + EngineArgs.spec_async_overlap); None = every step that samples resolves first
        self.overlapped = None
        self.max_model_len, self.block_tokens = max_model_len, block_tokens
        self._launch_seq = 0
        self.images = None            # ImageEmbeds: span embeddings of the requests' images (vision checkpoints)
        if getattr(model, "vision_tower", None) is not None:
            from deepinfer.worker.image_embeds import ImageEmbeds
            self.images = ImageEmbeds(model.vision_tower, batch_invariant)
        self._draft_probs: dict[str, torch.Tensor] = {}   # req_id -> q [k, V] of its sampled drafts ("sampled" rule)
        self._replay_len: dict[str, int] = {}             # req_id -> replayed accepted length (benchmark mode)
        self.graphs = None            # DecodeGraphs: captured pure-decode steps (needs scratch caches)
        # a rank worker's: every rank takes the same captured size in a step, or none does (parallel/lockstep.py)
        self.lockstep = lockstep
        if graph_sizes:
            from deepinfer.worker.graph_step import DecodeGraphs
            self.graphs = DecodeGraphs(model, caches, self.input_batch, graph_sizes, max_model_len,
                                       block_tokens, self.device, max_len=graph_max_len,
                                       lengths=(1,) if proposer is None else
                                       tuple(range(1, proposer.num_speculative_tokens + 2)),
                                       packed=packed_verify,
                                       before_forward=None if lockstep is None else lockstep.before_forward,
                                       gathered_ranks=1 if lockstep is None else lockstep.parallel.world_size)
            if lockstep is not None:
                lockstep.max_rows = max((b * q for b, q in self.graphs.keys.pairs), default=0)
            if proposer is not None and self.graphs.graphs is not None:
                from deepinfer.worker.graph_step import DraftGraphs
                proposer.graphs = DraftGraphs(model, caches, graph_sizes, self.graphs.max_pos, self.device)
                self.graphs.adopt_new_rope_tables()

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        return self.resolve(self.launch(sched_out))

    def launch(self, sched_out: SchedulerOutput, precomputed: dict[str, int] | None = None) -> _InFlight | None:
        """precomputed: req_id -> leading scheduled tokens already in the caches (a balanced-CP prefill,
        deepinfer/parallel/cp.py, ran them on every rank just before): only the rest runs here."""
        self._cache_copies(sched_out)
        self._update_states(sched_out)
        if sched_out.is_empty:
            return None
        ib = self.input_batch
        req_ids = list(sched_out.num_scheduled_tokens)
        q_lens = np.fromiter(sched_out.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        for i, req_id in enumerate(req_ids):
            n = (precomputed or {}).get(req_id, 0)
            if n:
                ib.num_computed[ib.row_of[req_id]] += n
                q_lens[i] -= n
        num_spec = np.zeros(len(req_ids), dtype=np.int64)
        for i, req_id in enumerate(req_ids):
            drafts = sched_out.spec_tokens.get(req_id)
            if drafts:
                ib.write_drafts(req_id, drafts)
                num_spec[i] = len(drafts)
        batch, rows, num_logits, logits, main_hidden = self._forward(req_ids, q_lens, num_spec)  # logits [N, V] fp32
        with torch.inference_mode():
            sampled, logprobs = self._sample(logits, batch, rows, num_logits, num_spec, req_ids)  # [N] on the device
            self._apply_forcing(sampled, rows, num_logits)
        self._set_pending(rows, num_logits, num_spec)
        self._prev_sampled = sampled
        fed = batch.input_ids[batch.logits_indices] if num_spec.any() else None
        keep_logits = logits if ib.return_logits else None
        # start positions on the host serve speculation only; a plain decode graph's are on the device
        start = batch.start_pos.numpy() if self.proposer is not None else None
        return self._finish_launch(req_ids, rows, num_logits, num_spec, q_lens, start,
                                   batch.positions, sampled, fed, keep_logits, logprobs, main_hidden,
                                   self._replayed_for(req_ids, num_spec), draft_after=sched_out.draft_after)

    def _finish_launch(self, req_ids, rows, num_logits, num_spec, q_lens, start, positions, sampled, fed,
                       keep_logits, logprobs, main_hidden, replayed, verified=None, draft_after=True) -> _InFlight:
        """The launch's last part: the device-side resolution (speculation), drafting on the device when
        the next step may overlap this one, and the host copies resolve() reads. start: [B] host array,
        or (an overlapped step) a device tensor; replayed: benchmark mode's lengths (host or device).
        verified [B] (an overlapped step, device): the drafts each request verified, <= num_spec (the
        layout's; q_lens and num_logits stay the layout, rows past 1 + verified are padding).
        draft_after False (speculation paused, spec/pause.py): nothing is drafted; the rows go into the
        DSpark rings at resolve (the accepted ones), or at launch where the step could draft on the device
        (all of them, as draft() does)."""
        res = res_host = drafts = drafts_host = replay_dev = verified_host = draft_probs = None
        absorbed = False
        if self.proposer is not None:   # resolved on the device: the host reads one copy, at resolve()
            if verified is None:
                res = resolve_on_device(sampled, fed, num_logits, num_spec, start, q_lens, replayed)
            else:
                res = resolve_on_device(sampled, fed, num_logits, verified, start, 1 + verified, replayed)
                verified_host, _ = self._to_host(verified)
            res_host, _ = self._to_host(torch.cat([res.num_tokens[:, None], res.tokens], dim=1))
            if self.overlapped is not None and main_hidden is not None and can_draft_on_device(
                    self.input_batch, rows, num_logits):
                if draft_after:
                    ids, conf, draft_probs = self.overlapped.draft(main_hidden, positions, q_lens, rows, res)
                    drafts = (ids, conf)
                    drafts_host = (self._to_host(drafts[0])[0], self._to_host(drafts[1])[0])
                    replay_dev = self.overlapped.replayed(rows, res)   # benchmark mode: the proposals' outcomes
                else:                         # paused: the rows into the rings, no proposal
                    self.overlapped.absorb(main_hidden, positions, q_lens, rows)
                    absorbed = True
        host, done = self._to_host(sampled)   # its event also covers the copies above (same stream)
        self._launch_seq += 1
        spec = None
        if self.proposer is not None and main_hidden is not None and drafts is None and not absorbed:
            if isinstance(start, torch.Tensor):
                raise RuntimeError("an overlapped verify step must draft on the device")
            spec = _SpecInputs(main_hidden, q_lens, start, self.input_batch.ring_slot[rows].copy())
        return _InFlight(req_ids, rows, num_logits, num_spec, host, done, fed, keep_logits,
                         logprobs=logprobs, seq=self._launch_seq, spec=spec, resolution=res,
                         resolution_host=res_host, device_drafts=drafts, drafts_host=drafts_host,
                         replay_dev=replay_dev, verified_host=verified_host, draft_probs_dev=draft_probs,
                         draft_after=draft_after)

    def _cache_copies(self, sched_out: SchedulerOutput) -> None:
        """The prefix cache's copies a step starts with (on the stream, so after every step launched
        before it): ended requests' window snapshots, then the tiers' block copies."""
        for save in sched_out.snapshot_saves:      # before this step reuses their slots and blocks
            self.snapshots.save(save.ring_slot, save.tail_block, save.snapshot_slot)
        for copy in sched_out.block_copies:        # in decision order: an offload before its block's reuse
            if copy.kind == "offload":
                self.host_blocks.offload(copy.block, copy.host_slot)
            elif copy.kind == "onload":
                self.host_blocks.onload(copy.host_slot, copy.block)
            elif copy.kind == "spill":
                self.disk_blocks.spill(copy.host_slot, copy.key)
            elif copy.kind == "disk_onload":
                self.disk_blocks.onload(copy.key, copy.block)
            else:
                self.disk_blocks.drop(copy.key)

    # verify steps that overlap (spec/overlap.py, worker/overlapped_step.py) ----------------------
    def enable_overlap(self) -> None:
        from deepinfer.worker.overlapped_step import OverlappedSteps
        self.overlapped = OverlappedSteps(self)

    def overlap_drafts(self, step: _InFlight | None) -> dict[str, int] | None:
        """req_id -> drafts it verifies, of a launched step whose requests drafted on the device (the
        next step may verify those drafts before this one resolves); None: resolve it first."""
        if step is None or step.device_drafts is None:
            return None
        return {r: int(k) for r, k in zip(step.req_ids, step.num_spec.tolist())}

    def launch_overlapped(self, sched_out: SchedulerOutput, prev: _InFlight) -> _InFlight | None:
        """A verify step scheduled with `prev` unresolved (SchedulerOutput.overlapped): each request runs
        prev's anchor and the first K' of the drafts prev proposed on the device, from prev's next_pos,
        with the step's metadata filled on the device (no host read of prev)."""
        self._cache_copies(sched_out)
        self._update_states(sched_out)
        if sched_out.is_empty:
            return None
        f = self.overlapped.forward(sched_out, prev)
        params = [self.input_batch.params[r] for r in f.rows.tolist()]
        logprobs = None
        with torch.inference_mode():
            sampled = self.overlapped.sample(f, prev)
            if any(p is not None and p.logprobs is not None for p in params):   # else no per-row work
                row_params = [p for p, n in zip(params, f.q_lens.tolist()) for _ in range(n)]
                logprobs = logprobs_on_device(f.logits, sampled, row_params, lambda t: self._to_host(t)[0])
        self.input_batch.pending_index[:] = -1
        self._prev_sampled = sampled
        replayed = None if prev.replay_dev is None else torch.where(
            to_device(f.q_lens, self.device) > 1, prev.replay_dev[to_device(f.prev_index, self.device)], -1)
        return self._finish_launch(f.req_ids, f.rows, f.q_lens.copy(), f.q_lens - 1, f.q_lens, f.start,
                                   f.positions, sampled, f.fed, None, logprobs, f.main_hidden, replayed,
                                   verified=f.num_verified, draft_after=sched_out.draft_after)

    def must_resolve_before_next(self, step: _InFlight | None) -> bool:
        """Speculation: a launched step in which a request samples verifies or proposes drafts, and
        the next step's positions and drafts follow from its accepted counts (host metadata)."""
        return step is not None and self.proposer is not None and bool((step.num_logits > 0).any())

    def resolve(self, step: _InFlight | None) -> ModelRunnerOutput:
        if step is None:
            return ModelRunnerOutput([], [])
        if step.done is not None:
            step.done.synchronize()
        if step.resolution_host is not None:
            h = step.resolution_host.numpy()
            per_req = [h[b, 1:1 + int(c)].tolist() for b, c in enumerate(h[:, 0].tolist())]
        else:
            per_req = self._accept(step.sampled.numpy(), step.num_logits, step.num_spec,
                                   None if step.fed is None else step.fed.cpu().numpy(), self._replayed(step))
        out_logits = self._gather_logits(step, per_req)
        logprobs = self._per_request_logprobs(step, per_req)
        self._advance_after_verification(step, per_req)
        self._append(step, per_req)
        drafts, confidences = None, None
        if step.spec is not None:
            drafts, confidences = self._speculate(step, per_req)
        elif step.drafts_host is not None:
            drafts, confidences = self._drafts_from_device(step, per_req)
        if step.seq == self._launch_seq:  # nothing launched after it: every token is known here now
            self.input_batch.pending_index[:] = -1
            self._prev_sampled = None
        num_verified = None if step.verified_host is None else step.verified_host.tolist()
        return ModelRunnerOutput(step.req_ids, per_req, logprobs=logprobs, logits=out_logits,
                                 draft_token_ids=drafts, draft_confidences=confidences, num_verified=num_verified)

    def _speculate(self, step: _InFlight, per_req: list[list[int]]):
        """Absorb the accepted rows into the DSpark rings, then draft for the requests that sampled
        (and can still generate). -> (draft ids, confidence logits) per request, [] for the others."""
        sp, ib = step.spec, self.input_batch
        num_acc = np.array([max(len(t) - 1, 0) for t in per_req], dtype=np.int64)
        keep = np.where(step.num_logits > 0, sp.q_lens - step.num_spec + num_acc, sp.q_lens)   # [B]
        cu = np.zeros(len(keep) + 1, dtype=np.int64)
        np.cumsum(sp.q_lens, out=cu[1:])
        idx = np.repeat(cu[:-1], keep) + _ragged_arange(keep)            # accepted rows of the step
        pos = np.repeat(sp.start, keep) + _ragged_arange(keep)
        dev = sp.main_hidden.device
        cu_keep = np.concatenate([[0], np.cumsum(keep)]).tolist()
        self.proposer.absorb(sp.main_hidden[to_device(idx, dev)], to_device(pos, dev),
                             sp.ring_slots.tolist(), cu_keep)
        if not step.draft_after:          # speculation paused: the rings are whole, nothing proposed
            return [[] for _ in per_req], [[] for _ in per_req]
        which = [i for i, (req_id, row, toks) in enumerate(zip(step.req_ids, step.rows.tolist(), per_req))
                 if toks and ib.row_of.get(req_id) == row and self._can_generate(row)]
        props = self.proposer.propose([per_req[i][-1] for i in which],
                                      [int(sp.start[i] + keep[i] - 1) for i in which],
                                      [int(sp.ring_slots[i]) for i in which],
                                      sampling=self._draft_sampling(step, which))
        replay = self.proposer.replay
        if replay is not None:   # benchmark mode: calibrated confidences with their outcomes
            props.confidences, lengths = replay.draw([(step.req_ids[i], int(sp.start[i] + keep[i] - 1)) for i in which])
        drafts, confs = [[] for _ in per_req], [[] for _ in per_req]
        for j, i in enumerate(which):
            req_id = step.req_ids[i]
            drafts[i], confs[i] = props.draft_ids[j], props.confidences[j]
            q = props.draft_probs[j] if props.draft_probs is not None else None
            if q is not None:
                self._draft_probs[req_id] = q
            else:
                self._draft_probs.pop(req_id, None)
            if replay is not None:
                self._replay_len[req_id] = lengths[j]
        return drafts, confs

    def _drafts_from_device(self, step: _InFlight, per_req: list[list[int]]):
        """The proposal made at launch (host copy), for the requests that sampled and can still generate."""
        ib = self.input_batch
        ids, conf = step.drafts_host[0].tolist(), step.drafts_host[1].tolist()
        drafts, confs = [[] for _ in per_req], [[] for _ in per_req]
        which = [i for i, (req_id, row, toks) in enumerate(zip(step.req_ids, step.rows.tolist(), per_req))
                 if toks and ib.row_of.get(req_id) == row and self._can_generate(row)]
        replay = self.proposer.replay
        if replay is not None:   # the same draws as the device table's (p = the anchor's position - 1)
            keys = [(step.req_ids[i], int(ib.num_tokens[step.rows[i]]) - 2) for i in which]
            conf_r, lengths = replay.draw(keys)
        q = step.draft_probs_dev
        for j, i in enumerate(which):
            req_id = step.req_ids[i]
            drafts[i], confs[i] = ids[i], conf[i] if replay is None else conf_r[j]
            p = self.input_batch.params[int(step.rows[i])]
            if q is not None and not p.greedy:   # sampled drafts: a host-built step verifies them with q
                self._draft_probs[req_id] = q[i]
            else:
                self._draft_probs.pop(req_id, None)
            if replay is not None:
                self._replay_len[req_id] = lengths[j]
        return drafts, confs

    def _draft_sampling(self, step: _InFlight, which: list[int]):
        """(params, seed) of the proposing requests that sample their drafts ("sampled" rule, T > 0)."""
        if self.proposer.acceptance != "sampled":
            return None
        ib, res = self.input_batch, []
        for i in which:
            row = int(step.rows[i])
            p, state = ib.params[row], ib.sampling_state[row]
            res.append((p, state.seed) if p is not None and not p.greedy and state is not None else None)
        return res

    def _replayed(self, step: _InFlight) -> np.ndarray | None:
        return self._replayed_for(step.req_ids, step.num_spec)

    def _replayed_for(self, req_ids: list[str], num_spec: np.ndarray) -> np.ndarray | None:
        """[B] replayed accepted lengths of the verifying requests (-1 = the real comparison)."""
        if self.proposer is None or self.proposer.replay is None or not num_spec.any():
            return None
        return np.array([self._replay_len.get(r, -1) if k else -1 for r, k in zip(req_ids, num_spec.tolist())],
                        dtype=np.int64)

    def _can_generate(self, row: int) -> bool:
        ib = self.input_batch
        return ib.num_tokens[row] - ib.num_prompt[row] < ib.params[row].max_tokens

    # helpers -----------------------------------------------------------------------------------
    def _forward(self, req_ids: list[str], q_lens: np.ndarray, num_spec: np.ndarray):
        """-> (batch, rows, num_logits, logits [N, V], main_hidden | None): a CUDA-graph replay when the
        step is a pure decode step a captured size holds, else the eager forward."""
        ib = self.input_batch
        rows = ib.decode_rows(req_ids, q_lens, num_spec) if self.graphs is not None else None
        key = None
        if rows is not None:
            length = int(q_lens.max())
            key = self.graphs.serves(len(rows), int((ib.num_computed[rows] + q_lens).max()) - 1, length,
                                     rows=int(q_lens.sum()))
        if self.lockstep is not None:     # the key every rank takes, or eager everywhere
            key = (self._lockstep_key(len(rows), int(q_lens.max()), int(q_lens.sum())) if key is not None
                   else self._lockstep_key(lockstep_mod.NOT_A_GRAPH_STEP))
        if key is not None:     # batch_invariant: the padded step run eagerly (a CPU's test mode) row by row
            with batch_invariant_mode(self.batch_invariant):
                if key[1] > 1 or self.proposer is not None:
                    return self._verify_graph_step(rows, q_lens, key)
                batch, logits, _, _ = self.graphs.step(ib.decode_inputs(rows), self._prev_sampled, key)
            if ib.return_logits:      # kept until resolve(): the next replay overwrites the static output
                logits = logits.clone()
            return batch, rows, np.ones(len(rows), dtype=np.int64), logits, None
        batch, rows, num_logits = ib.build(req_ids, q_lens, num_spec, self.device, self._prev_sampled)
        if self.images is not None and self.images.has_any():
            batch.image_rows, batch.image_embeds = self.images.gather(req_ids, batch.start_pos.numpy(), q_lens)
        with torch.inference_mode(), batch_invariant_mode(self.batch_invariant):
            out = self.model(batch, self.caches)
        return batch, rows, num_logits, out.logits, out.main_hidden

    def _lockstep_key(self, n: int, length: int = 1, rows: int | None = None) -> tuple[int, int] | None:
        """The key every rank takes this step (the captured key holding the most requests, tokens per
        request and rows of any rank), or None: every rank runs eagerly."""
        most = self.lockstep.agree(n, length, rows)
        return None if most is None else self.graphs.keys.key(*most)

    def idle_step(self) -> None:
        """A rank worker with no request this step while others have some: the step's collectives with no
        tokens of its own: the captured size the other ranks replay (all padding rows), or the eager
        idle forward."""
        key = None
        if self.lockstep is not None:
            key = self._lockstep_key(lockstep_mod.IDLE if self.graphs.graphs is not None
                                     else lockstep_mod.NOT_A_GRAPH_STEP)
        if key is None:
            self.model.idle_forward()
            return
        with batch_invariant_mode(self.batch_invariant):
            self.graphs.padding_step(key)

    def _verify_graph_step(self, rows: np.ndarray, q_lens: np.ndarray, key: tuple[int, int]):
        """A verify step (some request has drafts) through the captured (batch, L) graph: the real
        rows gathered out of the padded outputs into the eager step's layout (logits row per token,
        main_hidden row per token, a host start_pos), copies the next replay cannot overwrite."""
        from deepinfer.model.batch import ForwardBatch
        ib = self.input_batch
        fb, logits, hidden, cu_rows = self.graphs.step(ib.decode_inputs(rows, q_lens, int(q_lens.max())),
                                                       self._prev_sampled, key)
        # non-blocking: a plain copy here held the host for the whole replay (H200, 2026-12-02)
        idx = to_device(np.repeat(cu_rows[:-1], q_lens) + _ragged_arange(q_lens), self.device)
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        batch = ForwardBatch(input_ids=fb.input_ids[idx], positions=fb.positions[idx],
                             cu_seqlens=torch.from_numpy(cu), start_pos=torch.from_numpy(ib.num_computed[rows].copy()),
                             ngram_history=fb.ngram_history, ring_slots=fb.ring_slots, block_tables=fb.block_tables,
                             logits_indices=torch.arange(int(cu[-1]), device=self.device))
        return batch, rows, q_lens.copy(), logits[idx], None if hidden is None else hidden[idx]

    def _update_states(self, sched_out: SchedulerOutput) -> None:
        for req_id in sched_out.finished_req_ids | sched_out.preempted_req_ids:
            self.input_batch.remove(req_id)
            if self.images is not None:
                self.images.remove(req_id)
            self._draft_probs.pop(req_id, None)
            self._replay_len.pop(req_id, None)
        for new in sched_out.new_reqs:
            self.input_batch.add(new)
            if self.overlapped is not None and self.proposer.replay is not None:
                self.overlapped.fill_replay_table(new)
            if new.image_prompt is not None:
                if self.images is None:
                    raise ValueError(f"request {new.req_id} has images but the checkpoint has no vision tower")
                self.images.add(new.req_id, new.image_prompt, new.num_computed_tokens)
            if new.restore is not None:
                self.snapshots.restore(new.restore.snapshot_slot, new.restore.ring_slot, new.restore.tail_block)
        for diff in sched_out.cached_reqs:
            self.input_batch.update(diff)
        if self.images is not None:
            self.images.encode_pending()      # one tower pass for every request admitted now

    def _sample(self, logits, batch, rows, num_logits, num_spec, req_ids):
        """Argmax on the device when every sampling row is plain greedy; else the Sampler
        (temperature, top-k/p, min-p, penalties, grammar, logprobs), which syncs."""
        ib = self.input_batch
        sampling_rows = rows[num_logits > 0]
        if self.sampler is None or not ib.needs_sampler[sampling_rows].any():
            return sample_greedy(logits), None
        from deepinfer.sample import SamplingRow
        positions = (batch.positions[batch.logits_indices] + 1).tolist()   # position of each sampled token
        sample_rows, k = [], 0
        for req_id, row, n in zip(req_ids, rows.tolist(), num_logits.tolist()):
            state = ib.sampling_state[row]
            if state is None and n:
                state = ib.sampling_state[row] = self._new_state(row)
            p = ib.params[row]   # output ids only feed the penalties: skip the copy otherwise
            outs = (ib.token_ids[row, ib.num_prompt[row]:ib.num_tokens[row]].tolist()
                    if n and p is not None and (p.presence_penalty or p.frequency_penalty) else [])
            drafts = ib.token_ids[row, ib.num_tokens[row]:ib.num_tokens[row] + n - 1].tolist() if n > 1 else []
            q = self._draft_probs.get(req_id) if drafts else None   # sampled drafts: speculative sampling
            for j in range(n):   # row j of a verified request: its mask follows drafts d_1..d_j
                spec = dict(draft_id=drafts[j], draft_probs=q[j]) if q is not None and j < len(drafts) else {}
                sample_rows.append(SamplingRow(state, outs, positions[k], lookahead=drafts[:j], **spec))
                k += 1
        out = self.sampler.sample(logits, sample_rows, advance=not num_spec.any())
        return out.token_ids.to(logits.device), out.logprobs

    def _advance_after_verification(self, step: _InFlight, per_req: list[list[int]]) -> None:
        """With drafts the Sampler does not advance grammars (advance=False): the accepted tokens do."""
        if not step.num_spec.any():
            return
        ib = self.input_batch
        for req_id, row, toks in zip(step.req_ids, step.rows.tolist(), per_req):
            state = ib.sampling_state[row] if ib.row_of.get(req_id) == row else None
            if state is not None and toks:
                state.accept(toks)

    def _new_state(self, row: int):
        """Sampler state of a row; a resumed request's grammar re-accepts its outputs so far."""
        ib = self.input_batch
        state = self.sampler.new_state(ib.params[row])
        if state.grammar is not None:
            for t in ib.token_ids[row, ib.num_prompt[row]:ib.num_tokens[row]].tolist():
                state.grammar.accept(t)
        return state

    @staticmethod
    def _per_request_logprobs(step: _InFlight, per_req: list[list[int]]):
        if step.logprobs is None:
            return None
        rows = step.logprobs.rows() if isinstance(step.logprobs, DeviceLogprobs) else step.logprobs
        res, off = [], 0
        for n, toks in zip(step.num_logits.tolist(), per_req):
            lps = rows[off:off + len(toks)]
            res.append(lps if n and any(lp is not None for lp in lps) else None)
            off += n
        return res

    def _set_pending(self, rows, num_logits, num_spec) -> None:
        """Rows whose new token is only on the device until resolve() (one per sampling request)."""
        pi = self.input_batch.pending_index
        pi[:] = -1
        if num_spec.any():
            return  # verification steps are resolved before the next launch (no async with drafts)
        sampling = num_logits > 0
        pi[rows[sampling]] = np.arange(int(sampling.sum()))

    def _to_host(self, sampled: torch.Tensor):
        if self.device.type != "cuda":
            return sampled.cpu(), None
        host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        host.copy_(sampled, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def _apply_forcing(self, sampled: torch.Tensor, rows: np.ndarray, num_logits: np.ndarray) -> None:
        """Teacher forcing, on the device so the next launched step feeds the forced token."""
        ib = self.input_batch
        if not ib.forced:
            return
        idx, vals, off = [], [], 0
        for row, n in zip(rows.tolist(), num_logits.tolist()):
            forced = ib.forced.get(row)
            if forced is not None and n:
                k = int(ib.num_tokens[row] + (ib.pending_index[row] >= 0) - ib.num_prompt[row])
                for j in range(n):
                    if k + j < len(forced):
                        idx.append(off + j)
                        vals.append(forced[k + j])
            off += n
        if idx:
            sampled[to_device(idx, sampled.device)] = to_device(vals, sampled.device).to(sampled.dtype)

    @staticmethod
    def _accept(sampled: np.ndarray, num_logits: np.ndarray, num_spec: np.ndarray,
                fed: np.ndarray | None, replayed: np.ndarray | None = None) -> list[list[int]]:
        """replayed [B]: accepted lengths that replace the comparison (>= 0; benchmark mode)."""
        if fed is None:  # no drafts: one token per request that reached its end
            it = iter(sampled.tolist())
            return [[next(it)] if n else [] for n in num_logits.tolist()]
        out, off = [], 0
        for i, (n, k) in enumerate(zip(num_logits.tolist(), num_spec.tolist())):
            if n == 0:
                out.append([])
                continue
            g, drafts = sampled[off:off + n], fed[off + 1:off + n]
            a = 0
            if replayed is not None and replayed[i] >= 0:
                a = min(int(replayed[i]), k)
                out.append(drafts[:a].tolist() + [int(g[a])])
                off += n
                continue
            while a < k and drafts[a] == g[a]:
                a += 1
            out.append(g[:a + 1].tolist())
            off += n
        return out

    def _append(self, step: _InFlight, per_req: list[list[int]]) -> None:
        """Known tokens into the InputBatch rows (of requests it still holds)."""
        ib = self.input_batch
        rows, toks = [], []
        for req_id, row, t in zip(step.req_ids, step.rows.tolist(), per_req):
            if t and ib.row_of.get(req_id) == row:
                rows.append(row)
                toks.append(t)
        if rows:
            ib.append_tokens(np.array(rows, dtype=np.int64), toks)

    def _gather_logits(self, step: _InFlight, per_req) -> dict | None:
        if step.logits is None:
            return None
        ib, out, off = self.input_batch, {}, 0
        for req_id, row, n, toks in zip(step.req_ids, step.rows.tolist(), step.num_logits.tolist(), per_req):
            if n and row in ib.return_logits:
                out[req_id] = step.logits[off:off + len(toks)].float().cpu().numpy()
            off += n
        return out
