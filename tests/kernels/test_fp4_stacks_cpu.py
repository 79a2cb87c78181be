"""FP4 expert stacks (kernels/fp4_layout.py, EngineArgs.expert_format="fp4") through select's grouped GEMMs on
a CPU (the reference paths): the masked and contiguous forms give the FP8 stacks' bits for the same weights,
with empty experts and rows off every tile. The GPU kernels: tests/kernels/test_w4a16.py."""

import torch

from deepinfer.kernels import select
from deepinfer.kernels.fp4_layout import fp4_kernel_weight
from deepinfer.kernels.reference import act_quant_ref
from deepinfer.kernels.select import fp4_to_fp8_weight


def _stacks(e, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (e, n, k // 2), generator=gen).to(torch.uint8)
    scale = torch.randint(110, 129, (e, n, k // 32), generator=gen).to(torch.uint8)
    scale[0, :3, 1] = 0                                                   # zero blocks
    fp4 = [fp4_kernel_weight(packed[i], scale[i]) for i in range(e)]
    fp8 = [fp4_to_fp8_weight(packed[i], scale[i]) for i in range(e)]
    return (torch.stack([p for p, _ in fp4]), torch.stack([s for _, s in fp4]),
            torch.stack([w for w, _ in fp8]), torch.stack([s for _, s in fp8]), gen)


def test_fp4_masked_form_equals_fp8_stacks():
    w4, s4, w8, s8, gen = _stacks(5, 96, 160, 1)
    x = act_quant_ref(torch.randn(5, 7, 160, generator=gen).bfloat16())
    mm = torch.tensor([7, 0, 3, 1, 7], dtype=torch.int32)
    a = select.grouped_fp8_linear_masked(x, w4, s4, mm, 3)
    b = select.grouped_fp8_linear_masked(x, w8, s8, mm, 3)
    for g, r in enumerate(mm.tolist()):
        assert torch.equal(a[g, :r], b[g, :r]), g


def test_fp4_contiguous_form_equals_fp8_stacks():
    w4, s4, w8, s8, gen = _stacks(4, 64, 96, 2)
    counts = torch.tensor([5, 0, 9, 2], dtype=torch.int32)
    x = act_quant_ref(torch.randn(int(counts.sum()), 96, generator=gen).bfloat16())
    a = select.grouped_fp8_linear_contiguous(x, w4, s4, counts)
    b = select.grouped_fp8_linear_contiguous(x, w8, s8, counts)
    assert a.shape == (16, 64) and torch.equal(a, b)
