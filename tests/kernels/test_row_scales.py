"""select.row_scaled_fp8_weight: FP8 weights with per-(row, 32) E8M0 scales re-expressed with one pow2
scale per row, exactly or not at all (the row-scaled W8A16 kernel reads no scale in its K loop)."""

import pytest
import torch

from deepinfer.kernels.reference import E2M1_GRID
from deepinfer.kernels.select import dequant_fp8, row_scaled_fp8_weight


def _fp4_origin(n, k, lo, hi, seed=0):
    """e2m1 values as e4m3 with block exponents in [lo, hi] (what the loader makes of MXFP4 experts)."""
    gen = torch.Generator().manual_seed(seed)
    grid = torch.tensor(E2M1_GRID)
    grid = torch.cat([grid, -grid])
    w = grid[torch.randint(0, 16, (n, k), generator=gen)].to(torch.float8_e4m3fn)
    s = torch.randint(lo + 127, hi + 128, (n, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    s[:, 0], s[:, 1] = lo + 127, hi + 127                          # the full spread in every row
    return w, s


@pytest.mark.parametrize("spread", [0, 6, 14])
def test_fp4_experts_convert_exactly(spread):
    w, s = _fp4_origin(64, 512, -20, -20 + spread)
    out = row_scaled_fp8_weight(w, s)
    assert out is not None
    wr, sr = out
    assert wr.dtype == torch.float8_e4m3fn and sr.shape == (64, 1) and sr.dtype == torch.float32
    assert torch.equal(dequant_fp8(wr, sr), dequant_fp8(w, s))
    assert torch.equal(torch.frexp(sr).mantissa, torch.full_like(sr, 0.5))            # powers of two


def test_spread_too_wide_is_refused():
    """e2m1's 0.5 at 15 binades below the row's top block falls under e4m3's smallest subnormal."""
    w, s = _fp4_origin(8, 256, -20, -5)
    w[:, :32] = torch.tensor(0.5).to(torch.float8_e4m3fn)        # the low block holds its smallest value
    assert row_scaled_fp8_weight(w, s) is None


def test_top_mantissa_takes_one_binade_less():
    """A row whose largest element has mantissa 1.875 cannot sit at 2^8 (480 > 448): exact anyway."""
    w = torch.full((4, 64), 1.875).to(torch.float8_e4m3fn)
    w[:, 32:] = torch.tensor(1.0).to(torch.float8_e4m3fn)
    s = torch.tensor([[127, 120]] * 4, dtype=torch.uint8)
    wr, sr = row_scaled_fp8_weight(w, s)
    assert torch.equal(dequant_fp8(wr, sr), dequant_fp8(w, s))
    assert wr.float().abs().max() == 240                      # 1.875 * 2^7


def test_zero_rows_and_stacks():
    w, s = _fp4_origin(16, 128, -12, -8)
    w[3] = 0
    wr, sr = row_scaled_fp8_weight(w, s)
    assert not wr[3].float().any() and sr[3].item() > 0
    assert torch.equal(dequant_fp8(wr, sr), dequant_fp8(w, s))
    # leading dims (a stack of experts) convert as one
    w3, s3 = torch.stack([w, w]), torch.stack([s, s])
    wr3, sr3 = row_scaled_fp8_weight(w3, s3)
    assert torch.equal(wr3[1], wr) and sr3.shape == (2, 16, 1)


def test_tile_scales_are_not_row_scales():
    w, _ = _fp4_origin(64, 128, -10, -8)
    assert row_scaled_fp8_weight(w, torch.full((2, 4), 120, dtype=torch.uint8)) is None
