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


def test_fused_sublayer_input_gives_the_same_logits(model, monkeypatch):
    """A sublayer's hc_post, the next sublayer's collapse and norm as one kernel with that sublayer's mixes on a
    side stream, across blocks too
    (block.FUSE_SUBLAYER_INPUT, on by default): eager and captured steps give the three kernels' logits bit for bit."""
    from deepinfer.cache.model_caches import ModelCaches
    from deepinfer.model import block
    caches = ModelCaches.allocate(model.args, 24, 96, 64, "cuda", scratch=True)
    got, taps = {}, {}
    with torch.inference_mode():
        for on in (False, True):
            monkeypatch.setattr(block, "FUSE_SUBLAYER_INPUT", on)
            taps[on] = bench.decode_step(model, caches, 24, CTX0, 256, 64, full=True)().main_hidden.clone()
            step = bench.decode_step(model, caches, 24, CTX0, 256, 64)
            want = step().clone()
            g, out = captured_graph(step)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want), f"fused sublayer input {on}: the graph's logits differ from inline"
            got[on] = want
    assert torch.equal(got[True], got[False])
    assert torch.equal(taps[True], taps[False])                 # the DSpark taps (the kernel's mean)
