"""kernels/triton_compress.py: the ratio > 1 compressor's member rows gathered in one kernel equal
reference.compress_members_ref bit for bit (members from the step's rows, from the carry ring, mixed within
a group; several ring slots; ratio 2 and 4; a row width that is not a power of two), and its carry ring's
writes equal reference.carry_write_ref's (every row, or some rows of the step; rows left alone untouched), on
the GPU (-m gpu) and under Triton's interpreter on the CPU (a subprocess: TRITON_INTERPRET is read at import)."""

import os

import pytest
import torch
from kernel_utils import run_under_interpreter


def check(device):
    from deepinfer.kernels.reference import compress_members_ref
    from deepinfer.kernels.triton_compress import compress_members
    g = torch.Generator().manual_seed(0)
    for ratio, D, T, B, ring_len in ((2, 512, 9, 4, 8), (4, 96, 3, 3, 16), (2, 1500, 1, 1, 4)):
        raw = [torch.randn(T, D, generator=g) for _ in range(2)]
        carry = [torch.randn((B + 1) * ring_len, D, generator=g) for _ in range(2)]
        G = 5
        rows = torch.randint(-1, T, (G, ratio), generator=g)
        rows[0] = -1                                       # a group wholly before the step
        rows[1, -1] = T - 1                                # one straddling it
        rows[1, :-1] = -1
        carry_pos = torch.where(rows < 0, torch.randint(0, ring_len, (G, ratio), generator=g), -1)
        slots = torch.randperm(B + 1, generator=g)[:B]
        gseq = torch.randint(0, B, (G,), generator=g)
        args = [t.to(device) for t in (*raw, *carry, rows, carry_pos, slots, gseq)]
        got = compress_members(*args, ring_len)
        want = compress_members_ref(*args, ring_len)
        for a, b in zip(got, want):
            assert a.shape == b.shape == (G, ratio, D) and torch.equal(a, b), (ratio, D)


def check_carry_write(device):
    from deepinfer.kernels.reference import carry_write_ref
    from deepinfer.kernels.triton_compress import carry_write
    g = torch.Generator().manual_seed(1)
    for D, T, ring_rows, some in ((512, 9, 40, False), (96, 5, 16, True), (1500, 1, 4, False), (512, 7, 64, True)):
        raw = [torch.randn(T, D, generator=g).to(device) for _ in range(2)]
        carry = [torch.randn(ring_rows, D, generator=g).to(device) for _ in range(2)]
        rows = torch.randperm(T, generator=g)[:max(1, T // 2)].to(device) if some else None
        n = T if rows is None else rows.shape[0]
        dst = torch.randperm(ring_rows, generator=g)[:n].to(device)
        before = carry[0].clone()
        want = [c.clone() for c in carry]
        carry_write_ref(*raw, *want, dst, rows)
        carry_write(*raw, *carry, dst, rows)
        for a, b in zip(carry, want):
            assert torch.equal(a, b), (D, T, some)
        assert not torch.equal(carry[0][dst], before[dst])                   # the rows were written (not vacuous)


# an exp's last fp32 bit (CUDA's expf, torch's CPU one, float64 under the interpreter) can move the bf16 latent one
# ulp; the norm's scale stretches that to up to two of the output's, and each side rounds its output: three at most
# (measured: 3 in 1M elements at 2,048 groups under the interpreter, 2026-12-07). A latent near zero from
# cancelling members is off by the members' fp32 rounding, not its own: POOL_ATOL of the row's largest output.
POOL_ULPS, POOL_ATOL = 3, 1e-5


def pool_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """compress_pool's outputs against the reference's: within POOL_ULPS bf16 ulps or POOL_ATOL of the row's
    largest magnitude, and at least 90% of the elements the same bits."""
    got, want = got.float(), want.float()
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    tol = POOL_ULPS * ulp * 1.01 + POOL_ATOL * want.abs().amax(-1, keepdim=True)
    return bool(((got - want).abs() <= tol).all()) and (got == want).float().mean().item() >= 0.9


def check_pool(device):
    """compress_pool against compress_pool_ref (pool_close). Members from the step, the ring and both; ratio 2, 4 and
    128 (a long loop); widths that are not powers of two."""
    from deepinfer.kernels.reference import compress_pool_ref
    from deepinfer.kernels.triton_compress import compress_pool
    g = torch.Generator().manual_seed(2)
    for ratio, D, T, B, ring_len in ((2, 512, 9, 4, 8), (4, 96, 3, 3, 16), (2, 1500, 1, 1, 4), (128, 64, 5, 2, 256)):
        raw = [torch.randn(T, D, generator=g) * 3 for _ in range(2)]
        carry = [torch.randn((B + 1) * ring_len, D, generator=g) * 3 for _ in range(2)]
        G = 5
        rows = torch.randint(-1, T, (G, ratio), generator=g)
        rows[0] = -1
        rows[1, -1], rows[1, :-1] = T - 1, -1
        carry_pos = torch.where(rows < 0, torch.randint(0, ring_len, (G, ratio), generator=g), -1)
        slots = torch.randperm(B + 1, generator=g)[:B]
        gseq = torch.randint(0, B, (G,), generator=g)
        weight = torch.rand(D, generator=g) + 0.5
        args = [t.to(device) for t in (*raw, *carry, rows, carry_pos, slots, gseq)]
        got = compress_pool(*args, ring_len, weight.to(device), 1e-6)
        want = compress_pool_ref(*args, ring_len, weight.to(device), 1e-6)
        assert got.shape == want.shape == (G, D) and got.float().abs().sum() > 0
        assert pool_close(got, want), (ratio, D, (got.float() - want.float()).abs().max())


@pytest.mark.gpu
def test_compress_pool_cuda():
    check_pool("cuda")


@pytest.mark.gpu
def test_compress_pool_select_cuda(monkeypatch):
    """select.compress_pool takes the kernel on a GPU; with it off (FAST_OFF) the path it replaced, whose bits
    are the gather, the torch softmax-weighted sum and the Triton norm: the two pool_close."""
    from deepinfer.kernels import select
    from deepinfer.kernels.reference import softmax_pool_ref
    g = torch.Generator().manual_seed(3)
    G, ratio, D, T, ring_len = 33, 4, 512, 64, 8
    raw = [torch.randn(T, D, generator=g).cuda() for _ in range(2)]
    carry = [torch.randn(40 * ring_len, D, generator=g).cuda() for _ in range(2)]
    rows = torch.randint(-1, T, (G, ratio), generator=g).cuda()
    args = (*raw, *carry, rows, torch.where(rows < 0, 1, -1), torch.arange(40).cuda(), torch.arange(G).cuda() % 40,
            ring_len, torch.rand(D).cuda() + 0.5, 1e-20)
    fused = select.compress_pool(*args)
    monkeypatch.setattr(select, "FAST_OFF", frozenset({"compress_pool"}))
    apart = select.compress_pool(*args)
    kv, sc = select.compress_members(*args[:9])
    assert torch.equal(apart, select.rms_norm(softmax_pool_ref(kv, sc), args[-2], args[-1]))
    assert pool_close(fused, apart)


@pytest.mark.gpu
def test_compress_members_cuda():
    check("cuda")


@pytest.mark.gpu
def test_carry_write_cuda():
    check_carry_write("cuda")


def test_compress_members_interpreter():
    run_under_interpreter(__file__)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check("cpu")
    check_carry_write("cpu")
    check_pool("cpu")
    print("compress members, carry write, pool: ok")
