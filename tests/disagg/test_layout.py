"""CacheLayout: the runs of one request cover exactly its state. Copying the runs byte for byte
(what a NIXL READ does) from one ModelCaches to another, at other slot and block ids, gives the
second the same ring rows (last min(n, RING) positions), carry rows and compressed blocks."""

from __future__ import annotations

import ctypes

import pytest
import torch

from deepinfer.cache.model_caches import ModelCaches
from deepinfer.disagg.layout import CacheLayout, ring_runs
from deepinfer.model.args import ModelArgs


@pytest.mark.parametrize("n, ring, runs", [
    (0, 8, []), (3, 8, [(0, 3)]), (8, 8, [(0, 8)]), (11, 8, [(0, 8)]), (17, 8, [(0, 8)]),
])
def test_ring_runs(n, ring, runs):
    assert ring_runs(n, ring) == runs
    assert sum(c for _, c in runs) == min(n, ring)


@pytest.fixture(scope="module")
def model_args(tiny_checkpoint):
    return ModelArgs.from_checkpoint(str(tiny_checkpoint))


@pytest.mark.parametrize("n", [5, 64, 130, 300])
def test_copying_the_runs_moves_exactly_the_request_state(model_args, n):
    bt = 16
    src = ModelCaches.allocate(model_args, 3, 40, bt)
    dst = ModelCaches.allocate(model_args, 4, 50, bt)
    gen = torch.Generator().manual_seed(n)
    for t in [*src.window_kv, *src.carry_kv.values(), *src.carry_score.values(), *src.compressed_kv.values(),
              *src.index_k.values()]:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    nb = -(-n // bt)
    src_blocks, dst_blocks = list(range(40 - nb, 40))[::-1], list(range(3, 3 + nb))
    a, b = CacheLayout(src), CacheLayout(dst)
    assert a.signature == b.signature
    remote = b.runs(n, 2, src_blocks, a.base_addrs())
    local = b.runs(n, 1, dst_blocks)
    assert [ln for _, ln, _ in remote] == [ln for _, ln, _ in local]
    for (ra, ln, _), (la, _, _) in zip(remote, local):
        ctypes.memmove(la, ra, ln)
    ring = src.ring_len
    pos = torch.arange(max(0, n - ring), n)
    for s_t, d_t in zip([*src.window_kv, *src.carry_kv.values(), *src.carry_score.values()],
                        [*dst.window_kv, *dst.carry_kv.values(), *dst.carry_score.values()]):
        assert torch.equal(d_t[1, pos % ring], s_t[2, pos % ring])
        untouched = torch.ones(ring, dtype=torch.bool)
        untouched[pos % ring] = False
        assert not d_t[1, untouched].any() and not d_t[0].any()         # nothing else written
    for pools in ("compressed_kv", "index_k"):
        for src_id, s_t in getattr(src, pools).items():
            d_t = getattr(dst, pools)[src_id]
            assert torch.equal(d_t[dst_blocks], s_t[src_blocks])
            assert int((d_t != 0).any(-1).any(-1).sum()) <= nb
    ring_bytes, pool_bytes = b.num_bytes(n)
    assert ring_bytes + pool_bytes == sum(ln for _, ln, _ in local)


def test_layout_signature_differs_with_block_tokens(model_args):
    assert CacheLayout(ModelCaches.allocate(model_args, 2, 4, 16)).signature != \
        CacheLayout(ModelCaches.allocate(model_args, 2, 4, 32)).signature
