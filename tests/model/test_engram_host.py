"""engram_placement="host" (model/host_tables.py): the Engram tables stay in host memory and give the device
tables' rows and the same tokens; bad host memory is a clear error. Rank workers' one shared copy:
tests/parallel/test_dp_engine.py; the GPU reading the host rows: tests/model/test_engram_host_gpu.py."""

import os

import pytest
import torch

from deepinfer.config import EngineArgs
from deepinfer.llm import LLM
from deepinfer.model import host_tables
from deepinfer.model.loader import load_model
from deepinfer.sampling_params import SamplingParams


def _tables(model):
    return [layer.engram.embed for layer in model.layers if layer.engram is not None]


def test_host_tables_hold_the_device_rows(tiny_checkpoint, monkeypatch):
    """Filled a few rows at a time (a chunk boundary inside the table), the host rows and their lookups equal the
    device placement's, and the tables are not the model's buffers (Module.to() leaves them in host memory)."""
    monkeypatch.setattr(host_tables, "FILL_ROWS", 7)
    dev = load_model(tiny_checkpoint, device="cpu", progress=False)
    host = load_model(tiny_checkpoint, device="cpu", progress=False, engram_placement="host")
    pairs = list(zip(_tables(dev), _tables(host)))
    assert pairs and all(isinstance(h, host_tables.HostEngramTable) for _, h in pairs)
    buffers = {b.data_ptr() for b in host.buffers()}
    g = torch.Generator().manual_seed(0)
    for d, h in pairs:
        assert h.weight.shape == d.weight.shape and h.weight.shape[0] > 7
        assert torch.equal(h.weight.view(torch.uint8), d.weight.view(torch.uint8))
        assert torch.equal(h.scale, d.scale)
        assert h.weight.data_ptr() not in buffers and h.scale.data_ptr() not in buffers
        R = d.weight.shape[0]
        ids = torch.randint(0, R, (5, 24), generator=g)
        ids[0, :2] = torch.tensor([0, R - 1])
        assert torch.equal(h(ids), d(ids))


def test_host_placement_generates_the_same_tokens(tiny_checkpoint):
    prompts = [[0, 128803, 19923 + 7 * i, 128804, 128822] + list(range(100 + i, 100 + 5 * i)) for i in range(1, 4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = LLM(str(tiny_checkpoint), device="cpu", max_num_seqs=4).generate(prompts, params)
    llm = LLM(str(tiny_checkpoint), device="cpu", max_num_seqs=4, engram_placement="host")
    assert all(isinstance(t, host_tables.HostEngramTable) for t in _tables(llm.engine.runner.model))
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_a_small_shm_is_a_clear_error(tmp_path, monkeypatch):
    """A /dev/shm without room for a table refuses before writing (a tmpfs that fills mid-write kills the process
    with SIGBUS), and leaves no file."""
    monkeypatch.setattr(host_tables, "SHM_DIR", str(tmp_path))
    real = os.statvfs(str(tmp_path))

    class Small:
        f_bavail, f_frsize = 1, real.f_frsize
    monkeypatch.setattr(host_tables.os, "statvfs", lambda p: Small)
    share = host_tables.TableShare("deepinfer-engram-test", rank=0)
    with pytest.raises(host_tables.HostMemoryError, match="shm-size"):
        host_tables.host_bytes(1 << 20, lambda t: t.fill_(1), share, "layer1.weight")
    assert list(tmp_path.iterdir()) == []


def test_a_table_over_the_available_memory_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(host_tables, "available_memory", lambda: 1 << 20)
    with pytest.raises(host_tables.HostMemoryError, match="host memory"):
        host_tables.host_bytes(2 << 20, lambda t: t.fill_(1), None, "layer1.weight")


def test_leftovers_are_removed_by_prefix(tmp_path, monkeypatch):
    monkeypatch.setattr(host_tables, "SHM_DIR", str(tmp_path))
    for name in ("deepinfer-engram-1-ab-layer1.weight", "deepinfer-engram-1-ab-layer1.scale", "deepinfer-engram-2-cd-x"):
        (tmp_path / name).write_bytes(b"x")
    host_tables.remove_leftovers("deepinfer-engram-1-ab")
    assert [p.name for p in tmp_path.iterdir()] == ["deepinfer-engram-2-cd-x"]


def test_engram_placement_is_checked():
    with pytest.raises(ValueError, match="'device', 'sharded' or 'host'"):
        EngineArgs(checkpoint="x", engram_placement="disk")
    assert EngineArgs(checkpoint="x", engram_placement="host").resolved_engram_placement() == "host"


def test_rank_zero_removes_a_killed_drivers_names(tmp_path, monkeypatch):
    """A driver killed outright never runs its stop: rank 0 removes its lockstep segment and the host tables'
    leftovers as it exits (parallel/worker.py); the other ranks leave them to it."""
    from deepinfer.parallel import lockstep, worker
    monkeypatch.setattr(host_tables, "SHM_DIR", str(tmp_path))
    monkeypatch.setattr(lockstep, "SHM_DIR", str(tmp_path))
    names = ["deepinfer-lockstep-7-ab", "deepinfer-engram-7-cd-layer1.weight", "deepinfer-engram-8-ef-layer1.weight"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    spec = worker.WorkerSpec(1, 2, "tcp://x", "gloo", "cpu", 1, 7, "deepinfer-lockstep-7-ab", "deepinfer-engram-7-cd")
    worker._remove_driver_names(spec)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    spec.rank = 0
    worker._remove_driver_names(spec)
    assert [p.name for p in tmp_path.iterdir()] == ["deepinfer-engram-8-ef-layer1.weight"]
