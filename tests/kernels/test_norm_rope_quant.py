"""kernels/triton_norm_rope_quant.py: the KV row's RMSNorm + RoPE + act_quant in one kernel gives the three
Triton kernels' bits (triton_norm, triton_rope, triton_quant) on strided rows, every D / rope width / row
count form, and stays within act_quant's rounding of the torch reference. On the GPU (-m gpu) and under
Triton's interpreter on the CPU (a subprocess: TRITON_INTERPRET is read at import)."""

import os

import pytest
import torch
from kernel_utils import run_under_interpreter

SHAPES = [(1, 512, 32), (5, 512, 32), (64, 512, 32), (130, 512, 32), (7, 64, 8), (3, 128, 64), (9, 256, 4)]


def _case(T, D, half, device, seed):
    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(T, D + 96, generator=g) * torch.exp2(torch.randint(-6, 6, (T, 1), generator=g).float()))
    x = wide.to(torch.bfloat16)[:, 40:40 + D]                          # a column slice: strided rows
    w = torch.rand(D, generator=g) + 0.5
    ang = torch.rand(T, half, generator=g) * 6.28
    cis = torch.polar(torch.ones_like(ang), ang)
    return x.to(device), w.to(device), cis.to(device)


def check(device, shapes=SHAPES):
    from deepinfer.kernels import triton_norm, triton_quant, triton_rope
    from deepinfer.kernels.reference import norm_rope_quant_ref
    from deepinfer.kernels.triton_norm_rope_quant import norm_rope_quant, shape_ok
    for seed, (T, D, half) in enumerate(shapes):
        x, w, cis = _case(T, D, half, device, seed)
        assert shape_ok(x, cis)
        got = norm_rope_quant(x, w, 1e-6, cis)
        three = triton_quant.act_quant(triton_rope.rope(triton_norm.rms_norm(x, w, 1e-6), cis, inplace=True))
        assert torch.equal(got.view(torch.int16), three.view(torch.int16)), (T, D, half)
        # the reference: its norm sums in another order, so a norm output may be a bf16 ulp away, which a
        # rotation with cancellation carries into a small value, and act_quant may then round one e4m3 step
        # the other way (a step is at most 1/8 of the value, or a subnormal step of the block's scale)
        ref = norm_rope_quant_ref(x, w, 1e-6, cis).float()
        block_max = ref.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True).expand(-1, -1, 32).flatten(1)
        step = ref.abs() * 2 ** -2 + block_max * 2 ** -6
        assert ((got.float() - ref).abs() <= step).all(), (T, D, half)
        same = (got.float() == ref).float().mean().item()
        # (the interpreter truncates float -> bf16 casts where the GPU rounds: its count is lower)
        assert same > (0.97 if device == "cuda" else 0.5), (T, D, half, same)
    assert not shape_ok(x[:, :D - 32], cis)                       # a width not a power of two declines
    check_ring(device)


def check_ring(device):
    """ring=(ring, rows): the rows also land at those ring rows (in any order, int32 or int64 ids), the rest
    of the ring untouched, the output the same; select's composed form does the same write."""
    from deepinfer.kernels import select
    from deepinfer.kernels.triton_norm_rope_quant import norm_rope_quant, ring_ok
    for T, D, half, dtype in ((5, 512, 32, torch.int64), (70, 128, 16, torch.int32), (1, 64, 8, torch.int64)):
        x, w, cis = _case(T, D, half, device, T)
        ring = torch.randn(3 * T + 7, D, device=device).to(torch.bfloat16)
        before = ring.clone()
        rows = torch.randperm(ring.shape[0], generator=torch.Generator().manual_seed(T))[:T].to(device, dtype)
        got = norm_rope_quant(x, w, 1e-6, cis, (ring, rows))
        assert torch.equal(got, norm_rope_quant(x, w, 1e-6, cis))
        assert torch.equal(ring[rows.long()], got)
        others = torch.ones(ring.shape[0], dtype=torch.bool, device=device)
        others[rows.long()] = False
        assert torch.equal(ring[others], before[others])
        ring2 = before.clone()
        out2 = select.norm_rope_quant(x, w, 1e-6, cis, (ring2, rows))      # the kernel on a GPU, else the ops
        assert torch.equal(ring2[rows.long()], out2) and torch.equal(ring2[others], before[others])
    assert not ring_ok(x, (ring.float(), rows)) and not ring_ok(x, (ring, rows[:0]))


@pytest.mark.gpu
def test_norm_rope_quant_cuda():
    check("cuda", SHAPES + [(8192, 512, 32), (2048, 512, 32)])


def test_norm_rope_quant_interpreter():
    run_under_interpreter(__file__)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check("cpu")
    print("norm + rope + act_quant: ok")
