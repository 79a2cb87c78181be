"""MoE.forward's post (the FFN's mHC expand, handed to the MoE by Block.forward so the combine can apply it): on
each form of the MoE (the masked FP8 form, the dense per-token sum) the output equals
ops.hc_post of the plain output, and a Block's output is the same with kernels/select.py's COMBINE_POST_FUSE on
and off and with the expand applied after the MoE (the order before the fusion). On a CPU: the references
(tests/kernels/test_combine_post.py runs the fused kernel under Triton's interpreter and on the GPU)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import select
from deepinfer.model import ops
from deepinfer.model.loader import load_model


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    torch.set_num_threads(1)
    return {"dense": load_model(tiny_checkpoint, progress=False, weight_format="dense"),
            "masked": load_model(tiny_checkpoint, progress=False, weight_format="fp8", moe_masked=True)}


def _expand_args(T, args, seed):
    """(res [T, hc, d] bf16, post [T, hc], comb [T, hc, hc]) in the ranges the Sinkhorn pass gives."""
    g = torch.Generator().manual_seed(seed)
    res = torch.randn(T, args.hc_mult, args.dim, generator=g).bfloat16()
    return res, 2 * torch.rand(T, args.hc_mult, generator=g), torch.rand(T, args.hc_mult, args.hc_mult, generator=g)


@pytest.mark.parametrize("form", ["dense", "masked"])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_moe_post_is_hc_post_after(models, form, T):
    model = models[form]
    for layer in (model.layers[0], model.layers[-1], model.mtp[0]):
        moe = layer.ffn
        x = torch.randn(T, model.args.dim, generator=torch.Generator().manual_seed(T)).bfloat16()
        expand = _expand_args(T, model.args, T + 1)
        with torch.inference_mode():
            assert torch.equal(moe(x, post=lambda: expand), ops.hc_post(moe(x), *expand)), (form, layer.layer_id)
    assert form != "masked" or moe._use_masked(x, T)


@pytest.mark.parametrize("T", [1, 5])
def test_block_same_with_switch_and_order(models, monkeypatch, T):
    model = models["masked"]
    g = torch.Generator().manual_seed(T)
    attn = torch.randn(model.args.dim, model.args.dim, generator=g) * 0.2

    def attn_fn(xn, _rounded):
        return (xn.float() @ attn).bfloat16()

    for layer in (model.layers[0], model.layers[-1], model.mtp[0]):
        x = torch.randn(T, model.args.hc_mult, model.args.dim, generator=g).bfloat16()
        pre = torch.softmax(torch.randn(T, model.args.hc_mult, generator=g), -1)
        got = []
        with torch.inference_mode():
            for fuse in (True, False):
                monkeypatch.setattr(select, "COMBINE_POST_FUSE", fuse)
                got.append(layer(x, pre, attn_fn))
            # the order before: the MoE's plain output, then hc_post
            moe_forward = layer.ffn.forward
            monkeypatch.setattr(layer.ffn, "forward",
                                lambda xn, mask, xq, post: ops.hc_post(moe_forward(xn, mask, xq), *post()))
            got.append(layer(x, pre, attn_fn))
            monkeypatch.undo()
        for other in got[1:]:
            assert all(torch.equal(a, b) for a, b in zip(got[0], other)), (layer.layer_id, T)
