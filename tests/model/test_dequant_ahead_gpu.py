"""The MoE's expert stacks dequantized ahead on a side stream (kernels/stack_prefetch.py, MoE.dequant_ahead)
on the GPU: the GEMMs take what the side stream made, the outputs are the bits of the in-line dequant, the
side stream waits for what the main stream queued before it (a weight rewritten just before is read
rewritten), and a step that takes another form leaves nothing queued for a later one. FP8 and FP4 stacks."""

from __future__ import annotations

import pytest
import torch

import deepinfer.model.moe as moe_mod
from deepinfer.kernels import select, stack_prefetch
from deepinfer.model.loader import load_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["fp8", "fp4"])
def moe(request, small_checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    model = load_model(small_checkpoint, device="cuda", progress=False, expert_format=request.param)
    layer = next(b.ffn for b in model.layers if b.ffn.stacks is not None)
    assert layer.stacks.fp4 == (request.param == "fp4")
    return layer


@pytest.fixture
def long_steps(monkeypatch):
    """Every step past the masked form and onto the bf16 grouped GEMM (small sizes: fast tests)."""
    monkeypatch.setattr(moe_mod, "MASKED_MAX_PAIRS", 0)
    monkeypatch.setattr(select, "BF16_MOE_MIN_ROWS", 1)
    monkeypatch.setattr(stack_prefetch, "MODE", "low")


def _taken(monkeypatch) -> list:
    seen = []
    real = stack_prefetch.take

    def spy(w):
        got = real(w)
        seen.append(got is not None)
        return got
    monkeypatch.setattr(stack_prefetch, "take", spy)
    return seen


@pytest.mark.parametrize("T", [1, 77, 300])
def test_dequant_ahead_gives_the_in_line_bits(moe, long_steps, monkeypatch, T):
    x = torch.randn(T, moe.dim, device="cuda").bfloat16()
    with torch.inference_mode():
        assert moe._use_contiguous(x)
        want = moe(x)
        seen = _taken(monkeypatch)
        moe.dequant_ahead(x)
        got = moe(x)
    assert seen == [True, True]                        # both projections took the side stream's stacks
    assert torch.equal(got, want)
    assert not stack_prefetch._QUEUED.get(x.device)


def test_side_stream_waits_for_the_main_stream(moe, long_steps):
    """A weight rewritten on the main stream behind a long sleep is read rewritten by the dequant ahead."""
    x = torch.randn(200, moe.dim, device="cuda").bfloat16()
    w = moe.stacks.w13
    with torch.inference_mode():
        old = w.clone()
        new = w.flip(0).contiguous()                   # other experts' (valid) weights in each slot
        w.copy_(new)
        want = moe(x)
        w.copy_(old)
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)                 # ~0.1 s of main-stream work before the rewrite
        w.copy_(new)
        moe.dequant_ahead(x)
        got = moe(x)
        torch.cuda.synchronize()
        w.copy_(old)
    assert torch.equal(got, want)


def test_a_step_on_another_form_leaves_nothing_queued(moe, long_steps, monkeypatch):
    x = torch.randn(64, moe.dim, device="cuda").bfloat16()
    with torch.inference_mode():
        moe.dequant_ahead(x)
        assert len(stack_prefetch._QUEUED[x.device]) == 2
        monkeypatch.setattr(moe_mod, "MASKED_MAX_PAIRS", 10 ** 6)     # this step goes the masked way
        assert moe._use_masked(x, 64 * moe.gate.topk)
        moe(x)
    assert not stack_prefetch._QUEUED.get(x.device)


def test_off_and_short_steps_queue_nothing(moe, monkeypatch):
    monkeypatch.setattr(stack_prefetch, "MODE", "0")
    x = torch.randn(4096, moe.dim, device="cuda").bfloat16()
    moe.dequant_ahead(x)
    assert not stack_prefetch._QUEUED.get(x.device)
    monkeypatch.setattr(stack_prefetch, "MODE", "low")
    moe.dequant_ahead(x[:2])                            # a decode-sized step: the masked form, no dequant
    assert not stack_prefetch._QUEUED.get(x.device)


@pytest.mark.parametrize("P", [5, 300])
def test_received_pairs_take_the_contiguous_form(moe, long_steps, monkeypatch, P):
    """An EP rank's received pairs (MoE._routed with one pick a row, as _local_pairs calls it) run the
    grouped contiguous GEMMs where the step is long, not the per-expert loop; same outputs as the loop
    to the GEMMs' summation order."""
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
