"""Prefix caching's bookkeeping without a model: the hash chain, shared blocks, LRU eviction of
idle cached blocks, salts, and window-snapshot lookup."""

import pytest

from deepinfer.cache.block_hash import extend_block_hashes, root_hash
from deepinfer.cache.block_pool import BlockPool
from deepinfer.cache.kv_cache_manager import KVCacheManager
from deepinfer.cache.snapshot_index import SnapshotIndex


def hashes(tokens, bt=4, salt=None):
    return extend_block_hashes([], tokens, bt, salt)


def test_hash_chain_names_the_whole_prefix():
    a = hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(a) == 2                                  # full blocks only
    b = hashes([1, 2, 3, 4, 5, 6, 7, 8])
    assert a == b
    c = hashes([0, 2, 3, 4, 5, 6, 7, 8])                # block 1 equal, block 0 differs
    assert c[0] != a[0] and c[1] != a[1]
    assert hashes([1, 2, 3, 4], salt="t1") != hashes([1, 2, 3, 4], salt="t2") != hashes([1, 2, 3, 4])
    assert root_hash(None) != root_hash("")             # no salt is not the empty salt
    grow = hashes([1, 2, 3, 4])
    extend_block_hashes(grow, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert grow == a
    # the image hook: the same ids with other image content are other blocks
    img = extend_block_hashes([], [1, 2, 3, 4], 4, extra_keys=lambda k: b"image-sha")
    assert img != hashes([1, 2, 3, 4])


def test_pool_idle_cached_blocks_are_lru_and_reclaimed():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"A") and pool.cache(b, b"B")
    assert not pool.cache(b, b"A")                       # content cached elsewhere already
    pool.free([a, b])                                    # tail first: b is older in the LRU
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0 and pool.num_idle_cached_blocks == 2
    pool.check()
    assert pool.lookup(b"A") == a
    fresh = pool.allocate(3)                             # 2 plain free blocks, then the LRU idle one (b)
    assert b in fresh and a not in fresh and pool.lookup(b"B") is None and pool.num_evictions == 1
    pool.touch([a])                                      # a hit revives the idle block
    assert pool.ref_count(a) == 1 and pool.num_free_blocks == 0
    assert pool.allocate(1) is None
    pool.free(fresh[:1])                                 # never hashed: plainly free, not shareable
    with pytest.raises(RuntimeError, match="not cached"):
        pool.touch(fresh[:1])
    pool.free(fresh[1:] + [a])
    pool.check()
    assert pool.clear_cache() == 1 and pool.lookup(b"A") is None
    pool.check()


def test_manager_shares_blocks_by_reference():
    kv = KVCacheManager(8, 4, num_ring_slots=4, enable_prefix_caching=True)
    toks = list(range(100, 111))                          # 11 tokens: 2 full blocks
    h = hashes(toks)
    assert kv.allocate_slots("a", 11) is not None
    kv.cache_full_blocks("a", h, 11)
    hit = kv.find_cached_blocks(h, 2)
    assert hit == kv.block_ids["a"][:2]
    new = kv.allocate_slots("b", 11, cached_blocks=hit)
    assert len(new) == 1 and kv.block_ids["b"][:2] == hit
    assert [kv.pool.ref_count(x) for x in hit] == [2, 2]
    kv.check()
    kv.free("a")
    assert [kv.pool.ref_count(x) for x in hit] == [1, 1]  # still referenced by b: never freed
    kv.free("b")
    assert kv.num_used_blocks == 0 and kv.pool.num_idle_cached_blocks == 2
    kv.check()
    # a hit on idle blocks must also leave room for the fresh ones, or take nothing
    kv2 = KVCacheManager(3, 4, num_ring_slots=2, enable_prefix_caching=True)
    kv2.allocate_slots("a", 8)
    kv2.cache_full_blocks("a", h, 8)
    kv2.free("a")
    hit = kv2.find_cached_blocks(h, 2)
    assert kv2.allocate_slots("b", 16, cached_blocks=hit) is None   # 2 idle hits + 2 new > 3 blocks
    assert kv2.pool.num_idle_cached_blocks == 2 and "b" not in kv2.block_ids
    kv2.check()


def test_salts_never_share():
    kv = KVCacheManager(8, 4, num_ring_slots=4, enable_prefix_caching=True)
    toks = list(range(8))
    kv.allocate_slots("a", 8)
    kv.cache_full_blocks("a", hashes(toks, salt="tenant-1"), 8)
    assert kv.find_cached_blocks(hashes(toks, salt="tenant-2"), 2) == []
    assert kv.find_cached_blocks(hashes(toks), 2) == []
    assert len(kv.find_cached_blocks(hashes(toks, salt="tenant-1"), 2)) == 2


def test_snapshot_index_lru_ttl_and_tail_match():
    now = [0.0]
    idx = SnapshotIndex(2, block_tokens=4, ttl_s=10, clock=lambda: now[0])
    s0 = idx.add(b"p", 6, (5, 6))
    s1 = idx.add(b"p", 7, (5, 6, 7))
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    assert idx.find(b"p", toks, 4, 7).slot == s1          # the longest that matches
    assert idx.find(b"p", toks, 4, 6).slot == s0          # capped by max_tokens
    assert idx.find(b"p", [1, 2, 3, 4, 5, 9, 7, 8], 4, 7) is None
    assert idx.find(b"q", toks, 4, 7) is None
    idx.find(b"p", toks, 4, 6)                            # s0 used last: s1 is the LRU one
    s2 = idx.add(b"r", 4, ())
    assert s2 == s1 and idx.find(b"p", toks, 4, 7).num_tokens == 6 and idx.num_evictions == 1
    now[0] = 11.0
    assert idx.find(b"p", toks, 4, 7) is None             # expired
    assert SnapshotIndex(0, 4).add(b"p", 4, ()) is None
