"""kernels/triton_combine_post.py: the MoE's combine and the FFN's mHC expand in one kernel give the two Triton
kernels' bits (triton_moe.moe_combine, then triton_mhc.hc_post) over tokens 1..130, widths that are not a
multiple of the column tile, hc 2 and 4, top-k 1..8, padded slabs (the expand reads the first n tokens), the
contiguous form's slab and DeepGEMM's padded view; select's switch (COMBINE_POST_FUSE) picks one or the two.
A Block's output is the same with the switch on and off (the fused kernel ran).

    CPU, Triton's interpreter    this file run as a script in a subprocess (TRITON_INTERPRET and
                                 DEEPINFER_KERNELS are read at import)
    CUDA (-m gpu)                the same checks on the GPU, at the release's widths too

    python tests/kernels/test_combine_post.py [TINY_CHECKPOINT]
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from kernel_utils import rel_err, run_under_interpreter

# (tokens n, padding tokens of the slab, top-k K, experts E, d, hc)
SHAPES = [(1, 3, 6, 8, 160, 4), (3, 1, 1, 4, 96, 2), (3, 0, 8, 8, 600, 4), (64, 0, 5, 16, 160, 2),
          (130, 2, 2, 6, 96, 4), (7, 0, 7, 48, 1056, 4)]
GPU_SHAPES = SHAPES + [(1, 3, 6, 48, 5120, 4), (8, 0, 6, 384, 5120, 4), (128, 0, 6, 48, 5120, 4),
                       (2050, 2, 6, 48, 5120, 4)]


def _case(n, pad, K, E, d, hc, device, seed, contiguous=False):
    """The combine's inputs over a slab of T = n + pad tokens (the padding tokens take token 0's picks, as
    MoE._pad_slabs does) and the expand's over the first n: K distinct experts a token, shuffled in k."""
    from deepinfer.kernels import triton_moe as tm
    g = torch.Generator().manual_seed(seed)
    T = n + pad
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    idx = torch.cat([idx, idx[:1].expand(pad, K)]).to(device)
    _, slot = tm.moe_route(idx, E, contiguous=contiguous)
    rows = K if contiguous else E
    out = (torch.randn(rows, T, d, generator=g) * torch.exp(torch.randn(rows, T, 1, generator=g))).bfloat16()
    shared = torch.randn(T, d, generator=g).bfloat16()
    res = (torch.randn(n, hc, d, generator=g) * 4).bfloat16()
    post = 2 * torch.rand(n, hc, generator=g)
    comb = torch.rand(n, hc, hc, generator=g)
    return [t.to(device) for t in (out, slot, idx, shared, res, post, comb)]


def _two_kernels(out, slot, idx, shared, res, post, comb):
    from deepinfer.kernels import triton_mhc, triton_moe
    return triton_mhc.hc_post(triton_moe.moe_combine(out, slot, idx, shared)[:res.shape[0]], res, post, comb)


def _same(a, b, what):
    assert a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16)), what


