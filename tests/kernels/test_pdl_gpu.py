"""Programmatic dependent launch of the step's Triton kernels (kernels/pdl.py): a chain of dependent PDL
kernels computes what the plain chain does, and the whole decode step with PDL on (eager and replayed
from a CUDA graph) gives the logits of the step with PDL off, bit for bit, on the tiny and small presets."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from deepinfer.kernels import pdl
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
    assert pdl.pdl_args() == {"PDL": True, "launch_pdl": True}
    bench_pdl_chain.check_chain(1 << 20, 51)       # raises where a kernel read its predecessor's buffer early


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_decode_step_with_pdl_equals_without(sm90, preset, tiny_checkpoint, small_checkpoint, monkeypatch):
    from deepinfer.cache.model_caches import ModelCaches
    model = load_model(tiny_checkpoint if preset == "tiny" else small_checkpoint, device="cuda", progress=False)
    B = 24
    logits = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", on)
        caches = ModelCaches.allocate(model.args, B, B * 4, 64, "cuda", scratch=True)
        with torch.inference_mode():
            for i in range(6):          # fills the caches the later steps read
                step = bench.decode_step(model, caches, B, 120 + i, 256, 64)
                logits[on, i] = step().clone()
            if on:
                g, out = captured_graph(step)
                g.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, logits[False, 5]), "the PDL graph's logits differ from the plain step's"
    for i in range(6):
        assert torch.equal(logits[True, i], logits[False, i]), f"step {i}: PDL changed the logits"
