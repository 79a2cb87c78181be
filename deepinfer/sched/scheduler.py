"""The scheduler: fills each step under a token budget and a sequence cap, FCFS, with preemption.

No prefill or decode phase (vLLM v1's scheduling note): every request asks for
num_tokens + len(spec_token_ids) - num_computed_tokens tokens, and the step gives each running
request (in arrival order), then each waiting one, as many as the budget allows. A long prompt
is thereby chunked across steps while the others decode in the same steps.

When the block pool runs dry, the most recently admitted running request is preempted by
recompute: its caches are freed and it goes back to the front of the waiting queue with
num_computed_tokens = 0. A request whose prompt + output fits the whole cache therefore always
finishes: the oldest running request can always take every block.

num_computed_tokens advances when a step is scheduled, and a step that samples leaves a
placeholder until its token arrives (update_from_output). With async scheduling the next step is
scheduled while this one runs: a request with a placeholder then runs its not-yet-known token
(the runner takes it from the device), and a request that turns out finished wastes one token.

    known:  | prompt + outputs (num_tokens) | placeholder | drafts |
    cached: | ... num_computed_tokens ...                  |   (after schedule)

Speculative decoding: the runner returns drafts with confidence logits, which wait in the
DraftBook (spec/draft_book.py); at the next schedule() `spec_policy` (spec/policy.py, spec/budget.py)
picks, over the whole batch, the prefix each request verifies (_plan_drafts). That becomes the
request's spec_token_ids, scheduled after its last token as far as the budget allows, then lowered
by the rejected ones (_advance). With async scheduling a verify step may be scheduled while the
previous one is unresolved (schedule_overlapped, spec/overlap.py): the worst case of
spec/reservation.py, every draft in flight counted as accepted; _advance's lowering is then the trim.

Prefix caching (`prefix`, sched/prefix_admission.py) hooks in at four points: a waiting request's
admission may start past a cached prefix (or wait for a block another request computes), blocks
are registered after each step, and an ending request leaves a window snapshot.

The scheduler never sees tensors; what the runner must do is a value in the SchedulerOutput.
"""

from __future__ import annotations

import time
from collections import deque

from deepinfer.cache.kv_cache_manager import KVCacheManager
from deepinfer.outputs import (CachedRequestData, ModelRunnerOutput, NewRequestData, RequestOutput,
                               SchedulerOutput, SnapshotCopy)
