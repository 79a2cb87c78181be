"""Prefix caching on the real tiny model (CPU): a second turn that hits a window snapshot is
bit-identical to a cold run under batch_invariant=True; a hit on blocks alone runs bounded replay,
which never reads a window key below its start; cached tokens are reported; bad input is refused."""

import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.request import InvalidRequestError

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def engine_args(ckpt, **kw):
    return {**dict(checkpoint=str(ckpt), device="cpu", max_num_seqs=4, max_num_batched_tokens=512,
                   block_tokens=8, num_cache_blocks=96), **kw}


def llm(ckpt, **kw):
    a = engine_args(ckpt, **kw)
    return LLM(a.pop("checkpoint"), **a)


def prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 120000, n).tolist()


@pytest.fixture(scope="module")
def turns():
    p1 = prompt(137, 1)                       # 17 blocks of 8: the hit H = 136 > the window, s = 8
    return p1, prompt(9, 2)


def test_snapshot_hit_is_bit_identical_to_cold(tiny_checkpoint):
    p1, extra = prompt(61, 3), prompt(13, 4)     # short: batch-invariant GEMMs run row by row on a CPU
    warm = llm(tiny_checkpoint, batch_invariant=True, enable_prefix_caching=True)
    t1 = warm.generate(p1, GREEDY)[0]
    p2 = p1 + t1.token_ids + extra
    hot = warm.generate(p2, GREEDY, return_logits=True)[0]
    c = warm.stats()["counters"]
    assert c["prefix_cache_snapshot_hits_total"] == 1 and c["prefix_cache_replayed_tokens_total"] == 0
    assert hot.num_cached_tokens == len(p1) + len(t1.token_ids) - 1
    cold = llm(tiny_checkpoint, batch_invariant=True).generate(p2, GREEDY, return_logits=True)[0]
    assert cold.num_cached_tokens == 0
    assert hot.token_ids == cold.token_ids
    assert np.array_equal(hot.logits, cold.logits)      # bitwise
    # turn 2 computed only its new tokens (and the one turn 1 never ran)
    assert c["computed_tokens_total"] == (len(p1) + len(t1.token_ids) - 1) + (len(extra) + 1) + len(hot.token_ids) - 1


