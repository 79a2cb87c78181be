"""Engine: the synchronous engine core (add_request / abort / step), and the only class the
serving side needs besides AsyncEngine (which runs an Engine on a background thread).

    step():
        sched_out  = scheduler.schedule()                     # which requests, how many tokens, which blocks
        runner_out = runner.execute(sched_out)                # tensors, model, sampling
        return scheduler.update_from_output(sched_out, runner_out)   # tokens appended, stops, deltas

Not thread-safe: one thread drives it (AsyncEngine's loop, LLM.generate, a test).
A fault inside a step fails the requests of that step (finish_reason "error"), not the engine.

Async scheduling (default on CUDA): step() launches step N+1 before it finishes step N, so the
CPU schedules and builds N+1 while the device runs N:

    CPU:    schedule N+1 | build N+1 | launch N+1 | wait N, update N | schedule N+2 | ...
    device: ......... step N ............. | ......... step N+1 ......... |
    
A request that stops at step N has one wasted token in N+1 (dropped). On CPU there is nothing
to overlap (torch CPU ops are synchronous), so the plain step is used.
Speculative decoding (EngineArgs.speculative "dspark", deepinfer/spec/): its verification policy is
built after the scheduler (the default, "scheduler", first profiles step times through this
engine's own steps). Async scheduling is on with it as without it (CUDA by default; on a CPU when
async_scheduling=True: the tests). Then a step in flight that samples (it verifies drafts or proposes them)
and drafted on the device is followed by an overlapped verify step (spec/overlap.py,
spec_async_overlap): scheduled with the worst-case reservation (Scheduler.schedule_overlapped) and
built from the device-side resolution (ModelRunner.launch_overlapped) before its counts reach the
host. Any other such step is resolved BEFORE the next schedule (its accepted counts set the next
step's positions, built on the host). num_resolved_before_schedule / num_verify_steps_overlapped
count both cases.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from functools import partial

from deepinfer.cache.kv_cache_manager import KVCacheManager
from deepinfer.config import EngineArgs
from deepinfer.outputs import RequestOutput, SchedulerOutput
from deepinfer.request import EngineDeadError, InvalidRequestError, Request, RequestStatus, UnknownRequestError
from deepinfer.sampling_params import SamplingParams
from deepinfer.sched.scheduler import Scheduler
from deepinfer.stats import EngineStats
from deepinfer.worker.input_batch import needs_sampler

# the connector's polls while nothing else runs: every IDLE_POLL_S while pulls are open (a pull's end lets its
# request's first token out), backing off to HOLD_POLL_MAX_S while only holds are (a prefill instance waiting for
# decoders: a hold ends at the peer's notice or its deadline, and a few ms later is harmless)
IDLE_POLL_S = 0.001
HOLD_POLL_MAX_S = 0.032

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.stats = EngineStats()
        self._images_counted = 0         # image_encoder.images_done already in the stats
        self._seed_rng = random.Random(args.seed)   # seeds of requests that bring none
        self._seed_lock = threading.Lock()          # validate() runs on callers' threads
        self.dead: str | None = None                # why the engine can no longer run steps
        self._init_model()
        self._init_scheduler()
        self._init_connector()
        self._init_speculation()

    # construction ------------------------------------------------------------------------------
    def _init_model(self) -> None:
        """The model and its caches: in this process (one rank), or in data_parallel_size rank
        workers (deepinfer/parallel/) with only the config read here."""
        from deepinfer.worker.rank import ModelFacts, build_rank, make_sampler
        a = self.args
        facts = ModelFacts.read(a)
        self.model_args, self.eos_token_id = facts.model_args, facts.eos_token_id
        self.max_position, self.vocab_size = facts.max_position, facts.vocab_size
        self.device = a.resolved_device()
        if a.data_parallel_size > 1:
            from deepinfer.parallel.executor import MultiprocExecutor
            self.model = self.caches = None
            self.image_encoder = None     # set with the scheduler: each rank encodes its requests' images ahead
            self.runner = MultiprocExecutor(a, facts)
            self.sampler = make_sampler(a.checkpoint, self.vocab_size)   # request checks (grammars) here
            self.num_cache_blocks = self.runner.num_cache_blocks         # per rank
            self.max_model_len = self.runner.max_model_len
            self.graph_sizes = ()
            self.async_scheduling = self.runner.async_scheduling
            return
        rt = build_rank(a, facts)
        self.device, self.model, self.caches, self.runner = rt.device, rt.model, rt.caches, rt.runner
        self.image_encoder = None     # encodes requests' images ahead of scheduling (worker/image_embeds.py)
        if getattr(self.model, "vision_tower", None) is not None:
            from deepinfer.worker.image_embeds import ImageEncoder
            self.image_encoder = ImageEncoder(self.model.vision_tower, a.batch_invariant, a.vision_sm_share)
        self.sampler, self.num_cache_blocks, self.max_model_len = rt.sampler, rt.num_cache_blocks, rt.max_model_len
        self.graph_sizes, self.async_scheduling = rt.graph_sizes, rt.async_scheduling

    def _init_scheduler(self) -> None:
        a = self.args

        prefill_only = a.prefill_only_tokens(str(self.device))

        def scheduler():
            kv = KVCacheManager(self.num_cache_blocks, a.block_tokens, a.max_num_seqs, a.enable_prefix_caching,
                                *self._lower_tiers())
            return Scheduler(a.max_num_seqs, a.max_num_batched_tokens, self.max_model_len, kv, self.stats,
                             prefix=self._prefix_caching(kv),
                             max_prefill_only_tokens=prefill_only if prefill_only > a.max_num_batched_tokens else None)
        if a.data_parallel_size > 1:
            from deepinfer.parallel.dp_scheduler import DataParallelScheduler
            self.scheduler = DataParallelScheduler([scheduler() for _ in range(a.data_parallel_size)],
                                                   cp_min_prompt_tokens=a.cp_min_prompt_tokens
                                                   if a.context_parallel_size > 1 else None)
            self.kv_cache = self.scheduler.kv_cache
            if self.model_args.vision is not None:
                from deepinfer.parallel.image_ahead import RankImageEncoder
                self.image_encoder = RankImageEncoder(self.runner, self.scheduler)
        else:
            self.scheduler = scheduler()
            self.kv_cache = self.scheduler.kv_cache
            if self.image_encoder is not None:
                self.scheduler.encode_images = self.image_encoder.submit_request
        self.stats.set_gauges(cache_blocks_total=self.num_cache_blocks * a.data_parallel_size)
        self._in_flight = None  # (SchedulerOutput, launched step) of the pipelined step
        self._idle_polls = 0    # polls in a row with only holds open and nothing come of them
        # how the engine waits between idle polls; AsyncEngine makes it a wait that a new request ends
        self.idle_sleep = time.sleep
        # async + speculation: how often the pipeline was broken, and how often it was not
        # (tests/engine/test_spec_overlap.py): steps in flight resolved before the next schedule since
        # they sampled; verify steps launched while a step that samples was still unresolved
        self.num_resolved_before_schedule = 0
        self.num_verify_steps_overlapped = 0
        # the scheduler policy's step-time model corrected by finished verify steps (spec/step_time_online.py)
        self.step_time_observer = None

    def _init_speculation(self) -> None:
        """DSpark's verification policy; last, since the scheduler policy profiles real engine steps."""
        if self.args.speculative == "dspark":
            from deepinfer.spec.engine_policy import set_verification_policy
            set_verification_policy(self)

    def _prefix_caching(self, kv: KVCacheManager):
        """The scheduler's prefix-cache hooks (sched/prefix_admission.py), None when off."""
        a = self.args
        if not a.enable_prefix_caching:
            return None
        from deepinfer.cache.snapshot_index import SnapshotIndex
        from deepinfer.cache.snapshot_store import num_snapshot_slots
        from deepinfer.sched.prefix_admission import PrefixCaching
        slots = num_snapshot_slots(a, self.model_args)
        index = SnapshotIndex(slots, a.block_tokens, a.window_snapshot_ttl_s) if slots else None
        return PrefixCaching(kv, a.swa_replay_tokens, index, self.stats)

    def _lower_tiers(self):
        """(host tier index, disk tier index) of the prefix cache, each None when off."""
        from deepinfer.cache.disk_tier import DiskTierIndex, num_disk_blocks
        from deepinfer.cache.host_tier import HostTierIndex, num_host_slots
        n = num_host_slots(self.args, self.model_args)
        d = num_disk_blocks(self.args, self.model_args) if n else 0
        return (HostTierIndex(n) if n else None), (DiskTierIndex(d) if d else None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (vLLM's name); -> how many."""
        return self.kv_cache.pool.clear_cache()

    def _init_connector(self) -> None:
        """kv_role "prefill" / "decode": the KV connector (deepinfer/disagg/) on this rank's caches, or
        with rank workers on theirs (each rank's own NIXL agent: disagg/rank_connector.py)."""
        self.connector = None
        a = self.args
        if a.kv_role == "both":
            return
        if not a.kv_transfer_window and a.swa_replay_tokens < self.model_args.window_size:
            raise ValueError(f"kv_transfer_window=False replays swa_replay_tokens ({a.swa_replay_tokens}) positions, "
                             f"below the model's window ({self.model_args.window_size}): window keys would be missing")
        if a.data_parallel_size > 1:
            from deepinfer.disagg.rank_connector import RankKVConnector
            self.connector = RankKVConnector(a.kv_role, self.runner, self.scheduler, self.stats,
                                             a.kv_transfer_timeout_s, self.max_model_len,
                                             window=a.kv_transfer_window, replay_tokens=a.swa_replay_tokens)
            if a.kv_role == "prefill":
                for rank, s in enumerate(self.scheduler.schedulers):
                    s.kv_hold = partial(self.connector.request_finished, rank)
            return
        from deepinfer.disagg.connector import KVConnector
        self.connector = KVConnector(a.kv_role, self.caches, self.kv_cache, self.stats, a.kv_transfer_host,
                                     a.kv_transfer_port, a.kv_transfer_timeout_s, self.max_model_len,
                                     window=a.kv_transfer_window, replay_tokens=a.swa_replay_tokens)
        if a.kv_role == "prefill":
            self.scheduler.kv_hold = self.connector.request_finished

    def shutdown(self) -> None:
        """Stop the rank workers (multi-GPU); a no-op for one rank. Idempotent."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    # requests ----------------------------------------------------------------------------------
    def validate(self, request_id: str, prompt_token_ids, sampling_params: SamplingParams | None) -> SamplingParams:
        """Check one request without touching engine state (safe from any thread)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty str, got {request_id!r}")
        if prompt_token_ids is None or len(prompt_token_ids) == 0:
            raise InvalidRequestError(f"request {request_id}: empty prompt")
        n = len(prompt_token_ids)
        if n > self.max_model_len:
            raise InvalidRequestError(f"request {request_id}: prompt of {n} tokens is over the context limit "
                                      f"of {self.max_model_len} tokens")
        lo, hi = min(prompt_token_ids), max(prompt_token_ids)
        if lo < 0 or hi >= self.vocab_size:
            raise InvalidRequestError(f"request {request_id}: token id {lo if lo < 0 else hi} outside the "
                                      f"vocabulary [0, {self.vocab_size})")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"request {request_id}: sampling_params must be a SamplingParams")
        if not isinstance(params.max_tokens, int) or params.max_tokens < 1:
            raise InvalidRequestError(f"request {request_id}: max_tokens must be at least 1, got {params.max_tokens}")
        if self.sampler is None and needs_sampler(params):
            raise InvalidRequestError(f"request {request_id}: only greedy sampling is available "
                                      "(deepinfer.sample could not be imported)")
        if params.constraint is not None:
            self.sampler.new_state(params)  # compiles the grammar; InvalidConstraintError to this caller
        if params.seed is None and not params.greedy:
            # fix the random stream now (from EngineArgs.seed), so a preempted and recomputed request
            # draws the same tokens and a rerun of the same requests is reproducible
            with self._seed_lock:
                seed = self._seed_rng.getrandbits(63)
            params = dataclasses.replace(params, seed=seed)
        return params

    def prepare_images(self, request_id: str, prompt_token_ids, images):
        """-> ImagePrompt: the images decoded and planned (bytes, or ImageInputs already made) and the
        prompt's placeholders (one image_token_id per image) expanded to their spans. Image decoding
        is CPU work: call this on the caller's thread (AsyncEngine does), not the engine's.
        Raises InvalidRequestError for a corrupt / unsupported image or a span no step can hold."""
        import numpy as np

        from deepinfer.model.vision import (ImageError, ImageInput, ImagePrompt, expand_image_placeholders,
                                            image_from_pixels, load_image)
        from deepinfer.model.vision.preprocess import check_image_input
        if isinstance(images, ImagePrompt):
            return images
        v = self.model_args.vision
        if v is None:
            raise InvalidRequestError(f"request {request_id}: this checkpoint has no vision tower; "
                                      "images are not accepted")
        inputs = []
        for k, im in enumerate(images):
            try:
                if isinstance(im, ImageInput):
                    inputs.append(check_image_input(im, v))
                elif isinstance(im, np.ndarray):            # planned, padded pixels (the preprocess model's)
                    inputs.append(image_from_pixels(im, v))
                else:
                    inputs.append(load_image(im, v))
            except ImageError as e:
                raise InvalidRequestError(f"request {request_id}: image {k}: {e}") from None
        try:
            prompt = expand_image_placeholders(prompt_token_ids, inputs, v.image_token_id)
        except ValueError as e:
            raise InvalidRequestError(f"request {request_id}: {e}") from None
        for k, im in enumerate(prompt.images):
            if im.span_len > self.args.max_num_batched_tokens:
                raise InvalidRequestError(f"request {request_id}: image {k} takes {im.span_len} tokens, more than "
                                          f"one step holds (max_num_batched_tokens={self.args.max_num_batched_tokens})")
        return prompt

    @staticmethod
    def validate_cache_salt(request_id: str, cache_salt) -> None:
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError(f"request {request_id}: cache_salt must be a non-empty str, "
                                      f"got {type(cache_salt).__name__} {cache_salt!r}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    *, forced_token_ids: list[int] | None = None, return_logits: bool = False,
                    images=None, cache_salt: str | None = None, kv_transfer_params: dict | None = None) -> None:
        """Queue a request. Raises InvalidRequestError (bad input, duplicate id) to this caller only.

        forced_token_ids: teacher forcing, output token k is forced_token_ids[k] (scoring, parity tests).
        return_logits: each RequestOutput carries the fp32 logits [n, V] its new tokens were sampled from.
        images: image bytes (PNG/JPEG/GIF/WebP), planned [H, W, 3] uint8 pixels (vision.padded_rgb) or
        ImageInputs, one per image placeholder id in the prompt, in order; or an ImagePrompt from prepare_images. num_prompt_tokens then counts spans.
        cache_salt: prefix caching shares blocks only between requests with the same salt (a tenant key).
        kv_transfer_params: kv_role="decode": a prefill instance's hand-over (its final output's
        kv_transfer_params); the caches are pulled and the request goes on from the prefill's token.
        kv_role="prefill" runs every request to its first token (max_tokens=1) and hands it over.
        """
        image_prompt = None
        if images:
            image_prompt = self.prepare_images(request_id, prompt_token_ids, images)
            prompt_token_ids = image_prompt.token_ids
        params = self.validate(request_id, prompt_token_ids, sampling_params)
        self.validate_cache_salt(request_id, cache_salt)
        if request_id in self.scheduler.requests or (self.connector is not None and self.connector.owns(request_id)):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        handover = None if kv_transfer_params is None else \
            self.check_handover(request_id, kv_transfer_params, len(prompt_token_ids))
        if self.args.kv_role == "prefill":
            params = dataclasses.replace(params, max_tokens=1)
        req = Request(request_id, [int(t) for t in prompt_token_ids], params, self.eos_token_id,
                      forced_token_ids, return_logits, image_prompt=image_prompt, cache_salt=cache_salt)
        if handover is not None:
            # the prefill instance read the images; this one never does unless the request is preempted
            # (its runner then encodes them in the recompute's step) or the pull's replay would cover a
            # span (the connector pulls the window instead)
            self.connector.start_load(req, handover)
            return
        self.scheduler.add_request(req)
        if image_prompt is not None and image_prompt.embeds is None and self.image_encoder is not None:
            # encoded ahead of scheduling (by its rank's scheduler's hook: DP places it first); with a prefix
            # hit, images wholly inside the cached prefix are never read: not encoded
            sched = self.scheduler.scheduler_of(request_id)
            start = sched.prefix.expected_start(req) if sched.prefix is not None else 0
            sched.encode_images(req, image_prompt.needed(start))

    def check_handover(self, request_id: str, kv_transfer_params: dict, num_prompt_tokens: int):
        """A hand-over's form, this instance's role, layout and the prompt (InvalidRequestError);
        reads nothing that changes, so the async engine refuses bad ones on the caller's thread (a
        400, not a failed request). -> KVTransferParams"""
        if self.args.kv_role != "decode":
            raise InvalidRequestError(f"request {request_id}: kv_transfer_params need a kv_role='decode' instance "
                                      f"(this one is {self.args.kv_role!r})")
        from deepinfer.disagg.params import KVTransferParams
        try:
            handover = KVTransferParams.from_dict(kv_transfer_params)
        except ValueError as e:
            raise InvalidRequestError(f"request {request_id}: {e}") from None
        self.connector.check(request_id, handover, num_prompt_tokens)
        return handover

    def abort(self, request_id: str) -> RequestOutput:
        """Finish a request now (caches freed); its final output has finish_reason "abort"."""
        if self.connector is not None and request_id in self.connector.loads:
            out = self.connector.abort(request_id)
            self.stats.inc("requests_finished_abort")
            return out
        if request_id not in self.scheduler.requests:
            raise UnknownRequestError(f"unknown request id {request_id!r}")
        out = self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)[0]
        self._update_gauges(step=False)
        return out

    def holds_request(self, request_id: str) -> bool:
        """In the scheduler, or (kv_role="decode") having its caches pulled."""
        return request_id in self.scheduler.requests or (self.connector is not None and request_id in self.connector.loads)

    def has_unfinished_requests(self) -> bool:
        if self.dead is not None:
            return False
        return (self.scheduler.has_unfinished_requests() or self._in_flight is not None
                or (self.connector is not None and self.connector.has_work()))

    # the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        handed = self._encode_images() if self.image_encoder is not None else []
        if self.dead is not None:
            return handed
        handed += self._poll_connector() if self.connector is not None and not self.connector.poll_after_step else []
        if self.async_scheduling:
            return handed + self._with_handover(self._step_pipelined())
        sched_out = self.scheduler.schedule()
        try:
            runner_out = self.runner.execute(sched_out)
        except EngineDeadError as e:
            return handed + self._die(e)
        except Exception as e:  # noqa: BLE001 - one bad step must not kill the engine
            return handed + self._fail_step(sched_out, e)
        outputs = self.scheduler.update_from_output(sched_out, runner_out)
        self._observe_step(sched_out, runner_out)
        self._update_gauges()
        return handed + self._with_handover(outputs)

    def _encode_images(self) -> list[RequestOutput]:
        """Images asked since the last step: one pass, beside the steps. A request whose images fail to
        encode fails alone (its final output says why); a rank gone fails the engine."""
        try:
            failed = self.image_encoder.flush()
        except EngineDeadError as e:
            return self._die(e)
        done = self.image_encoder.images_done
        self.stats.inc("images_encoded_total", done - self._images_counted)
        self._images_counted = done
        self.stats.inc("image_encode_failures_total", len(failed))
        outs = []
        for req_id, error in failed.items():
            outs += self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ERROR,
                                                   error=f"image encoding failed: {error}")
        if outs:
            self._update_gauges(step=False)
        return outs

    def _observe_step(self, sched_out, runner_out) -> None:
        if self.step_time_observer is not None:
            self.step_time_observer.finished(sched_out, runner_out)

    # prefill/decode disaggregation (deepinfer/disagg/) ---------------------------------------------
    def idle_poll_wait(self) -> float | None:
        """Seconds to wait before the next connector poll where the engine has nothing but the connector's
        transfers to attend to (None: it has a step to run): IDLE_POLL_S while pulls are open, doubling up to
        HOLD_POLL_MAX_S over polls in a row that only holds are open and nothing came of."""
        if self.connector is None or self.scheduler.has_unfinished_requests() or self._in_flight is not None:
            return None
        if self.connector.loads:
            return IDLE_POLL_S
        return min(HOLD_POLL_MAX_S, IDLE_POLL_S * 2 ** min(self._idle_polls, 16))

    def _poll_connector(self) -> list[RequestOutput]:
        """Pulls that finished go to the scheduler (their first delta is the prefill's token); failed
        ones end here. Idle with only transfers open: a wait (idle_poll_wait) instead of a hot loop."""
        wait = self.idle_poll_wait()
        if wait is not None:
            self.idle_sleep(wait)
        held = len(self.connector.held)
        outs, ready = self.connector.poll()
        quiet = wait is not None and not outs and not ready and len(self.connector.held) == held
        self._idle_polls = self._idle_polls + 1 if quiet else 0
        for req in ready:
            self.scheduler.add_request(req)
        for out in outs:
            if out.finished:
                self.stats.inc(f"requests_finished_{out.finish_reason}")
        return outs

    def _with_handover(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """kv_role="prefill": a request's final output carries its kv_transfer_params. Rank workers: the
        connector's round trip first (the nonces of this step's holds reach their ranks before the params leave)."""
        if self.connector is None:
            return outputs
        if self.connector.poll_after_step and self.dead is None:
            try:
                outputs = outputs + self._poll_connector()
            except EngineDeadError as e:
                return outputs + self._die(e)
            self._update_gauges(step=False)      # blocks the round trip freed
        if self.args.kv_role != "prefill":
            return outputs
        for out in outputs:
            if out.finished:
                out.kv_transfer_params = self.connector.take_params(out.request_id)
        return outputs

    def _step_pipelined(self) -> list[RequestOutput]:
        """Launch the next step, then finish the one in flight (its outputs are returned). A step in
        flight whose results the next schedule needs (speculation) is finished first, unless the next
        verify step can overlap it (spec/overlap.py)."""
        outputs, launched, sched_out = [], None, None
        if self._in_flight is not None and self._resolve_first(self._in_flight[1]):
            sched_out = self._schedule_overlapped(self._in_flight[1])
            if sched_out is None:
                self.num_resolved_before_schedule += 1
                outputs += self._finish_in_flight()
                if self.dead is not None:
                    return outputs
        if sched_out is None:
            sched_out = self.scheduler.schedule()
        try:
            if getattr(sched_out, "overlapped", False):     # DP: some rank overlaps (ParallelSchedulerOutput)
                launched = self.runner.launch_overlapped(sched_out, self._in_flight[1])
            else:
                launched = self.runner.launch(sched_out)
        except EngineDeadError as e:
            return self._die(e)
        except Exception as e:  # noqa: BLE001
            outputs += self._fail_step(sched_out, e)
        if getattr(sched_out, "overlapped", False):
            # counted by the launch, not by its drafts: an overlapped step may verify none (every
            # request at its last token) and still runs from the unresolved step's device state
            self.num_verify_steps_overlapped += 1
        if self._in_flight is not None:
            outputs += self._finish_in_flight()
            if self.dead is not None:
                return outputs
        self._in_flight = (sched_out, launched) if launched is not None else None
        self._update_gauges()
        return outputs

    def _schedule_overlapped(self, launched):
        """The next verify step with `launched` unresolved (spec/overlap.py), or None: resolve it first."""
        drafts_of = getattr(self.runner, "overlap_drafts", None)
        in_flight = drafts_of(launched) if drafts_of is not None else None
        if in_flight is None:
            return None
        return self.scheduler.schedule_overlapped(in_flight, self.args.num_speculative_tokens)

    def _resolve_first(self, launched) -> bool:
        must = getattr(self.runner, "must_resolve_before_next", None)
        return must is not None and must(launched)

    def _finish_in_flight(self) -> list[RequestOutput]:
        """Resolve the step in flight into the scheduler (nothing in flight afterwards)."""
        prev_out, prev = self._in_flight
        self._in_flight = None
        try:
            runner_out = self.runner.resolve(prev)
            outputs = self.scheduler.update_from_output(prev_out, runner_out)
            self._observe_step(prev_out, runner_out)
            return outputs
        except EngineDeadError as e:
            return self._die(e)
        except Exception as e:  # noqa: BLE001
            return self._fail_step(prev_out, e)

    def _die(self, exc: EngineDeadError) -> list[RequestOutput]:
        """A rank is gone: every request fails with the reason, new ones are refused."""
        self.dead = str(exc)
        self._in_flight = None
        logger.error("engine is dead: %s", self.dead)
        self.stats.set_gauges(engine_healthy=0)
        outs = self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_ERROR,
                                              error=f"EngineDeadError: {self.dead}")
        fail_pulls = getattr(self.connector, "fail_all", None)      # rank workers: pulls die with them
        if fail_pulls is not None:
            outs += fail_pulls(f"EngineDeadError: {self.dead}")
        self._update_gauges(step=False)
        return outs

    def _fail_step(self, sched_out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        logger.exception("engine step failed; failing its %d requests", len(sched_out.num_scheduled_tokens))
        outs = self.scheduler.finish_requests(list(sched_out.num_scheduled_tokens), RequestStatus.FINISHED_ERROR,
                                              error=f"{type(exc).__name__}: {exc}")
        self._update_gauges(step=False)
        return outs

    def _update_gauges(self, step: bool = True) -> None:
        s, kv = self.scheduler, self.kv_cache
        if step:
            self.stats.inc("steps_total")
        total = self.num_cache_blocks * self.args.data_parallel_size
        self.stats.set_gauges(num_requests_running=s.num_running, num_requests_waiting=s.num_waiting,
                              cache_blocks_used=kv.num_used_blocks, cache_usage=kv.num_used_blocks / total)
        if self.args.enable_prefix_caching:
            c = self.stats.counters
            q = c["prefix_cache_queries_total"]
            self.stats.set_gauges(prefix_cache_hit_rate=c["prefix_cache_hits_total"] / q if q else 0.0,
                                  prefix_cache_blocks_cached=kv.pool.num_cached_blocks)
        if self.args.data_parallel_size > 1:
            self.stats.set_gauges(ranks=s.rank_gauges())
            lb = self.runner.last_rebalance
            if lb is not None:
                self.stats.set_gauges(moe_load_balance=lb["balance_before"], moe_load_balance_after=lb["balance_after"])
        if self.args.speculative:
            c = self.stats.counters   # engine thread: the only writer
            steps, verified = c["spec_verify_steps_total"], c["spec_draft_tokens_verified_total"]
            accepted = c["spec_draft_tokens_accepted_total"]
            self.stats.set_gauges(spec_mean_accepted_length=1 + accepted / steps if steps else 0.0,
                                  spec_acceptance_rate=accepted / verified if verified else 0.0)

