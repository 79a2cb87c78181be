"""The MoE's grouped contiguous form taking verify-sized steps (moe.CONTIGUOUS_FROM_PAIRS) on the GPU:
the step takes that form once it has enough pairs, equals the masked form to summation order, and
replays inside a CUDA graph with new routing (no host read; perf/bench_moe_forms.py times the two)."""

from __future__ import annotations

import pytest
import torch

import deepinfer.model.moe as moe_mod
from deepinfer.model.loader import load_model
from tests.conftest import graph_replay_matches_eager

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    return load_model(tiny_checkpoint, device="cuda", progress=False)


@pytest.mark.parametrize("T", [24, 100, 300])
def test_contiguous_from_pairs_matches_masked_in_a_graph(model, monkeypatch, T):
    moe = next(b.ffn for b in model.layers if b.ffn.stacks is not None)
    x = torch.randn(T, model.args.dim, device="cuda").bfloat16()
    with torch.inference_mode():
        w, idx = moe.gate(x, None)
        masked_ok = moe._use_masked(x, idx.numel())
        want = moe(x).float()
        monkeypatch.setattr(moe_mod, "CONTIGUOUS_FROM_PAIRS", idx.numel())
        if not moe._use_contiguous(x):
            pytest.skip("the contiguous form declines this config")
        assert masked_ok and not moe._use_masked(x, idx.numel())
        got = moe(x).float()
        assert (got - want).abs().max() <= 2e-2 * want.abs().max()
        graph_replay_matches_eager(moe, x.clone(), torch.randn_like(x))      # other tokens, other routing


@pytest.fixture(scope="module", params=["fp8", "fp4"])
def stacked_moe(request, small_checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    model = load_model(small_checkpoint, device="cuda", progress=False, expert_format=request.param)
    layer = next(b.ffn for b in model.layers if b.ffn.stacks is not None)
    assert layer.stacks.fp4 == (request.param == "fp4")
    return layer


@pytest.mark.parametrize("P", [5, 300])
def test_received_pairs_take_the_contiguous_form(stacked_moe, monkeypatch, P):
    """An EP rank's received pairs (MoE._routed with one pick a row, as _local_pairs calls it) of a step past
    the masked form run the grouped contiguous GEMMs, not the per-expert loop (a host read a layer); same
    outputs as the loop to the GEMMs' summation order. FP8 and FP4 stacks."""
    moe = stacked_moe
    monkeypatch.setattr(moe_mod, "MASKED_MAX_PAIRS", 0)
    gen = torch.Generator(device="cuda").manual_seed(P)
    x = torch.randn(P, moe.dim, device="cuda", generator=gen).bfloat16()
    weights = torch.rand(P, 1, device="cuda", generator=gen)
    experts = torch.randint(0, moe.n_experts, (P, 1), device="cuda", generator=gen)
    calls = []
    real = moe._contiguous_experts
    monkeypatch.setattr(moe, "_contiguous_experts", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        got = moe._routed(x, weights, experts).float()
        want = moe._routed_loop(x, weights, experts).float()
    assert calls == [1]
    assert got.shape == (P, 1, moe.dim)
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


def test_fp4_prefill_step_forms_agree(stacked_moe, monkeypatch):
    """FP4 stacks: a prefill-sized step (past the masked form) through the whole MoE forward on the W4A16 K loop
    (select.FP4_W4A16_MAX_ROWS_PER_EXPERT above its rows) and on the whole stack dequantized + one bf16 grouped GEMM
    (FP4_W4A16_MAX_ROWS_PER_EXPERT 0): the same products, so equal to summation order."""
    from deepinfer.kernels import select
    moe = stacked_moe
    if not moe.stacks.fp4:
        pytest.skip("FP4 stacks only")
    monkeypatch.setattr(moe_mod, "MASKED_MAX_PAIRS", 0)
    x = torch.randn(700, moe.dim, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).bfloat16()
    outs = {}
    with torch.inference_mode():
        assert moe._use_contiguous(x)
        for max_rows in (1 << 30, 0):
            monkeypatch.setattr(select, "FP4_W4A16_MAX_ROWS_PER_EXPERT", max_rows)
            outs[max_rows] = moe(x).float()
    got, want = outs[1 << 30], outs[0]
    assert not torch.equal(got, torch.zeros_like(got))
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
