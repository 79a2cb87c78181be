"""Prefix caching on CUDA, where the engine schedules asynchronously (a finished request's last
step is still in flight when its snapshot is decided) and the snapshot / host-tier stores are
pinned host memory copied on the stream: the snapshot hit stays bit-identical to a cold run under
batch_invariant, replay never reads window keys below its start (CUDA graphs on), and an onloaded
host-tier hit equals the device one.

    pytest -m gpu tests/engine/test_prefix_cache_gpu.py -q
"""

import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from tests.engine.test_prefix_cache import GREEDY, prompt

pytestmark = pytest.mark.gpu


def llm(ckpt, **kw):
    base = dict(device="cuda", max_num_seqs=8, max_num_batched_tokens=512, block_tokens=8, num_cache_blocks=96)
    return LLM(str(ckpt), **{**base, **kw})


@pytest.fixture(autouse=True)
def need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def test_snapshot_hit_bit_identical_on_cuda(tiny_checkpoint):
    p1, extra = prompt(300, 11), prompt(40, 12)
    warm = llm(tiny_checkpoint, batch_invariant=True, enable_prefix_caching=True)
    assert warm.engine.async_scheduling
    t1 = warm.generate(p1, GREEDY)[0]
    p2 = p1 + t1.token_ids + extra
    hot = warm.generate(p2, GREEDY, return_logits=True)[0]
    assert warm.stats()["counters"]["prefix_cache_snapshot_hits_total"] == 1
    assert hot.num_cached_tokens == len(p1) + len(t1.token_ids) - 1
    cold = llm(tiny_checkpoint, batch_invariant=True).generate(p2, GREEDY, return_logits=True)[0]
    assert hot.token_ids == cold.token_ids and np.array_equal(hot.logits, cold.logits)


def test_replay_clip_and_host_tier_on_cuda(tiny_checkpoint):
    p1, extra = prompt(301, 13), prompt(20, 14)
    H = len(p1) // 8 * 8          # full blocks of 8 (llm's block_tokens): 296

    def run(poison=False, **kw):
        eng = llm(tiny_checkpoint, enable_prefix_caching=True, window_snapshot_bytes=0, **kw)
        eng.generate(p1, SamplingParams(max_tokens=1, temperature=0))
        if "host_cache_bytes" in kw:   # push turn 1's blocks out of the small device cache
            eng.generate(prompt(320, 15), SamplingParams(max_tokens=1, temperature=0))
        if poison:
            for ring in eng.engine.caches.window_kv:
                ring.fill_(3e4)
        out = eng.generate(p1 + extra, GREEDY, return_logits=True)[0]
        assert out.num_cached_tokens == H
        return eng, out

    _, clean = run()
    _, poisoned = run(poison=True)
    assert np.allclose(poisoned.logits, clean.logits, atol=1e-3, rtol=0), np.abs(poisoned.logits - clean.logits).max()
    eng, host = run(num_cache_blocks=48, host_cache_bytes=64 << 20)
    assert eng.stats()["counters"]["prefix_cache_host_hits_total"] > 0
    assert host.token_ids == clean.token_ids
    assert np.allclose(host.logits, clean.logits, atol=1e-3, rtol=0)
