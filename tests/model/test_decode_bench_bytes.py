"""perf/bench_model_decode.py's byte count (the denominator of every decode "of copy" figure) on the tiny
model on the CPU: the routed experts counted are those the step's gates name (a random-weight router
names fewer than uniform routing would, which once inflated the figure), and balanced routing makes
every expert in use once before any twice."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "perf"))

import bench_model_decode as bench  # noqa: E402


@pytest.fixture(scope="module")
def model_and_caches(tiny_model):
    from deepinfer.cache.model_caches import ModelCaches
    caches = ModelCaches.allocate(tiny_model.args, 8, 8 * 4, 64, "cpu", scratch=True)
    return tiny_model, caches


def _step(model, caches, B):
    return bench.decode_step(model, caches, B, 128, 192, 64, device="cpu")


def _gate_picks(model, step) -> dict[int, torch.Tensor]:
    picks, hooks = {}, []
    for layer in model.layers:
        hooks.append(layer.ffn.gate.register_forward_hook(
            lambda mod, inp, out, lid=layer.layer_id: picks.__setitem__(lid, out[1].clone())))
    try:
        step()
    finally:
        for h in hooks:
            h.remove()
    return picks


@pytest.mark.usefixtures("one_thread")
def test_routed_experts_are_the_gates_distinct_picks(model_and_caches):
    model, caches = model_and_caches
    with torch.inference_mode():
        step = _step(model, caches, 4)
        used = bench.routed_experts(model, step)
        picks = _gate_picks(model, step)
    assert used == {lid: int(p.unique().numel()) for lid, p in picks.items()}
    assert set(used) == {layer.layer_id for layer in model.layers}
    # the bytes follow the count: experts' bytes are routed * used / E a layer
    counted = bench.step_bytes(model, 4, 128, used)
    def expert_bytes(moe):
        st = moe.stacks
        return bench.tensor_bytes([st.w13, st.s13, st.w2, st.s2]) if st is not None else bench.module_bytes(moe.experts)
    expect = sum(expert_bytes(layer.ffn) * used[layer.layer_id] / layer.ffn.n_experts for layer in model.layers)
    assert counted["experts"] == pytest.approx(expect)
    # no count: uniform routing's expectation, as before
    uniform = bench.step_bytes(model, 4, 128)
    assert uniform["attention+shared"] == counted["attention+shared"] and uniform["kv"] == counted["kv"]


@pytest.mark.usefixtures("one_thread")
def test_balanced_routing_uses_every_expert_once_before_any_twice(model_and_caches):
    model, caches = model_and_caches
    hooks = bench.balance_routing(model)
    try:
        with torch.inference_mode():
            for B in (1, 3, 8):
                step = _step(model, caches, B)
                picks = _gate_picks(model, step)
                used = bench.routed_experts(model, step)
                for layer in model.layers:
                    E, k = layer.ffn.n_experts, layer.ffn.gate.topk
                    p = picks[layer.layer_id]
                    assert p.shape == (B, k)
                    counts = torch.bincount(p.flatten(), minlength=E)
                    assert int(counts.max() - counts.min()) <= 1, (B, counts)
                    assert all(len(set(row.tolist())) == k for row in p)     # a token's picks distinct
                    assert used[layer.layer_id] == min(E, B * k)
    finally:
        for h in hooks:
            h.remove()
    # removed: no hook is left on any gate (they route by their weights again)
    assert all(not layer.ffn.gate._forward_hooks for layer in model.layers)


def test_variant_knobs_set_and_restore():
    """--knobs: a variant's module attributes are set from Python literals, and the next variant ('none' or
    another knob) first puts every earlier one back."""
    from deepinfer.kernels import select
    off, rows = select.FAST_OFF, select.GROUPED_FP8_MAX_ROWS
    try:
        bench.set_knobs("deepinfer.kernels.select:FAST_OFF=('compress_pool',);deepinfer.kernels.select:GROUPED_FP8_MAX_ROWS=7")
        assert select.FAST_OFF == ("compress_pool",) and select.GROUPED_FP8_MAX_ROWS == 7
        bench.set_knobs("deepinfer.kernels.select:GROUPED_FP8_MAX_ROWS=3")
        assert select.FAST_OFF is off and select.GROUPED_FP8_MAX_ROWS == 3
        bench.set_knobs("none")
        assert select.FAST_OFF is off and select.GROUPED_FP8_MAX_ROWS == rows
    finally:
        bench.set_knobs("none")
