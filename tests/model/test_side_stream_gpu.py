"""The decode step captured in a CUDA graph with its independent branches on the side stream
(model/side_stream.py: the shared expert, the compressor and indexer, Engram's projections, the mHC mixes'
tails) gives the inline eager step's logits bit for bit, on the tiny and small presets (Engram, KV / index
sources, a re-indexer), step after step as the caches the branches read and write fill up."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from deepinfer.model import side_stream
from deepinfer.model.loader import load_model
from tests.conftest import captured_graph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "perf"))

import bench_model_decode as bench  # noqa: E402

pytestmark = pytest.mark.gpu

CTX0, STEPS = 120, 8        # crosses ratio-2 group ends and the tiny window's edge


@pytest.fixture(scope="module", params=["tiny", "small"])
def model(request, tiny_checkpoint, small_checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    ckpt = tiny_checkpoint if request.param == "tiny" else small_checkpoint
    return load_model(ckpt, device="cuda", progress=False)


@pytest.mark.parametrize("B", [1, 24])
def test_side_stream_graph_step_equals_inline(model, B):
    from deepinfer.cache.model_caches import ModelCaches
    caches = ModelCaches.allocate(model.args, B, B * 4, 64, "cuda", scratch=True)
    with torch.inference_mode():
        for i in range(STEPS):
            step = bench.decode_step(model, caches, B, CTX0 + i, 256, 64)
            want = step().clone()                     # eager: inline (no fork outside a capture)
            before = side_stream.forked_branches
            g, out = captured_graph(step)
            # a shared expert a layer at least forked in the capture, none in the eager warm-up
            assert side_stream.forked_branches - before >= len(model.layers)
            for _ in range(2):      # the step rewrites the same cache rows: every replay gives the same logits
                g.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, want), f"step {i}: the side-stream graph's logits differ from inline"


def test_no_fork_when_disabled(model, monkeypatch):
    from deepinfer.cache.model_caches import ModelCaches
    monkeypatch.setattr(side_stream, "ENABLED", False)
    caches = ModelCaches.allocate(model.args, 4, 16, 64, "cuda", scratch=True)
    with torch.inference_mode():
        step = bench.decode_step(model, caches, 4, CTX0, 256, 64)
        want = step().clone()
        before = side_stream.forked_branches
        g, out = captured_graph(step)
        g.replay()
        torch.cuda.synchronize()
    assert side_stream.forked_branches == before
    assert torch.equal(out, want)


def test_kv_row_fork_changes_no_value(model, monkeypatch):
    """The attention's kv row forked beside wq_b (side_stream.KV_ROW, opt-in): the captured step still gives the
    inline step's logits bit for bit, and each layer forked one branch more than without it."""
    from deepinfer.cache.model_caches import ModelCaches
    caches = ModelCaches.allocate(model.args, 8, 32, 64, "cuda", scratch=True)
    forks = {}
    with torch.inference_mode():
        for on in (False, True):
            monkeypatch.setattr(side_stream, "KV_ROW", on)
            step = bench.decode_step(model, caches, 8, CTX0, 256, 64)
            want = step().clone()
            before = side_stream.forked_branches
            g, out = captured_graph(step)
            forks[on] = side_stream.forked_branches - before
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want), f"kv row fork {on}: the graph's logits differ from inline"
    assert forks[True] - forks[False] >= len(model.layers)


@pytest.mark.parametrize("lanes", [dict(ENGRAM_LANE=3), dict(ENGRAM_LANE=3, LANE_SMS={3: 16}),
                                   dict(LANE_SMS={0: 24, 1: 16})])
def test_engram_lane_and_capped_lanes_change_no_value(model, monkeypatch, lanes):
    """Engram's projections on a lane of their own, and lanes on a few SMs (green contexts): the captured step
    gives the inline step's logits bit for bit (same kernels, other SMs and order), replay after replay."""
    from deepinfer.cache.model_caches import ModelCaches
    from deepinfer.model import sm_partition
    for name, value in lanes.items():
        monkeypatch.setattr(side_stream, name, value)
    for lane, sms in lanes.get("LANE_SMS", {}).items():
        stream = sm_partition.capped_stream(torch.cuda.current_device(), sms)
        assert stream is not None, "no green-context stream on this GPU (driver 12.4+ makes one)"
        assert sm_partition.sms_of(stream) >= sms
    caches = ModelCaches.allocate(model.args, 8, 32, 64, "cuda", scratch=True)
    with torch.inference_mode():
        for i in range(3):
            step = bench.decode_step(model, caches, 8, CTX0 + i, 256, 64)
            want = step().clone()
            g, out = captured_graph(step)
            for _ in range(2):
                g.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, want), f"{lanes}, step {i}: the graph's logits differ from inline"


def test_capped_stream_keeps_its_kernels_on_its_sms():
    """A kernel of many programs on a capped stream runs on at most the SMs the green context was given (and
    fewer than the device has); on a plain stream it spreads over most of them. Eager and in a CUDA graph."""
    import triton
    import triton.language as tl

    from deepinfer.model import sm_partition

    if not torch.cuda.is_available():
        pytest.skip("no CUDA")

    @triton.jit
    def smid_kernel(out_ptr):
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out_ptr + tl.program_id(0), sm)

    dev = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(dev).multi_processor_count
    capped = sm_partition.capped_stream(dev, 16)
    assert capped is not None, "no green-context stream on this GPU (driver 12.4+ makes one)"
    given = sm_partition.sms_of(capped)
    assert 16 <= given < total

    def used(stream, graph=False):
        out = torch.full((4096,), -1, dtype=torch.int32, device="cuda")
        stream.wait_stream(torch.cuda.current_stream())
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fork = torch.cuda.current_stream()
                stream.wait_stream(fork)
                with torch.cuda.stream(stream):
                    smid_kernel[(4096,)](out)
                fork.wait_stream(stream)
            g.replay()
        else:
            with torch.cuda.stream(stream):
                smid_kernel[(4096,)](out)
        torch.cuda.synchronize()
        assert (out >= 0).all()
        return len(set(out.tolist()))

    assert used(torch.cuda.Stream()) > given
    assert used(capped) <= given
    assert used(capped, graph=True) <= given
