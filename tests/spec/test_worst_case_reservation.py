"""spec/reservation.py on the real KVCacheManager: a verify step scheduled with the previous one in
flight under the worst case (every draft accepted), trimmed when the accepted counts arrive, leaves
the request's computed tokens and block table exactly as the synchronous schedule would, never
reserves less than the step really runs, and never more drafts than max_tokens leaves room for."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.cache.kv_cache_manager import KVCacheManager
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.reservation import reserve, trim, worst_case_drafts

K, BT, MAX_LEN = 5, 4, 256


@pytest.mark.parametrize("seed", range(8))
def test_reserve_then_trim_equals_the_synchronous_bookkeeping(seed):
    rng = np.random.default_rng(seed)
    max_tokens = int(rng.integers(8, 40))
    kv = KVCacheManager(num_blocks=64, block_tokens=BT, num_ring_slots=2)
    prompt = list(range(int(rng.integers(3, 20))))
    req = Request("r", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    # prefill, then step N = the first verify step (k drafts), scheduled synchronously
    known = len(prompt) + 1                         # the prefill sampled one token
    req.all_token_ids.append(0)
    k = min(K, max_tokens - 2)
    req.num_computed_tokens = known + k             # anchor + k drafts from position known - 1
    assert kv.allocate_slots("r", req.num_computed_tokens) is not None
    req.num_output_placeholders = 1
    steps = 0
    while True:
        kn = worst_case_drafts(req, k, K, MAX_LEN)
        a = int(rng.integers(0, k + 1))             # what step N will turn out to accept
        outputs_after_n = req.num_output_tokens + a + 1
        if kn is None:                              # may be done: the synchronous path takes over
            assert req.num_output_tokens + 1 + k >= max_tokens
            break
        # the synchronous schedule of N+1, once N is known, verifies at least as many drafts
        sync_k = min(K, max_tokens - outputs_after_n - 1)
        assert 0 <= kn <= sync_k
        # schedule N+1 on the worst case, before N's counts are known
        assert reserve(kv, req, kn) is not None
        req.num_computed_tokens += 1 + kn
        reserved_end = req.num_computed_tokens
        # N resolves: a accepted, k - a rejected; N+1 in flight really runs from known + a
        req.all_token_ids += [0] * (a + 1)
        trim(kv, req, k - a)
        sync_computed = (known + a + 1) - 1 + 1 + kn     # N+1 scheduled on N's real outcome
        assert req.num_computed_tokens == sync_computed <= reserved_end
        assert len(kv.block_ids["r"]) == kv.num_blocks_for(sync_computed)
        kv.check()
        known, k, steps = known + a + 1, kn, steps + 1
        if req.num_output_tokens + 1 + k > max_tokens:
            break
    assert steps >= 1 or max_tokens - req.num_output_tokens <= K + 1
    kv.free("r")
    assert kv.num_used_blocks == 0


def test_no_reservation_for_a_request_that_may_be_done():
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    req.all_token_ids += [7, 8]                     # 2 outputs; a step with 3 drafts + 1 sample in flight
    req.num_output_placeholders = 1
    assert worst_case_drafts(req, 3, K, MAX_LEN) is None      # 2 + 1 + 3 = 6: may have reached max_tokens
    assert worst_case_drafts(req, 2, K, MAX_LEN) == 0         # 5 at most: one more sample, no drafts
    assert worst_case_drafts(req, 0, K, MAX_LEN) == 2
