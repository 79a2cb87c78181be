"""Balanced context parallelism on GPUs (NCCL ranks, the CUDA kernels' in-place attention and
indexer paths over the CP share's metadata): the long prompts of the shared fixtures prefilled over
2 (and 4) GPUs pass the fixtures' rule. Needs 2+ GPUs; skipped otherwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import build_fixture
from tests.engine.test_engine_parity import check_copies, run_teacher_forced

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fixture_name,ranks", [("v41-tiny-bf16", 2), ("v41-tiny", 2), ("v41-tiny", 4)])
def test_cp_prefill_on_gpus_passes_check_parity(fixture_name, ranks, tmp_path, tmp_path_factory):
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs, {torch.cuda.device_count()} here")
    from deepinfer.config import EngineArgs
    from deepinfer.engine import Engine
    ckpt = build_fixture(fixture_name, tmp_path_factory)
    expected = np.load(ckpt / "expected.npz")
    engine = Engine(EngineArgs(checkpoint=str(ckpt), device="cuda", max_num_seqs=8, max_num_batched_tokens=1024,
                               num_cache_blocks=8 * 13, data_parallel_size=ranks, context_parallel_size=ranks,
                               cp_min_prompt_tokens=256, model_overrides={"emulate_index_k_alias": True}))
    try:
        logits = run_teacher_forced(engine, expected)
        cp = engine.scheduler.cp_prefills
        assert engine.kv_cache.num_used_blocks == 0
    finally:
        engine.shutdown()
    assert len(cp) >= 4 and {n for _, _, n in cp} == {299, 694}, cp
    check_copies(logits, expected, ckpt, tmp_path, f"16 requests over {ranks} GPUs, long prompts with CP")


def test_cp_share_matches_plain_prefill_on_cuda(tmp_path_factory):
    """One GPU: the CP share's metadata through the CUDA kernels (in-place attention, Triton indexer)
    leaves the plain prefill's caches and logits (tests/parallel/test_cp.py has the CPU twin)."""
    from tests.parallel.test_cp import cp_share_matches_plain_prefill
    cp_share_matches_plain_prefill(build_fixture("v41-tiny", tmp_path_factory), "cuda", "nccl")


def test_cp_image_share_matches_plain_prefill_on_cuda(tiny_checkpoint):
    """One GPU: an image prompt's CP share (span rows from the owner's encoded copy, token types, DEAD history)
    through the CUDA kernels leaves the plain prefill's caches and logits (test_cp_images.py has the CPU twin)."""
    from tests.parallel.test_cp_images import cp_image_share_matches_plain_prefill
    cp_image_share_matches_plain_prefill(tiny_checkpoint, "cuda", "nccl")
