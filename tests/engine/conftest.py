"""Shared builders for engine tests (vLLM tests/v1/core/utils.py style): a real Scheduler on a
small block pool, requests, and runner outputs computed from the SchedulerOutput alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.cache.kv_cache_manager import KVCacheManager
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from deepinfer.sched.scheduler import Scheduler

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
if not SHARED.exists():
    SHARED = Path("/work/shared")


def create_scheduler(num_blocks=64, block_tokens=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=None):
    kv = KVCacheManager(num_blocks, block_tokens, max_num_seqs)
    return Scheduler(max_num_seqs, max_num_batched_tokens, max_model_len or num_blocks * block_tokens, kv)


def make_request(req_id, prompt_len, max_tokens=4, **kw):
    return Request(str(req_id), list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0), **kw)


def fake_runner_output(sched_out: SchedulerOutput, sched: Scheduler, token=7, accept=None) -> ModelRunnerOutput:
    """A token for every request whose scheduled tokens reach its end; `accept(req_id, drafts)`
    says how many drafts are accepted (default all)."""
    req_ids, sampled = [], []
    for req_id, n in sched_out.num_scheduled_tokens.items():
        req = sched.requests[req_id]
        req_ids.append(req_id)
        drafts = sched_out.spec_tokens.get(req_id, [])
        if req.num_computed_tokens - len(drafts) < req.num_tokens:  # computed already counts this step
            sampled.append([])
            continue
        a = len(drafts) if accept is None else accept(req_id, drafts)
        sampled.append(list(drafts[:a]) + [token])
    return ModelRunnerOutput(req_ids, sampled)


_built: dict[str, Path] = {}


def build_fixture(name: str, tmp_path_factory) -> Path:
    """A shared fixture's checkpoint, built into a temp dir once per session (about 5 s)."""
    if name in _built:
        return _built[name]
    src = SHARED / "fixtures" / name
    tool = SHARED / "tools" / "make-fixture"
    if not src.exists() or not tool.exists():
        pytest.skip(f"shared fixture {name} not found at {SHARED} (needs ../shared/fixtures and ../shared/tools)")
    out = tmp_path_factory.mktemp("fixture") / name
    subprocess.run([sys.executable, str(tool), "--from-fixture", str(src), "--out", str(out)],
                   check=True, capture_output=True)
    _built[name] = out
    return out


@pytest.fixture(scope="session")
def fixture_checkpoint(tmp_path_factory):
    """The v41-tiny-bf16 shared fixture."""
    return build_fixture("v41-tiny-bf16", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The project's own tiny preset (deepinfer.cli.make_checkpoint), for the bulk engine tests."""
    out = tmp_path_factory.mktemp("preset") / "tiny"
    subprocess.run([sys.executable, "-m", "deepinfer.cli.make_checkpoint", "--preset", "tiny", "--seed", "0",
                    "--out", str(out)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def tiny_engine_args(tiny_checkpoint):
    """Small real-model engine settings: CPU, block_tokens 8, a modest cache."""
    return dict(checkpoint=str(tiny_checkpoint), device="cpu", max_num_seqs=8, max_num_batched_tokens=64,
                block_tokens=8, num_cache_blocks=64)