def test_block_hit_runs_bounded_replay(tiny_checkpoint, turns):
    p1, extra = turns
    eng = llm(tiny_checkpoint, enable_prefix_caching=True, window_snapshot_bytes=0)
    eng.generate(p1, SamplingParams(max_tokens=1, temperature=0))
    p2 = p1 + extra
    cold = llm(tiny_checkpoint).generate(p2, GREEDY, return_logits=True)[0]
    before = eng.stats()["counters"]["computed_tokens_total"]
    out = eng.generate(p2, GREEDY, return_logits=True, forced_token_ids=[cold.token_ids])[0]
    c = eng.stats()["counters"]
    H = (len(p1) // 8) * 8                                 # 144: full blocks of turn 1
    assert out.num_cached_tokens == H
    assert c["prefix_cache_replayed_tokens_total"] == 128
    assert c["computed_tokens_total"] - before == (len(p2) - (H - 128)) + len(out.token_ids) - 1
    assert eng.stats()["gauges"]["prefix_cache_hit_rate"] > 0
    # approximate by design, but the same model: teacher-forced, the logits stay close to the cold run's
    cos = (out.logits * cold.logits).sum(-1) / np.linalg.norm(out.logits, axis=-1) / np.linalg.norm(cold.logits, axis=-1)
    assert cos.min() > 0.9, cos


def test_replay_never_reads_window_keys_before_its_start(tiny_checkpoint, turns, monkeypatch):
    """Poison every window ring after turn 1 (huge finite values: a pad's zero weight still
    cancels them): the replay rebuilds positions >= s before anything reads them, so its logits
    equal those of the unpoisoned run bit for bit; with the window floor ignored they do not."""
    p1, extra = turns

    def run(poison):
        eng = llm(tiny_checkpoint, enable_prefix_caching=True, window_snapshot_bytes=0)
        eng.generate(p1, SamplingParams(max_tokens=1, temperature=0))
        if poison:
            for ring in eng.engine.caches.window_kv:
                ring.fill_(3e4)
        out = eng.generate(p1 + extra, SamplingParams(max_tokens=2, temperature=0), return_logits=True)[0]
        assert out.num_cached_tokens == 136
        return out.logits

    clean = run(False)
    assert np.array_equal(run(True), clean)
    import deepinfer.model.step_metadata as sm
    lists = sm._window_lists
    monkeypatch.setattr(sm, "_window_lists", lambda *a: lists(*a[:8], device=a[9]))   # drops the floor
    assert not np.allclose(run(True), clean, atol=1e-2)


def test_salts_isolate_and_bad_salt_is_refused(tiny_checkpoint):
    p1, extra = prompt(20, 5), prompt(3, 6)
    eng = llm(tiny_checkpoint, enable_prefix_caching=True)
    eng.generate(p1, SamplingParams(max_tokens=1, temperature=0), cache_salt="tenant-a")
    assert eng.generate(p1 + extra, GREEDY, cache_salt="tenant-b")[0].num_cached_tokens == 0
    assert eng.generate(p1 + extra, GREEDY)[0].num_cached_tokens == 0
    assert eng.generate(p1 + extra, GREEDY, cache_salt="tenant-a")[0].num_cached_tokens > 0
    for bad in (7, b"x", ""):
        with pytest.raises(InvalidRequestError, match="cache_salt"):
            eng.generate(p1, GREEDY, cache_salt=bad)
    assert not eng.engine.scheduler.requests
    eng.engine.kv_cache.check()
    assert eng.engine.kv_cache.num_used_blocks == 0


def test_replay_below_the_window_is_refused_at_start(tiny_checkpoint):
    with pytest.raises(ValueError, match="swa_replay_tokens"):
        llm(tiny_checkpoint, enable_prefix_caching=True, swa_replay_tokens=64)


def test_host_tier_brings_evicted_blocks_back(tiny_checkpoint, turns):
    """A device cache too small to keep turn 1's blocks past another request: they go to the host
    tier and come back on the hit, and the result equals the same replay hit from device blocks."""
    p1, extra = turns
    small = llm(tiny_checkpoint, enable_prefix_caching=True, window_snapshot_bytes=0, num_cache_blocks=24,
                host_cache_bytes=1 << 20)
    small.generate(p1, SamplingParams(max_tokens=1, temperature=0))
    small.generate(prompt(150, 9), SamplingParams(max_tokens=1, temperature=0))   # evicts turn 1's blocks
    out = small.generate(p1 + extra, GREEDY, return_logits=True)[0]
    c = small.stats()["counters"]
    assert c["prefix_cache_evictions_total"] > 0 and c["prefix_cache_host_offloads_total"] > 0
    assert c["prefix_cache_host_hits_total"] > 0 and out.num_cached_tokens == 136
    big = llm(tiny_checkpoint, enable_prefix_caching=True, window_snapshot_bytes=0)
    big.generate(p1, SamplingParams(max_tokens=1, temperature=0))
    ref = big.generate(p1 + extra, GREEDY, return_logits=True)[0]
    assert big.stats()["counters"]["prefix_cache_host_hits_total"] == 0 and ref.num_cached_tokens == 136
    assert out.token_ids == ref.token_ids and np.array_equal(out.logits, ref.logits)
    small.engine.kv_cache.check()
    small.engine.kv_cache.host.check()
    assert len(small.engine.kv_cache.host) <= small.engine.kv_cache.host.num_slots


def test_host_cache_larger_than_memory_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="host_cache_bytes"):
        llm(tiny_checkpoint, enable_prefix_caching=True, host_cache_bytes=1 << 50)