from deepinfer.request import FINISH_REASONS, Request, RequestStatus
from deepinfer.spec.draft_book import DraftBook
from deepinfer.spec.overlap_verify import plan_overlapped
from deepinfer.spec.policy import VerifyAllPolicy
from deepinfer.spec.reservation import reserve, worst_case_drafts
from deepinfer.stats import EngineStats


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 kv_cache: KVCacheManager, stats: EngineStats | None = None, spec_policy=None,
                 prefix=None, max_prefill_only_tokens: int | None = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # a step in which no running request decodes may take this many (EngineArgs.max_prefill_only_tokens);
        # None: max_num_batched_tokens, whatever it is set to
        self.max_prefill_only_tokens = max_prefill_only_tokens
        self.max_model_len = max_model_len
        self.kv_cache = kv_cache
        self.stats = stats or EngineStats()
        self.draft_book = DraftBook(spec_policy or VerifyAllPolicy())   # spec_policy None: verify all drafts
        self.prefix = prefix                     # PrefixCaching (sched/prefix_admission.py); None = off
        self.requests: dict[str, Request] = {}   # unfinished requests by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # admission order = priority order
        self._finished_for_runner: set[str] = set()
        # kv_role="prefill" (deepinfer/disagg/): kv_hold(req) -> True keeps a finished request's
        # ring slot and blocks for a decode instance; the connector frees them later
        self.kv_hold = None
        # encode_images(req, indices), the engine's ImageEncoder.submit_request (one rank) or
        # RankImageEncoder.submit (DP): images a request reads from its start that were not encoded (at
        # add_request; later a shorter hit than expected, or a preemption)
        self.encode_images = None
        # requests whose step in flight proposed drafts that an overlapped step already verifies: its
        # proposal does not go to the DraftBook when it resolves (schedule_overlapped)
        self._drafts_taken: set[str] = set()

    # requests in and out -------------------------------------------------------------------
    def scheduler_of(self, req_id: str) -> "Scheduler":
        """The scheduler that holds req_id (DataParallelScheduler: its rank's)."""
        return self

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.stats.inc("prompt_tokens_total", req.num_prompt_tokens)
        if self.prefix is not None:
            self.prefix.on_add(req)

    def finish_requests(self, req_ids, status: RequestStatus, error: str | None = None) -> list[RequestOutput]:
        """Finish (abort, fail) requests at any moment: caches freed now, a final output each."""
        outs = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
                self._finished_for_runner.add(req_id)
            else:
                self.waiting.remove(req)
            self._finish(req, status)
            outs.append(RequestOutput(req_id, [], req.finish_reason, req.num_prompt_tokens,
                                      req.num_output_tokens, error=error, num_cached_tokens=req.num_cached_tokens or 0))
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # the step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [], {}, 0, finished_req_ids=self._finished_for_runner)
        self._finished_for_runner = set()
        self._plan_drafts()
        out.draft_after = self._draft_after()
        if self.prefix is not None:
            out.snapshot_saves = self.prefix.take_saves()
        step_budget = self._step_budget()
        budget = self._schedule_running(out, step_budget)
        if not out.preempted_req_ids:
            budget = self._schedule_waiting(out, budget)
        out.total_num_scheduled_tokens = step_budget - budget
        if self.kv_cache.host is not None:
            out.block_copies = self.kv_cache.take_block_copies()
        self.stats.inc("computed_tokens_total", out.total_num_scheduled_tokens)
        return out

    def schedule_overlapped(self, in_flight: dict[str, int], num_speculative_tokens: int) -> SchedulerOutput | None:
        """The next verify step while the one in flight is unresolved (spec/overlap.py): every running
        request was in it (in_flight: req_id -> drafts it verifies there) and runs its anchor plus up
        to the K' drafts spec/reservation.py's worst case leaves room for, of its device-side
        proposal: the policy's host half picks B (or caps K') here, its device half the k_i <= K'
        (spec/overlap_verify.py; the newest confidences are not on the host yet). Positions, tokens and blocks are
        counted as if every draft in flight were accepted; update_from_output trims the rejected
        ones a step later (_advance). None (nothing changed): schedule normally after resolving -
        a request waits, one may be done under the worst case, or the pool or the budget is short.
        With prefix caching on, blocks are registered as their tokens reach the host (min of the
        optimistic computed count and the known tokens, PrefixCaching.after_step): a block whose last
        KV the step in flight writes is read only by later steps on the same stream."""
        plan = self.overlap_plan(in_flight, num_speculative_tokens)
        return None if plan is None else self.commit_overlapped(plan)

    def overlap_plan(self, in_flight: dict[str, int], num_speculative_tokens: int):
        """schedule_overlapped's decision, changing nothing: (each running request's K', the device half's
        verify rule) or None. DataParallelScheduler asks every rank before any commits."""
        if self.waiting or not self.running:
            return None
        if any(r.request_id not in in_flight for r in self.running):
            return None
        ks = [worst_case_drafts(req, in_flight[req.request_id], num_speculative_tokens, self.max_model_len)
              for req in self.running]
        if any(k is None for k in ks):
            return None
        book = self.draft_book     # the policy's host half (spec/overlap_verify.py): B from the older confidences
        ks, verify = plan_overlapped(book.policy, ks, [book.last_confidences(r.request_id) for r in self.running])
        need = sum(max(self.kv_cache.num_blocks_for(req.num_computed_tokens + 1 + k)
                       - len(self.kv_cache.block_ids[req.request_id]), 0) for req, k in zip(self.running, ks))
        if need > self.kv_cache.num_free_blocks or sum(ks) + len(ks) > self.max_num_batched_tokens:
            return None
        return list(zip(self.running, ks)), verify

    def commit_overlapped(self, plan) -> SchedulerOutput:
        """The overlapped step of overlap_plan's answer: reservations made, positions advanced."""
        plan, verify = plan
        total = sum(1 + k for _, k in plan)
        out = SchedulerOutput([], [], {}, total, finished_req_ids=self._finished_for_runner, overlapped=True,
                              overlap_verify=verify, draft_after=self._draft_after())
        self._finished_for_runner = set()
        if self.prefix is not None:     # requests ended at the last resolve: saved before their slots are reused
            out.snapshot_saves = self.prefix.take_saves()
        for req, k in plan:
            rid = req.request_id
            new_blocks = reserve(self.kv_cache, req, k)
            if new_blocks is None:      # counted above: cannot happen
                raise RuntimeError(f"request {rid}: the worst-case reservation found the pool short")
            num_blocks = len(self.kv_cache.block_ids[rid]) - len(new_blocks)
            out.cached_reqs.append(CachedRequestData(rid, req.num_computed_tokens, num_blocks, new_blocks))
            out.num_scheduled_tokens[rid] = 1 + k
            req.num_computed_tokens += 1 + k
            req.num_output_placeholders += 1
            if k:
                out.spec_tokens[rid] = [-1] * k
            self._drafts_taken.add(rid)
        if self.kv_cache.host is not None:
            out.block_copies = self.kv_cache.take_block_copies()
        self.stats.inc("computed_tokens_total", total)
        return out

    def _step_budget(self) -> int:
        """max_num_batched_tokens while any running request decodes (its inter-token latency is the step's
        time), else the prefill-only budget: every row of the step is a prompt chunk."""
        p = self.max_prefill_only_tokens
        if p is not None and p > self.max_num_batched_tokens and \
                all(r.num_computed_tokens < r.num_prompt_tokens for r in self.running):
            return p
        return self.max_num_batched_tokens

    def _draft_after(self) -> bool:
        """Whether this step drafts after it (spec/pause.py); a paused step is counted."""
        d = self.draft_book.draft_after(len(self.running))
        if not d:
            self.stats.inc("spec_paused_steps_total")
        return d

    def _plan_drafts(self) -> None:
        """The verification policy's batch-wide choice of drafts (for requests with a new proposal)."""
        for req_id, drafts in self.draft_book.plan([r.request_id for r in self.running]).items():
            self.requests[req_id].spec_token_ids = drafts

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        if req.num_output_tokens + req.num_output_placeholders >= req.sampling_params.max_tokens:
            return 0  # its last token is in flight
        num_new = req.num_tokens + req.num_output_placeholders + len(req.spec_token_ids) - req.num_computed_tokens
        num_new = max(0, min(num_new, budget, self.max_model_len - req.num_computed_tokens))
        return req.clip_to_spans(req.num_computed_tokens, num_new)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._num_new_tokens(req, budget)
            if num_new == 0:
                i += 1
                continue
            new_blocks = self._allocate_or_preempt(req, num_new, out)
            if new_blocks is None:  # req itself was preempted: everything after it is gone too
                break
            num_blocks = len(self.kv_cache.block_ids[req.request_id]) - len(new_blocks)
            out.cached_reqs.append(CachedRequestData(req.request_id, req.num_computed_tokens, num_blocks, new_blocks))
            self._record(req, num_new, out)
            budget -= num_new
            i += 1
        return budget

    def _allocate_or_preempt(self, req: Request, num_new: int, out: SchedulerOutput) -> list[int] | None:
        while True:
            new_blocks = self.kv_cache.allocate_slots(req.request_id, req.num_computed_tokens + num_new)
            if new_blocks is not None:
                return new_blocks
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is req:
                return None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        if self.prefix is not None:
            self.prefix.on_release(req)
        self.kv_cache.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0
        req.spec_token_ids = []
        self.draft_book.drop(req.request_id)
        self._drafts_taken.discard(req.request_id)
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted_req_ids.add(req.request_id)
        self.stats.inc("preemptions_total")

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        deferred = []   # waiting for a block a running request computes (prefix caching)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            # prefix hits (image spans keyed by the image's content: cache/image_keys.py)
            hit = (self.prefix.plan_hit(req) if self.prefix is not None and req.num_computed_tokens == 0
                   else None)
            if hit is not None and hit.wait:
                deferred.append(self.waiting.popleft())
                continue
            if not self._images_ready(req, hit.start if hit is not None else req.num_computed_tokens):
                break                       # its images are still being encoded
            new_blocks = self._admit(req, hit, budget)
            if new_blocks is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            out.new_reqs.append(self._new_request_data(req, hit))
            num_new = self._num_new_tokens(req, budget)
            self._record(req, num_new, out)
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _images_ready(self, req: Request, start: int) -> bool:
        """Are the images a run from `start` reads encoded? Those not yet asked for are asked now."""
        ip = req.image_prompt
        if ip is None or not ip.encoding:
            return True
        todo = [i for i in ip.missing(start) if i not in ip.asked]
        if todo and self.encode_images is not None:
            self.encode_images(req, todo)
        return ip.ready_from(start)

    def _admit(self, req: Request, hit, budget: int) -> list[int] | None:
        """Blocks for the request's first step (starting past its prefix hit, if any); None = no room."""
        if hit is not None:
            req.num_computed_tokens = hit.start
        num_new = self._num_new_tokens(req, budget)
        new_blocks = None
        if num_new > 0:                       # 0: its next image span does not fit this step's budget
            new_blocks = self.kv_cache.allocate_slots(req.request_id, req.num_computed_tokens + num_new,
                                                      cached_blocks=hit.blocks if hit is not None else None)
        if new_blocks is None:
            if hit is not None:
                req.num_computed_tokens = 0
            return None
        if self.prefix is not None:
            self.prefix.admitted(req, hit)
        return new_blocks

    def _new_request_data(self, req: Request, hit) -> NewRequestData:
        rid = req.request_id
        table, slot = self.kv_cache.block_ids[rid], self.kv_cache.ring_slot[rid]
        replay = restore = None
        if hit is not None and hit.replay is not None:
            replay = hit.replay
        elif req.handover_replay is not None:     # taken once: a preempted request recomputes from 0
            replay, req.handover_replay = req.handover_replay, None
        if hit is not None and hit.snapshot_slot is not None:
            j, partial = divmod(hit.start, self.kv_cache.block_tokens)
            restore = SnapshotCopy(hit.snapshot_slot, slot, table[j] if partial else -1)
        return NewRequestData(rid, list(req.all_token_ids), req.num_prompt_tokens, req.num_computed_tokens,
                              req.sampling_params, list(table), slot, req.forced_token_ids, req.return_logits,
                              image_prompt=req.image_prompt, replay=replay, restore=restore)

    def _record(self, req: Request, num_new: int, out: SchedulerOutput) -> None:
        out.num_scheduled_tokens[req.request_id] = num_new
        req.num_computed_tokens += num_new
        known = req.num_tokens + req.num_output_placeholders
        num_spec = req.num_computed_tokens - known   # drafts that fit this step
        if num_spec > 0:
            out.spec_tokens[req.request_id] = req.spec_token_ids[:num_spec]
        if req.num_computed_tokens >= known:         # reaches the last known token: samples
            req.num_output_placeholders += 1

    # after the step --------------------------------------------------------------------------
    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for i, req_id in enumerate(runner_out.req_ids):
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran: drop its tokens
            sampled = runner_out.sampled_token_ids[i]
            self._advance(req, sched_out, sampled, runner_out.num_verified[i] if runner_out.num_verified else None)
            if not sampled:
                continue  # a prompt chunk that did not reach the end
            new_ids, status = self._append_tokens(req, sampled)
            self._record_token_times(req, len(new_ids), now)
            logprobs = runner_out.logprobs[i][:len(new_ids)] if runner_out.logprobs and runner_out.logprobs[i] else None
            logits = runner_out.logits.get(req_id) if runner_out.logits else None
            if status is not None:
                self.running.remove(req)
                self._finished_for_runner.add(req_id)
                self._finish(req, status)
            elif req_id in self._drafts_taken:
                self._drafts_taken.discard(req_id)     # an overlapped step in flight verifies them
                if runner_out.draft_confidences is not None and runner_out.draft_confidences[i]:
                    self.draft_book.remember(req_id, runner_out.draft_confidences[i])   # the next budget's "older"
            elif runner_out.draft_token_ids is not None:
                self._take_drafts(req, runner_out, i)
            outputs.append(RequestOutput(req_id, new_ids, req.finish_reason, req.num_prompt_tokens,
                                         req.num_output_tokens, logprobs, logits,
                                         num_cached_tokens=req.num_cached_tokens or 0))
        if self.prefix is not None:
            self.prefix.after_step(self.running)
        return outputs

    def _advance(self, req: Request, sched_out: SchedulerOutput, sampled: list[int],
                 num_verified: int | None = None) -> None:
        """Resolve the step's placeholder; lower num_computed_tokens by rejected drafts (blocks freed).
        num_verified: the drafts an overlapped step's device verified of the len(spec) scheduled (the
        trim is len(spec) - accepted either way: the step ran start .. start + accepted for real)."""
        if sampled:
            req.num_output_placeholders -= 1
        spec = sched_out.spec_tokens.get(req.request_id)
        if spec:
            num_accepted = len(sampled) - 1
            num_rejected = len(spec) - num_accepted
            self.stats.inc("spec_draft_tokens_verified_total", len(spec) if num_verified is None else num_verified)
            self.stats.inc("spec_draft_tokens_accepted_total", num_accepted)
            self.stats.inc("spec_verify_steps_total")
            req.num_computed_tokens -= num_rejected
            self.kv_cache.rollback(req.request_id, req.num_computed_tokens)
            req.spec_token_ids = []

    def _take_drafts(self, req: Request, runner_out: ModelRunnerOutput, i: int) -> None:
        """Next step's drafts into the DraftBook, no more than max_tokens leaves room for."""
        drafts = runner_out.draft_token_ids[i]
        if not drafts:
            return
        self.stats.inc("spec_draft_tokens_proposed_total", len(drafts))
        confs = runner_out.draft_confidences[i] if runner_out.draft_confidences else None
        room = req.sampling_params.max_tokens - req.num_output_tokens - 1   # the step samples one more
        self.draft_book.propose(req.request_id, drafts, confs, room)

    def _append_tokens(self, req: Request, sampled: list[int]) -> tuple[list[int], RequestStatus | None]:
        params = req.sampling_params
        for k, tok in enumerate(sampled):
            req.all_token_ids.append(tok)
            status = None
            if not params.ignore_eos and tok == req.eos_token_id or tok in params.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                return sampled[:k + 1], status
        return list(sampled), None

    def _record_token_times(self, req: Request, n: int, now: float) -> None:
        if req.first_token_time is None:
            req.first_token_time = now
            self.stats.observe("time_to_first_token_seconds", now - req.arrival_time)
        elif req.last_token_time is not None:
            self.stats.observe("inter_token_latency_seconds", (now - req.last_token_time) / n)
        req.last_token_time = now
        self.stats.inc("generation_tokens_total", n)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.draft_book.drop(req.request_id)
        self._drafts_taken.discard(req.request_id)
        if self.prefix is not None:
            self.prefix.on_release(req)
            self.prefix.on_finish(req, ended_normally=status in (RequestStatus.FINISHED_STOPPED,
                                                                 RequestStatus.FINISHED_LENGTH),
                                  failed=status == RequestStatus.FINISHED_ERROR)
        if self.kv_hold is None or not self.kv_hold(req):   # kv_role "prefill": held for a decode pull
            self.kv_cache.free(req.request_id)
        del self.requests[req.request_id]
        self.stats.inc(f"requests_finished_{FINISH_REASONS[status]}")
        self.stats.observe("e2e_request_latency_seconds", time.monotonic() - req.arrival_time)
