"""wo_a on its FP8 blocks (what a CUDA load does: ops.grouped_w8a16, half the bytes of the dequantized
bf16 copy) computes the block-diagonal product of the same exact weight values as the einsum."""

import pytest
import torch

from deepinfer.model.loader import load_model


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    torch.set_num_threads(1)
    kw = dict(progress=False, weight_format="fp8")
    return load_model(tiny_checkpoint, wo_a_fp8=False, **kw), load_model(tiny_checkpoint, wo_a_fp8=True, **kw)


def test_wo_a_blocks_replace_the_dense_copy(pair):
    dense, blocks = pair
    for ld, lb in zip(dense.layers, blocks.layers):
        a, b = ld.attn, lb.attn
        assert a.wo_a.fp8_blocks is None and a.wo_a.weight.numel() > 0
        w, s = b.wo_a.fp8_blocks
        assert w.dtype == torch.float8_e4m3fn and w.shape == (b.n_groups, b.o_lora_rank, a.wo_a.in_features)
        assert b.wo_a.weight.numel() == 0
        from deepinfer.model import ops
        assert torch.equal(ops.dequant_fp8(w, s).flatten(0, 1), a.wo_a.weight.float())


@pytest.mark.parametrize("T", [1, 7])
def test_wo_a_blocks_same_output(pair, T):
    dense, blocks = pair
    torch.manual_seed(T)
    for ld, lb in zip(dense.layers[:3], blocks.layers[:3]):
        a, b = ld.attn, lb.attn
        o = torch.randn(T, a.n_heads, a.head_dim).bfloat16()
        pos = torch.arange(T)
        cis = dense.rope[a.rope_kind](pos, T - 1)
        # fp32 sums of the same exact products in two orders: equal up to fp32 rounding, then bf16
        torch.testing.assert_close(b.out(o, cis).float(), a.out(o, cis).float(), rtol=1e-2, atol=1e-2)
