"""MoE: the grouped routed experts (pairs sorted by expert, batched matmuls over the experts in
use) equal the per-expert loop bitwise, on both fixtures' weights (bf16, and FP8/FP4 dequantized
at load with activation rounding)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.loader import load_model


@pytest.mark.parametrize("name", ["v41-tiny-bf16", "v41-tiny"])
@pytest.mark.parametrize("T", [1, 5, 64])
def test_grouped_equals_loop(fixture_dir, name, T):
    model = load_model(fixture_dir(name), progress=False)
    torch.manual_seed(T)
    for layer in (0, 5, len(model.layers) - 1):
        moe = model.layers[layer].ffn
        x = torch.randn(T, model.args.dim).to(torch.bfloat16)
        w, idx = moe.gate(x, None)
        assert moe._stacked(x.device) is not None
        assert torch.equal(moe._routed_grouped(x, w, idx), moe._routed_loop(x, w, idx))
