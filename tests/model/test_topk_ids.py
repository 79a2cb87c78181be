"""attention.topk_ids: the k largest entries of each row, ties to the lowest index. The 32-bit key
(bf16 scores, rows up to 2^16 wide) must pick exactly what the 64-bit (float order, reversed index)
key picks, on rows full of ties, -inf, -0.0 / +0.0, and at the width limit."""

import pytest
import torch

from deepinfer.model.attention import topk_ids


def _picks_64bit(x: torch.Tensor, k: int) -> torch.Tensor:
    bits = x.float().contiguous().view(torch.int32)
    order = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)
    key = order * (1 << 32) + ((1 << 31) - 1 - torch.arange(x.shape[-1]))
    return key.topk(k, dim=-1, sorted=False).indices.sort(-1).values


@pytest.mark.parametrize("width", [5, 100, 8192, 1 << 16, (1 << 16) + 3])
def test_topk_ids_matches_the_64bit_key(width):
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(6, width, generator=g) * 3).round().bfloat16()       # small integers: many ties
    x[0, : width // 2] = -torch.inf
    x[1] = 0.0
    x[2, ::3] = -0.0
    for k in sorted({1, min(width, 4), min(width, 512)}):
        got = topk_ids(x, k).sort(-1).values
        assert torch.equal(got, _picks_64bit(x, k)), (width, k)
    # ties go to the lowest index
    assert torch.equal(topk_ids(x[1:2], 3).sort(-1).values, torch.tensor([[0, 1, 2]]))


def test_topk_ids_fp32_rows_keep_full_precision():
    x = torch.tensor([[1.0, 1.0 + 2 ** -20, 1.0, 0.5]])                   # equal in bf16, not in fp32
    assert topk_ids(x, 1).tolist() == [[1]]
