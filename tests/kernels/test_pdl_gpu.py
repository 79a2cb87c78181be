"""Programmatic dependent launch of the step's Triton kernels (kernels/pdl.py): a chain of dependent PDL
kernels computes what the plain chain does, PDL is asked for only inside graph captures, and the decode
step replayed from a graph captured with PDL gives the logits of the eager plain step bit for bit, on the
tiny and small presets, as the caches fill."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from deepinfer.kernels import pdl
from deepinfer.model import side_stream
from deepinfer.model.loader import load_model
from tests.conftest import captured_graph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "perf"))

import bench_model_decode as bench  # noqa: E402
import bench_pdl_chain  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs an SM90+ GPU")


def test_pdl_chain_equals_plain_chain(sm90):
    bench_pdl_chain.check_chain(1 << 20, 51)       # raises where a kernel read its predecessor's buffer early


def test_pdl_only_in_graph_captures(sm90):
    assert pdl.pdl_args() == {}                    # eager: a plain launch
    seen = []
    g = torch.cuda.CUDAGraph()
    x = torch.zeros(8, device="cuda")
    with torch.cuda.graph(g):
        seen.append(pdl.pdl_args())
        x += 1
    assert seen == [{"PDL": True, "launch_pdl": True}]


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_decode_step_with_pdl_equals_without(sm90, preset, tiny_checkpoint, small_checkpoint, monkeypatch):
    from deepinfer.cache.model_caches import ModelCaches
    model = load_model(tiny_checkpoint if preset == "tiny" else small_checkpoint, device="cuda", progress=False)
    B = 24
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(side_stream, "ENABLED", False)      # PDL alone (test_side_stream_gpu.py: the two together)
    caches = ModelCaches.allocate(model.args, B, B * 4, 64, "cuda", scratch=True)
    with torch.inference_mode():
        for i in range(6):          # each step reads the caches the steps before it filled
            step = bench.decode_step(model, caches, B, 120 + i, 256, 64)
            want = step().clone()
            g, out = captured_graph(step)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want), f"step {i}: the PDL graph's logits differ from the plain step's"
