"""CacheLayout: the runs of one request cover exactly the state a later step reads. Copying the runs
byte for byte (what a NIXL READ does) from one ModelCaches to another, at other slot and block ids,
gives the second the same window rows (the last WINDOW positions), carry rows (each unfinished
compressor group) and compressed blocks, and writes nothing else."""

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


@pytest.mark.parametrize("n, keep, runs", [
    (0, 4, []), (3, 4, [(0, 3)]), (5, 4, [(1, 4)]), (8, 4, [(4, 4)]), (10, 4, [(6, 2), (0, 2)]),
    (13, 3, [(2, 3)]), (17, 0, []), (17, 7, [(2, 6), (0, 1)]), (17, 8, [(0, 8)]),
])
def test_ring_runs_keep_the_last_positions(n, keep, runs):
    """keep < RING: the last `keep` positions, two runs where they wrap past the ring's end."""
    ring = 8
    assert ring_runs(n, ring, keep) == runs
    rows = [r for first, count in runs for r in range(first, first + count)]
    assert sorted(rows) == sorted(p % ring for p in range(max(0, n - keep), n))


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
    window = [(s, d, ring // 2) for s, d in zip(src.window_kv, dst.window_kv)]
    carry = [(src.carry_kv[L], dst.carry_kv[L], n % src.ratios[L]) for L in src.carry_kv]
    carry += [(src.carry_score[L], dst.carry_score[L], n % src.ratios[L]) for L in src.carry_score]
    assert window and carry
    for s_t, d_t, keep in window + carry:        # the window's last positions, each carry's unfinished group
        pos = torch.arange(max(0, n - keep), n)
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


@pytest.mark.parametrize("n", [5, 130])
def test_a_mirror_computes_the_same_runs_and_sizes_without_the_caches(model_args, n):
    """CacheLayout.mirror(describe()): what an engine computes for a rank worker's caches (meta tensors,
    that process's addresses) equals what the rank would; the remote runs carry the peer's device id."""
    caches = ModelCaches.allocate(model_args, 3, 40, 16)
    real = CacheLayout(caches)
    mirror = CacheLayout.mirror(real.describe())
    assert all(r.tensor.device.type == "meta" for r in mirror.regions)
    assert mirror.signature == real.signature and mirror.base_addrs() == real.base_addrs()
    assert mirror.num_bytes(n) == real.num_bytes(n) and mirror.num_bytes(n, False) == real.num_bytes(n, False)
    blocks = [7, 2, 30, 11, 5, 9, 1, 3, 4]
    assert mirror.runs(n, 2, blocks) == real.runs(n, 2, blocks)
    assert mirror.runs(n, 1, blocks, window=False) == real.runs(n, 1, blocks, window=False)
    remote = mirror.runs(n, 1, blocks, [a + 4096 for a in real.base_addrs()], dev_id=3)
    assert {d for _, _, d in remote} == {3}
    assert [(a - 4096, ln) for a, ln, _ in remote] == [(a, ln) for a, ln, _ in real.runs(n, 1, blocks)]


def test_params_without_a_device_id_read_as_device_0():
    from deepinfer.disagg.params import KVTransferParams
    p = KVTransferParams("agent", "127.0.0.1", 5, "r", 3, 9, 0, (1,), 7, (100, 200), 300, "sig", 10, dev_id=2)
    d = p.to_dict()
    assert KVTransferParams.from_dict(d) == p
    del d["dev_id"]
    assert KVTransferParams.from_dict(d).dev_id == 0
