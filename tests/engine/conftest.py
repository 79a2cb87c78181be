"""Shared builders for engine tests (vLLM tests/v1/core/utils.py style): a real Scheduler on a
small block pool, requests, and runner outputs computed from the SchedulerOutput alone."""

from __future__ import annotations

import pytest

from deepinfer.cache.kv_cache_manager import KVCacheManager
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from deepinfer.sched.scheduler import Scheduler


def create_scheduler(num_blocks=64, block_tokens=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=None,
                     max_prefill_only_tokens=None):
    kv = KVCacheManager(num_blocks, block_tokens, max_num_seqs)
    return Scheduler(max_num_seqs, max_num_batched_tokens, max_model_len or num_blocks * block_tokens, kv,
                     max_prefill_only_tokens=max_prefill_only_tokens)


def drain(engine) -> tuple[dict[str, list[int]], dict]:
    """Step a real engine until it holds nothing: (new tokens by request id, final output by request id)."""
    tokens, final = {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                final[o.request_id] = o
    return tokens, final


def make_request(req_id, prompt_len, max_tokens=4, **kw):
    return Request(str(req_id), list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0), **kw)


def fake_runner_output(sched_out: SchedulerOutput, sched: Scheduler, token=7, accept=None) -> ModelRunnerOutput:
    """A token for every request whose scheduled tokens reach its end; `accept(req_id, drafts)`
    says how many drafts are accepted (default all)."""
    req_ids, sampled = [], []
    for req_id, n in sched_out.num_scheduled_tokens.items():
        req = sched.requests[req_id]
        req_ids.append(req_id)
        drafts = sched_out.spec_tokens.get(req_id, [])
        if req.num_computed_tokens - len(drafts) < req.num_tokens:  # computed already counts this step
            sampled.append([])
            continue
        a = len(drafts) if accept is None else accept(req_id, drafts)
        sampled.append(list(drafts[:a]) + [token])
    return ModelRunnerOutput(req_ids, sampled)


@pytest.fixture(scope="session")
def tiny_engine_args(tiny_checkpoint):
    """Small real-model engine settings: CPU, block_tokens 8, a modest cache."""
    return dict(checkpoint=str(tiny_checkpoint), device="cpu", max_num_seqs=8, max_num_batched_tokens=64,
                block_tokens=8, num_cache_blocks=64)


# -- speculation under async scheduling (test_spec_async.py, test_spec_overlap.py) ------------------

@pytest.fixture(scope="module")
def spec_args(tiny_engine_args):
    """DSpark on the tiny model with a small step budget (prompts prefill over several steps) under
    batch_invariant, every draft verified (threshold 0)."""
    return {**tiny_engine_args, "max_num_batched_tokens": 24, "num_cache_blocks": 64, "batch_invariant": True,
            "speculative": "dspark", "spec_policy": "threshold", "spec_confidence_threshold": 0.0}


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def sampled(n, seed):
    # the tiny model's logits are ~100 wide: temperature 8 spreads its samples
    return SamplingParams(max_tokens=n, temperature=8.0, top_p=0.95, seed=seed, ignore_eos=True)
