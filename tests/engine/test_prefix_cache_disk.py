"""The prefix cache's disk tier (cache/disk_tier.py) under a host tier of two blocks: blocks the host
tier evicts are written to files, read back on a hit with the same bits, the file count stays
within disk_cache_bytes, and bad settings are refused at start."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.cache.disk_tier import DiskTierIndex

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0)


def prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 120000, n).tolist()


def llm(ckpt, **kw):
    return LLM(str(ckpt), device="cpu", max_num_seqs=4, max_num_batched_tokens=512, block_tokens=8,
               enable_prefix_caching=True, window_snapshot_bytes=0, **kw)


def block_bytes(ckpt) -> int:
    from deepinfer.cache.model_caches import ModelCaches
    from deepinfer.model.args import ModelArgs
    return ModelCaches.bytes_per_block(ModelArgs.from_checkpoint(ckpt), 8, torch.bfloat16)


def test_disk_tier_lru_is_bounded():
    d = DiskTierIndex(3)
    assert d.put(b"a") == [] and d.put(b"b") == [] and d.put(b"a") is None   # held already
    assert d.has(b"a")                                                        # a is now the newest
    assert d.put(b"c") == [] and d.put(b"d") == [b"b"] and len(d) == 3
    assert not d.has(b"b") and d.num_evictions == 1
    assert DiskTierIndex(0).put(b"x") is None


def test_blocks_spilled_to_disk_come_back_bit_identical(tiny_checkpoint, tmp_path):
    per = block_bytes(tiny_checkpoint)
    p1, extra = prompt(137, 1), prompt(9, 2)                  # 17 full blocks of 8
    small = llm(tiny_checkpoint, num_cache_blocks=24, host_cache_bytes=2 * per,
                disk_cache_dir=str(tmp_path), disk_cache_bytes=64 * per)
    small.generate(p1, ONE)
    small.generate(prompt(150, 9), ONE)                       # evicts p1's blocks: host (2) -> disk
    kv = small.engine.kv_cache
    files = os.listdir(small.engine.runner.disk_blocks.dir)
    assert kv.num_spills > 0 and len(files) == len(kv.disk) <= kv.disk.num_blocks
    out = small.generate(p1 + extra, GREEDY, return_logits=True)[0]
    c = small.stats()["counters"]
    assert c["prefix_cache_disk_spills_total"] > 0 and c["prefix_cache_disk_hits_total"] > 0
    assert out.num_cached_tokens == 136
    big = llm(tiny_checkpoint, num_cache_blocks=96)
    big.generate(p1, ONE)
    ref = big.generate(p1 + extra, GREEDY, return_logits=True)[0]
    assert ref.num_cached_tokens == 136
    assert out.token_ids == ref.token_ids and np.array_equal(out.logits, ref.logits)
    kv.check()
    kv.host.check()


def test_disk_tier_file_count_stays_bounded(tiny_checkpoint, tmp_path):
    per = block_bytes(tiny_checkpoint)
    eng = llm(tiny_checkpoint, num_cache_blocks=24, host_cache_bytes=2 * per,
              disk_cache_dir=str(tmp_path), disk_cache_bytes=5 * per)
    for seed in range(3):                                     # 3 x 17 blocks pushed down the tiers
        eng.generate(prompt(137, 20 + seed), ONE)
    eng.generate(prompt(150, 9), ONE)
    kv = eng.engine.kv_cache
    assert kv.disk.num_blocks == 5 and kv.disk.num_evictions > 0
    assert len(os.listdir(eng.engine.runner.disk_blocks.dir)) == len(kv.disk) <= 5


def test_bad_disk_settings_are_refused(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="host_cache_bytes"):
        llm(tiny_checkpoint, disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="disk_cache_dir"):
        llm(tiny_checkpoint, host_cache_bytes=1 << 20, disk_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="free space"):
        llm(tiny_checkpoint, host_cache_bytes=1 << 20, disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 60)
