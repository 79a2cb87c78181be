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
Draft verification needs the accepted count before the next step: EngineArgs.speculative ("dspark",
deepinfer/spec/) turns async scheduling off.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
from pathlib import Path

from deepinfer.cache.kv_cache_manager import KVCacheManager, cdiv
from deepinfer.config import EngineArgs
from deepinfer.outputs import RequestOutput, SchedulerOutput
from deepinfer.request import InvalidRequestError, Request, RequestStatus, UnknownRequestError
from deepinfer.sampling_params import SamplingParams
from deepinfer.sched.scheduler import Scheduler
from deepinfer.stats import EngineStats
from deepinfer.worker.input_batch import needs_sampler

logger = logging.getLogger(__name__)

CPU_DEFAULT_CACHE_TOKENS_PER_SEQ = 2048   # CPU cache size when num_cache_blocks is not given


class Engine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.stats = EngineStats()
        self._seed_rng = random.Random(args.seed)   # seeds of requests that bring none
        self._seed_lock = threading.Lock()          # validate() runs on callers' threads
        self._init_model()
        self._init_caches()
        self._init_scheduler()
        self._init_runner()

    # construction ------------------------------------------------------------------------------
    def _init_model(self) -> None:
        from deepinfer.worker.loading import load_model
        self.device = self.args.resolved_device()
        # batch invariance also needs chunking invariance: one window layout for every chunk
        overrides = {**({"step_shape_invariant": True} if self.args.batch_invariant else {}),
                     **self.args.model_overrides}
        self.model, self.model_args = load_model(self.args.checkpoint, self.device, self.args.dtype, overrides)
        cfg = _read_hf_config(self.args.checkpoint)
        self.eos_token_id = cfg.get("eos_token_id", cfg.get("text_config", {}).get("eos_token_id"))
        tc = cfg.get("text_config", {})
        self.max_position = int(tc.get("max_position_embeddings", cfg.get("max_position_embeddings", 1 << 20)))
        self.vocab_size = self.model_args.vocab_size
        from deepinfer.worker.graph_step import graph_sizes
        self.graph_sizes = graph_sizes(self.args, self.model_args, self.device)

    def _init_caches(self) -> None:
        from deepinfer.worker.loading import allocate_caches, cache_bytes_per_block
        a = self.args
        num_blocks = a.num_cache_blocks
        if num_blocks is None:
            if self.device.startswith("cuda"):
                num_blocks = _blocks_from_memory(self.model_args, a, cache_bytes_per_block)
            else:
                want = min(self.max_position, CPU_DEFAULT_CACHE_TOKENS_PER_SEQ)
                num_blocks = a.max_num_seqs * cdiv(want, a.block_tokens)
        self.num_cache_blocks = num_blocks
        self.max_model_len = min(a.max_model_len or self.max_position, self.max_position,
                                 num_blocks * a.block_tokens)
        self.caches = allocate_caches(self.model_args, a.max_num_seqs, num_blocks, a.block_tokens,
                                      self.device, a.dtype, scratch=bool(self.graph_sizes))

    def _init_scheduler(self) -> None:
        a = self.args
        self.kv_cache = KVCacheManager(self.num_cache_blocks, a.block_tokens, a.max_num_seqs)
        policy = None
        if a.speculative == "dspark":
            from deepinfer.spec.policy import StaticThresholdPolicy
            policy = StaticThresholdPolicy(a.spec_confidence_threshold)
        self.scheduler = Scheduler(a.max_num_seqs, a.max_num_batched_tokens, self.max_model_len,
                                   self.kv_cache, self.stats, spec_policy=policy)
        self.stats.set_gauges(cache_blocks_total=self.num_cache_blocks)

    def _init_runner(self) -> None:
        a = self.args
        self.async_scheduling = a.async_scheduling if a.async_scheduling is not None else self.device.startswith("cuda")
        proposer = None
        if a.speculative == "dspark":
            from deepinfer.spec.dspark_proposer import DSparkProposer
            proposer = DSparkProposer(self.model, self.caches, a.num_speculative_tokens)
            self.async_scheduling = False   # verification needs the accepted count before the next step
        self._in_flight = None  # (SchedulerOutput, launched step) of the pipelined step
        from deepinfer.worker.model_runner import ModelRunner
        self.sampler = _make_sampler(a.checkpoint, self.vocab_size)
        self.runner = ModelRunner(self.model, self.caches, self.device, a.max_num_seqs,
                                  self.max_model_len, a.block_tokens,
                                  ngram_width=max(self.model_args.engram_max_ngram_size - 1, 0),
                                  sampler=self.sampler, batch_invariant=a.batch_invariant, proposer=proposer,
                                  graph_sizes=self.graph_sizes, graph_max_len=a.max_seq_len_to_capture)

    # requests ----------------------------------------------------------------------------------
    def validate(self, request_id: str, prompt_token_ids, sampling_params: SamplingParams | None) -> SamplingParams:
        """Check one request without touching engine state (safe from any thread)."""
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

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    *, forced_token_ids: list[int] | None = None, return_logits: bool = False) -> None:
        """Queue a request. Raises InvalidRequestError (bad input, duplicate id) to this caller only.

        forced_token_ids: teacher forcing, output token k is forced_token_ids[k] (scoring, parity tests).
        return_logits: each RequestOutput carries the fp32 logits [n, V] its new tokens were sampled from.
        """
        params = self.validate(request_id, prompt_token_ids, sampling_params)
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        req = Request(request_id, [int(t) for t in prompt_token_ids], params, self.eos_token_id,
                      forced_token_ids, return_logits)
        self.scheduler.add_request(req)

    def abort(self, request_id: str) -> RequestOutput:
        """Finish a request now (caches freed); its final output has finish_reason "abort"."""
        if request_id not in self.scheduler.requests:
            raise UnknownRequestError(f"unknown request id {request_id!r}")
        out = self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)[0]
        self._update_gauges(step=False)
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    # the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.async_scheduling:
            return self._step_pipelined()
        sched_out = self.scheduler.schedule()
        try:
            runner_out = self.runner.execute(sched_out)
        except Exception as e:  # noqa: BLE001 - one bad step must not kill the engine
            return self._fail_step(sched_out, e)
        outputs = self.scheduler.update_from_output(sched_out, runner_out)
        self._update_gauges()
        return outputs

    def _step_pipelined(self) -> list[RequestOutput]:
        """Launch the next step, then finish the one in flight (its outputs are returned)."""
        outputs, launched = [], None
        sched_out = self.scheduler.schedule()
        try:
            launched = self.runner.launch(sched_out)
        except Exception as e:  # noqa: BLE001
            outputs += self._fail_step(sched_out, e)
        if self._in_flight is not None:
            prev_out, prev = self._in_flight
            try:
                outputs += self.scheduler.update_from_output(prev_out, self.runner.resolve(prev))
            except Exception as e:  # noqa: BLE001
                outputs += self._fail_step(prev_out, e)
        self._in_flight = (sched_out, launched) if launched is not None else None
        self._update_gauges()
        return outputs

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
        self.stats.set_gauges(num_requests_running=s.num_running, num_requests_waiting=s.num_waiting,
                              cache_blocks_used=kv.num_used_blocks,
                              cache_usage=kv.num_used_blocks / self.num_cache_blocks)
        if self.args.speculative:
            c = self.stats.counters   # engine thread: the only writer
            steps, verified = c["spec_verify_steps_total"], c["spec_draft_tokens_verified_total"]
            accepted = c["spec_draft_tokens_accepted_total"]
            self.stats.set_gauges(spec_mean_accepted_length=1 + accepted / steps if steps else 0.0,
                                  spec_acceptance_rate=accepted / verified if verified else 0.0)


def _make_sampler(checkpoint: str, vocab_size: int):
    """The Sampler, or None (greedy only) where its dependencies (xgrammar) are missing."""
    try:
        from deepinfer.sample import Sampler
    except ImportError as e:
        logger.warning("deepinfer.sample unavailable (%s): greedy sampling only", e)
        return None
    tokenizer = Path(checkpoint) / "tokenizer.json"
    return Sampler(vocab_size, str(tokenizer) if tokenizer.is_file() else None)


def _read_hf_config(checkpoint: str) -> dict:
    path = Path(checkpoint) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _blocks_from_memory(model_args, args: EngineArgs, bytes_per_block) -> int:
    import torch

    from deepinfer.worker.loading import ring_slot_bytes
    free, _ = torch.cuda.mem_get_info()
    budget = int(free * args.cache_memory_fraction) - args.max_num_seqs * ring_slot_bytes(model_args, args.dtype)
    return max(1, budget // bytes_per_block(model_args, args.block_tokens, args.dtype))
