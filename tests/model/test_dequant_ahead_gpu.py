"""A long prefill step's expert stacks dequantized to bf16 on a side stream beside the attention sublayer
(MoE.dequant_ahead) give the same logits, bit for bit, as dequantizing each stack just before its grouped
GEMM, with FP8 and FP4 stacks; the branch forks once a MoE layer and the GEMMs take its stacks (no scratch
dequant left)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from deepinfer.kernels import select
from deepinfer.model import moe, side_stream
from deepinfer.model.loader import load_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "perf"))

import bench_model_prefill as bench  # noqa: E402

pytestmark = pytest.mark.gpu

SEQS, TOKENS = 2, 640           # 1,280 tokens x top-4 = 5,120 pairs: past the masked form's 4,096


@pytest.fixture(scope="module", params=["fp8", "fp4"])
def model(request, small_checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    m = load_model(small_checkpoint, device="cuda", progress=False, expert_format=request.param, dense_bf16=True)
    m.expert_format = request.param
    return m


def _prefill(model, monkeypatch, ahead: bool) -> tuple[torch.Tensor, int, int]:
    """(logits, branches forked, stack-sized scratch requests) of one prefill step."""
    from deepinfer.cache.model_caches import ModelCaches
    monkeypatch.setattr(moe, "DEQUANT_AHEAD", ahead)
    scratch = []
    real = select._bf16_scratch
    monkeypatch.setattr(select, "_bf16_scratch", lambda x, n: scratch.append(n) or real(x, n))
    nb = -(-TOKENS // 64)
    caches = ModelCaches.allocate(model.args, SEQS, SEQS * nb, 64, "cuda")
    batch = bench.case_batch(model, caches, SEQS, TOKENS, nb=nb)
    before = side_stream.forked_branches
    with torch.inference_mode():
        logits = model(batch, caches).logits.clone()
    torch.cuda.synchronize()
    return logits, side_stream.forked_branches - before, len(scratch)


def test_dequant_ahead_equals_dequant_in_place(model, monkeypatch):
    # FP8 stacks take the bf16 grouped GEMM from BF16_MOE_MIN_ROWS pairs (16,384 by default)
    monkeypatch.setattr(select, "BF16_MOE_MIN_ROWS", 1024)
    moe_layers = sum(layer.ffn.stacks is not None for layer in model.layers)
    assert moe_layers
    want, forks_off, scratch_off = _prefill(model, monkeypatch, ahead=False)
    got, forks_on, scratch_on = _prefill(model, monkeypatch, ahead=True)
    assert forks_off == 0 and scratch_off >= 2 * moe_layers        # each stack dequantized into the scratch
    assert forks_on == moe_layers and scratch_on == 0               # each layer's stacks forked, taken as given
    assert torch.equal(got, want), "the dequant-ahead prefill's logits differ"


def test_no_dequant_ahead_where_the_step_does_not_take_bf16(model, monkeypatch):
    """Steps the bf16 grouped GEMM does not take (FP8 stacks under BF16_MOE_MIN_ROWS; side streams off)
    fork nothing and dequantize nothing ahead."""
    if model.expert_format == "fp4":
        monkeypatch.setattr(side_stream, "ENABLED", False)
    else:
        monkeypatch.setattr(select, "BF16_MOE_MIN_ROWS", 1 << 30)
    _, forks, _ = _prefill(model, monkeypatch, ahead=True)
    assert forks == 0
