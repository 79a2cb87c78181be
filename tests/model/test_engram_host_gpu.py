"""engram_placement="host" on a GPU (model/host_tables.py): the lookup kernel reads the registered host rows through
a CUDA view (no CPU gather), gives the device table's rows, and the model's captured decode step with host tables
gives the device placement's logits bit for bit."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from deepinfer.model import host_tables
from deepinfer.model.loader import load_model
from tests.conftest import captured_graph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "perf"))

import bench_model_decode as bench  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models(small_checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    return (load_model(small_checkpoint, device="cuda", progress=False),
            load_model(small_checkpoint, device="cuda", progress=False, engram_placement="host"))


def _tables(model):
    return [layer.engram.embed for layer in model.layers if layer.engram is not None]


def test_lookups_read_host_rows_through_a_cuda_view(models):
    dev, host = models
    g = torch.Generator(device="cuda").manual_seed(0)
    for d, h in zip(_tables(dev), _tables(host)):
        assert not h.weight.is_cuda and h._views is not None and h._views[0].is_cuda
        assert h._views[0].data_ptr() == h.weight.data_ptr()          # the host bytes themselves, not a copy
        R = d.weight.shape[0]
        for T in (1, 64, 1000):
            ids = torch.randint(0, R, (T, 24), device="cuda", generator=g)
            ids[0, 0] = R - 1
            assert torch.equal(h(ids), d(ids))
        assert not h._declined


def test_captured_decode_step_with_host_tables_equals_device(models):
    from deepinfer.cache.model_caches import ModelCaches
    outs = []
    with torch.inference_mode():
        for model in models:
            caches = ModelCaches.allocate(model.args, 8, 32, 64, "cuda", scratch=True)
            step = bench.decode_step(model, caches, 8, 100, 256, 64)
            want = step().clone()
            g, out = captured_graph(step)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)
            outs.append(want)
    assert torch.equal(outs[0], outs[1])


def test_a_table_cuda_cannot_map_falls_back_to_a_cpu_gather(models, monkeypatch):
    """Declined views (a platform without mapped host memory): the lookup gathers on the CPU, same rows."""
    dev, host = models
    d, h = _tables(dev)[0], _tables(host)[0]
    monkeypatch.setattr(h, "_views", None)
    monkeypatch.setattr(h, "_declined", False)
    ids = torch.randint(0, d.weight.shape[0], (16, 24), device="cuda")
    assert torch.equal(h(ids), d(ids)) and h._declined
    assert host_tables.cuda_view(torch.zeros(8, dtype=torch.uint8), torch.device("cuda")) is None   # unregistered
