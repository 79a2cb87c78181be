"""kernels/triton_rope_fp4.py: RoPE then FP4 rounding in one kernel gives the two Triton kernels' bits
(triton_rope, triton_quant.fp4_quant) for the index queries ([T, heads, 128], block 32), the index keys (block 32)
and the compressed latents ([G, 512], block 16), with the pool write landing on the given rows only; select's
composed form writes the same way. On the GPU (-m gpu) and under Triton's interpreter on the CPU."""

import os

import pytest
import torch
from kernel_utils import run_under_interpreter

# (rows T, heads or None, D, rope pairs, block, pool write)
SHAPES = [(5, None, 512, 32, 16, True), (9, 8, 128, 32, 32, False), (7, None, 64, 8, 16, True),
          (130, None, 128, 32, 32, True), (3, 4, 64, 16, 32, False), (1, None, 512, 32, 16, True)]


def _case(T, heads, D, half, device, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (T, D) if heads is None else (T, heads, D)
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-6, 6, shape[:-1] + (1,), generator=g).float())
    ang = torch.rand(T, half, generator=g) * 6.28
    return x.to(torch.bfloat16).to(device), torch.polar(torch.ones_like(ang), ang).to(device)


def check(device, shapes=SHAPES):
    from deepinfer.kernels import select, triton_quant, triton_rope
    from deepinfer.kernels.reference import fp4_pack_rows_ref, fp4_rows_width, fp4_unpack_rows_ref
    from deepinfer.kernels.triton_rope_fp4 import rope_fp4_quant, shape_ok
    for seed, (T, heads, D, half, block, write) in enumerate(shapes):
        x, cis = _case(T, heads, D, half, device, seed)
        want = triton_quant.fp4_quant(triton_rope.rope(x, cis), block)
        dst = pool = None
        if write:
            pool = torch.randn(2 * T + 5, D, device=device).to(torch.bfloat16)
            before = pool.clone()
            dst = torch.randperm(pool.shape[0], generator=torch.Generator().manual_seed(seed))[:T].to(device)
        got = rope_fp4_quant(x, cis, block, dst, pool)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (T, heads, D, half, block)
        if write:
            assert torch.equal(pool[dst], got)
            others = torch.ones(pool.shape[0], dtype=torch.bool, device=device)
            others[dst] = False
            assert torch.equal(pool[others], before[others])
            pool2 = before.clone()
            out2 = select.rope_fp4_quant(x.clone(), cis, block, dst, pool2)     # the kernel on a GPU, else the ops
            assert torch.equal(pool2[dst], out2) and torch.equal(pool2[others], before[others])
            if block == 32:                           # the cache's index keys: packed FP4 rows
                packed = torch.randint(0, 256, (pool.shape[0], fp4_rows_width(D)), dtype=torch.uint8, device=device)
                p_before = packed.clone()
                assert shape_ok(x, cis, block, dst, packed)
                rope_fp4_quant(x, cis, block, dst, packed)
                assert torch.equal(packed[dst], fp4_pack_rows_ref(got)), (T, D, "packed")
                assert torch.equal(fp4_unpack_rows_ref(packed[dst], D).view(torch.int16), got.view(torch.int16))
                assert torch.equal(packed[others], p_before[others])
                packed2 = p_before.clone()
                out2 = select.rope_fp4_quant(x.clone(), cis, block, dst, packed2)
                assert torch.equal(packed2[dst], fp4_pack_rows_ref(out2)) and torch.equal(packed2[others], p_before[others])
    assert not shape_ok(x[..., :48], cis, 16) and not shape_ok(x, cis, 8)


@pytest.mark.gpu
def test_rope_fp4_quant_cuda():
    check("cuda", SHAPES + [(64, 64, 128, 32, 32, False), (128, None, 512, 32, 16, True)])


def test_rope_fp4_quant_interpreter():
    run_under_interpreter(__file__)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check("cpu")
    print("rope + fp4_quant: ok")