def check(device, shapes=SHAPES) -> None:
    from deepinfer.kernels import select
    from deepinfer.kernels.reference import hc_post_ref, moe_combine_ref
    from deepinfer.kernels.triton_combine_post import moe_combine_hc_post, shape_ok
    for seed, shape in enumerate(shapes):
        args = _case(*shape, device, seed)
        want = _two_kernels(*args)
        _same(moe_combine_hc_post(*args), want, shape)
        out, slot, idx, shared, *post = args                            # and near the torch references
        ref = hc_post_ref(moe_combine_ref(out, slot, idx, shared)[:shape[0]], *post)
        assert rel_err(want, ref) < 1e-2, shape
        for columns in (128, 2048):                                     # other tiles: the same bits
            _same(moe_combine_hc_post(*args, columns=columns), want, (shape, columns))
        saved = select.COMBINE_POST_FUSE
        try:
            for fuse in (True, False):                                  # select: the kernel, or the two ops
                select.COMBINE_POST_FUSE = fuse
                _same(select.moe_combine_hc_post(*args), want, (shape, fuse))
        finally:
            select.COMBINE_POST_FUSE = saved
        # DeepGEMM's masked output: [E, C padded, d][:, :T], read in place
        out, *rest = args
        padded = torch.zeros(out.shape[0], out.shape[1] + 5, out.shape[2], dtype=out.dtype, device=device)
        padded[:, :out.shape[1]] = out
        _same(moe_combine_hc_post(padded[:, :out.shape[1]], *rest), want, (shape, "padded"))
        # the contiguous form's slab [K, T, d]: pair p at flat row slot[p], in the stable sort by expert
        args = _case(*shape, device, seed, contiguous=True)
        _same(moe_combine_hc_post(*args), _two_kernels(*args), (shape, "contiguous"))
    out, slot, idx, shared, res, post, comb = _case(3, 1, 2, 4, 96, 4, device, 0)
    assert shape_ok(out, slot, idx, shared, res, post, comb)
    assert not shape_ok(out, slot, idx, shared.float(), res, post, comb)                  # bf16 only
    assert not shape_ok(out, slot, idx, shared, torch.cat([res, res]), post, comb)        # n > the slab's T
    assert not shape_ok(out, slot, idx, shared, res, post[:, :2], comb)
    empty = moe_combine_hc_post(out, slot, idx, shared, res[:0], post[:0], comb[:0])
    assert empty.shape == (0, 4, 96)


def check_block(ckpt: str, device) -> None:
    """A Block of the masked FP8 model (the MoE's combine and the FFN's expand as one op) gives the same bits
    with the fused kernel and with the two kernels, and the fused kernel ran."""
    from deepinfer.kernels import select, triton_combine_post
    from deepinfer.model.loader import load_model
    model = load_model(ckpt, device, progress=False, weight_format="fp8", moe_masked=True)
    calls = []
    fused, saved = triton_combine_post.moe_combine_hc_post, select.COMBINE_POST_FUSE
    triton_combine_post.moe_combine_hc_post = lambda *a: (calls.append(a[0].shape), fused(*a))[1]
    g = torch.Generator().manual_seed(0)
    attn = torch.randn(model.args.dim, model.args.dim, generator=g).to(device) * 0.2

    def attn_fn(xn, _rounded):
        return (xn.float() @ attn).bfloat16()

    try:
        for layer in (model.layers[0], model.layers[-1], model.mtp[0]):
            for T in (1, 5):
                x = torch.randn(T, model.args.hc_mult, model.args.dim, generator=g).bfloat16().to(device)
                pre = torch.softmax(torch.randn(T, model.args.hc_mult, generator=g), -1).to(device)
                got = {}
                for fuse in (True, False):
                    select.COMBINE_POST_FUSE = fuse
                    with torch.inference_mode():
                        got[fuse] = layer(x, pre, attn_fn)
                for a, b in zip(got[True], got[False]):
                    assert torch.equal(a, b), (layer.layer_id, T)
    finally:
        select.COMBINE_POST_FUSE = saved
        triton_combine_post.moe_combine_hc_post = fused
    assert len(calls) == 6, calls


def test_combine_post_interpreter(tiny_checkpoint):
    run_under_interpreter(__file__, timeout=900, args=(str(tiny_checkpoint),), DEEPINFER_KERNELS="fast")


@pytest.mark.gpu
def test_combine_post_cuda():
    check("cuda", GPU_SHAPES)


@pytest.mark.gpu
def test_block_switch_cuda(tiny_checkpoint):
    check_block(str(tiny_checkpoint), "cuda")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("DEEPINFER_KERNELS") == "fast"
    check("cpu")
    print("moe_combine + hc_post: ok")
    if len(sys.argv) > 1:
        check_block(sys.argv[1], "cpu")
        print("block, switch on / off: ok")
